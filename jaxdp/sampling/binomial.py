"""Binomial(n, q) to 50 significant digits, and draws from it with a total-variation error below 1e-30.

The Poisson sampler (`jaxdp.sampling.poisson`) draws a batch size from Binomial(n, q) and the accountant
assumes that law exactly; any difference between the law the code draws from and the binomial is
paid in delta, (1 + e^epsilon) x steps x TV, by the coupling argument of `jaxdp.sampling.poisson`. A float64
inverse CDF is off by ~1e-16 per size (the resolution of a 53-bit uniform, and the pmf's own
rounding): TV 1e-14 to 7e-13 per step for n from 1e5 to 1e7, i.e. up to 4e-6
of unpaid delta at epsilon 8 over 1e5 steps. So, once per (n, q):

- `table(n, q)`: the pmf over the window [lo, hi] (`window`: all but < 1e-300 of the mass on each
  side, by Bernstein's inequality), by the ratio recurrence pmf(k + 1) / pmf(k) = (n - k) q /
  ((k + 1)(1 - q)) from the mode, in 60-digit decimal arithmetic with q exactly its binary float,
  normalised by its sum. Each value is the binomial's to ~1e-50 relative (the recurrence's rounding
  over at most ~1e6 steps) plus the < 2e-300 outside the window.
- `thresholds(n, q)`: the CDF as integers floor(CDF(k) x 2^128), the last one 2^128. A draw
  (`jaxdp.sampling.poisson.KeyStream.binomial`) is lo + #{thresholds <= u} for u uniform on [0, 2^128): each
  size's probability is off by at most 2^-128 (TV <= window x 2^-128 < 1e-32 for n < 1e6 sizes).

`sf` and `smallest_size_above` read the same table (tails summed in decimal, so a tail of 1e-250 is
as exact as one of 0.1). Tables are cached (`functools.lru_cache`), built once per (n, q); the cost
grows with the window (117k sizes at n = 1e7, q = 0.5, the largest).
"""

from __future__ import annotations

import bisect
import decimal
import functools
import math
from decimal import Decimal

UNIFORM_BITS = 128  # a draw compares one uniform integer of this many bits with the thresholds
_DIGITS = 60
_CONTEXT = decimal.Context(prec=_DIGITS, Emin=-10**9, Emax=10**9)  # the table's arithmetic
# Bernstein's inequality, P(|X - nq| >= t) <= 2 exp(-t^2 / (2 (var + t / 3))), bounds the mass outside
# mean +- t; t is chosen so that it is below 1e-300 on each side.
_LOG_OUTSIDE_MASS = math.log(1e300)


def window(n: int, q: float) -> tuple[int, int]:
    """[lo, hi] holding all but < 1e-300 of the Binomial(n, q) mass on each side."""
    mean, var, big_l = n * q, n * q * (1 - q), _LOG_OUTSIDE_MASS
    t = big_l / 3 + math.sqrt(big_l**2 / 9 + 2 * big_l * var)
    return max(0, math.floor(mean - t)), min(n, math.ceil(mean + t))


def _check(n: int, q: float) -> None:
    if n < 1 or not 0 < q < 1:
        raise ValueError(f"need n >= 1 and 0 < q < 1, got n={n!r}, q={q!r}")


@functools.lru_cache(maxsize=16)
def table(n: int, q: float) -> tuple[int, tuple[Decimal, ...]]:
    """(lo, (P(X = lo), ..., P(X = hi))) for X ~ Binomial(n, q), 0 < q < 1 (module docstring)."""
    _check(n, q)
    lo, hi = window(n, q)
    with decimal.localcontext(_CONTEXT):
        dq = Decimal(q)  # exact: a binary float is a finite decimal
        r = dq / (1 - dq)
        mode = min(hi, max(lo, math.floor((n + 1) * q)))
        w = [Decimal(0)] * (hi - lo + 1)
        w[mode - lo] = Decimal(1)
        for k in range(mode, hi):
            w[k + 1 - lo] = w[k - lo] * (n - k) * r / (k + 1)
        for k in range(mode, lo, -1):
            w[k - 1 - lo] = w[k - lo] * k / ((n - k + 1) * r)
        total = sum(w)
        return lo, tuple(x / total for x in w)


@functools.lru_cache(maxsize=16)
def thresholds(n: int, q: float) -> tuple[int, tuple[int, ...]]:
    """(lo, (floor(CDF(lo) x 2^128), ..., 2^128)): the integers `draw` compares a uniform with."""
    lo, pmf = table(n, q)
    scale, out, cdf = 2**UNIFORM_BITS, [], Decimal(0)
    with decimal.localcontext(_CONTEXT):
        for p in pmf:
            cdf += p
            out.append(min(scale, int(cdf * scale)))
    out[-1] = scale  # the < 2e-300 outside the window and the rounding go to hi
    return lo, tuple(out)


def draw(n: int, q: float, u: int) -> int:
    """The Binomial(n, q) size for the uniform integer u in [0, 2^128); q >= 1 gives n."""
    n, q = int(n), float(q)  # Decimal takes neither a NumPy float32 nor int64
    if q >= 1:
        return n
    lo, th = thresholds(n, q)
    return lo + bisect.bisect_right(th, u)


def sf(n: int, q: float, k: int) -> float:
    """P(X > k) for X ~ Binomial(n, q), 0 < q <= 1."""
    n, q = int(n), float(q)
    if k >= n:
        return 0.0
    if k < 0 or q >= 1:
        return 1.0
    lo, pmf = table(n, q)
    if k < lo:
        return 1.0  # all but < 1e-300
    return float(sum(pmf[k + 1 - lo:]))


def smallest_size_above(n: int, q: float, max_tail: float) -> int:
    """The smallest b >= 1 with P(Binomial(n, q) > b) < max_tail (n when q >= 1)."""
    n, q = int(n), float(q)
    if q >= 1:
        return n
    lo, pmf = table(n, q)
    tail, limit = Decimal(0), Decimal(max_tail)
    # Walk down from hi: tail = P(X > k) before adding pmf(k).
    for i in range(len(pmf) - 1, -1, -1):
        if tail >= limit:
            return max(1, lo + i + 1)
        tail += pmf[i]
    return max(1, lo)
