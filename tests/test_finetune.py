"""Trainable subsets (LoRA, adapters, BiTFiT, soft prompt, ladder side network): equal to the vmap reference,
frozen costs nothing."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_testing import (
    by_path,
    clipped_sums_some_clipped,
    fast_jit,
    lm_batch,
    lm_loss,
    plant,
    random_model,
)
from flax import nnx

import jaxdp
import jaxdp.core.losses
import jaxdp.core.reference  # the vmap oracle: not exported by jaxdp
from jaxdp.finetune import methods as finetune
from jaxdp.finetune.settings import Adapters, LoRA, Prompt, Reversible, Side
from jaxdp.models import layers
from jaxdp.models.gpt2 import GPT2, GPT2Config
from jaxdp.models.llama import Llama, LlamaConfig
from jaxdp.clipping.settings import ClipSpec, NormPlan

RTOL = 1e-5  # float32, highest matmul precision
LORA = LoRA(rank=4, alpha=8.0)
# each method's settings in these tests ("full" and "bitfit" take none)
OPTIONS = {"lora": LORA, "adapter": Adapters(bottleneck=8), "prompt": Prompt(length=3), "side": Side(reduction=8),
           "reversible": Reversible(LORA, bottleneck=8)}


def tiny_config(n_layer=1):
    return dataclasses.replace(GPT2Config.preset("tiny", vocab_size=97, seq_len=32), n_layer=n_layer)


def prepared(method, seed):
    """A one-block tiny GPT-2 fine-tuned by `method`, random parameters."""
    return random_model(lambda: finetune.prepare(GPT2(tiny_config(), rngs=nnx.Rngs(seed)), method,
                                                 rngs=nnx.Rngs(seed + 1), options=OPTIONS.get(method)), seed)


@pytest.fixture(scope="module", autouse=True)
def _frozen_head_in_chunks_of_7_tokens():
    """A frozen head runs over chunks of tokens (`jaxdp.core.losses.token_nll`): 7 tokens a chunk here, so the
    B 5 x T 12 batches take 9 chunks, the last one padded, and the reference's single examples 2."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jaxdp.core.losses, "HEAD_CHUNK_BYTES", 4 * 97 * 7)
        yield


@fast_jit
def logits_of(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)


def logits_fn(model, tokens):
    return logits_of(*nnx.split(model), tokens)


def numpy_by_path(tree):
    return {p: np.asarray(v) for p, v in by_path(tree).items()}


def rel_err(actual, expected):
    """max over parameters of max|a - e| / max|e|."""
    assert actual.keys() == expected.keys(), set(actual) ^ set(expected)
    return max(np.abs(actual[p] - expected[p]).max() / np.abs(expected[p]).max() for p in expected)


@fast_jit
def plain_and_chunked_head(graphdef, state, tokens):
    """(loss, gradient) of the summed NLL through the plain head and through `token_nll`'s chunks."""
    def plain(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(tokens[:, :-1]), tokens[:, 1:]).sum()

    def chunked(model):
        return jaxdp.core.losses.token_nll(model, tokens[:, :-1], tokens[:, 1:]).sum()
    model = nnx.merge(graphdef, state)
    return nnx.value_and_grad(plain)(model), nnx.value_and_grad(chunked)(model)


@pytest.mark.parametrize("method", ["bitfit", "side", "reversible", "llama_lora"])
def test_frozen_head_in_chunks_equals_the_plain_head(method):
    """The chunked frozen head (each chunk's logits recomputed in the backward; 7 tokens a chunk here) gives
    the plain head's NLL and gradients; the planted error (one chunk's targets shifted) does not."""
    if method == "llama_lora":
        config = LlamaConfig.preset("tiny", vocab_size=97, seq_len=32, tie_embeddings=False)
        model = random_model(lambda: finetune.prepare(Llama(config, rngs=nnx.Rngs(0)), "lora", rngs=nnx.Rngs(1),
                                                      options=LORA), seed=3)
    else:
        model = prepared(method, seed=len(method))
    assert model.frozen_head() is not None
    tokens = lm_batch(seed=4, B=5, T=12)["tokens"]
    (plain, g_plain), (chunked, g_chunked) = plain_and_chunked_head(*nnx.split(model), tokens)
    np.testing.assert_allclose(chunked, plain, rtol=RTOL)
    assert rel_err(numpy_by_path(g_chunked), numpy_by_path(g_plain)) <= RTOL
    planted = tokens.at[0, 3].set((tokens[0, 3] + 1) % 97)
    (_, g_planted), _ = plain_and_chunked_head(*nnx.split(model), planted)
    assert rel_err(numpy_by_path(g_chunked), numpy_by_path(g_planted)) > 10 * RTOL


def test_trained_head_is_never_chunked():
    """Review 13: LoRA on Llama's untied lm_head crashed `frozen_head` (no `kernel`); a head module holding
    any trainable parameter takes the plain path."""
    config = LlamaConfig.preset("tiny", vocab_size=97, seq_len=32, tie_embeddings=False)
    model = finetune.prepare(Llama(config, rngs=nnx.Rngs(0)), "lora", rngs=nnx.Rngs(1),
                             options=dataclasses.replace(LORA, targets=("attn/q_proj", "lm_head")))
    assert model.frozen_head() is None
    tokens = lm_batch(seed=4, B=2, T=6)["tokens"]
    assert jaxdp.core.losses.token_nll(model, tokens[:, :-1], tokens[:, 1:]).shape == (2, 6)


@pytest.mark.parametrize("method", ["lora", "adapter", "bitfit", "prompt", "side"])
def test_equals_reference_on_trainable_parameters(method):
    model = prepared(method, seed=len(method))
    batch = lm_batch(seed=len(method) + 1, B=5, T=12)
    out = clipped_sums_some_clipped(model, batch)  # C strictly between the per-example norms
    for clipping, sums in out.items():
        expected = numpy_by_path(sums["expected"])
        assert set(expected) == set(finetune.trainable_paths(model))
        assert rel_err(numpy_by_path(sums["fast"]), expected) <= RTOL, clipping
    # The same comparison fails for a 1% error in one parameter's per-example gradients.
    assert rel_err(numpy_by_path(out["flat"]["fast"]), numpy_by_path(out["flat"]["planted"])) > 10 * RTOL


def test_optimizer_step_leaves_frozen_parameters_unchanged_and_prompted_logits_are_causal():
    """All four methods on one model; a DP adamw step (weight decay 0.1) through nnx.Optimizer(wrt=nnx.Param)
    moves every trainable parameter and no frozen one. The per-example gradients are random arrays of the
    trainable tree (per_example_grads returns exactly that tree: test_equals_reference_on_trainable_parameters),
    which keeps the model out of this compile; sigma = 0, as noise (added to the same tree) costs seconds
    of compile and adds nothing to the property."""
    def build():
        model = GPT2(tiny_config(), rngs=nnx.Rngs(0))
        finetune.add_lora(model, rank=LORA.rank, rngs=nnx.Rngs(1))
        finetune.add_adapters(model, bottleneck=OPTIONS["adapter"].bottleneck, rngs=nnx.Rngs(2))
        finetune.add_soft_prompt(model, length=OPTIONS["prompt"].length, rngs=nnx.Rngs(3))
        methods = [finetune.trainable_filter(m, train_layer_norms=False)
                   for m in ("lora", "adapter", "bitfit", "prompt")]
        return finetune.freeze(model, lambda path, owner: any(f(path, owner) for f in methods))

    model = random_model(build, seed=4)
    frozen = numpy_by_path(nnx.state(model, jaxdp.core.nn.Frozen))
    trainable = numpy_by_path(nnx.state(model, nnx.Param))
    assert {p[-1] for p in frozen} == {"kernel", "scale", "embedding"} and ("blocks", 0, "ln_1", "bias") in trainable
    tx = optax.chain(jaxdp.fused_clip(1.0, 0.0, expected_batch_size=4.0, key=jax.random.key(0)),
                     optax.adamw(1e-2, weight_decay=0.1))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    rng = np.random.default_rng(4)
    per_example = jax.tree.map(lambda v: jnp.asarray(rng.standard_normal((4, *v.shape)), jnp.float32),
                               nnx.state(model, nnx.Param))

    @fast_jit
    def step(graphdef, state, grads):
        model, optimizer = nnx.merge(graphdef, state)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer))

    graphdef, state = nnx.split((model, optimizer))
    nnx.update((model, optimizer), step(graphdef, state, per_example))
    for path, value in numpy_by_path(nnx.state(model, jaxdp.core.nn.Frozen)).items():
        assert np.array_equal(value, frozen[path]), path
    for path, value in numpy_by_path(nnx.state(model, nnx.Param)).items():
        assert not np.array_equal(value, trainable[path]), path

    # With the soft prompt before them, the tokens' logits keep their shape and stay causal.
    tokens = jax.random.randint(jax.random.key(9), (2, 10), 0, 97)
    logits = logits_fn(model, tokens)
    assert logits.shape == (2, 10, 97)
    changed = logits_fn(model, tokens.at[:, 6:].set((tokens[:, 6:] + 1) % 97))
    np.testing.assert_allclose(changed[:, :6], logits[:, :6], rtol=1e-5, atol=1e-6)
    assert not np.allclose(changed[:, 6:], logits[:, 6:])
    with pytest.raises(ValueError, match="seq_len"):
        model(jnp.zeros((1, 32 - 2), jnp.int32))  # 3 prompt embeddings + 30 tokens > seq_len 32


def all_eqns(jaxpr):
    """Every equation of a jaxpr, inner jaxprs (custom_vjp, pjit, remat) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from all_eqns(inner)


def dot_output_shapes(jaxpr) -> set:
    """Output shapes of every dot_general in a jaxpr."""
    return {tuple(eqn.outvars[0].aval.shape) for eqn in all_eqns(jaxpr) if eqn.primitive.name == "dot_general"}


def weight_gradient_dots(fn, model, frozen_shapes) -> set:
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s: fn(nnx.merge(graphdef, s)))(state).jaxpr
    return {s for s in dot_output_shapes(jaxpr) for shape in frozen_shapes
            if s[-2:] in (shape, shape[::-1])}


def test_frozen_layers_cost_no_per_example_work_and_no_weight_gradient():
    """BiTFiT: frozen kernels are never recorded (zero-width records), fully frozen layers never tap, and the
    traced backward holds no GEMM shaped like a frozen weight; the plain gradient of the same model does."""
    model = prepared("bitfit", seed=3)
    batch = lm_batch(seed=4, B=6, T=16)
    graphdef, params, rest, uses, axes, _ = jaxdp.core.per_example.discover(lm_loss, model, batch)
    owners = {p[:-1] for p in finetune.trainable_paths(model)}
    assert {u.path for u in uses.values()} == owners  # wte / wpe (frozen, no bias) never tap
    assert all(u.record.shape[-1] == 0 for u in uses.values())  # bias terms need no input record
    frozen_shapes = {tuple(v.shape) for v in by_path(nnx.state(model, jaxdp.core.nn.Frozen)).values() if v.ndim == 2}
    assert (64, 192) in frozen_shapes and (97, 64) in frozen_shapes

    def dp_grads(m):
        return jaxdp.per_example_grads(lm_loss, fallback=False)(m, batch)

    def plain_grads(m):  # what the check must catch: the ordinary backward forms every weight gradient
        return nnx.grad(lambda m: lm_loss(m, batch).sum(), argnums=nnx.DiffState(0, ...))(m)

    assert weight_gradient_dots(dp_grads, model, frozen_shapes) == set()
    assert len(weight_gradient_dots(plain_grads, model, frozen_shapes)) >= 4


def test_side_network_backward_never_enters_the_backbone():
    """MemDPT-side: the traced DP gradient uses each backbone block kernel once (its forward GEMM), so no
    backbone activation is kept for a backward; LoRA, which backpropagates through the backbone, uses them
    more often (the count can fail)."""
    kernels = {(64, 192), (64, 64), (64, 256), (256, 64)}  # a tiny block's c_attn, c_proj, c_fc, mlp c_proj

    def backbone_gemms(model):
        graphdef, state = nnx.split(model)
        batch = lm_batch(seed=1, B=2, T=8)
        jaxpr = jax.make_jaxpr(lambda s: jaxdp.per_example_grads(lm_loss)(nnx.merge(graphdef, s), batch))(state)
        return sum(1 for eqn in all_eqns(jaxpr.jaxpr) if eqn.primitive.name == "dot_general"
                   and any(tuple(v.aval.shape) in kernels for v in eqn.invars))

    side = prepared("side", seed=11)
    assert side.up.kernel.shape == (64 // OPTIONS["side"].reduction, 64)
    assert backbone_gemms(side) == len(kernels)
    assert backbone_gemms(prepared("lora", seed=12)) > len(kernels)


def test_lora_merge_and_hf_export(tmp_path):
    """merge_lora folds W + scale A B into the base kernel: same logits, then the HF export accepts the model."""
    model = prepared("lora", seed=5)
    tokens = jax.random.randint(jax.random.key(6), (2, 9), 0, 97)
    logits = logits_fn(model, tokens)
    finetune.merge_lora(finetune.freeze(model, lambda path, owner: True))
    assert not any("lora_a" in p for p in finetune.trainable_paths(model))
    np.testing.assert_allclose(logits_fn(model, tokens), logits, rtol=1e-5, atol=1e-5)
    jaxdp.save_hf_gpt2(model, tmp_path)
    np.testing.assert_allclose(logits_fn(jaxdp.load_hf_gpt2(tmp_path), tokens), logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no place for.*adapter"):
        jaxdp.save_hf_gpt2(prepared("adapter", seed=7), tmp_path)


@pytest.mark.parametrize("call, match", [
    (lambda m: finetune.prepare(m, "prefix", rngs=nnx.Rngs(0)), "method must be one of"),
    (lambda m: finetune.add_lora(m, rank=0, rngs=nnx.Rngs(0)), "rank must be"),
    (lambda m: finetune.add_lora(m, rank=2, targets=("attn/q_proj",), rngs=nnx.Rngs(0)),
     r"targets: 'attn/q_proj' names no projection of a gpt2 model; its names are attn/c_attn"),
    (lambda m: finetune.add_lora(m, rank=2, targets="attn/c_attn", rngs=nnx.Rngs(0)), "targets must be"),
    (lambda m: finetune.add_adapters(m, bottleneck=0, rngs=nnx.Rngs(0)), "bottleneck must be"),
    (lambda m: finetune.add_soft_prompt(m.blocks[0], length=2, rngs=nnx.Rngs(0)), "GPT2"),
    (lambda m: finetune.add_soft_prompt(m, length=0, rngs=nnx.Rngs(0)), "length must be"),
    (lambda m: finetune.prepare(m, "side", options=Side(reduction=3), rngs=nnx.Rngs(0)),
     "reduction must be .* d_model=64"),
    (lambda m: finetune.prepare(m, "reversible", options=Reversible(beta=0.0), rngs=nnx.Rngs(0)),
     "alpha and beta must be > 0"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call(nnx.eval_shape(lambda: GPT2(tiny_config(), rngs=nnx.Rngs(0))))


@fast_jit
def reversible_and_stored(graphdef, stored_graphdef, state, batch, C):
    """Clipped sums of the factored path through the inverted backward (`graphdef`) and of the vmap reference
    through the same forward with stored activations (`stored_graphdef`, ordinary autodiff), plus the
    reference with a planted error."""
    _, grads = jaxdp.per_example_grads(lm_loss, fallback=False)(nnx.merge(graphdef, state), batch)
    _, ref = jaxdp.core.reference.per_example_grads(lm_loss, nnx.merge(stored_graphdef, state), batch)
    out = {}
    for clipping, strategy in (("flat", "ghost"), ("per_layer", "instantiate")):
        expected, norms = jaxdp.core.reference.clipped_sum(ref, C, clipping=clipping)
        out[clipping] = {"expected": expected, "norms": norms,
                         "fast": jaxdp.clipped_aggregate(grads, C, clip=ClipSpec(clipping=clipping),
                                                         norms=NormPlan(strategy=strategy))[0]}
    out["flat"]["planted"] = jaxdp.core.reference.clipped_sum(plant(ref), C)[0]
    return out


@pytest.mark.parametrize("dtype, n_layer, keep_streams_every", [("float64", 2, None), ("float32", 3, 2)])
def test_reversible_equals_stored_activation_reference(dtype, n_layer, keep_streams_every):
    """MemDPT-rev, MEFT's alpha = beta = 0.1: per-example gradients whose every activation the backward
    recomputed by inverting the layers equal the vmap reference of the same forward with stored
    activations, flat and per-layer. Each inversion divides by alpha beta, so its rounding grows ~100x per
    inverted layer (jaxdp.models.reversible): pure inversion is checked in float64 at two layers (error
    ~1e-12, far below the float32 rounding of the parameters' gradients and clip factors that RTOL is set
    for), and in float32 at three layers with the streams kept every second layer (one inversion between
    kept streams: error ~100 float32 ulps, within RTOL)."""
    jax.config.update("jax_enable_x64", dtype == "float64")
    try:
        config = dataclasses.replace(tiny_config(n_layer=n_layer), dtype=dtype)
        options = dataclasses.replace(OPTIONS["reversible"], keep_streams_every=keep_streams_every)
        model = random_model(lambda: finetune.prepare(GPT2(config, rngs=nnx.Rngs(0)), "reversible",
                                                      rngs=nnx.Rngs(1), options=options), seed=13)
        assert model.backward == "reversible" and (model.alpha, model.beta) == (0.1, 0.1)
        batch = lm_batch(seed=14, B=5, T=12)
        graphdef, state = nnx.split(model)
        model.backward = "stored"
        stored_graphdef = nnx.split(model)[0]
        norms = np.asarray(reversible_and_stored(graphdef, stored_graphdef, state, batch,
                                                 jnp.float32(1e6))["flat"]["norms"]["all"])
        norms = np.sort(norms[norms > 0])
        out = jax.device_get(reversible_and_stored(graphdef, stored_graphdef, state, batch,
                                                   jnp.float32(np.sqrt(norms[0] * norms[-1]))))
    finally:
        jax.config.update("jax_enable_x64", False)
    for clipping, sums in out.items():
        expected = numpy_by_path(sums["expected"])
        assert set(expected) == set(finetune.trainable_paths(model))
        assert any("lora_b" in p for p in expected) and any(p[0] == "adapters" for p in expected)
        assert rel_err(numpy_by_path(sums["fast"]), expected) <= RTOL, clipping
    assert rel_err(numpy_by_path(out["flat"]["fast"]), numpy_by_path(out["flat"]["planted"])) > 10 * RTOL


@pytest.mark.parametrize("method", ["lora", "adapter", "bitfit"])
def test_methods_on_a_scanned_model_equal_the_reference(method):
    """`prepare` on a model with stacked blocks (scan_layers=True) adds the method's modules to every block and
    restacks them: the trainable parameters lead with the layer axis, and the clipped sums (flat and per layer)
    equal the vmap reference's. "side" and "reversible" wrap unrolled blocks and are refused by name."""
    config = dataclasses.replace(tiny_config(n_layer=2), scan_layers=True)
    model = random_model(lambda: finetune.prepare(GPT2(config, rngs=nnx.Rngs(3)), method, rngs=nnx.Rngs(4),
                                                  options=OPTIONS.get(method)), 3)
    assert model.config.scan_layers
    block_params = [v for p, v in by_path(nnx.state(model, nnx.Param)).items() if p[0] == "blocks"]
    assert block_params and all(v.shape[0] == 2 for v in block_params)
    batch = lm_batch(seed=5, B=5, T=12)
    scanned = clipped_sums_some_clipped(model, batch)
    # The reference groups by leaf, so its per-layer clipping of a stacked leaf is one group; the unrolled
    # model with the same values has the groups per-layer clipping means (the C chosen is the same: flat norms).
    unrolled = clipped_sums_some_clipped(layers.unrolled(model), batch)
    for clipping in scanned:
        fast = {}
        for p, v in numpy_by_path(scanned[clipping]["fast"]).items():
            fast.update({(p[0], i) + p[1:]: v[i] for i in range(2)} if p[0] == "blocks" else {p: v})
        assert rel_err(fast, numpy_by_path(unrolled[clipping]["expected"])) <= RTOL, clipping
    with pytest.raises(ValueError, match="'side' wraps the blocks of an unrolled GPT-2"):
        finetune.prepare(GPT2(config, rngs=nnx.Rngs(3)), "side", rngs=nnx.Rngs(4))
