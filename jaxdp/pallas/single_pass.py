"""Single-pass per-layer clipping of a linear layer: each G_b tile computed ONCE, for its norm and its clipped sum.

With per-layer (or per-group inside one layer) clipping, the clip factor of
example b depends only on this layer's norm ||G_b||, which is complete only
after EVERY (P, D) tile of G_b = x_b^T g_b has been computed. The tiles of
one example live in different programs, so the norm needs a cross-tile
synchronisation before any tile can be scaled.

Synchronisation chosen: a bounded scratch between two launches, per chunk of
E examples (`chunk_size`).

  launch 1  grid (E, nP, nD): program (e, i, j) computes the (bp, bd) tile
            G_e[i, j] over T on chip (float32 accumulator), writes it to the
            scratch S (E, P', D') (P', D' rounded up to tiles) and writes the
            tile's sum of squares to partials (E, nP, nD).
  between   (XLA, E floats) squared norm n_e^2 = sum of partials (+ the
            squared norms of the group's other parameters, e.g. the bias),
            clip factors c_e = clip_factors_fn(n_e^2).
  launch 2  grid (nP, nD): out[i, j] += sum_e c_e S[e, i, j]; the
            accumulator is aliased in place (`input_output_aliases`).

The launch boundary is the barrier: no atomics, no spin-waits on other
programs (which Triton cannot schedule safely: a persistent kernel that
waits for all tiles of a norm deadlocks when not all programs are resident),
and it runs in the interpreter. FlashDP's reference code instead loops over
examples in Python; here the examples of a chunk are one grid axis.

Counts for B examples, chunk E, scratch itemsize s (4 for float32):
  FLOPs   2 B T P D  (each G_b tile once: the non-DP weight-gradient GEMM)
        + 2 B P D    (squares)  + 2 B P D (scaled sum)
  bytes   inputs as any tiled GEMM: B T (P nD + D nP) itemsize
        + 2 B P D s  (scratch written once, read once)
        + 2 ceil(B/E) P D 4  (accumulator read + written per chunk)
  scratch E P D s bytes, whatever B.
The two-pass alternative (`linear_sq_norms` then `linear_clipped_sum`)
costs 4 B T P D FLOPs and no scratch. The single pass saves 2 B T P D FLOPs
(time 2 B T P D / R at matmul rate R) and moves 2 B P D s more bytes (time
2 B P D s / W at bandwidth W): it wins when T > s R / W, with R and W the
device's row of `jaxdp.clipping.device_rates` (a prediction; the crossing for an H100
is in WORKSPACE.md). `SinglePassConfig(scratch_dtype=jnp.bfloat16)` halves s and so
the crossing, but rounds G_b before scaling.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxdp._keywords import old_keywords
from jaxdp.pallas import _common

BLOCK_T, BLOCK_P, BLOCK_D = 64, 64, 64
DEFAULT_CHUNK_SIZE = 8


@dataclasses.dataclass(frozen=True)
class SinglePassConfig:
    """How the single pass is tiled and launched; no effect on what it computes beyond rounding.

    Attributes:
      block_t, block_p, block_d: preferred tile edges along T, P and D (powers of two >= 16; a smaller
        dimension takes the smallest power of two covering it, `jaxdp.pallas._common.block`).
      scratch_dtype: of the G_b tiles between the two launches: float32 (exact) or bfloat16 (half the
        scratch bytes; the norm is of the rounded tiles the sum reads).
      interpret: run in the Pallas interpreter; None: exactly on a CPU backend (`_common.resolve_interpret`).
      num_warps: Triton warps per program.
    """
    block_t: int = BLOCK_T
    block_p: int = BLOCK_P
    block_d: int = BLOCK_D
    scratch_dtype: Any = jnp.float32
    interpret: bool | None = None
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_t", "block_p", "block_d"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < _common.MIN_BLOCK or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= {_common.MIN_BLOCK}, got {value!r}")
        if not jnp.issubdtype(self.scratch_dtype, jnp.floating):
            raise ValueError(f"scratch_dtype must be a float dtype (float32 or bfloat16), got {self.scratch_dtype!r}")
        if self.interpret is not None and not isinstance(self.interpret, bool):
            raise TypeError(f"interpret must be None, True or False, got {self.interpret!r}")
        if not isinstance(self.num_warps, int) or self.num_warps < 1:
            raise ValueError(f"num_warps must be an integer >= 1, got {self.num_warps!r}")


class _Chunk(NamedTuple):
    """Examples b0 .. b0 + E - 1 of one launch pair, with their slices of the per-example inputs."""
    b0: int
    E: int
    extra_sq_E: jax.Array | None  # the group's other parameters' squared norms
    args_E: tuple                 # `factor_args_B`'s slices


def _tiles_kernel(x_ref, g_ref, tile_ref, partial_ref, *, bt, bp, bd):
    # x_ref (T, P), g_ref (T, D) of one example; tile_ref (bp, bd) of the scratch; partial_ref scalar.
    acc_PD = _common.example_grad_tile(x_ref, g_ref, bt, bp, bd)
    tile = acc_PD.astype(tile_ref.dtype)
    tile_ref[...] = tile
    kept = tile.astype(jnp.float32)  # the norm of what the sum will read (a bf16 scratch rounds the tile)
    partial_ref[...] = jnp.sum(kept * kept)


def _scaled_tile_sum_kernel(tiles_ref, c_ref, acc_ref, out_ref):
    # tiles_ref (E, bp, bd), c_ref (E,), acc_ref / out_ref (bp, bd) aliased.
    def body(e, acc_PD):
        c = c_ref[e]
        tile = tiles_ref[e].astype(jnp.float32)
        return acc_PD + jnp.where(c != 0, tile * c, 0.0)  # c = 0: exact zero, even for a non-finite tile

    out_ref[...] = lax.fori_loop(0, tiles_ref.shape[0], body, acc_ref[...])


def _chunk_pallas(x_BTP, g_BTD, acc_PD, chunk: _Chunk, clip_factors_fn, launch: SinglePassConfig):
    # `launch`: the blocks as resolved for this shape, `interpret` resolved.
    _, T, P = x_BTP.shape
    D = g_BTD.shape[-1]
    b0, E, extra_sq_E, args_E = chunk
    bt, bp, bd, interpret = launch.block_t, launch.block_p, launch.block_d, launch.interpret
    nP, nD = acc_PD.shape[0] // bp, acc_PD.shape[1] // bd
    params = _common.compiler_params(num_warps=launch.num_warps)
    tiles, partials = pl.pallas_call(
        functools.partial(_tiles_kernel, bt=bt, bp=bp, bd=bd),
        out_shape=(_common.out_struct((E, nP * bp, nD * bd), launch.scratch_dtype, x_BTP, g_BTD),
                   _common.out_struct((E, nP, nD), jnp.float32, x_BTP, g_BTD)),
        grid=(E, nP, nD),
        in_specs=[pl.BlockSpec((None, T, P), lambda e, i, j: (b0 + e, 0, 0)),
                  pl.BlockSpec((None, T, D), lambda e, i, j: (b0 + e, 0, 0))],
        out_specs=(pl.BlockSpec((None, bp, bd), lambda e, i, j: (e, i, j)),
                   pl.BlockSpec((None, None, None), lambda e, i, j: (e, i, j))),
        compiler_params=params, interpret=interpret, name="linear_grad_tiles",
    )(x_BTP, g_BTD)
    sq_E = jnp.sum(partials, axis=(1, 2))
    group_sq_E = sq_E if extra_sq_E is None else sq_E + extra_sq_E
    c_E = _common.f32(clip_factors_fn(group_sq_E, *args_E))
    acc_PD = pl.pallas_call(
        _scaled_tile_sum_kernel,
        out_shape=_common.out_struct(acc_PD.shape, jnp.float32, tiles, c_E, acc_PD),
        grid=(nP, nD),
        in_specs=[pl.BlockSpec((E, bp, bd), lambda i, j: (0, i, j)),
                  pl.BlockSpec((E,), lambda i, j: (0,)),
                  pl.BlockSpec((bp, bd), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((bp, bd), lambda i, j: (i, j)),
        input_output_aliases={2: 0},
        compiler_params=params, interpret=interpret, name="linear_scaled_tile_sum",
    )(tiles, c_E, acc_PD)
    return acc_PD, sq_E


@old_keywords(config=(SinglePassConfig, tuple(f.name for f in dataclasses.fields(SinglePassConfig))))
def linear_fused_clipped_sum(x_BTP: jax.Array, g_BTD: jax.Array,
                             clip_factors_fn: Callable[[jax.Array], jax.Array], *,
                             extra_sq_norms_B: jax.Array | None = None, factor_args_B: tuple = (),
                             chunk_size: int = DEFAULT_CHUNK_SIZE,
                             config: SinglePassConfig = SinglePassConfig()) -> tuple[jax.Array, jax.Array]:
    """Per-layer clipped sum in one pass over the per-example gradient tiles.

    Args:
      x_BTP, g_BTD: layer inputs and output gradients, any float dtype.
      clip_factors_fn: maps the group's per-example squared norms (E,) to clip
        factors (E,); applied elementwise per chunk of examples. It must return
        0 for examples to drop (e.g. non-finite norms): those contribute exact zeros.
      extra_sq_norms_B: squared norms (B,) of the group's other parameters
        (a bias), added before `clip_factors_fn`.
      factor_args_B: further per-example arrays (B, ...); each chunk calls
        `clip_factors_fn(group_sq_E, *[a[chunk] for a in factor_args_B])`.
      chunk_size: E, examples whose tiles share the bounded scratch (E P D floats).
      config: tiles, scratch dtype and launch (`SinglePassConfig`). The keywords it replaced (`block_t=`,
        `block_p=`, `block_d=`, `scratch_dtype=`, `interpret=`, `num_warps=`) are still accepted for one
        release, with a DeprecationWarning.

    Returns:
      (sum_b c_b x_b^T g_b of shape (P, D) float32, this layer's squared norms (B,) float32).
    """
    B, T, P = x_BTP.shape
    D = g_BTD.shape[-1]
    if not isinstance(config, SinglePassConfig):
        raise TypeError(f"config must be a SinglePassConfig, got {type(config).__name__}: {config!r}")
    launch = dataclasses.replace(config, block_t=_common.block(T, config.block_t),
                                 block_p=_common.block(P, config.block_p), block_d=_common.block(D, config.block_d),
                                 interpret=_common.resolve_interpret(config.interpret))
    dt = _common.compute_dtype(x_BTP, g_BTD)
    x_BTP, g_BTD = x_BTP.astype(dt), g_BTD.astype(dt)
    acc_PD = _common.zeros_varying_like((pl.cdiv(P, launch.block_p) * launch.block_p,
                                         pl.cdiv(D, launch.block_d) * launch.block_d), jnp.float32, x_BTP, g_BTD)
    sq = []
    for b0 in range(0, B, chunk_size):  # static chunks: ceil(B / E) launch pairs
        E = min(chunk_size, B - b0)
        extra = None if extra_sq_norms_B is None else _common.f32(extra_sq_norms_B)[b0:b0 + E]
        chunk = _Chunk(b0, E, extra, tuple(a[b0:b0 + E] for a in factor_args_B))
        acc_PD, sq_E = _chunk_pallas(x_BTP, g_BTD, acc_PD, chunk, clip_factors_fn, launch)
        sq.append(sq_E)
    return acc_PD[:P, :D], jnp.concatenate(sq)


def linear_fused_clipped_sum_reference(x_BTP, g_BTD, clip_factors_fn, *, extra_sq_norms_B=None,
                                       factor_args_B=(), **unused) -> tuple[jax.Array, jax.Array]:
    """Plain jnp, float32: instantiate every G_b, norms, factors, masked weighted sum."""
    del unused
    G_BPD = jnp.einsum("btp,btd->bpd", _common.f32(x_BTP), _common.f32(g_BTD),
                       precision=lax.Precision.HIGHEST)
    sq_B = jnp.sum(G_BPD * G_BPD, axis=(1, 2))
    group_sq_B = sq_B if extra_sq_norms_B is None else sq_B + _common.f32(extra_sq_norms_B)
    c_B = _common.f32(clip_factors_fn(group_sq_B, *factor_args_B))
    scaled = jnp.where((c_B != 0)[:, None, None], G_BPD * c_B[:, None, None], 0.0)
    return jnp.sum(scaled, axis=0), sq_B
