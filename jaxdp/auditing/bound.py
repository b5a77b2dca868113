"""One-run privacy audit (Steinke, Nasr & Jagielski 2023): an empirical LOWER bound on epsilon.

The auditor draws m canaries and includes each one in the training set
independently with probability 1/2 (`draw_inclusion`), trains ONCE, scores
every canary (higher = "looks included"), guesses the k_plus highest-scoring
canaries "in" and the k_minus lowest "out" (`guesses`), and counts the
correct guesses. If the training run is (epsilon, delta)-DP with respect to
adding or removing one canary, the number W of correct guesses among
r = k_plus + k_minus is stochastically dominated, up to a delta term, by
Binomial(r, e^eps / (1 + e^eps)) (arXiv:2305.08846, Theorem 3.1):

    P[W >= v] <= f(v) + 2 m delta max_{i = 1..v} (f(v - i) - f(v)) / i,
    f(v) = P[Binomial(r, e^eps / (1 + e^eps)) >= v].

`epsilon_lower_bound` returns the largest epsilon that this p-value rejects
at the given confidence (95% by default): with probability >= 95% over the
canaries' inclusion and the training run's randomness, a run that really is
(epsilon, delta)-DP yields a bound <= epsilon. So a bound ABOVE the claimed
epsilon is evidence of a bug (in the clipping, the noise, the accounting or
the sampling). A bound BELOW it proves nothing: the audit only sees the
attack it runs, and one run with m canaries cannot certify more than about
log(r / log(1 / (1 - confidence))) even against a non-private algorithm.

Scores: `loss_drop_scores` (black box: a canary's loss before training minus
after) and `gradient_scores` (white box: the inner product of each canary's
gradient direction with the total parameter change). Guessing several
(k_plus, k_minus) and keeping the best is allowed only with a union bound:
`epsilon_lower_bound(..., ks=[...])` splits the confidence over them
(Bonferroni).

The bound is written here (NumPy / SciPy, on the host) and cross-checked in
`tests/test_auditing.py` against jax_privacy's `auditing._epsilon_one_run`
(the same theorem, maintained by the paper's authors' group), whose package
is not a jaxdp dependency: it would pin its own jax.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
import scipy.optimize
import scipy.special
import scipy.stats

DEFAULT_CONFIDENCE = 0.95
_EPS_TOL = 1e-6


def _check_unit(name: str, value: float, *, closed_low: bool = False) -> float:
    ok = (0 <= value < 1) if closed_low else (0 < value < 1)
    if not ok:
        interval = "[0, 1)" if closed_low else "(0, 1)"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return float(value)


def one_run_p_value(num_canaries: int, num_guesses: int, num_correct: int, epsilon: float,
                    delta: float) -> float:
    """P-value of `num_correct` correct guesses out of `num_guesses` under an (epsilon, delta)-DP run.

    Theorem 3.1 of arXiv:2305.08846 with the exact binomial tail: f(v) + 2 m delta
    max_{1 <= i <= v} (f(v - i) - f(v)) / i, capped at 1 (i > v gives no larger term,
    since f(v - i) = 1 there).
    """
    m, r, v = int(num_canaries), int(num_guesses), int(num_correct)
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= num_correct ({v}) <= num_guesses ({r}) <= num_canaries ({m})")
    if v == 0:
        return 1.0
    q = scipy.special.expit(epsilon)            # e^eps / (1 + e^eps)
    f_v = scipy.stats.binom.sf(v - 1, r, q)      # P[Binomial(r, q) >= v]
    if delta == 0:
        return float(min(f_v, 1.0))
    i = np.arange(1, v + 1)
    f_below = scipy.stats.binom.sf(v - i - 1, r, q)  # f(v - i)
    alpha = float(np.max((f_below - f_v) / i))
    return float(min(f_v + 2 * m * delta * alpha, 1.0))


def one_run_epsilon(num_canaries: int, num_guesses: int, num_correct: int, *, delta: float,
                    confidence: float = DEFAULT_CONFIDENCE) -> float:
    """The largest epsilon whose (epsilon, delta)-DP claim `num_correct` of `num_guesses` rejects.

    That is sup {eps >= 0: p-value(eps) <= 1 - confidence}; 0 when even eps = 0 is not rejected.
    """
    _check_unit("delta", delta, closed_low=True)
    _check_unit("confidence", confidence)
    significance = 1 - confidence

    def excess(eps):  # > 0 while the claim eps is rejected
        return significance - one_run_p_value(num_canaries, num_guesses, num_correct, eps, delta)

    if excess(0.0) <= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    while excess(hi) > 0:
        lo, hi = hi, 2 * hi
        if hi > 1e3:  # unreachable for finite m: the delta-free tail alone exceeds alpha by eps ~ log(r / alpha)
            return math.inf
    return float(scipy.optimize.brentq(excess, lo, hi, xtol=_EPS_TOL))


def draw_inclusion(num_canaries: int, rng: np.random.Generator) -> np.ndarray:
    """Which canaries are trained on: each independently with probability 1/2 (bool (m,))."""
    if num_canaries < 1:
        raise ValueError(f"num_canaries must be >= 1, got {num_canaries!r}")
    return rng.random(num_canaries) < 0.5


def loss_drop_scores(loss_before: np.ndarray, loss_after: np.ndarray) -> np.ndarray:
    """Black-box scores: each canary's loss under the model before training minus after (m,)."""
    before, after = np.asarray(loss_before, np.float64), np.asarray(loss_after, np.float64)
    if before.shape != after.shape or before.ndim != 1:
        raise ValueError(f"loss_before and loss_after must be 1-D of one shape, got {before.shape}, {after.shape}")
    return before - after


def gradient_scores(canary_grads, total_update) -> np.ndarray:
    """White-box scores: -<g_i, total update> for each canary's (clipped) gradient g_i (m,).

    `canary_grads` is a pytree like `total_update` (the parameters after training minus before)
    whose leaves have a leading canary axis. Gradient descent moves against the gradients it
    was given, so a canary trained on scores high.
    """
    g_leaves, g_def = jax.tree.flatten(canary_grads)
    u_leaves, u_def = jax.tree.flatten(total_update)
    if g_def != u_def:
        raise ValueError(f"canary_grads and total_update must have one tree structure, got {g_def} and {u_def}")
    total = 0.0
    for g, u in zip(g_leaves, u_leaves):
        g, u = np.asarray(g, np.float64), np.asarray(u, np.float64)
        if g.shape[1:] != u.shape:
            raise ValueError(f"a canary_grads leaf {g.shape} is not (m,) + its update's shape {u.shape}")
        total = total - g.reshape(g.shape[0], -1) @ u.reshape(-1)
    return np.asarray(total)


def guesses(scores: np.ndarray, k_plus: int, k_minus: int = 0) -> np.ndarray:
    """+1 for the k_plus highest scores ("in"), -1 for the k_minus lowest ("out"), 0 otherwise.

    Ties are broken by position, never by the inclusion (which the guesser must not see).
    """
    scores = np.asarray(scores, np.float64)
    m = scores.shape[0]
    if scores.ndim != 1 or not np.all(np.isfinite(scores)):
        raise ValueError(f"scores must be a finite 1-D array, got shape {scores.shape}")
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > m or k_plus + k_minus == 0:
        raise ValueError(f"k_plus and k_minus must be >= 0 with 1 <= k_plus + k_minus <= m = {m}, "
                         f"got k_plus={k_plus!r}, k_minus={k_minus!r}")
    order = np.argsort(-scores, kind="stable")
    out = np.zeros(m, np.int8)
    out[order[:k_plus]] = 1
    if k_minus:
        out[order[m - k_minus:]] = -1
    return out


def default_guesses(num_canaries: int) -> list[tuple[int, int]]:
    """(k_plus, k_minus) pairs tried by default: m/1000, m/200, m/50, m/10 "in" (those >= 10), and m/4 each way.

    Small k pays off when only the extreme scores are telling (noisy runs, many canaries);
    large k when the scores separate well (up to about log(r / 3) for r guesses).
    """
    m = int(num_canaries)
    if m < 2:
        return [(1, 0)]
    ks = [(k, 0) for k in dict.fromkeys((m // 1000, m // 200, m // 50, m // 10)) if k >= 10]
    return ks + [(max(1, m // 4), max(1, m // 4))]


def max_epsilon(num_canaries: int, ks: Sequence[tuple[int, int]], *, delta: float,
                confidence: float = DEFAULT_CONFIDENCE) -> float:
    """The largest bound an audit with these guesses can give: every guess right (a fully non-private run).

    A claim at or above it cannot be caught by this audit, whatever the run does (m = 1000 at delta
    1e-5: 4.75); raise m or lower the audited claim."""
    each = 1 - (1 - confidence) / len(ks)
    return max(one_run_epsilon(num_canaries, kp + km, kp + km, delta=delta, confidence=each) for kp, km in ks)


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """The one-run audit's outcome (`epsilon_lower_bound`)."""
    epsilon: float          # lower bound on epsilon at `confidence` (0: nothing shown)
    k_plus: int             # the guess that gave it
    k_minus: int
    num_guesses: int
    num_correct: int
    num_canaries: int
    num_included: int
    delta: float
    confidence: float
    num_hypotheses: int     # (k_plus, k_minus) pairs tried; the confidence was split over them
    max_epsilon: float      # the bound with every guess right (`max_epsilon`): claims >= it go undetected


def epsilon_lower_bound(scores: np.ndarray, included: np.ndarray, *, delta: float,
                        ks: Sequence[tuple[int, int]] | None = None, k_plus: int | None = None,
                        k_minus: int = 0, confidence: float = DEFAULT_CONFIDENCE) -> AuditResult:
    """The one-run audit's epsilon lower bound from canary scores and their true inclusion.

    Args:
      scores: (m,) finite scores, higher meaning "more likely trained on".
      included: (m,) bools from `draw_inclusion`: the truth the guesses are checked against.
      delta: the delta of the DP claim under audit.
      ks: (k_plus, k_minus) guesses to try, each at confidence 1 - (1 - confidence) / len(ks)
        (a union bound), the best kept. Exclusive with `k_plus`. Default (neither given):
        `default_guesses(m)`.
      k_plus, k_minus: one guess.
      confidence: of the lower bound, in (0, 1).

    Returns:
      An `AuditResult`; `.epsilon` is the bound.
    """
    scores = np.asarray(scores, np.float64)
    included = np.asarray(included)
    if included.dtype != np.bool_ or included.shape != scores.shape:
        raise ValueError(f"included must be a bool array shaped like scores {scores.shape}, "
                         f"got {included.dtype} {included.shape}")
    _check_unit("confidence", confidence)
    if scores.ndim != 1:
        raise ValueError(f"scores must be a 1-D array (one score per canary), got shape {scores.shape}")
    m = scores.shape[0]
    if ks is not None and k_plus is not None:
        raise ValueError("pass either ks (several guesses, union bound) or k_plus / k_minus, not both")
    if ks is None:
        ks = default_guesses(m) if k_plus is None else [(k_plus, k_minus)]
    if not all(isinstance(k, (int, np.integer)) and not isinstance(k, bool) for pair in ks for k in pair):
        raise ValueError(f"ks must be (k_plus, k_minus) pairs of integers, got {ks!r}")
    ks = [(int(a), int(b)) for a, b in ks]
    if not ks:
        raise ValueError("ks must name at least one (k_plus, k_minus) pair")
    each = 1 - (1 - confidence) / len(ks)
    best = None
    for kp, km in ks:
        g = guesses(scores, kp, km)
        correct = int(np.sum((g == 1) & included) + np.sum((g == -1) & ~included))
        eps = one_run_epsilon(m, kp + km, correct, delta=delta, confidence=each)
        if best is None or eps > best[0]:
            best = (eps, kp, km, correct)
    eps, kp, km, correct = best
    return AuditResult(epsilon=eps, k_plus=kp, k_minus=km, num_guesses=kp + km, num_correct=correct,
                       num_canaries=m, num_included=int(included.sum()), delta=float(delta),
                       confidence=float(confidence), num_hypotheses=len(ks),
                       max_epsilon=max_epsilon(m, ks, delta=delta, confidence=confidence))
