"""Choosing a correlated-noise strategy and measuring it: coefficients, sensitivity, expected error (NumPy).

Notation as in `jaxdp.noise.mechanisms`: C is the n x n lower-triangular Toeplitz strategy of a mechanism
(n = `steps`), A = tril(ones) the prefix-sum workload, and the noise added to the prefix sums of the
released gradients is A C^{-1} z with z_t ~ N(0, std^2 I) independent.

  `bandmf(steps, bands)`     the banded Toeplitz C minimising the mean squared prefix-sum error times C's
                             squared max column norm (arXiv:2306.08153, as jax_privacy's
                             `toeplitz.optimize_banded_toeplitz`), returned with coefficients of L2 norm 1.
                             Ours: float64 NumPy/SciPy (L-BFGS-B on an analytic gradient), cached per
                             (steps, bands); it reaches jax_privacy 2.0.0's loss (tests/test_mf_strategies.py).
  `blt(steps, buffers, ...)` a BLT (arXiv:2404.16706, arXiv:2408.08868) from jax_privacy's
                             `buffered_toeplitz.optimize`, behind the optional extra `jaxdp[mf]`.
  `sensitivity(...)`         the largest L2 norm of a sum of C's columns over the participation patterns
                             with at most `participations` participations at least `min_sep` steps apart
                             (jax_privacy's `toeplitz.minsep_sensitivity_squared`, arXiv:2405.13763 Thm. 2).
  `per_query_error`, `prefix_sum_rms_error`
                             the variance of each prefix sum of A C^{-1} z per unit noise, and the RMS over
                             the steps of its standard deviation (DP-SGD: sqrt((steps + 1) / 2)).

How these enter a guarantee: `jaxdp.accounting.mechanisms` (which sensitivity goes into the noise std and
which DpEvent is accounted). Everything here is deterministic float64 host arithmetic; JAX's global x64
flag is never touched (the BLT optimiser runs inside `jax.enable_x64(True)` as a context manager).
"""

from __future__ import annotations

import functools
import math
import operator

import numpy as np
import scipy.linalg
import scipy.optimize
import scipy.signal

from jaxdp.noise.mechanisms import BLT, DPSGD, BandMF, Mechanism

MF_EXTRA = "jaxdp[mf]"  # pip install 'jaxdp[mf]': jax-privacy==2.0.0, for `blt`
_MAX_OPTIMIZER_STEPS = 250
_MONOTONE_RTOL = 1e-12


def _check_steps(steps: int) -> int:
    steps = operator.index(steps)
    if steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    return steps


def _impulse(steps: int) -> np.ndarray:
    e = np.zeros(steps)
    e[0] = 1.0
    return e


def _blt_polynomials(mechanism: BLT) -> tuple[np.ndarray, np.ndarray]:
    """(numerator, denominator) of C's generating function in the delay z: C(z) = 1 + z sum_i w_i / (1 -
    theta_i z) = N(z) / D(z), D = prod_i (1 - theta_i z), coefficients in ascending powers of z."""
    factors = [np.array([1.0, -d]) for d in mechanism.buf_decay]
    den = functools.reduce(np.convolve, factors, np.ones(1))
    num = np.concatenate([den, [0.0]])
    for i, w in enumerate(mechanism.output_scale):
        others = functools.reduce(np.convolve, factors[:i] + factors[i + 1:], np.ones(1))
        num[1:1 + others.size] += w * others
    return num, den


def toeplitz_coefs(mechanism: Mechanism, steps: int) -> np.ndarray:
    """C's first column (its Toeplitz coefficients), float64, length `steps`."""
    steps = _check_steps(steps)
    if isinstance(mechanism, DPSGD):
        return _impulse(steps)
    if isinstance(mechanism, BandMF):
        return np.pad(np.asarray(mechanism.coefs), (0, max(0, steps - mechanism.bands)))[:steps]
    if isinstance(mechanism, BLT):
        num, den = _blt_polynomials(mechanism)
        return scipy.signal.lfilter(num, den, _impulse(steps))
    raise TypeError(f"not a mechanism: {mechanism!r}")


def inverse_coefs(mechanism: Mechanism, steps: int) -> np.ndarray:
    """C^{-1}'s first column, float64, length `steps`: the noise x_t of a single unit draw z_0 = 1."""
    steps = _check_steps(steps)
    if isinstance(mechanism, DPSGD):
        return _impulse(steps)
    if isinstance(mechanism, BandMF):
        return scipy.signal.lfilter([1.0], np.asarray(mechanism.coefs), _impulse(steps))
    if isinstance(mechanism, BLT):
        num, den = _blt_polynomials(mechanism)
        return scipy.signal.lfilter(den, num, _impulse(steps))
    raise TypeError(f"not a mechanism: {mechanism!r}")


def strategy_matrix(mechanism: Mechanism, steps: int) -> np.ndarray:
    """C as a dense float64 (steps, steps) matrix (a reference for tests and small n)."""
    c = toeplitz_coefs(mechanism, steps)
    return scipy.linalg.toeplitz(c, np.zeros_like(c))


def per_query_error(mechanism: Mechanism, steps: int) -> np.ndarray:
    """Var((A C^{-1} z)_t) for unit-variance z, t = 0..steps-1: cumsum of the squared coefficients of the
    Toeplitz matrix A C^{-1} (whose first column is cumsum(C^{-1}'s))."""
    b = np.cumsum(inverse_coefs(mechanism, steps))
    return np.cumsum(b * b)


def prefix_sum_rms_error(mechanism: Mechanism, steps: int) -> float:
    """sqrt(mean_t Var((A C^{-1} z)_t)) per unit noise: multiply by the noise std of z (in units of the clip
    norm) for the RMS error of the released prefix sums. DP-SGD: sqrt((steps + 1) / 2)."""
    return math.sqrt(float(np.mean(per_query_error(mechanism, steps))))


def step_rms_error(mechanism: Mechanism, steps: int) -> float:
    """sqrt(mean_t Var((C^{-1} z)_t)) per unit noise: the RMS noise of each step's own release (the identity
    workload), which an optimiser that normalises each update by its running RMS (Adam) sees. DP-SGD: 1."""
    return math.sqrt(float(np.mean(np.cumsum(inverse_coefs(mechanism, steps) ** 2))))


def max_participations(steps: int, min_sep: int, participations: int | None = None) -> int:
    """The most participations `steps` steps allow at least `min_sep` apart, capped at `participations`."""
    steps, min_sep = _check_steps(steps), operator.index(min_sep)
    if min_sep < 1:
        raise ValueError(f"min_sep must be an integer >= 1, got {min_sep!r}")
    k = -(-steps // min_sep)
    if participations is not None:
        if operator.index(participations) < 1:
            raise ValueError(f"participations must be None or an integer >= 1, got {participations!r}")
        k = min(k, participations)
    return k


def sensitivity(mechanism: Mechanism, steps: int, min_sep: int, participations: int | None = None) -> float:
    """max over participation patterns of ||sum of C's columns at the participating steps||_2.

    The patterns: at most `participations` (None: no cap) steps, any two at least `min_sep` apart, within
    `steps`. Exact when the columns in a pattern cannot overlap (`min_sep` >= the length of C's nonzero
    band: banded C under cyclic sampling with as many groups as bands), where it is the root of the sum of
    the first k columns' squared norms, and for one participation (C's max column norm, its first); otherwise
    exact for non-negative, non-increasing coefficients (the worst pattern is then the first k steps
    `min_sep` apart), and a ValueError for other strategies.
    """
    k = max_participations(steps, min_sep, participations)
    c = toeplitz_coefs(mechanism, steps)
    support = int(np.flatnonzero(c)[-1]) + 1
    slack = _MONOTONE_RTOL * np.abs(c).max()  # rounding in a computed tail (BLT) is not an increase
    if k > 1 and min_sep < support and not (np.all(c >= -slack) and np.all(np.diff(c) <= slack)):
        raise ValueError(f"no exact sensitivity for {mechanism!r} at min_sep={min_sep} < its band {support}: "
                         "its Toeplitz coefficients must be non-negative and non-increasing")
    # The sum of the columns at 0, min_sep, ..., (k - 1) min_sep: a running sum of the coefficients in
    # blocks of min_sep, minus the part that began k blocks earlier (an O(steps) difference of cumsums).
    padded = np.pad(c, (0, -steps % min_sep))
    running = padded.reshape(-1, min_sep).cumsum(axis=0).ravel()
    window = running.copy()
    span = min_sep * k
    if span < running.size:
        window[span:] -= running[:-span]
    window = window[:steps]
    return math.sqrt(float(window @ window))


# ---------------------------------------------------------------- BandMF: our optimiser


def _bandmf_loss_and_grad(c: np.ndarray, steps: int) -> tuple[float, np.ndarray]:
    """mean_t Var((A C^{-1} z)_t) x ||c||^2 and its gradient in c (scale-invariant in c).

    With h = C^{-1} e_0 and B = cumsum(h), the mean is M = (1/n) sum_s (n - s) B_s^2; dM/dh_k = v_k =
    sum_{s>=k} (2/n)(n - s) B_s; and from C h = e_0, dh_k/dc_j = -(C^{-1} h)_{k-j}, so
    dM/dc_j = -sum_{k>=j} v_k g_{k-j} with g = C^{-1} h.
    """
    n = steps
    h = scipy.signal.lfilter([1.0], c, _impulse(n))
    b = np.cumsum(h)
    weights = (n - np.arange(n)) / n
    mean = float(weights @ (b * b))
    v = np.cumsum((2 * weights * b)[::-1])[::-1]
    g = scipy.signal.lfilter([1.0], c, h)
    d_mean = -np.array([v[j:] @ g[:n - j] for j in range(c.size)])
    norm2 = float(c @ c)
    return mean * norm2, d_mean * norm2 + 2 * mean * c


def _loss_in_steps(d: np.ndarray, steps: int) -> tuple[float, np.ndarray]:
    """The loss and its gradient in the steps d >= 0 of the coefficients c_j = sum_{i>=j} d_i."""
    c = np.cumsum(d[::-1])[::-1]
    with np.errstate(over="ignore", invalid="ignore"):
        loss, grad = _bandmf_loss_and_grad(c, steps)
    return (loss, np.cumsum(grad)) if np.isfinite(loss) and np.all(np.isfinite(grad)) else (np.inf, np.zeros_like(d))


@functools.lru_cache(maxsize=64)
def _optimise_bandmf(steps: int, bands: int) -> tuple[float, ...]:
    # Over non-negative, non-increasing coefficients (c_j = sum_{i>=j} d_i, d >= 0: L-BFGS-B's bounds): C^{-1}
    # then cannot blow up (its polynomial has no root inside the unit disk, Enestrom-Kakeya), where an
    # unconstrained first step can leave C^{-1} overflowing, and `sensitivity` is exact for every pattern.
    k = np.arange(bands)
    start = np.cumprod(np.where(k == 0, 1.0, (2 * k - 1) / np.maximum(2 * k, 1)))  # 1/sqrt(1 - x)'s series
    d0 = start - np.append(start[1:], 0.0)
    result = scipy.optimize.minimize(_loss_in_steps, d0, args=(steps,), jac=True, method="L-BFGS-B",
                                     bounds=[(0, None)] * bands,
                                     options=dict(maxiter=_MAX_OPTIMIZER_STEPS, gtol=1e-12, ftol=1e-15))
    d = result.x if np.isfinite(result.fun) and result.fun <= _loss_in_steps(d0, steps)[0] else d0
    c = np.cumsum(d[::-1])[::-1]
    return tuple(float(v) for v in c / np.linalg.norm(c))


def bandmf(steps: int, bands: int) -> BandMF:
    """The banded Toeplitz strategy with `bands` bands for `steps` steps, coefficients of L2 norm 1.

    Minimises (mean squared prefix-sum error) x (C's squared max column norm) from the truncated series of
    1/sqrt(1 - x) (the optimal unbanded strategy's, Fichtenberger et al.), as jax_privacy's
    `toeplitz.optimize_banded_toeplitz(n=steps, bands=bands)`, then scales the coefficients to norm 1, so
    C's max column norm is 1 (the last `bands - 1` columns are shorter). `bands=1` is DP-SGD. Cached per
    (steps, bands).

    Raises:
      ValueError: bands < 1 or bands > steps.
    """
    steps, bands = _check_steps(steps), operator.index(bands)
    if not 1 <= bands <= steps:
        raise ValueError(f"bands must be an integer in [1, steps] = [1, {steps}], got {bands!r}")
    return BandMF((1.0,) if bands == 1 else _optimise_bandmf(steps, bands))


# ---------------------------------------------------------------- BLT: jax_privacy's optimiser


def _buffered_toeplitz():
    try:
        from jax_privacy.matrix_factorization import buffered_toeplitz
    except ImportError as e:
        raise ImportError(f"BLT strategies need jax_privacy: pip install '{MF_EXTRA}' (jax-privacy==2.0.0); "
                          f"{e}") from e
    return buffered_toeplitz


@functools.lru_cache(maxsize=32)
def _optimise_blt(steps: int, buffers: int, min_sep: int, participations: int | None,
                  error: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    import jax  # only here: the rest of this module is NumPy
    buffered_toeplitz = _buffered_toeplitz()
    with jax.enable_x64(True):
        found = buffered_toeplitz.optimize(n=steps, min_sep=min_sep, max_participations=participations,
                                           error=error, min_buffers=buffers, max_buffers=buffers)
        return (tuple(float(v) for v in np.asarray(found.buf_decay)),
                tuple(float(v) for v in np.asarray(found.output_scale)))


def blt(steps: int, buffers: int, min_sep: int = 1, participations: int | None = 1, *,
        error: str = "mean") -> BLT:
    """A BLT strategy with `buffers` buffers for `steps` steps and the participation pattern (`min_sep`,
    `participations`; None: as many as `steps` allow), minimising the `error` ("mean" or "max") squared
    prefix-sum error times the squared `sensitivity` for that pattern: jax_privacy 2.0.0's
    `buffered_toeplitz.optimize(n, min_sep, max_participations, error, min_buffers=max_buffers=buffers)`.
    Cached per arguments.

    Raises:
      ImportError: jax_privacy is not installed (the optional extra `jaxdp[mf]`).
      ValueError: a bad argument, or the optimiser returned a BLT outside `mechanisms.BLT`'s contract.
    """
    steps, buffers = _check_steps(steps), operator.index(buffers)
    if not 1 <= buffers <= 10:
        raise ValueError(f"buffers must be an integer in [1, 10], got {buffers!r}")
    max_participations(steps, min_sep, participations)  # validates min_sep and participations
    if error not in ("mean", "max"):
        raise ValueError(f"error must be 'mean' or 'max', got {error!r}")
    decay, scale = _optimise_blt(steps, buffers, operator.index(min_sep),
                                 None if participations is None else operator.index(participations), error)
    return BLT(decay, scale)
