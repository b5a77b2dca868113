"""The per-layer single pass of `jaxdp.clipped_aggregate` (strategy="pallas"): the drop rule around the kernel.

Where a clipping group holds a single linear term (per-layer clipping), `clipped_aggregate` takes that
term's clipped sum from `jaxdp.pallas.single_pass.linear_fused_clipped_sum`, which computes each G_b tile
once for its norm and its clipped sum. The kernel knows nothing of DP; this module applies
`jaxdp.clipping.rules`'s rules around it: the guarded norms, and the drop rule (an example non-finite in any
group contributes zeros), in two steps because the kernel's factors are fixed before every group's norm
is known.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdp.clipping import norms as norms_lib
from jaxdp.clipping import rules as clipping_lib
from jaxdp.core.terms import LinearTerm
from jaxdp.pallas import single_pass as kernel
from jaxdp.pallas.clipped_sum import linear_clipped_sum


def single_linear_terms(factored, groups) -> dict:
    """{group: (parameter index, term index)} of the groups holding exactly one LinearTerm."""
    found: dict = {}
    for i, (grad, group) in enumerate(zip(factored, groups)):
        for j, term in enumerate(grad.terms):
            if isinstance(term, LinearTerm):
                found.setdefault(group, []).append((i, j))
    return {g: refs[0] for g, refs in found.items() if len(refs) == 1}


def single_pass_sums(factored, single, sq_by_group, bound_by_group, roots_by_group, factors_of, chunk_size):
    """Clipped sums of the single linear terms, each G_b tile computed once (`linear_fused_clipped_sum`).

    A group's clip factor needs its norm only, which the kernel completes
    chunk by chunk; but an example with a non-finite norm in ANY group must
    contribute nothing anywhere, and other single-pass groups' norms are not
    known yet. So the drop rule is applied in two steps:
      before  keep_pre_B: every other group's norm is finite and this term's
              x_b, g_b are finite (a non-finite x_b or g_b makes x_b^T g_b
              non-finite: each entry with it is inf or NaN, so keep_pre is
              implied by the global rule);
      after   `redo_if_dropped_late`: an example kept here but dropped by the
              global rule (its norm overflowed to inf in another single-pass
              group from finite inputs) has that term recomputed by the
              two-pass kernel with the final factors, under `lax.cond`: never
              in practice, exact always.
    Returns ({group: (P, D) float32 sum}, sq_by_group and bound_by_group with the kernels' norms and
    their bounds added, keep_pre_B, {group: the clip factors (B,) the kernel applied}). The group's
    other parameters must be clipped with these very factors, not with factors recomputed from the
    same norms in another fusion: where the kernel's term and another term of the group cancel (the
    tied embedding), one ulp of difference between the two is multiplied by the size of the parts.
    """
    finite = {g: jnp.isfinite(sq) for g, sq in sq_by_group.items()}
    for g, (i, j) in single.items():
        term = factored[i].terms[j]
        finite[g] &= (jnp.all(jnp.isfinite(term.x_BTP), axis=(1, 2))
                      & jnp.all(jnp.isfinite(term.g_BTD), axis=(1, 2)))
    keep_pre_B = jnp.all(jnp.stack(list(finite.values())), axis=0)
    linear_sums, sq_by_group, bound_by_group = {}, dict(sq_by_group), dict(bound_by_group)
    applied = {}
    for g, (i, j) in single.items():
        term, chunks = factored[i].terms[j], []

        def clip_factors_fn(layer_sq_E, other_sq_E, bound_E, keep_E, roots_E, g=g, term=term, chunks=chunks):
            norms_E = clipping_lib.guarded_norms(layer_sq_E + other_sq_E,
                                                 bound_E + _own_bound(layer_sq_E, roots_E, term))
            # keep_E False: dropped before the pass, the example contributes exact zeros.
            c_E = factors_of(norms_E, g, keep_E & jnp.isfinite(norms_E))
            chunks.append(c_E)  # called once per chunk, in this trace, between the kernel's two launches
            return c_E

        linear_sums[g], sq_B = kernel.linear_fused_clipped_sum(
            term.x_BTP, term.g_BTD, clip_factors_fn,
            factor_args_B=(sq_by_group[g], bound_by_group[g], keep_pre_B, roots_by_group[g]), chunk_size=chunk_size)
        applied[g] = jnp.concatenate(chunks).astype(jnp.float32)
        sq_by_group[g] = sq_by_group[g] + sq_B
        bound_by_group[g] = bound_by_group[g] + _own_bound(sq_B, roots_by_group[g], term)
    return linear_sums, sq_by_group, bound_by_group, keep_pre_B, applied


def _own_bound(layer_sq, roots, term):
    """The kernel's share of its parameter's final-sums bound: `norms.final_sums_bound(roots + |T|, N)`
    less the `final_sums_bound(roots, N)` that `bound_by_group` holds (roots: the parameter's other
    terms' norms summed, |T| = sqrt(layer_sq)), i.e. kappa(N) |T| (|T| + 2 roots). The kernel's factors
    and the group's final norms must both add it: a factor that differs between the kernel's term and
    the group's other terms breaks their cancellation."""
    N = term.x_BTP.shape[2] * term.g_BTD.shape[2]
    c = norms_lib.final_sums_bound(jnp.ones((), jnp.float32), N) ** 0.5
    own = c * jnp.sqrt(jnp.maximum(layer_sq, 0))
    return own * (own + 2 * c * roots)


def redo_if_dropped_late(linear_sums, factored, single, norms, keep_pre_B, keep_B, factors):
    """Recompute the single-pass sums with the final factors if any example was dropped after its pass."""
    late = jnp.any(jnp.stack([keep_pre_B & jnp.isfinite(norms[g]) & ~keep_B for g in single]))

    def two_pass():
        return {g: linear_clipped_sum(factored[i].terms[j].x_BTP, factored[i].terms[j].g_BTD,
                                      factors[g]).astype(jnp.float32)
                for g, (i, j) in single.items()}

    return jax.lax.cond(late, two_pass, lambda: linear_sums)
