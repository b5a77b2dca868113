"""Clip-and-aggregate of a linear layer, sum_b c_b x_b^T g_b = x^T diag(c) g.

Algorithm: x and g are viewed as (B T, P) and (B T, D) (a free reshape).
Grid (P-tile i, D-tile j); program (i, j) loops over the examples b and,
inside, over example b's tokens in tiles of bk (rows past the example's end
are zeroed), accumulating x_b_tile^T g_b_tile in float32; the
example's float32 partial is then scaled by c_b and added to the output
tile. Scaling the float32 partial, not the operand, keeps c_b x_b^T g_b
exact to float32 rounding: a bf16 operand c_b g_b would be rounded to 8 bits
per row, and a per-example gradient whose tokens cancel (x_2 = x_1,
g_2 = -g_1 + small) would then contribute more than its clipped norm
(`tests/test_norm_rounding.py` builds such examples).
Examples whose scale is exactly 0 contribute exact zeros even when x or g
holds inf / NaN there (the non-finite-example rule of `jaxdp.clipping.rules`).

Cost: FLOPs 2 B T P D + B P D (the scaling), the non-DP weight gradient.
HBM bytes: x read nD times, g read nP times (as any tiled GEMM), out P D 4.
Token tiles never straddle two examples, so when T is not a multiple of bk
the last tile of each example is partly masked (ceil(T / bk) bk - T rows of
wasted FLOPs per example).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxdp.pallas import _common

BLOCK_K, BLOCK_P, BLOCK_D = 64, 64, 64


def _linear_clipped_sum_kernel(x_ref, g_ref, c_ref, out_ref, *, seq_len, bk, bp, bd):
    # x_ref: (B T, P), g_ref: (B T, D), c_ref: (B,) float32, out_ref: (P, D).
    i, j = pl.program_id(0), pl.program_id(1)

    def example(b, acc_PD):
        def body(k, part_PD):
            # Rows of example b only: those past its end (the next example's) are zeroed.
            mine = ((k * bk + jnp.arange(bk)) < seq_len)[:, None]
            x = _common.load_tile(x_ref, b * seq_len + k * bk, bk, i * bp, bp)
            g = _common.load_tile(g_ref, b * seq_len + k * bk, bk, j * bd, bd)
            x, g = jnp.where(mine, x, 0).astype(x.dtype), jnp.where(mine, g, 0).astype(g.dtype)
            return part_PD + _common.dot(x, g, trans_a=True)

        part_PD = lax.fori_loop(0, pl.cdiv(seq_len, bk), body, jnp.zeros((bp, bd), jnp.float32))
        c = c_ref[b]
        return acc_PD + jnp.where(c != 0, c * part_PD, 0.0)  # c = 0: exact zeros, even for a non-finite part

    acc_PD = lax.fori_loop(0, c_ref.shape[0], example, jnp.zeros((bp, bd), jnp.float32))
    _common.store_tile(out_ref, i * bp, bp, j * bd, bd, acc_PD)


def _linear_clipped_sum_pallas(x_BTP, g_BTD, c_B, *, block_k, block_p, block_d, interpret, num_warps):
    B, T, P = x_BTP.shape
    D = g_BTD.shape[-1]
    bk, bp, bd = _common.block(T, block_k), _common.block(P, block_p), _common.block(D, block_d)
    dt = _common.compute_dtype(x_BTP, g_BTD)
    return pl.pallas_call(
        functools.partial(_linear_clipped_sum_kernel, seq_len=T, bk=bk, bp=bp, bd=bd),
        out_shape=_common.out_struct((P, D), jnp.float32, x_BTP, g_BTD, c_B),
        grid=(pl.cdiv(P, bp), pl.cdiv(D, bd)),
        compiler_params=_common.compiler_params(num_warps=num_warps),
        interpret=_common.resolve_interpret(interpret),
        name="linear_clipped_sum",
    )(x_BTP.reshape(B * T, P).astype(dt), g_BTD.reshape(B * T, D).astype(dt), _common.f32(c_B))


def linear_clipped_sum(x_BTP: jax.Array, g_BTD: jax.Array, c_B: jax.Array, *,
                       block_k: int = BLOCK_K,
                       block_p: int = BLOCK_P, block_d: int = BLOCK_D,
                       interpret: bool | None = None, num_warps: int = 4) -> jax.Array:
    """sum_b c_b x_b^T g_b, shape (P, D), float32: one GEMM-shaped kernel, each example's float32
    partial scaled by c_b (XLA's version: `linear_clipped_sum_reference`).

    Args:
      x_BTP, g_BTD: the layer's inputs and output gradients, any float dtype.
      c_B: per-example scales (clip factors), float32. An example with c_b = 0
        contributes exact zeros, whatever its x_b and g_b hold.
    """
    return _linear_clipped_sum_pallas(x_BTP, g_BTD, c_B, block_k=block_k, block_p=block_p,
                                      block_d=block_d, interpret=interpret, num_warps=num_warps)


def linear_clipped_sum_reference(x_BTP: jax.Array, g_BTD: jax.Array, c_B: jax.Array, **unused) -> jax.Array:
    """Plain jnp, float32: x^T diag(c) g, zero-scale examples masked out first."""
    del unused
    live = (c_B != 0)[:, None, None]
    x = jnp.where(live, _common.f32(x_BTP), 0)
    g = jnp.where(live, _common.f32(g_BTD) * _common.f32(c_B)[:, None, None], 0)
    return jnp.einsum("btp,btd->pd", x, g, precision=lax.Precision.HIGHEST)
