"""Shared pieces of the Pallas (Triton backend) kernels: block sizes, masked tile loads, dispatch.

Every kernel reads whole-array refs and loads power-of-two tiles with masks
(`plgpu.load(ref.at[pl.ds(...), pl.ds(...)], mask=..., other=0)`), so odd
sizes need no padding copy of the inputs: out-of-range rows and columns load
as zeros, which contribute nothing to any sum of products. Triton's `tl.dot`
needs every tile dimension >= 16 and a power of two; `block` enforces both.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxdp.core import _tape

MIN_BLOCK = 16  # tl.dot's smallest tile edge



def resolve_interpret(interpret: bool | None) -> bool:
    """None: interpret exactly when the default backend is the CPU (no Triton there), unless the
    environment sets JAXDP_PALLAS_INTERPRET=0 / 1 (a deviceless compile for a GPU on a CPU machine
    sets 0: `experiments/bench_throughput.py --target`)."""
    if interpret is not None:
        return bool(interpret)
    forced = os.environ.get("JAXDP_PALLAS_INTERPRET")
    if forced in ("0", "1"):
        return forced == "1"
    return jax.default_backend() == "cpu"


def block(dim: int, preferred: int) -> int:
    """A power-of-two tile edge >= 16, no larger than `preferred` or than `dim` rounded up."""
    if preferred < MIN_BLOCK or preferred & (preferred - 1):
        raise ValueError(f"block sizes must be powers of two >= {MIN_BLOCK}, got {preferred}")
    return max(MIN_BLOCK, min(preferred, pl.next_power_of_2(dim)))


def _varying_axes(*inputs) -> tuple[str, ...]:
    """The mesh axes any of `inputs` varies over inside a `jax.shard_map` (empty outside one)."""
    return tuple(sorted(set().union(*(_tape.varying_axes(a) for a in inputs))))


def out_struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
    """A pallas_call output's type: varying over every mesh axis that one of `inputs` varies over.

    Inside `jax.shard_map(check_vma=True)` (`jaxdp.sharding.ShardedDPStep`)
    pallas_call needs the varying axes of its outputs; outside a shard_map
    they are empty.
    """
    varying = jax.sharding.ManualAxisType(varying=frozenset(_varying_axes(*inputs)))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=varying)


def zeros_varying_like(shape, dtype, *inputs) -> jax.Array:
    """Zeros typed as varying like `inputs` (see `out_struct`): the start of an accumulator
    that a pallas_call updates in place (`input_output_aliases`: the output takes its type)."""
    return _tape.varying_like(jnp.zeros(shape, dtype), _varying_axes(*inputs))


def compiler_params(num_warps: int = 4, num_stages: int = 2):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def load_tile(ref, row0, rows: int, col0, cols: int):
    """ref[row0:row0+rows, col0:col0+cols] of a 2-D ref, zeros outside the array."""
    n_rows, n_cols = ref.shape
    r = row0 + jnp.arange(rows)
    c = col0 + jnp.arange(cols)
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    return plgpu.load(ref.at[pl.ds(row0, rows), pl.ds(col0, cols)], mask=mask, other=0)


def store_tile(ref, row0, rows: int, col0, cols: int, value):
    n_rows, n_cols = ref.shape
    r = row0 + jnp.arange(rows)
    c = col0 + jnp.arange(cols)
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    plgpu.store(ref.at[pl.ds(row0, rows), pl.ds(col0, cols)], value.astype(ref.dtype), mask=mask)


def dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """Tile product with float32 accumulation; float32 tiles in IEEE precision (no TF32)."""
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=False)


def example_grad_tile(x_ref, g_ref, bt: int, bp: int, bd: int):
    """Tile (i, j) = (program_id(1), program_id(2)) of one example's x^T g, reduced over T on chip.

    x_ref (T, P) and g_ref (T, D) hold one example; returns the (bp, bd) float32 tile.
    """
    T = x_ref.shape[0]
    i, j = pl.program_id(1), pl.program_id(2)

    def body(k, acc_PD):
        x = load_tile(x_ref, k * bt, bt, i * bp, bp)
        g = load_tile(g_ref, k * bt, bt, j * bd, bd)
        return acc_PD + dot(x, g, trans_a=True)

    return lax.fori_loop(0, pl.cdiv(T, bt), body, jnp.zeros((bp, bd), jnp.float32))


def per_example_partial_sums(kernel, x_BTP, g_BTD, n_i: int, n_j: int, *, name: str,
                             interpret: bool | None, num_warps: int) -> jax.Array:
    """Runs `kernel` on grid (B, n_i, n_j) and returns, per example, the sum of its programs' partials (B,).

    Program (b, i, j) sees example b's whole x (T, P) and g (T, D), in the
    compute dtype, and writes one float32 scalar.
    """
    B, T, P = x_BTP.shape
    D = g_BTD.shape[-1]
    dt = compute_dtype(x_BTP, g_BTD)
    partials = pl.pallas_call(
        kernel,
        out_shape=out_struct((B, n_i, n_j), jnp.float32, x_BTP, g_BTD),
        grid=(B, n_i, n_j),
        in_specs=[pl.BlockSpec((None, T, P), lambda b, i, j: (b, 0, 0)),
                  pl.BlockSpec((None, T, D), lambda b, i, j: (b, 0, 0))],
        out_specs=pl.BlockSpec((None, None, None), lambda b, i, j: (b, i, j)),
        compiler_params=compiler_params(num_warps=num_warps),
        interpret=resolve_interpret(interpret),
        name=name,
    )(x_BTP.astype(dt), g_BTD.astype(dt))
    return jnp.sum(partials, axis=(1, 2))


def compute_dtype(*arrays):
    """The dtype tiles enter the tensor cores in: bf16 / f16 stay, anything else float32."""
    dt = jnp.result_type(*arrays)
    return dt if dt in (jnp.bfloat16, jnp.float16) else jnp.dtype(jnp.float32)


def f32(a):
    return jnp.asarray(a).astype(jnp.float32)
