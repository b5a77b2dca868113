"""Shared helpers for DP tests: tiny models, batches, loss functions, comparisons; the fused_clip case that
the XLA and Pallas reference tests share; the fine-tuning case (random parameters, clipped sums of the
factored path and of the reference); Hugging Face checkpoint files."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxdp
import jaxdp.core.losses
import jaxdp.core.reference  # the vmap oracle: not exported by jaxdp
from jaxdp.models.gpt2 import GPT2, GPT2Config
from jaxdp.models.llama import Llama, LlamaConfig
from jaxdp.models.safetensors_io import write_safetensors

RTOL = 1e-5  # reference equality in float32 at the highest matmul precision


def lm_loss(model, batch):
    """Per-example mean next-token NLL, zero for masked (padding) examples."""
    nll = jaxdp.core.losses.token_nll(model, batch["tokens"][:, :-1], batch["tokens"][:, 1:])  # frozen head: chunks
    return jnp.where(batch["mask"], nll.mean(axis=-1), 0.0)


def tiny_gpt2(seed=0, *, remat=False, vocab_size=97, seq_len=32, dtype="float32"):
    config = GPT2Config.preset("tiny", vocab_size=vocab_size, seq_len=seq_len, remat=remat, dtype=dtype)
    return GPT2(config, rngs=nnx.Rngs(seed))


def tiny_llama(seed=0, **overrides):
    config = LlamaConfig.preset("tiny", **dict(dict(vocab_size=97, seq_len=32), **overrides))
    return Llama(config, rngs=nnx.Rngs(seed))


def lm_batch(seed, B=6, T=16, vocab_size=97, num_masked=1):
    tokens = jax.random.randint(jax.random.key(seed), (B, T + 1), 0, vocab_size)
    mask = jnp.arange(B) < B - num_masked
    return {"tokens": tokens, "mask": mask}


def by_path(tree):
    """{path tuple: array} of an nnx.State (Variables or plain leaves) or of a path dict."""
    if isinstance(tree, dict) and all(isinstance(k, tuple) for k in tree):
        return tree
    return {tuple(p): (v.get_value() if isinstance(v, nnx.Variable) else v)
            for p, v in nnx.to_flat_state(tree)}


def max_rel_err(actual, expected):
    """max over parameters of max|a - e| / max|e| (normwise relative error).

    In NumPy on the host, in the arrays' dtype (as jnp would compute it): on the device every new
    shape, dtype and sharding would compile its own small subtract / abs / max programs."""
    actual, expected = by_path(actual), by_path(expected)
    assert actual.keys() == expected.keys(), set(actual) ^ set(expected)
    errs = []
    for p in expected:
        a, e = np.asarray(actual[p]), np.asarray(expected[p])
        errs.append(float(np.max(np.abs(a - e)) / np.max(np.abs(e))))
    return max(errs)


@functools.partial(nnx.jit, static_argnums=0)
def reference_grads(loss_fn, model, batch):
    """(losses (B,), {path: per-example gradients (B, ...)}) of the vmap reference, jitted: one compile
    per loss, model structure and batch shape, shared by every test (and test file) that asks for it."""
    return jaxdp.core.reference.per_example_grads(loss_fn, model, batch)


def clip_between(ref_grads):
    """A C strictly between the smallest and largest non-zero per-example norm of `{path: (B, ...)}`
    per-example gradients (on the host: no second compile of the reference for its norms)."""
    sq = sum(np.sum(np.square(np.asarray(g, np.float64).reshape(g.shape[0], -1)), axis=1)
             for g in ref_grads.values())
    n = np.sort(np.sqrt(sq[sq > 0]))
    assert n[0] < n[-1], n
    return float(np.sqrt(n[0] * n[-1]))


def first_updates_fn(loss_fn, txs, **grads_kwargs):
    """A jitted (model, batch) -> [first update of each tx]: every configuration in one compile."""
    grads_fn = jaxdp.per_example_grads(loss_fn, **grads_kwargs)

    @nnx.jit
    def all_updates(model, batch):
        _, grads = grads_fn(model, batch)
        params = nnx.state(model, nnx.Param)
        return [tx.update(grads, tx.init(params), params)[0] for tx in txs]

    return all_updates


def assert_json_close(actual, expected, *, rtol, atol=0.0, where="$"):
    """Two JSON values (dicts, lists, numbers, strings, bools, None) equal, floats within rtol / atol.

    Keys, lengths, types, strings, bools and None compare exactly; only floats compare with a tolerance.
    (pytest.approx compares flat numeric containers only: from pytest 9 it raises on a None or a string.)
    """
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), (where, actual, expected)
        for k in expected:
            assert_json_close(actual[k], expected[k], rtol=rtol, atol=atol, where=f"{where}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), (where, actual, expected)
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_json_close(a, e, rtol=rtol, atol=atol, where=f"{where}[{i}]")
    elif isinstance(expected, float) and isinstance(actual, (int, float)) and not isinstance(actual, bool):
        assert np.isclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True), (where, actual, expected)
    else:
        assert type(actual) is type(expected) and actual == expected, (where, actual, expected)


def write_hf_checkpoint(path, tensors, config):
    """A Hugging Face checkpoint directory: config.json and model.safetensors of {HF name: array}."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    write_safetensors(os.path.join(path, "model.safetensors"), tensors, {"format": "pt"})
    return str(path)


# ------------------------------------------------------------------ fused_clip against the vmap reference
# The case test_fused_clip_reference (XLA strategies) and test_pallas_fused_clip (the kernels) share.

EXPECTED_BATCH_SIZE = 5.0


def by_block(path):
    """An explicit grouping: one group per transformer block, one for the rest."""
    return path[:2] if path[0] == "blocks" else "embeddings_and_final_norm"


CLIPPINGS = {"flat": "flat", "per_layer": "per_layer", "by_block": by_block}


@functools.lru_cache(maxsize=None)
def gpt2_case_with_reference(remat):
    """model, batch, C and the vmap reference's (losses, {path: per-example grads}), jitted (one compile)."""
    model = tiny_gpt2(seed=11, remat=remat)
    batch = lm_batch(seed=12)
    reference = reference_grads(lm_loss, model, batch)
    return model, batch, clip_between(reference[1]), reference


def gpt2_case(remat):
    """model, batch, C (between the per-example norms) and the reference's {path: per-example grads}."""
    model, batch, C, (_, ref_grads) = gpt2_case_with_reference(remat)
    return model, batch, C, ref_grads


def reference_update(remat, clipping, clip_fn):
    """fused_clip's first update (sigma 0) on `gpt2_case(remat)`, from the reference's clipped sums."""
    _, _, C, ref_grads = gpt2_case(remat)
    sums, _ = jaxdp.core.reference.clipped_sum(ref_grads, C, clipping=CLIPPINGS[clipping], clip_fn=clip_fn)
    return {p: s / EXPECTED_BATCH_SIZE for p, s in sums.items()}


# ------------------------------------------------------------------ fine-tuned models against the vmap reference
# The case test_finetune, test_hf_llama and test_norm_rounding share: a model with random parameters, the
# clipped sums of the factored path beside the reference's, and a planted error the comparison must see.

# Tiny shapes: compile time dominates, and XLA's backend optimisations cost half of it (as experiments/long_context).
FAST_COMPILE = dict(xla_backend_optimization_level=0, xla_llvm_disable_expensive_passes=True)


def fast_jit(fn):
    """`jax.jit` of `fn(graphdef, state, *args)` (graphdef static) with FAST_COMPILE."""
    return jax.jit(fn, static_argnums=0, compiler_options=FAST_COMPILE)


def random_model(build, seed):
    """The model `build()` makes, built abstractly (no eager init: at these shapes its op-by-op compiles cost
    seconds), with every parameter drawn afresh: N(1, 0.1^2) for norm scales, N(0, 0.1^2) otherwise. So
    LoRA's B and the side network's up-projection are not zero (which would zero the per-example gradients
    before them and leave the comparison empty)."""
    graphdef, state = nnx.split(nnx.eval_shape(build))
    rng = np.random.default_rng(seed)
    leaves = [(path, var.replace(jnp.asarray((path[-1] == "scale") + 0.1 * rng.standard_normal(var.shape),
                                             var.dtype)))
              for path, var in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def plant(per_example):
    """A 1% error in the per-example gradients {path: (B, ...)} of the first trainable parameter."""
    first = next(iter(per_example))
    return {p: g * 1.01 if p == first else g for p, g in per_example.items()}


@fast_jit
def clipped_sums_and_reference(graphdef, state, batch, C):
    """Clipped sums of the factored path (flat: ghost norms, per-layer: instantiated) and of the vmap
    reference, and the reference's flat sums with a planted error: one compile per model."""
    model = nnx.merge(graphdef, state)
    _, grads = jaxdp.per_example_grads(lm_loss, fallback=False)(model, batch)
    _, ref = jaxdp.core.reference.per_example_grads(lm_loss, model, batch)
    out = {}
    for clipping, strategy in (("flat", "ghost"), ("per_layer", "instantiate")):
        expected, norms = jaxdp.core.reference.clipped_sum(ref, C, clipping=clipping)
        out[clipping] = {"expected": expected, "norms": norms,
                         "fast": jaxdp.clipped_aggregate(grads, C, clip=jaxdp.ClipSpec(clipping=clipping),
                                                         norms=jaxdp.NormPlan(strategy=strategy))[0]}
    out["flat"]["planted"] = jaxdp.core.reference.clipped_sum(plant(ref), C)[0]
    return out
