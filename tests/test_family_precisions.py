"""Per-example gradients of every family in float64 and in bf16 compute, against the vmap reference.

The float32 comparison of each family is in tests/test_hf_families.py. Here the same families (the Llama
switches as `LlamaConfig` options: Mistral's sliding window, Qwen2's q/k/v biases with a tied head, Qwen3's
per-head q/k norms with a wider head) and GPT-2:

- float64 (JAX's x64 mode, parameters and compute in float64): every parameter's per-example gradient equals
  the reference to 1e-12 relative, so the rules are exact, not merely close in float32.
- bf16 compute (parameters float32, activations bf16): within a tolerance derived from bf16's epsilon,
  which a 25% error planted in one parameter's per-example gradients exceeds.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_testing import by_path, lm_batch, lm_loss, max_rel_err, tiny_gpt2, tiny_llama
from flax import nnx

import jaxdp
import jaxdp.core.reference  # the vmap oracle: not exported by jaxdp
from jaxdp.core import terms

FAMILIES = {
    "gpt2": {},
    "llama": {},
    "mistral": dict(sliding_window=8, family="mistral"),
    "qwen2": dict(qkv_bias=True, tie_embeddings=True, family="qwen2"),
    "qwen3": dict(qk_norm=True, head_dim=24, family="qwen3"),
}
# bf16 keeps 8 bits of mantissa: eps = 2**-7 between 1 and 2. The two paths round the same activations in
# different orders (a batched matmul against one example's), so their per-example gradients differ by a few
# roundings (about one eps at most, measured: notebook/2026-11-28-memory-plan-and-precisions.md); 4 eps
# (3%) leaves room and is still far below a planted 25% error.
BF16_RTOL = 4 * float(jnp.finfo(jnp.bfloat16).eps)


def model_of(family: str, dtype: str):
    if family == "gpt2":
        return tiny_gpt2(seed=5, dtype=dtype)
    return tiny_llama(seed=5, dtype=dtype, **FAMILIES[family])


@nnx.jit
def fast_and_reference(model, batch):
    _, grads = jaxdp.per_example_grads(lm_loss, fallback=False)(model, batch)
    _, ref = jaxdp.core.reference.per_example_grads(lm_loss, model, batch)
    fast = {tuple(p): sum(terms.instantiate(t) for t in v.get_value().terms) for p, v in nnx.to_flat_state(grads)}
    return fast, ref


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_float64_per_example_grads_equal_reference(family):
    with jax.enable_x64(True):
        model = model_of(family, "float64")
        nnx.update(model, jax.tree.map(lambda a: a.astype(jnp.float64), nnx.state(model)))
        fast, ref = jax.device_get(fast_and_reference(model, lm_batch(seed=6, B=4, T=12)))
    assert all(np.asarray(v).dtype == np.float64 for v in fast.values())
    assert max_rel_err(fast, ref) <= 1e-12, max_rel_err(fast, ref)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_per_example_grads_within_rounding_of_reference(family):
    model = model_of(family, "bfloat16")
    fast, ref = jax.device_get(fast_and_reference(model, lm_batch(seed=7, B=4, T=12)))
    fast = {p: np.asarray(v, np.float32) for p, v in by_path(fast).items()}
    ref = {p: np.asarray(v, np.float32) for p, v in by_path(ref).items()}
    assert max_rel_err(fast, ref) <= BF16_RTOL, max_rel_err(fast, ref)
    planted = dict(fast)
    path = max(planted, key=lambda p: planted[p].size)
    planted[path] = planted[path] * 1.25
    assert max_rel_err(planted, ref) > BF16_RTOL
