"""Sharded DP steps on 8 fake CPU devices equal the single-device step.

GPT-2 tiny and Llama tiny on every (data, seq) mesh and under every
(clipping, ZeRO stage) pair (a covering design, see CASES) are compared with
the single-device `optax.chain(jaxdp.fused_clip(...), adam)` step on the same
batch: the privatised gradient and the parameters after one DP-Adam step
(sigma = 0: relative error <= 1e-5). With sigma > 0 a replicated gradient
gets the single-device noise exactly; a reduce-scattered one (ZeRO 2/3) has
per-coordinate std sigma * C within 3%, and without its noise equals the
single-device gradient.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_testing import by_path, lm_loss, max_rel_err, tiny_gpt2
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxdp
from jaxdp import sharding
from jaxdp.clipping.settings import ClipSpec, DPSpec, NormPlan
from jaxdp.core import sequence_shards
from jaxdp.models.llama import Llama, LlamaConfig

RTOL = 1e-5
C, EBS, LR = 0.05, 6.0, 1e-2
B, T, V = 8, 16, 97


def adam():
    # eps well above float32 noise in the gradients: the first Adam step g / (|g| + eps)
    # is ill-conditioned where |g| << eps, which would test Adam, not the sharding.
    return optax.adam(LR, eps=1e-3)


def cp_loss(model, batch, seq_axis=None):
    """Per-example mean NLL over the GLOBAL sequence; this shard's share on a sequence shard."""
    logits = model(batch["inputs"], seq_axis=seq_axis)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.where(batch["mask"], sequence_shards.sequence_mean(nll, seq_axis), 0.0)


@functools.cache
def setup(name):
    tokens = jax.random.randint(jax.random.key(3), (B, T + 1), 0, V)
    mask = jnp.arange(B) < B - 1
    if name == "gpt2":
        return tiny_gpt2(seed=1), lm_loss, {"tokens": tokens, "mask": mask}
    if name == "gpt2cp":  # GPT-2 with inputs / targets split, so that the sequence can be sharded
        return tiny_gpt2(seed=1), cp_loss, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}
    model = Llama(LlamaConfig.preset("tiny", vocab_size=V, seq_len=32), rngs=nnx.Rngs(2))
    return model, cp_loss, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


SIGMA = 2.0
REFERENCE_CONFIGS = (("flat", 0.0), ("per_layer", 0.0), ("flat", SIGMA))


@functools.cache
def single_device(name):
    """{(clipping, sigma): (privatised gradient, params after one DP-Adam step)} on one device, one jit."""
    model, loss_fn, batch = setup(name)
    dps = [jaxdp.fused_clip(C, sigma, expected_batch_size=EBS, key=jax.random.key(7),
                            clip=ClipSpec(clipping=clipping))
           for clipping, sigma in REFERENCE_CONFIGS]

    @nnx.jit
    def steps(model, batch):
        params = nnx.state(model, nnx.Param)
        _, grads = jaxdp.per_example_grads(loss_fn)(model, batch)
        results = []
        for dp in dps:
            tx = optax.chain(dp, adam())
            state = tx.init(params)
            updates, _ = tx.update(grads, state, params)
            private, _ = dp.update(grads, state[0], params)
            results.append((by_path(private), by_path(optax.apply_updates(params, updates))))
        return results

    return dict(zip(REFERENCE_CONFIGS, steps(model, batch)))


@functools.cache
def sharded(name, mesh_shape, zero_stage, clipping, sigma, method="bookkeeping"):
    model, loss_fn, batch = setup(name)
    mesh = sharding.make_mesh(*mesh_shape)
    step = sharding.ShardedDPStep(loss_fn, adam(), mesh,
                                  DPSpec(l2_norm_clip=C, noise_multiplier=sigma,
                                         expected_batch_size=EBS, clip=ClipSpec(clipping=clipping)),
                                  key=jax.random.key(7), zero_stage=zero_stage, method=method)
    state = step.init(model)
    new_state, out = step(state, batch)
    return step, state, new_state, out


def reference(name):
    # gpt2cp is gpt2 on the same tokens with the loss written per sequence shard: same reference.
    return single_device("gpt2" if name == "gpt2cp" else name)


# The acceptance grid is model x mesh x clipping x ZeRO 1-3 (48 steps, each its own compile).
# Covering rule: every model meets every mesh, and every (clipping, ZeRO 1/2/3) pair on a mesh with
# data > 1. On the i-th mesh of ((8, 1), (4, 2), (2, 4)), model k (gpt2 0, llama 1) runs flat clipping
# under ZeRO z = 1 + (i + k) % 3 and per-layer clipping under ZeRO z - 1 (cyclically: z = 1 gives 3):
# six steps per model, and across the two models every (mesh, ZeRO stage). On (1, 8) ZeRO has a single
# data shard (the step is ZeRO 0 whatever the stage), so it runs once per model at stage 0; so does
# gpt2 on (8, 1), the baseline of test_zero3_memory_falls_with_data_shards. Two of the six steps per
# model are NOISE_CASES, with sigma > 0.
MESHES = ((8, 1), (4, 2), (2, 4), (1, 8))
CASES = [
    # (model, (data, seq), zero_stage, clipping); sigma = 0
    ("gpt2", (8, 1), 0, "flat"),
    ("gpt2", (8, 1), 1, "flat"),
    ("gpt2", (8, 1), 3, "per_layer"),
    ("gpt2cp", (4, 2), 1, "per_layer"),
    ("gpt2cp", (2, 4), 3, "flat"),
    ("gpt2cp", (2, 4), 2, "per_layer"),
    ("gpt2cp", (1, 8), 0, "flat"),
    ("llama", (8, 1), 2, "flat"),
    ("llama", (8, 1), 1, "per_layer"),
    ("llama", (4, 2), 2, "per_layer"),
    ("llama", (2, 4), 1, "flat"),
    ("llama", (2, 4), 3, "per_layer"),
    ("llama", (1, 8), 0, "per_layer"),
]
# (model, (data, seq), zero_stage); flat clipping, sigma = SIGMA, ZeRO >= 2: some leaves replicated, some
# reduce-scattered. On seq > 1 meshes, so that the noise also meets the sum over `seq`.
NOISE_CASES = [
    ("gpt2cp", (4, 2), 2),
    ("llama", (4, 2), 3),
]


def test_cases_cover_the_acceptance_grid():
    """The covering rule above holds for CASES + NOISE_CASES (so that editing them cannot drop a cell)."""
    steps = [(n.removesuffix("cp"), m, z, c) for n, m, z, c in CASES]
    steps += [(n.removesuffix("cp"), m, z, "flat") for n, m, z in NOISE_CASES]
    for model in ("gpt2", "llama"):
        assert {m for n, m, _, _ in steps if n == model} == set(MESHES)
        pairs = {(c, z) for n, m, z, c in steps if n == model and m[0] > 1}
        assert pairs >= {(c, z) for c in ("flat", "per_layer") for z in (1, 2, 3)}, model
        assert any(n.removesuffix("cp") == model for n, _, _ in NOISE_CASES)


def assert_zero_layout(step, new_state, out, zero_stage):
    """The layout the ZeRO stage promises: optimizer state, then gradients, then parameters sharded over data."""
    kernel_specs = [s for p, s in by_path(step.layout.param_specs).items() if p[-1] == "kernel"]
    mu_specs = [v.sharding.spec for p, v in by_path(new_state.opt_state[0].mu).items() if p[-1] == "kernel"]
    grad_specs = [v.sharding.spec for p, v in by_path(out["grads"]).items() if p[-1] == "kernel"]
    data = sharding.DATA
    assert all((data in s) == (zero_stage >= 1) for s in mu_specs)
    assert all((data in s) == (zero_stage >= 2) for s in grad_specs)
    assert all((data in s) == (zero_stage >= 3) for s in kernel_specs)


@pytest.mark.parametrize("name, mesh_shape, zero_stage, clipping", CASES,
                         ids=[f"{n}-{d}x{s}-zero{z}-{c}" for n, (d, s), z, c in CASES])
def test_sharded_step_equals_single_device(name, mesh_shape, zero_stage, clipping):
    expected_grads, expected_params = reference(name)[(clipping, 0.0)]
    step, _, new_state, out = sharded(name, mesh_shape, zero_stage, clipping, 0.0)
    assert max_rel_err(out["grads"], expected_grads) <= RTOL
    assert max_rel_err(new_state.params, expected_params) <= RTOL
    assert out["losses"].shape == (B,) and float(np.asarray(out["losses"])[-1]) == 0.0
    assert_zero_layout(step, new_state, out, zero_stage)


# method="two_pass" (norms in each layer's backward, then a clip-weighted backward; flat clipping):
# both models, data and sequence sharding (the ZeRO reductions after the sums are the method's
# neighbours, not its code: covered by CASES).
TWO_PASS_CASES = [
    ("gpt2", (8, 1), 2),
    ("gpt2cp", (2, 4), 3),
    ("llama", (1, 8), 0),
]


@pytest.mark.parametrize("name, mesh_shape, zero_stage", TWO_PASS_CASES,
                         ids=[f"{n}-{d}x{s}-zero{z}" for n, (d, s), z in TWO_PASS_CASES])
def test_two_pass_step_equals_single_device(name, mesh_shape, zero_stage):
    expected_grads, expected_params = reference(name)[("flat", 0.0)]
    step, _, new_state, out = sharded(name, mesh_shape, zero_stage, "flat", 0.0, "two_pass")
    assert max_rel_err(out["grads"], expected_grads) <= RTOL
    assert max_rel_err(new_state.params, expected_params) <= RTOL
    assert_zero_layout(step, new_state, out, zero_stage)


@jax.jit
def one_device_adam_step(params, grads):
    """The parameters after one Adam step from `params` on `grads`, on one device (jitted: eagerly every
    leaf shape compiles its own small programs)."""
    updates, _ = adam().update(grads, adam().init(params), params)
    return optax.apply_updates(params, updates)


@pytest.mark.parametrize("name, mesh_shape, zero_stage", NOISE_CASES,
                         ids=[f"{n}-{d}x{s}-zero{z}" for n, (d, s), z in NOISE_CASES])
def test_noisy_step_under_zero_2_3(name, mesh_shape, zero_stage):
    """sigma > 0, ZeRO 2/3: replicated leaves get one device's noise exactly; reduce-scattered ones draw
    fold_in(key, shard) noise of std sigma * C, different per shard, and minus that noise equal one device.

    The noise alone is the same step (same compile, same key) on the batch with every example masked.
    """
    clean, _ = reference(name)[("flat", 0.0)]
    noisy_one_device, _ = reference(name)[("flat", SIGMA)]
    step, state, new_state, out = sharded(name, mesh_shape, zero_stage, "flat", SIGMA)
    batch = setup(name)[2]
    _, noise_out = step(state, {**batch, "mask": jnp.zeros_like(batch["mask"])})
    grads, noise_alone, dims = by_path(out["grads"]), by_path(noise_out["grads"]), by_path(step.layout.grad_dims)
    # grads = (sum + noise) / EBS rounds to float32 at the scale of the noise.
    eps = float(jnp.finfo(jnp.float32).eps)
    sharded_noise = []
    for path, g in grads.items():
        g, n = np.asarray(g), np.asarray(noise_alone[path])
        atol = RTOL * np.max(np.abs(clean[path])) + 4 * eps * np.max(np.abs(g))
        np.testing.assert_allclose(g - n, clean[path], rtol=0, atol=atol, err_msg=str(path))
        if dims[path] < 0:
            np.testing.assert_allclose(g, noisy_one_device[path], rtol=RTOL, atol=RTOL * SIGMA * C / EBS)
        else:
            sharded_noise.append(n.ravel() * EBS)
            # Shards draw different noise: two data shards' blocks are not equal.
            blocks = np.split(n, mesh_shape[0], axis=dims[path])
            assert not np.allclose(blocks[0], blocks[1])
    noise = np.concatenate(sharded_noise)
    assert noise.size > 50_000
    assert abs(noise.std() / (SIGMA * C) - 1) < 0.03
    assert abs(noise.mean()) < 0.03 * SIGMA * C
    # The sharded optimizer takes the step one device takes on the same privatised gradient.
    expected_params = one_device_adam_step(jax.device_get(state.params), jax.device_get(out["grads"]))
    assert max_rel_err(new_state.params, expected_params) <= RTOL
    assert_zero_layout(step, new_state, out, zero_stage)


def test_partition_rules_cover_every_matrix():
    """Every kernel and embedding of GPT-2 and Llama is sharded by a named rule at production sizes."""
    from jaxdp.models.gpt2 import GPT2, GPT2Config
    for make in (lambda: GPT2(GPT2Config.preset("small"), rngs=nnx.Rngs(0)),
                 lambda: Llama(LlamaConfig.preset("1B", tie_embeddings=False), rngs=nnx.Rngs(0))):
        params = nnx.state(nnx.eval_shape(make), nnx.Param)
        for path, leaf in by_path(params).items():
            dim = sharding.shard_dim(path, leaf.shape, 8)
            if path[-1] in ("kernel", "embedding"):
                assert dim is not None and leaf.shape[dim] % 8 == 0, path
            else:
                assert dim is None, path


def test_zero3_memory_falls_with_data_shards():
    """Compiled per-device argument bytes (params + Adam state dominate) fall ~1/N under ZeRO-3."""
    _, _, batch = setup("gpt2")
    sizes = {}
    for zero_stage, clipping in ((0, "flat"), (3, "per_layer")):
        step, state, _, _ = sharded("gpt2", (8, 1), zero_stage, clipping, 0.0)
        sizes[zero_stage] = step.lower(state, batch).compile().memory_analysis().argument_size_in_bytes
    assert sizes[3] < 0.2 * sizes[0], sizes


def test_bad_arguments_are_rejected():
    _, loss_fn, _ = setup("gpt2")
    with pytest.raises(ValueError, match="zero_stage"):
        sharding.ShardedDPStep(loss_fn, adam(), sharding.make_mesh(8, 1),
                               DPSpec(l2_norm_clip=C, noise_multiplier=0.0, expected_batch_size=EBS), zero_stage=4)
    with pytest.raises(ValueError, match="devices"):
        sharding.make_mesh(4, 4)
    with pytest.raises(ValueError, match="method"):
        sharding.ShardedDPStep(loss_fn, adam(), sharding.make_mesh(8, 1),
                               DPSpec(l2_norm_clip=C, noise_multiplier=0.0, expected_batch_size=EBS),
                               method="ghost")
    with pytest.raises(ValueError, match="clipping"):
        sharding.ShardedDPStep(loss_fn, adam(), sharding.make_mesh(8, 1),
                               DPSpec(l2_norm_clip=C, noise_multiplier=0.0, expected_batch_size=EBS,
                                      clip=ClipSpec(clipping="per_layer")),
                               method="two_pass")
    with pytest.raises(ValueError, match='strategy="pallas".*GPU'):  # CPU: JAX's Pallas interpreter
        sharding.ShardedDPStep(loss_fn, adam(), sharding.make_mesh(8, 1),
                               DPSpec(l2_norm_clip=C, noise_multiplier=0.0, expected_batch_size=EBS),
                               norms=NormPlan(strategy="pallas"))
    # Context parallelism hands the loss its sequence axis (no ambient state): a loss that cannot take it is refused.
    with pytest.raises(ValueError, match="seq_axis"):
        sharding.ShardedDPStep(lambda model, batch: loss_fn(model, batch), adam(), sharding.make_mesh(2, 4),
                               DPSpec(l2_norm_clip=C, noise_multiplier=0.0, expected_batch_size=EBS))
    step = sharding.ShardedDPStep(loss_fn, adam(), sharding.make_mesh(8, 1),
                                  DPSpec(l2_norm_clip=C, noise_multiplier=0.0, expected_batch_size=EBS))
    with pytest.raises(ValueError, match="init"):  # the layout follows the model
        step.lower(None, setup("gpt2")[2])
    step.init(setup("gpt2")[0])
    with pytest.raises(ValueError, match="another model structure"):
        step.init(setup("llama")[0])


@pytest.mark.parametrize("name, mesh_shape, clipping", [("gpt2", (8, 1), "per_layer"), ("gpt2cp", (2, 4), "flat")])
def test_pallas_step_lowers_for_cuda(name, mesh_shape, clipping, monkeypatch):
    """strategy="pallas" on a mesh: the step, Triton kernels inside the shard_map (single-pass kernel under
    per-layer clipping, clipped-sum kernel on sequence partials), lowers for CUDA on CPU. The kernels'
    outputs must be typed varying over the mesh (`pallas._common.out_struct`), else check_vma rejects them.
    (Numbers need a GPU: on CPU the interpreter cannot run under shard_map, see test_bad_arguments_are_rejected.)"""
    from jaxdp.pallas import _common
    monkeypatch.setattr(_common, "resolve_interpret", lambda interpret: False)
    model, loss_fn, batch = setup(name)
    step = sharding.ShardedDPStep(loss_fn, adam(), sharding.make_mesh(*mesh_shape),
                                  DPSpec(l2_norm_clip=C, noise_multiplier=SIGMA,
                                         expected_batch_size=EBS, clip=ClipSpec(clipping=clipping)),
                                  zero_stage=1, norms=NormPlan(strategy="pallas"))
    text = step.lower(step.init(model), batch, lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


class _LinearAndPlainScale(nnx.Module):
    """A jaxdp Linear (tape rule) and a plain nnx.Param (vmap fallback), shared by every position."""

    def __init__(self, rngs):
        self.linear = jaxdp.core.nn.Linear(6, 5, rngs=rngs)
        self.scale = nnx.Param(jnp.linspace(0.5, 1.5, 5))

    def __call__(self, x_BTP):
        return self.linear(x_BTP) * self.scale[...]


def test_per_example_grads_in_shard_map_with_check_vma():
    """Inside shard_map(check_vma=True) over 8 data shards, per-example gradients (tape and fallback)
    equal one device's: no cotangent comes back summed over the devices (the DESIGN.md pitfall)."""
    model = _LinearAndPlainScale(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (16, 3, 6))
    loss_fn = lambda m, x: jnp.sum(m(x) ** 2, axis=(1, 2))
    graphdef, params = nnx.split(model)

    def per_example(params, x):
        _, grads = jaxdp.per_example_grads(loss_fn)(nnx.merge(graphdef, params), x)
        return {p: sum(jaxdp.core.terms.instantiate(t) for t in g.terms) for p, g in by_path(grads).items()}

    expected = jax.jit(per_example)(params, x)
    mesh = sharding.make_mesh(8, 1)
    sharded_fn = jax.jit(jax.shard_map(per_example, mesh=mesh, in_specs=(P(), P(sharding.DATA)),
                                       out_specs=P(sharding.DATA), check_vma=True))
    got = sharded_fn(params, x)
    assert got.keys() == expected.keys() == {("linear", "kernel"), ("linear", "bias"), ("scale",)}
    assert max_rel_err(got, expected) <= RTOL


def test_context_parallel_norms_of_bf16_partials_are_not_rounded_low():
    """Context parallel norms instantiate each sequence shard's partial x^T g: in bf16 that partial
    must not be rounded to bf16 before it is squared. Built to round down: every product
    (1 + 7/128)(1 + 9/128) = 1.12885 sits just below the bf16 midpoint, so bf16 partials would give a
    norm 0.34% low while the clipped sum scales the exact x^T g: a contribution of 1.0034 C."""
    from jaxdp.core.terms import FactoredGrad, LinearTerm
    from jaxdp.sharding import context_parallel
    Bn, Tn, Pn, Dn = 2, 8, 16, 24
    x = jnp.full((Bn, Tn, Pn), 1 + 7 / 128, jnp.bfloat16)
    g = jnp.full((Bn, Tn, Dn), 1 + 9 / 128, jnp.bfloat16) * jnp.where(jnp.arange(Tn) % 2 == 0, 1, -1)[:, None]
    g = g.at[:, -1].multiply(-1)  # the signs do not cancel: 6 of 8 tokens of one sign
    mesh = sharding.make_mesh(1, 8)
    norms_fn = jax.jit(jax.shard_map(
        lambda x, g: context_parallel.squared_norms(FactoredGrad((LinearTerm(x, g),)), sharding.SEQ),
        mesh=mesh, in_specs=(P(None, sharding.SEQ), P(None, sharding.SEQ)), out_specs=P(), check_vma=False))
    sq, bound = norms_fn(x, g)
    G = np.einsum("btp,btd->bpd", np.asarray(x, np.float64), np.asarray(g, np.float64))
    true = np.sum(G.reshape(Bn, -1) ** 2, axis=1)
    guarded = np.asarray(jaxdp.clipping.rules.guarded_norms(sq, bound), np.float64)
    assert np.all(guarded >= np.sqrt(true) * (1 - 1e-6)), (guarded, np.sqrt(true))


def test_instantiated_partials_keep_bf16_products_exact():
    """`norms.instantiated` (what the context-parallel norms square) keeps bf16 x^T g unrounded: on the
    products built to round down, its norm is exact, while the planted alternative (the einsum rounded
    to bf16, as `terms.instantiate` gives eagerly) comes out 0.34% low."""
    from jaxdp.clipping import norms
    from jaxdp.core.terms import LinearTerm, instantiate
    x = jnp.full((2, 1, 16), 1 + 7 / 128, jnp.bfloat16)
    g = jnp.full((2, 1, 24), 1 + 9 / 128, jnp.bfloat16)
    true = np.sqrt(16 * 24) * (1 + 7 / 128) * (1 + 9 / 128)
    norm = lambda G: np.linalg.norm(np.asarray(G, np.float64).reshape(2, -1), axis=1)
    assert np.all(np.abs(norm(norms.instantiated(LinearTerm(x, g))) / true - 1) <= 1e-7)
    assert np.all(norm(instantiate(LinearTerm(x, g)).astype(jnp.float32)) / true < 1 - 3e-3)  # the plant
