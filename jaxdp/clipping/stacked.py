"""Norms and clipped sums of a parameter stacked over L layers (a scanned model), one traced copy for all L.

`jaxdp.clipping.aggregation.clipped_aggregate` takes a `StackedGrad` here unless it must split it into L
per-layer parameters (the Pallas single pass, or a caller's `squared_norms_fn`): each rule below runs under
`jax.vmap` over the layer axis, so the compiled program holds one copy of a layer's norm and clipped-sum
code, not L, and its size does not grow with depth. Layer l's squared norms and rounding bounds are those
the unrolled model's layer l gets from the same rules, so its group (flat: the one group; per layer:
`(*stack path, l, module)`) receives exactly what the split path adds. Two differences, both exact:
strategy "store" (and "auto"'s choice to keep a layer's G_b) computes the norm by the ghost / instantiate
rules instead of keeping G_b, and a materialised gradient's bound always carries the underflow term
`squares_underflow` (what `clipped_aggregate` adds only for a traced threshold: at most 4 mu N to the
squared norm).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdp.clipping import norms as norms_lib
from jaxdp.clipping import rules as clipping_lib
from jaxdp.clipping.settings import NormPlan
from jaxdp.core.terms import DenseTerm, FactoredGrad, StackedGrad, pinned


def _dense(grad: FactoredGrad):
    """The per-example gradients (B, ...) of a parameter with one DenseTerm, else None."""
    if len(grad.terms) == 1 and isinstance(grad.terms[0], DenseTerm):
        return grad.terms[0].value_B
    return None


def _layer_norms(grad: FactoredGrad, plan: NormPlan) -> tuple[jax.Array, jax.Array]:
    """(squared norms (B,), rounding bound (B,)) of one layer's slice, by the unrolled path's rules."""
    value = _dense(grad)
    if value is not None:  # as clipped_aggregate's materialised gradients: a sum of squares
        v = value.reshape(value.shape[0], -1).astype(jnp.promote_types(value.dtype, jnp.float32))
        sq = jnp.sum(jnp.square(v), axis=-1)
        return sq, norms_lib.final_sums_bound(jnp.sqrt(sq), v.shape[1]) + norms_lib.squares_underflow(
            v.shape[1], v.dtype)
    strategy = "auto" if plan.strategy == "store" else plan.strategy
    sq, roots = norms_lib.squared_norms_and_roots(grad, strategy, chunk_size=plan.chunk_size,
                                                  memory_budget_bytes=plan.memory_budget_bytes)
    return sq, norms_lib.rounding_bound(grad, roots)


def pinned_layers(grad: StackedGrad) -> StackedGrad:
    """`grad` with its arrays below float32 pinned once (`jaxdp.core.terms.pinned`): the norms and the
    clipped sums then read one rounding."""
    return StackedGrad(pinned(grad.grad), grad.layer_axis_at)


def squared_norms(grad: StackedGrad, plan: NormPlan) -> tuple[jax.Array, jax.Array]:
    """(squared norms (L, B), rounding bounds (L, B)) of every layer of a (pinned) stacked parameter."""
    return jax.vmap(lambda g: _layer_norms(g, plan))(grad.grad)


def clipped_sums(grad: StackedGrad, factors_LB: jax.Array) -> jax.Array:
    """(L, *shape): layer l's sum_b c_lb G_lb, with `factors_LB[l]` the factors of layer l's group."""
    def one(g, c_B):
        value = _dense(g)
        if value is not None:
            return clipping_lib.materialized_clipped_sum(value, c_B)
        return clipping_lib.clipped_sum(g, c_B)
    return jax.vmap(one)(grad.grad, factors_LB)
