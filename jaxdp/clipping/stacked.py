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

Also here: a stacked parameter's L per-layer groups as one (L, B) `Family` (so the clip factors and the
drop rule stay one array operation at any depth), and the split route (`per_layer`, `restacked`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxdp.clipping import norms as norms_lib
from jaxdp.clipping import rules as clipping_lib
from jaxdp.clipping.settings import NormPlan
from jaxdp.core.terms import DenseTerm, FactoredGrad, StackedGrad, is_stacked, pinned


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


def per_layer(paths, factored):
    """(paths, FactoredGrads, counts): every StackedGrad of L layers split into its L layers under the
    unrolled model's paths, so that groups, thresholds and norms are the unrolled model's; `counts[i]` is
    how many entries leaf i became (L, or 1)."""
    out_paths, out, counts = [], [], []
    for path, grad in zip(paths, factored):
        if is_stacked(grad):
            L = grad.num_layers
            out_paths += [grad.layer_path(path, l) for l in range(L)]
            out += [grad.layer(l) for l in range(L)]
            counts.append(L)
        else:
            out_paths.append(path)
            out.append(grad)
            counts.append(1)
    return out_paths, out, counts


def restacked(sums, counts, factored) -> list:
    """The per-leaf sums of `per_layer`'s entries: a stacked leaf's L sums stacked again."""
    out, i = [], 0
    for n, grad in zip(counts, factored):
        out.append(jnp.stack(sums[i:i + n]) if is_stacked(grad) else sums[i])
        i += n
    return out


@dataclasses.dataclass(frozen=True)
class Family:
    """The L per-layer groups of a stacked parameter, kept as one (L, B) entry through the guarded norms, the
    drop rule and the clip factors: XLA fused the drop rule's test of all G groups into each group's factors
    (G^2 operations, G ~ 9 per layer), so per-layer groups counted one by one made a deep step's compile
    grow quadratically with depth."""
    groups: tuple


def families(stacked_groups: dict, other_groups: list) -> dict:
    """{stacked leaf index: Family} for the leaves whose L groups are distinct and receive nothing from any
    other leaf but those with the same L groups (a Linear's kernel and bias); the others stay per group."""
    others = set(other_groups)
    counts: dict = {}
    for gs in stacked_groups.values():
        for g in set(gs):
            counts.setdefault(g, set()).add(tuple(gs))
    return {i: Family(tuple(gs)) for i, gs in stacked_groups.items()
            if len(set(gs)) == len(gs) > 1 and not others & set(gs) and all(len(counts[g]) == 1 for g in gs)}


def all_finite(norms_LB):
    """(B,): 0 where every layer's norm is finite, NaN elsewhere (what the drop rule reads)."""
    return jnp.where(jnp.all(jnp.isfinite(norms_LB), axis=0), 0.0, jnp.nan).astype(norms_LB.dtype)


def add(sq_by_group: dict, bound_by_group: dict, g, sq, bound) -> None:
    sq_by_group[g] = sq if g not in sq_by_group else sq_by_group[g] + sq
    bound_by_group[g] = bound if g not in bound_by_group else bound_by_group[g] + bound


def add_layers(sq_by_group: dict, bound_by_group: dict, layer_groups: list, sq_LB, bound_LB) -> None:
    """Adds layer l's squared norms and bounds to its group `layer_groups[l]` (one sum when all share one)."""
    if len(set(layer_groups)) == 1:
        parts = [(layer_groups[0], sq_LB.sum(axis=0), bound_LB.sum(axis=0))]
    else:
        parts = [(g, sq_LB[l], bound_LB[l]) for l, g in enumerate(layer_groups)]
    for g, sq, bound in parts:
        add(sq_by_group, bound_by_group, g, sq, bound)
