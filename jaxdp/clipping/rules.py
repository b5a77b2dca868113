"""Clipping: groups, thresholds, clip factors and clipped sums.

A parameter belongs to one clipping group. Group thresholds C_g satisfy
sum_g C_g^2 = C^2 (by default C_g = C / sqrt(G)), so example b's clipped
contribution has L2 norm at most C whatever the grouping, and the noise
sigma * C calibrates the same privacy for every style.

Clip functions (n = the example's norm within the group):
  "abadi"      c = min(1, C_g / n)                 (Abadi et al. 2016)
  "automatic"  c = C_g / (n + gamma)               (Bu et al. 2023, arXiv:2206.07136)
An example with any non-finite group norm contributes zero to every group
(the drop rule: `kept_examples`, below).

Rounding. The norm n a clip factor is computed from must not fall below the
true norm: a computed squared norm s can be far too small, even 0 or
negative, when the per-example gradient's parts cancel (ghost norms of
tokens with x_2 = x_1, g_2 = -g_1 + small), and min(1, C_g / n) then lets
the example through unclipped; so can underflow (x ~ 1e-20, g ~ 1e18 gave a
ghost norm of 0). `jaxdp.clipping.norms.rounding_bound` gives E >= |s - true| for
every strategy (rounding, the final sums, underflow); `guarded_norms` uses

    n^2 = s+ + max(0, E - delta s+),   s+ = max(s, 0),   delta = 2**-12,

which leaves n = sqrt(s) wherever the bound is negligible (E <= delta s+,
every example of ordinary data at the test sizes), and otherwise adds the
bound. Then true^2 <= s + E <= n^2 (1 + delta): every example's clipped
contribution is at most C * SENSITIVITY_FACTOR, SENSITIVITY_FACTOR =
sqrt(1 + delta) = 1.000122, and the noise is calibrated to that
sensitivity (`jaxdp.noise.draws.noise_std`), so the privacy guarantee holds as
accounted. This assumes the norm and the clipped sum see the same values:
below float32 `jaxdp.core.terms.pinned` makes sure of it (one rounding of the
terms for the norm and the sum, whatever XLA's excess precision; a kept
G_b is one array read by both).
"""

from __future__ import annotations

import math
from typing import Callable, Hashable, Mapping

import jax
import jax.numpy as jnp

from jaxdp.core.terms import DenseTerm, EmbedTerm, FactoredGrad, LinearTerm, lookup

CLIPPINGS = ("flat", "per_layer")
ROUNDING_DELTA = 2.0**-12
SENSITIVITY_FACTOR = (1 + ROUNDING_DELTA) ** 0.5


def noise_std(l2_norm_clip: float, noise_multiplier: float) -> float:
    """Standard deviation of DP-SGD's Gaussian noise: sigma times the guaranteed sensitivity C * SENSITIVITY_FACTOR."""
    return float(noise_multiplier) * float(l2_norm_clip) * SENSITIVITY_FACTOR
CLIP_FNS = ("abadi", "automatic")
Path = tuple
Grouping = str | Callable[[Path], Hashable]


def check_clipping(clipping) -> None:
    if not (callable(clipping) or clipping in CLIPPINGS):
        raise ValueError(
            f"clipping must be one of {CLIPPINGS} or a callable mapping a parameter path "
            f"to a group key, got {clipping!r}")


def check_clip_fn(clip_fn) -> None:
    if clip_fn not in CLIP_FNS:
        raise ValueError(f"clip_fn must be one of {CLIP_FNS}, got {clip_fn!r}")


MIN_GAMMA = 2.0**-20  # automatic clipping: a norm that underflows to 0 passes at most C * 2^-47 / gamma


def check_gamma(clip_fn: str, gamma) -> None:
    """Automatic clipping's gamma must be >= MIN_GAMMA: an example whose squares all underflow in float32
    (every entry below 2^-63) has a computed norm of 0 and a true norm up to sqrt(size) 2^-63 (< 2^-47 for
    2^32 entries), which c = C / (0 + gamma) lets through at C * true / gamma (a tiny gamma lets such an
    example through at many times C); gamma >= 2^-20 keeps that below 2^-27 C, inside the rounding allowance."""
    if clip_fn != "automatic" or isinstance(gamma, jax.core.Tracer):
        return
    if not gamma >= MIN_GAMMA:  # NaN fails too
        raise ValueError(f"gamma must be >= 2**-20 ({MIN_GAMMA:.3g}) with clip_fn='automatic', got {gamma!r}")


def group_of(path: Path, clipping: Grouping) -> Hashable:
    """The clipping group of a parameter. per_layer: the owning module's path."""
    if clipping == "flat":
        return "all"
    if clipping == "per_layer":
        return tuple(path[:-1])
    return clipping(tuple(path))


def group_thresholds(groups, l2_norm_clip: float,
                     group_weights: Mapping[Hashable, float] | None = None) -> dict:
    """C_g = C * sqrt(w_g / sum w); equal weights by default, so C_g = C / sqrt(G)."""
    groups = list(dict.fromkeys(groups))
    if group_weights is not None and (missing := [g for g in groups if g not in group_weights]):
        raise ValueError(f"group_weights has no weight for clipping group(s) {missing}; it must map every "
                         f"group to a finite weight > 0, groups: {groups}")
    weights = {g: 1.0 for g in groups} if group_weights is None else {g: float(group_weights[g]) for g in groups}
    if not all(0 < w < math.inf for w in weights.values()):  # NaN fails too
        raise ValueError(f"group_weights must be finite and > 0, got {weights}")
    total = sum(weights.values())
    return {g: l2_norm_clip * (weights[g] / total) ** 0.5 for g in groups}


def guarded_norms(sq_B: jax.Array, bound_B: jax.Array) -> jax.Array:
    """Per-example norms (B,) that clip safely: sqrt(s+ + max(0, E - delta s+)) (module docstring).

    `sq_B`: computed squared norms (any strategy, may be negative under
    cancellation); `bound_B`: a bound E on their rounding error. A
    non-finite squared norm or bound gives a non-finite norm (the example is
    dropped).
    """
    s_B = jnp.maximum(sq_B, 0)
    n_B = jnp.sqrt(s_B + jnp.maximum(0, bound_B - ROUNDING_DELTA * s_B))
    return jnp.where(jnp.isfinite(sq_B), n_B, sq_B)  # -inf (an overflowed cancellation) must not become 0


# ------------------------------------------------------------------ the drop rule
#
# Stated once, here; the XLA sums below, the two-pass method and the Pallas kernels all follow it.
# An example whose norm is non-finite in ANY clipping group (an inf or NaN in its data, or a norm that
# overflowed) contributes exact zeros to EVERY parameter: `kept_examples` is False for it, so
# `clip_factors` gives it c_b = 0 in every group, and every clipped sum adds nothing where c_b == 0
# (never c_b * G_b, which is NaN for a non-finite G_b; the kernels test `c != 0` the same way). It still
# counts in the batch (the sum is divided by the expected batch size), and zero is within the bound.


def kept_examples(norms_by_group: Mapping[Hashable, jax.Array]) -> jax.Array:
    """keep_B: whether every group norm of each example is finite (the drop rule)."""
    return jnp.all(jnp.stack([jnp.isfinite(n) for n in norms_by_group.values()]), axis=0)


def clip_factors(norms_B: jax.Array, threshold: float, clip_fn: str, gamma: float,
                 keep_B: jax.Array | None = None) -> jax.Array:
    """Per-example clip factors for one group's norms; exactly 0 where `keep_B` is False (the drop rule)."""
    if clip_fn == "abadi":
        c_B = jnp.minimum(1.0, threshold / norms_B)
    else:
        c_B = threshold / (norms_B + gamma)
    return c_B if keep_B is None else jnp.where(keep_B, c_B, 0)



def materialized_clipped_sum(G_B: jax.Array, c_B: jax.Array) -> jax.Array:
    """sum_b c_b G_b of materialised per-example gradients (B, *shape); c_b == 0 adds exact zeros.

    `c_B` may also be (B, G), one factor per example and row of `G_B` (B, G, *shape): then the
    result is (G, *shape), row g summed with its own factors (the block of small gradients)."""
    dt = jnp.promote_types(G_B.dtype, c_B.dtype)
    live = (c_B != 0).reshape(c_B.shape + (1,) * (G_B.ndim - c_B.ndim))
    G = jnp.where(live, G_B.astype(dt), 0)
    axes = "bg"[:c_B.ndim]
    return jnp.einsum(f"{axes},{axes}...->{axes[1:]}...", c_B.astype(dt), G, precision=jax.lax.Precision.HIGHEST)


def clipped_sum(grad: FactoredGrad, c_B: jax.Array, *, pallas: bool = False) -> jax.Array:
    """sum_b c_b G_b of one parameter; examples with c_b == 0 contribute exact zeros (the drop rule).

    A linear term is one GEMM x^T diag(c) g with K = B*T (with `pallas`, the
    `jaxdp.pallas.linear_clipped_sum` kernel, scale fused into the load); an
    embedding term one scatter-add of the scaled rows.
    """
    live = (c_B != 0)[:, None, None]
    total = None
    for term in grad.terms:
        if isinstance(term, LinearTerm) and pallas:
            from jaxdp import pallas as pallas_lib  # imports jax.experimental.pallas only when used
            part = pallas_lib.linear_clipped_sum(term.x_BTP, term.g_BTD, c_B)
            part = part.astype(jnp.promote_types(jnp.result_type(term.x_BTP, term.g_BTD), c_B.dtype))
        elif isinstance(term, LinearTerm):
            dt = jnp.promote_types(jnp.result_type(term.x_BTP, term.g_BTD), c_B.dtype)
            x = jnp.where(live, term.x_BTP, 0)
            g = jnp.where(live, term.g_BTD.astype(dt) * c_B[:, None, None].astype(dt), 0)
            # HIGHEST: the scaled rows c_b g_b must enter the GEMM unrounded (TF32 would round them to
            # 10 bits, and a cancelling example's sum would then exceed its clipped norm).
            part = jnp.einsum("btp,btd->pd", x.astype(dt), g, precision=jax.lax.Precision.HIGHEST)
        elif isinstance(term, EmbedTerm):
            ids, g = lookup(term)
            dt = jnp.promote_types(g.dtype, c_B.dtype)
            g = jnp.where(live, g.astype(dt) * c_B[:, None, None].astype(dt), 0)
            part = jnp.zeros(term.shape, dt).at[ids.reshape(-1)].add(g.reshape(-1, g.shape[-1]))
        elif isinstance(term, DenseTerm):
            part = materialized_clipped_sum(term.value_B, c_B)
        else:
            raise TypeError(f"unknown term type {type(term).__name__}")
        total = part if total is None else total + part
    return total
