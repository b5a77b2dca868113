"""The cost model behind `strategy="auto"` (`jaxdp.clipping.norms`): FLOPs, bytes and scratch of each way to
compute a layer's per-example norms and clipped sum, and which layers keep their per-example gradients.

`pair_cost` prices one pair rule (ghost or instantiate; see `jaxdp.clipping.norms` for the rules),
`choose_method` picks the least time at the device's rates (`jaxdp.clipping.device_rates`) among the rules
whose scratch fits a per-layer memory budget (fastDP's FLOP rule 2 T^2 < P D without rates),
`linear_layer_cost` prices a linear layer's norm and clipped sum together (ghost / instantiate, or
`store`: G_b held in the input dtype), and `plan_stored` picks the layers `auto` stores within a
budget for the bytes held. No arrays: shapes in (`LayerShape`), numbers out (`experiments/cost_model.py`
prints them).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax.numpy as jnp

from jaxdp._keywords import old_keywords
from jaxdp.clipping.device_rates import DeviceRates

DEFAULT_CHUNK_SIZE = 8
DEFAULT_MEMORY_BUDGET_BYTES = 1 << 30


class LayerShape(NamedTuple):
    """A layer's shape as the cost model sees it: B examples of T tokens, input width P (the vocabulary for
    an embedding), output width D, the inputs' `itemsize` in bytes, and S the length of a pair's second
    term's sequence (None: T). `plan_stored`'s (B, T, P, D, itemsize) tuples are LayerShapes."""
    B: int
    T: int
    P: int
    D: int
    itemsize: int = 4
    S: int | None = None


# The keywords `pair_cost`, `choose_method` and `linear_layer_cost` took before `LayerShape` (one release).
_SHAPE_KEYWORDS = old_keywords(shape=(LayerShape, LayerShape._fields))


@dataclasses.dataclass(frozen=True)
class PairCost:
    """FLOPs, HBM bytes moved and scratch bytes of one pair rule for a batch."""
    flops: float
    bytes_moved: float
    scratch_bytes: float


@_SHAPE_KEYWORDS
def pair_cost(kind: str, method: str, shape: LayerShape, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> PairCost:
    """Cost of one pair rule. kind: "linear" | "embed" | "linear_embed"; method: "ghost" | "instantiate".

    Scratch is what one chunk of examples holds beyond the inputs.
    """
    B, T, P, D, itemsize, S = shape
    S = T if S is None else S
    k = min(chunk_size, B)
    inputs = B * (T * (P + D)) * itemsize if kind == "linear" else B * T * (D + 1) * itemsize
    if method == "ghost":
        if kind == "linear":
            flops = 2 * B * T * S * (P + D) + 2 * B * T * S
        else:
            flops = 2 * B * T * S * D + 2 * B * T * S
        scratch = 2 * k * T * S * 4
        return PairCost(flops, inputs + 2 * B * T * S * 4 * 2, scratch)
    if kind == "linear":
        flops = 2 * B * T * P * D + 2 * B * P * D
        return PairCost(flops, inputs + 2 * B * P * D * 4, k * P * D * 4)
    if kind == "embed":
        flops = 3 * B * T * D + B * T * math.log2(max(T, 2))
        return PairCost(flops, inputs + 2 * B * T * D * 4, k * T * D * 4)
    flops = 2 * B * T * P * D + 2 * B * S * D
    return PairCost(flops, inputs + 2 * B * P * D * 4, k * P * D * 4)


def _dtype_of(itemsize: int):
    return jnp.bfloat16 if itemsize == 2 else jnp.float32


@_SHAPE_KEYWORDS
def choose_method(kind: str, shape: LayerShape, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                  memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES, rates: DeviceRates | None = None) -> str:
    """The `auto` rule: least time with `rates` (fewest FLOPs without) among methods whose scratch fits."""
    costs = {m: pair_cost(kind, m, shape, chunk_size=chunk_size) for m in ("ghost", "instantiate")}
    fits = [m for m, c in costs.items() if c.scratch_bytes <= memory_budget_bytes]
    if not fits:
        return min(costs, key=lambda m: costs[m].scratch_bytes)
    if rates is None:
        return min(fits, key=lambda m: costs[m].flops)
    return min(fits, key=lambda m: rates.seconds(costs[m].flops, costs[m].bytes_moved, _dtype_of(shape.itemsize)))


@_SHAPE_KEYWORDS
def linear_layer_cost(method: str, shape: LayerShape, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> PairCost:
    """Norm AND clipped sum of a linear layer: ghost / instantiate norms then the clipped-sum GEMM
    x^T diag(c) g (scratch per chunk), or `store` (G_b of every example held in the input dtype: written
    once, read for the norm and for the clipped sum). `shape.S` is not read."""
    B, T, P, D, itemsize, _ = shape
    inputs = B * T * (P + D) * itemsize
    if method == "store":
        held = B * P * D * itemsize
        return PairCost(2 * B * T * P * D + 4 * B * P * D, inputs + 3 * held + P * D * 4, held)
    norm = pair_cost("linear", method, LayerShape(B, T, P, D, itemsize), chunk_size=chunk_size)
    return PairCost(norm.flops + 2 * B * T * P * D, norm.bytes_moved + inputs + P * D * 4, norm.scratch_bytes)


def plan_stored(shapes: dict, rates: DeviceRates, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
                store_budget_bytes: float | None = None) -> set:
    """Keys of `shapes` ({key: a `LayerShape` or (B, T, P, D, itemsize)}, `storable` parameters) whose
    per-example gradients `auto` keeps: where storing is faster than the best of ghost / instantiate (whose scratch
    fits `memory_budget_bytes`), most time saved per byte first, while the bytes held fit
    `store_budget_bytes` in total (default: `memory_budget_bytes`)."""
    budget = memory_budget_bytes if store_budget_bytes is None else store_budget_bytes
    gains = []
    for key, value in shapes.items():
        shape = LayerShape(*value)
        other = choose_method("linear", shape, chunk_size=chunk_size, memory_budget_bytes=memory_budget_bytes,
                              rates=rates)
        seconds = {m: rates.seconds(c.flops, c.bytes_moved, _dtype_of(shape.itemsize))
                   for m in (other, "store") for c in [linear_layer_cost(m, shape, chunk_size=chunk_size)]}
        held = linear_layer_cost("store", shape, chunk_size=chunk_size).scratch_bytes
        if seconds["store"] < seconds[other]:
            gains.append(((seconds[other] - seconds["store"]) / held, held, key))
    stored, total = set(), 0
    for _, held, key in sorted(gains, key=lambda g: g[0], reverse=True):
        if total + held <= budget:
            stored.add(key)
            total += held
    return stored
