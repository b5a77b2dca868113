"""The inverse questions of `jaxdp.accounting.epsilon`: the noise a budget needs, the steps a budget allows.

`calibrate_noise_multiplier` finds the smallest sigma whose epsilon (for q,
steps, delta and the accountant) is within the target; `steps_for_epsilon` the
largest number of steps within it. Both are bracketing searches on
`accounting.epsilon` (regula falsi in log-log space, where epsilon is close to
a power law, falling back to bisection) that keep the answer on the safe side
of the budget exactly, for the accountant used.

Example::

    sigma = calibrate_noise_multiplier(8.0, sampling_probability=0.01,
                                       steps=10_000, delta=1e-5)
    accounting.epsilon(sigma, 0.01, 10_000, 1e-5)   # <= 8.0
"""

from __future__ import annotations

import math

from jaxdp.accounting.accountant import (
    DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    _check_accountant,
    _check_count,
    _check_delta,
    _check_noise_multiplier,
    _check_sampling_probability,
    _check_target_epsilon,
    _epsilon,
)

_MAX_SEARCH_STEPS = 200


def _log_ratio(eps: float, target: float) -> float:
    """log(eps / target), the function the searches below drive to 0."""
    return math.log(eps / target) if eps > 0 else -math.inf


def _falsi_point(x_lo: float, f_lo: float, x_hi: float, f_hi: float) -> float:
    """Where the chord through (x_lo, f_lo), (x_hi, f_hi) crosses 0, if strictly
    inside (x_lo, x_hi); else the midpoint."""
    if math.isfinite(f_lo) and math.isfinite(f_hi) and f_lo != f_hi:
        x = (x_lo * f_hi - x_hi * f_lo) / (f_hi - f_lo)
        if x_lo < x < x_hi:
            return x
    return (x_lo + x_hi) / 2


def calibrate_noise_multiplier(
    target_epsilon: float,
    sampling_probability: float,
    steps: int,
    delta: float,
    *,
    accountant: str = "pld",
    rtol: float = 1e-3,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
) -> float:
    """The smallest noise multiplier whose epsilon is at most `target_epsilon`.

    Brackets sigma by doubling or halving from 1, then shrinks the bracket
    (regula falsi in log-log space, a bisection that picks its split point by
    interpolation). The invariant is epsilon(hi) <= target < epsilon(lo), so
    the returned sigma never exceeds the budget; the search stops once
    epsilon(sigma) >= (1 - rtol) * target_epsilon. (If the accountant's
    epsilon is too coarse in sigma to reach that band, it stops when the
    bracket reaches float resolution and still returns a sigma within budget.)

    Args:
      target_epsilon: privacy budget for the whole run, > 0.
      sampling_probability: q, in (0, 1].
      steps: number of steps the run will take, >= 0. 0 steps return 0.0.
      delta: target delta, in (0, 1).
      accountant: "pld" (default) or "rdp", as in `accounting.epsilon`.
      rtol: relative tolerance on epsilon, in (0, 1).
      value_discretization_interval: PLD only, as in `accounting.epsilon`.

    Returns:
      sigma with (1 - rtol) * target_epsilon <= epsilon(sigma) <= target_epsilon.

    Example::

      >>> sigma = calibrate_noise_multiplier(2.0, 0.01, 1000, 1e-5)
      >>> 0.998 * 2.0 <= accounting.epsilon(sigma, 0.01, 1000, 1e-5) <= 2.0
      True
    """
    target = _check_target_epsilon(target_epsilon)
    q = _check_sampling_probability(sampling_probability)
    steps = _check_count("steps", steps)
    delta = _check_delta(delta)
    _check_accountant(accountant, value_discretization_interval)
    if not 0 < rtol < 1:
        raise ValueError(f"rtol must be in the open interval (0, 1), got {rtol!r}")
    if steps == 0:
        return 0.0

    def eps(sigma: float) -> float:
        return _epsilon(sigma, q, steps, delta, accountant, value_discretization_interval)

    # Bracket: eps(lo) > target >= eps(hi). eps -> inf as sigma -> 0 and
    # eps -> 0 as sigma -> inf, so both loops end.
    hi, eps_hi = 1.0, eps(1.0)
    if eps_hi > target:
        while eps_hi > target:
            lo, eps_lo = hi, eps_hi
            hi, eps_hi = 2 * hi, eps(2 * hi)
    else:
        lo, eps_lo = hi / 2, eps(hi / 2)
        while eps_lo <= target:
            hi, eps_hi = lo, eps_lo
            lo, eps_lo = lo / 2, eps(lo / 2)

    # Shrink the bracket by regula falsi (Illinois variant) on
    # f(log sigma) = log(eps / target): eps is close to a power law in sigma, so
    # f is nearly linear and this takes ~5 evaluations where plain bisection
    # takes ~12. It keeps the bracket exactly as bisection does, and bisects
    # whenever two tries failed to halve it.
    f_lo, f_hi = _log_ratio(eps_lo, target), _log_ratio(eps_hi, target)
    last_moved, widths = None, [math.log(hi / lo)]
    for _ in range(_MAX_SEARCH_STEPS):
        if eps_hi >= (1 - rtol) * target:
            break
        x_lo, x_hi = math.log(lo), math.log(hi)
        if len(widths) >= 3 and widths[-1] > widths[-3] / 2:
            x = (x_lo + x_hi) / 2
        else:
            x = _falsi_point(x_lo, f_lo, x_hi, f_hi)
        if not x_lo < x < x_hi:
            break  # Bracket at float resolution.
        sigma = math.exp(x)
        eps_sigma = eps(sigma)
        if eps_sigma > target:
            lo, f_lo = sigma, _log_ratio(eps_sigma, target)
            f_hi = f_hi / 2 if last_moved == "lo" else f_hi
            last_moved = "lo"
        else:
            hi, eps_hi, f_hi = sigma, eps_sigma, _log_ratio(eps_sigma, target)
            f_lo = f_lo / 2 if last_moved == "hi" else f_lo
            last_moved = "hi"
        widths.append(math.log(hi / lo))
    return hi


def steps_for_epsilon(
    target_epsilon: float,
    noise_multiplier: float,
    sampling_probability: float,
    delta: float,
    *,
    accountant: str = "pld",
    max_steps: int = 10**7,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
) -> int:
    """The largest number of steps whose epsilon is at most `target_epsilon`.

    A growing search from 1 step brackets the answer, then a bracketing
    search (regula falsi in log-log space, falling back to bisection) narrows
    it to adjacent integers, so the answer k satisfies
    epsilon(k) <= target_epsilon < epsilon(k + 1) exactly for the accountant
    used, unless it is capped at `max_steps`. ~10 accountant calls.

    Args:
      target_epsilon: privacy budget, > 0.
      noise_multiplier: sigma, >= 0 (0 allows no step).
      sampling_probability: q, in (0, 1].
      delta: target delta, in (0, 1).
      accountant: "pld" (default) or "rdp", as in `accounting.epsilon`.
      max_steps: cap on the answer, >= 0.
      value_discretization_interval: PLD only, as in `accounting.epsilon`.

    Returns:
      The number of steps, an int in [0, max_steps].

    Example::

      >>> steps_for_epsilon(2.0, 1.1, 0.01, 1e-5), steps_for_epsilon(2.0, 1.1, 0.01, 1e-5, accountant="rdp")
      (1725, 1404)
    """
    target = _check_target_epsilon(target_epsilon)
    sigma = _check_noise_multiplier(noise_multiplier)
    q = _check_sampling_probability(sampling_probability)
    delta = _check_delta(delta)
    _check_accountant(accountant, value_discretization_interval)
    max_steps = _check_count("max_steps", max_steps)

    def f(steps: int) -> float:  # log(epsilon / target): <= 0 iff within budget.
        return _log_ratio(_epsilon(sigma, q, steps, delta, accountant,
                                   value_discretization_interval), target)

    if max_steps == 0 or (f_lo := f(1)) > 0:
        return 0
    # Bracket: f(lo) <= 0 < f(hi). epsilon grows roughly like steps**a with a
    # between ~0.3 and 1, so extrapolate log(eps) linearly in log(steps), 10%
    # past the crossing, growing 2x to 1000x per try.
    lo, prev = 1, None
    while True:
        guess = 2 * lo
        if prev is not None:
            slope = (f_lo - prev[1]) / math.log(lo / prev[0])
            if slope > 0 and math.isfinite(f_lo):
                guess = math.ceil(1.1 * lo * math.exp(min(-f_lo / slope, 10.0)))
        hi = min(max_steps, max(2 * lo, min(1000 * lo, guess)))
        f_hi = f(hi)
        if f_hi > 0:
            break
        if hi == max_steps:
            return max_steps
        prev, lo, f_lo = (lo, f_lo), hi, f_hi
    # Shrink to adjacent integers by regula falsi in log-log space (Illinois),
    # bisecting whenever two tries failed to halve the bracket.
    last_moved, widths = None, [hi - lo]
    while hi - lo > 1:
        x_lo, x_hi = math.log(lo), math.log(hi)
        if len(widths) >= 3 and widths[-1] > widths[-3] / 2:
            x = (x_lo + x_hi) / 2
        else:
            x = _falsi_point(x_lo, f_lo, x_hi, f_hi)
        mid = min(hi - 1, max(lo + 1, round(math.exp(x))))
        f_mid = f(mid)
        if f_mid <= 0:
            lo, f_lo = mid, f_mid
            f_hi = f_hi / 2 if last_moved == "lo" else f_hi
            last_moved = "lo"
        else:
            hi, f_hi = mid, f_mid
            f_lo = f_lo / 2 if last_moved == "hi" else f_lo
            last_moved = "hi"
        widths.append(hi - lo)
    return lo
