"""Clip-and-aggregate of a linear layer, sum_b c_b x_b^T g_b = x^T diag(c) g, one GEMM with K = B T.

Algorithm: x and g are viewed as (K, P) and (K, D) with K = B T (a free
reshape). Grid (P-tile i, D-tile j); program (i, j) loops over K in tiles of
bk, loads the x and g tiles and the scales c[k // T] of their rows (a gather
of the (B,) factors, fused into the operand load: no scaled copy of g is
written), and accumulates x_tile^T (c * g_tile) in float32. Rows whose scale
is exactly 0 contribute exact zeros even when x or g holds inf / NaN there
(the non-finite-example rule of `jaxdp.clipping`).

Cost: FLOPs 2 B T P D + B T D (the scaling), the non-DP weight gradient.
HBM bytes: x read nD times, g read nP times (as any tiled GEMM), out P D 4.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxdp.pallas import _common

BLOCK_K, BLOCK_P, BLOCK_D = 64, 64, 64


def _linear_clipped_sum_kernel(x_ref, g_ref, c_ref, out_ref, *, seq_len, bk, bp, bd):
    # x_ref: (K, P), g_ref: (K, D), c_ref: (B,) float32, out_ref: (P, D).
    K = x_ref.shape[0]
    i, j = pl.program_id(0), pl.program_id(1)

    def body(k, acc_PD):
        rows = k * bk + jnp.arange(bk)
        c = plgpu.load(c_ref.at[rows // seq_len], mask=rows < K, other=0.0)
        live = (c != 0)[:, None]
        x = _common.load_tile(x_ref, k * bk, bk, i * bp, bp)
        g = _common.load_tile(g_ref, k * bk, bk, j * bd, bd)
        x = jnp.where(live, x, 0).astype(x_ref.dtype)
        g = jnp.where(live, g.astype(jnp.float32) * c[:, None], 0).astype(g_ref.dtype)
        return acc_PD + _common.dot(x, g, trans_a=True)

    acc_PD = lax.fori_loop(0, pl.cdiv(K, bk), body, jnp.zeros((bp, bd), jnp.float32))
    _common.store_tile(out_ref, i * bp, bp, j * bd, bd, acc_PD)


def _linear_clipped_sum_pallas(x_BTP, g_BTD, c_B, *, block_k, block_p, block_d, interpret, num_warps):
    B, T, P = x_BTP.shape
    D = g_BTD.shape[-1]
    K = B * T
    bk, bp, bd = _common.block(K, block_k), _common.block(P, block_p), _common.block(D, block_d)
    dt = _common.compute_dtype(x_BTP, g_BTD)
    return pl.pallas_call(
        functools.partial(_linear_clipped_sum_kernel, seq_len=T, bk=bk, bp=bp, bd=bd),
        out_shape=_common.out_struct((P, D), jnp.float32, x_BTP, g_BTD, c_B),
        grid=(pl.cdiv(P, bp), pl.cdiv(D, bd)),
        compiler_params=_common.compiler_params(num_warps=num_warps),
        interpret=_common.resolve_interpret(interpret),
        name="linear_clipped_sum",
    )(x_BTP.reshape(K, P).astype(dt), g_BTD.reshape(K, D).astype(dt), _common.f32(c_B))


def linear_clipped_sum(x_BTP: jax.Array, g_BTD: jax.Array, c_B: jax.Array, *,
                       implementation: str = "pallas", block_k: int = BLOCK_K,
                       block_p: int = BLOCK_P, block_d: int = BLOCK_D,
                       interpret: bool | None = None, num_warps: int = 4) -> jax.Array:
    """sum_b c_b x_b^T g_b, shape (P, D), float32.

    Args:
      x_BTP, g_BTD: the layer's inputs and output gradients, any float dtype.
      c_B: per-example scales (clip factors), float32. An example with c_b = 0
        contributes exact zeros, whatever its x_b and g_b hold.
      implementation: "pallas" (one GEMM-shaped kernel, scale fused into the
        load) or "xla" (jnp.where + einsum).
    """
    _common.check_implementation(implementation)
    if implementation == "xla":
        return linear_clipped_sum_reference(x_BTP, g_BTD, c_B)
    return _linear_clipped_sum_pallas(x_BTP, g_BTD, c_B, block_k=block_k, block_p=block_p,
                                      block_d=block_d, interpret=interpret, num_warps=num_warps)


def linear_clipped_sum_reference(x_BTP: jax.Array, g_BTD: jax.Array, c_B: jax.Array, **unused) -> jax.Array:
    """Plain jnp, float32: x^T diag(c) g, zero-scale examples masked out first."""
    del unused
    live = (c_B != 0)[:, None, None]
    x = jnp.where(live, _common.f32(x_BTP), 0)
    g = jnp.where(live, _common.f32(g_BTD) * _common.f32(c_B)[:, None, None], 0)
    return jnp.einsum("btp,btd->pd", x, g, precision=lax.Precision.HIGHEST)
