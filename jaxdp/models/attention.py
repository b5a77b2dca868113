"""Causal self-attention for the jaxdp models: fused (cuDNN) on GPU, XLA elsewhere.

`causal_attention(q, k, v, implementation=...)` is `jax.nn.dot_product_attention`
with a causal mask. The implementation:

  "auto"   cuDNN's fused flash attention when the default backend is a GPU,
           the inputs are bf16 / f16 and the head size is a multiple of 8 up
           to 128 (what cuDNN's kernel takes); XLA otherwise (CPU, float32);
  "xla"    XLA's attention (materialises the B x N x T x T logits);
  "cudnn"  cuDNN always (fails where cuDNN is missing); lets a deviceless
           XLA:GPU compile on a CPU machine see the GPU program.

This is the baseline a user would run: cuDNN's fused attention never
materialises the T x T logits, so the non-DP step is faster and smaller with
it and fits contexts where XLA attention runs out of memory (measurements in
WORKSPACE.md, "Design decisions", causal_attention). DP and
non-DP use the same attention: it has no parameters, and the per-example
gradients of the projections around it are exact for either implementation.

Context parallelism (`jaxdp.core.sequence_shards`): keys and values of every
shard are all-gathered and the mask is causal on GLOBAL positions, which is
not cuDNN's causal mask (queries of shard s start at position s T / S), so
the sequence-sharded step uses XLA attention with an explicit mask.

Sliding-window attention (Mistral): `window=w` lets query t attend to keys
t - w + 1 .. t only, HF's `kv_idx > q_idx - sliding_window` on top of the
causal mask; `jax.nn.dot_product_attention`'s `local_window_size=(w - 1, 0)`
(cuDNN's `sliding_window_length=w`), or the explicit mask under context
parallelism. A window no shorter than the keys masks nothing and is dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdp.core import sequence_shards as context

IMPLEMENTATIONS = ("auto", "xla", "cudnn")


def check_implementation(implementation: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {IMPLEMENTATIONS}, got {implementation!r}")


def resolve(implementation: str, dtype, head_dim: int) -> str:
    """The implementation "auto" stands for on this machine, for these inputs."""
    check_implementation(implementation)
    if implementation != "auto":
        return implementation
    fused_ok = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128
    return "cudnn" if fused_ok and jax.default_backend() == "gpu" else "xla"


def causal_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, positions_T: jax.Array, *,
                     implementation: str = "auto", seq_axis: str | None = None,
                     window: int | None = None) -> jax.Array:
    """Causal attention (grouped-query when K < N heads); `positions_T` are the queries' global positions.

    `seq_axis`: the mesh axis sharding the sequence (context parallelism), or None. `window`: each query
    attends to itself and the `window - 1` keys before it only (sliding-window attention), or None: all."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or an integer >= 1, got {window!r}")
    if seq_axis is None:
        impl = resolve(implementation, q_BTNH.dtype, q_BTNH.shape[-1])
        local = None if window is None or window >= k_BTKH.shape[1] else (window - 1, 0)
        return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, is_causal=True, local_window_size=local,
                                            implementation=impl)
    # Context parallel: keys / values of every shard, causal on global positions.
    k_BSKH, v_BSKH = context.gather_sequence(k_BTKH, seq_axis), context.gather_sequence(v_BTKH, seq_axis)
    key_positions_S = jnp.arange(k_BSKH.shape[1])
    mask_TS = positions_T[:, None] >= key_positions_S[None, :]
    if window is not None and window < k_BSKH.shape[1]:
        mask_TS &= positions_T[:, None] - key_positions_S[None, :] < window
    return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask_TS[None, None], implementation="xla")
