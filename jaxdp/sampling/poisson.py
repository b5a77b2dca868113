"""Poisson sampling into fixed-shape, masked batches (host-side NumPy).

DP-SGD's accounting (`jaxdp.accounting.epsilon`) assumes Poisson sampling: at every
step each of the N examples joins the batch independently with probability
q = expected_batch_size / N, so the batch size is Binomial(N, q), not fixed.
A jitted step wants one static shape, so `PoissonSampler.sample(step)` returns
`max_batch_size` slots: the sampled indices first, in increasing order, then
padding slots holding index 0 with mask False. Padding must contribute exactly
zero (mask the loss or the clip factor), and the noisy sum must be divided by
the expected batch size q * N, never by `mask.sum()`: the realised size
depends on the data set and is not protected by the noise.

A draw is a Binomial(N, q) size followed by a uniformly random subset of that
size, which is the same distribution as N independent coin flips (Beltran et
al. 2024, arXiv:2406.17298, Lemma 1) at O(batch) cost instead of O(N): the size
by comparing a 128-bit uniform integer with the binomial CDF's exact thresholds
(`jaxdp.sampling.binomial`: total-variation distance from Binomial(N, q) below 1e-30,
where a float64 inverse CDF is ~1e-13 off), the subset by Floyd's algorithm
with exact uniform integers (Lemire's multiply-and-reject). The draw for step s
(attempt a, see "resample") uses only the ChaCha20 keystream (`jaxdp.noise.chacha`, a
cryptographically secure generator) keyed by `jaxdp.noise.seeds.derive_seed(seed,
"poisson", s, a)`, so a resumed run reproduces an uninterrupted one exactly with
no RNG state to save;
only the seed and the step counter must be restored. `derive_seed` hashes the
whole path (SHA-256), so no step's stream is the stream of the bare seed or of
another step.

The seed must be secret: whoever knows it knows every batch, hence which
examples each noisy sum holds. `seed=None` (the default) draws a 128-bit seed
from the operating system's entropy (`jaxdp.noise.seeds.secret_seed`); a pinned seed
reproduces the batches and the guarantee then assumes it is kept secret. (The
formal guarantee also assumes ideal randomness: ChaCha20, not a statistical
generator such as NumPy's PCG64, whose state some outputs would give away.)

Overflow and what it does to the guarantee. If a draw has more than
`max_batch_size` examples, the step is no longer the Poisson-sampled Gaussian
mechanism that the accountant analyses:

  "truncate"  keeps a uniformly random `max_batch_size` of the sampled
              examples (truncated Poisson sampling). Note that an added
              example can then displace another one, which plain Poisson
              accounting does not model.
  "resample"  redraws the whole batch (attempt 1, 2, ... of the step) until
              it fits: the batch is Poisson conditioned on fitting.
  "error"     raises RuntimeError; the run stops.

In every mode the implemented run differs from the ideal one only on the
event that some step overflowed, whose probability is at most T * p over T
steps, where p is the per-step overflow probability on either neighbouring
data set (`overflow_probability` reports it for N + 1 examples, the larger
neighbour). A coupling argument then gives: if the ideal run is
(epsilon, delta)-DP, the implemented run is

    (epsilon, delta + (1 + e^epsilon) * T * p)-DP.

`overflow_slack(epsilon, T, p)` is that slack. With the default
`max_batch_size` p < 1e-9, but the e^epsilon factor is not negligible: at
epsilon = 8 and T = 1e4 steps the slack is ~3e-2, far above a typical delta.
So pay it inside delta: `max_batch_size_for_delta(N, q N, T, epsilon, delta)`
is the smallest `max_batch_size` whose slack is at most delta / 10 (cheap:
each factor of 1000 in p adds about one standard deviation of the batch size),
and the accountant then runs at delta - slack. That is what the pretraining
job does (`jaxdp.training`); it refuses a `max_batch_size` whose slack exceeds
delta / 10. The alternative, for "truncate", is exact accounting:
dp_accounting's PLD accountant takes
`TruncatedSubsampledGaussianDpEvent(num_examples, q, max_batch_size, sigma)`
(Ganesh 2025, arXiv:2508.15089), which `jaxdp.accounting.epsilon` does not wrap:
its PLD is far slower to build than plain Poisson's, and the job's calibration
makes dozens of accountant calls. With
the max size 4.5 standard deviations above the mean it cost ~3% more epsilon
than plain Poisson in one check (N = 1000, q = 0.02, sigma = 1, 100 steps).
At max_batch_size = q N it is far from plain: N = 1650, q N = 8, 20 steps,
delta = 1/N, sigma = 0.343 (RDP epsilon 8) gives 24.5 (plain Poisson PLD
5.63; max_batch_size 30 gives 5.63 too). "resample" has no such exact
analysis here; only the slack bound applies. In "error" mode, restarting a
failed run with a new seed is a second draw and must be paid for too. jax_privacy's notes on variable batch sizes
(docs/sharp_edges_variable_batch_sizes.md) discuss the same trade-offs; Chua
et al. 2024, arXiv:2411.04205, bound truncation by absorbing it into delta.

Example::

    sampler = PoissonSampler(num_examples=50_000, expected_batch_size=512)
    for step in range(start_step, num_steps):
        indices, mask = sampler.sample(step)    # (max_batch_size,) each
        batch = dataset[indices]                # padding rows are example 0
        ...                                     # loss masked by `mask`
"""

from __future__ import annotations

import math
import operator

import numpy as np

from jaxdp.noise import chacha, seeds
from jaxdp.sampling import binomial

OVERFLOW_MODES = ("truncate", "resample", "error")
DEFAULT_MAX_OVERFLOW_PROBABILITY = 1e-9
_MAX_RESAMPLE_ATTEMPTS = 1000
_DOMAIN = "poisson"  # derive_seed(seed, _DOMAIN, step, attempt): the stream of one draw

class KeyStream:
    """Uniform draws from the ChaCha20 keystream of a 256-bit seed (nonce 0): a CSPRNG, host-side."""

    _CHUNK = 64  # blocks generated at a time (1,024 words)

    def __init__(self, seed: int):
        self._key = seeds.seed_words(seed, 8)
        self._block = 0
        self._buffer = np.zeros(0, np.uint64)

    def words64(self, count: int) -> np.ndarray:
        """The next `count` 64-bit words (uint64)."""
        while self._buffer.size < count:
            blocks = max(self._CHUNK, -(-2 * (count - self._buffer.size) // chacha.WORDS_PER_BLOCK))
            w = chacha.stream(self._key, np.zeros(3, np.uint32), blocks * chacha.WORDS_PER_BLOCK, self._block)
            self._block += blocks
            w = w.astype(np.uint64)
            self._buffer = np.concatenate([self._buffer, (w[0::2] << np.uint64(32)) | w[1::2]])
        out, self._buffer = self._buffer[:count], self._buffer[count:]
        return out

    def below(self, bound: int, word: int | None = None) -> int:
        """Exactly uniform on [0, bound) (Lemire's multiply-and-reject; `word`: the first 64-bit word to use);
        1 <= bound <= 2^64 (above, no 64-bit word could be accepted)."""
        if not 1 <= bound <= 2**64:
            raise ValueError(f"bound must be in [1, 2^64], got {bound!r}")
        threshold = (2**64 - bound) % bound
        while True:
            m = (int(self.words64(1)[0]) if word is None else word) * bound
            word = None
            if m & (2**64 - 1) >= threshold:
                return m >> 64

    def subset(self, n: int, k: int) -> np.ndarray:
        """A uniformly random k-subset of range(n) (Floyd's algorithm), sorted."""
        if k == n:
            return np.arange(n, dtype=np.int64)
        chosen: set[int] = set()
        for word, j in zip(self.words64(k).tolist(), range(n - k, n)):
            t = self.below(j + 1, word)
            chosen.add(j if t in chosen else t)
        return np.sort(np.fromiter(chosen, np.int64, k))

    def binomial(self, n: int, q: float) -> int:
        """A Binomial(n, q) draw: a 128-bit uniform integer against the exact CDF thresholds of
        `jaxdp.sampling.binomial` (total-variation error < 1e-30)."""
        high, low = (int(w) for w in self.words64(2))
        return binomial.draw(n, q, (high << 64) | low)


# ---------------------------------------------------------------- delta slack

DEFAULT_SLACK_FRACTION = 0.1  # the share of delta that overflow may take


def overflow_slack(epsilon: float, steps: int, overflow_probability: float) -> float:
    """(1 + e^epsilon) * steps * p: what overflow adds to delta over `steps` steps (module docstring).

    Args:
      epsilon: the epsilon of the ideal (never overflowing) run, >= 0.
      steps: the number of steps T, >= 0.
      overflow_probability: p, the per-step overflow probability on the larger
        neighbour (`PoissonSampler.overflow_probability`), in [0, 1].

    Returns:
      The slack; inf when it overflows a float.
    """
    if not 0 <= overflow_probability <= 1 or steps < 0 or epsilon < 0:
        raise ValueError(f"need epsilon >= 0, steps >= 0, overflow_probability in [0, 1]; got "
                         f"{epsilon!r}, {steps!r}, {overflow_probability!r}")
    if overflow_probability == 0 or steps == 0:
        return 0.0
    log_slack = _log1p_exp(epsilon) + math.log(steps) + math.log(overflow_probability)
    return math.exp(log_slack) if log_slack < 709 else math.inf


def max_batch_size_for_delta(num_examples: int, expected_batch_size: float, steps: int, epsilon: float,
                             delta: float, *, slack_fraction: float = DEFAULT_SLACK_FRACTION) -> int:
    """The smallest max_batch_size whose overflow slack over `steps` steps is at most slack_fraction * delta.

    The slack is `overflow_slack(epsilon, steps, p)` with p = P(Binomial(N + 1,
    q) > max_batch_size), q = expected_batch_size / N (as
    `PoissonSampler.overflow_probability`). The result may exceed N (only when
    no smaller size keeps the slack below the bound; N + 1 never overflows).

    Args:
      num_examples: N, > 0.
      expected_batch_size: q * N, in (0, N].
      steps: T, the most steps the run may take, >= 1.
      epsilon: the target epsilon (the slack grows with e^epsilon), > 0.
      delta: the run's total delta, in (0, 1).
      slack_fraction: the share of delta the slack may take, in (0, 1).
    """
    n = operator.index(num_examples)
    if n <= 0 or not 0 < expected_batch_size <= n:
        raise ValueError(f"need num_examples > 0 and expected_batch_size in (0, num_examples]; got "
                         f"{num_examples!r}, {expected_batch_size!r}")
    if operator.index(steps) < 1 or not epsilon > 0 or not 0 < delta < 1 or not 0 < slack_fraction < 1:
        raise ValueError(f"need steps >= 1, epsilon > 0, delta and slack_fraction in (0, 1); got "
                         f"{steps!r}, {epsilon!r}, {delta!r}, {slack_fraction!r}")
    # (1 + e^epsilon) * steps * p <= slack_fraction * delta, solved for p.
    log_p = math.log(slack_fraction * delta) - math.log(steps) - _log1p_exp(epsilon)
    if log_p < math.log(1e-300):  # below the binomial tail's resolution: take no risk
        return n + 1
    return binomial.smallest_size_above(n + 1, expected_batch_size / n, math.exp(log_p))


def _log1p_exp(x: float) -> float:
    """log(1 + e^x) without overflow."""
    return x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x))


# ---------------------------------------------------------------- sampler


class PoissonSampler:
    """Poisson-sampled batches of fixed shape, reproducible per step.

    Args:
      num_examples: N, the number of examples in the training set, > 0.
      expected_batch_size: q * N, in (0, N]; q = expected_batch_size / N.
      max_batch_size: number of slots per batch, >= 1. None picks the smallest
        size b with P(Binomial(N + 1, q) > b) < max_overflow_probability (N + 1:
        the larger neighbouring data set), at most N, computed from the exact
        binomial tail.
      seed: int >= 0, or None (default) for a secret seed from the operating
        system's entropy. Step s, attempt a draws from
        `KeyStream(jaxdp.noise.seeds.derive_seed(seed, "poisson", s, a))`.
        Keep a pinned seed secret: it reproduces every batch.
      overflow: what to do when a draw exceeds max_batch_size: "truncate",
        "resample" or "error" (see the module docstring for what each does to
        the privacy guarantee).
      max_overflow_probability: per-step overflow probability that sets the
        default max_batch_size, in (0, 0.5]. See the module docstring for
        the delta it costs.

    Attributes:
      overflow_count: steps sampled by this instance whose draw overflowed
        (truncated, redrawn; not saved across restarts).
      last_overflow: whether the latest `sample` call overflowed.

    Example::

      >>> sampler = PoissonSampler(1000, 10, max_batch_size=32, seed=0)
      >>> indices, mask = sampler.sample(step=7)
      >>> indices.shape, mask.dtype, bool((indices[~mask] == 0).all())
      ((32,), dtype('bool'), True)
    """

    def __init__(
        self,
        num_examples: int,
        expected_batch_size: float,
        *,
        max_batch_size: int | None = None,
        seed: int | None = None,
        overflow: str = "truncate",
        max_overflow_probability: float = DEFAULT_MAX_OVERFLOW_PROBABILITY,
    ):
        num_examples = operator.index(num_examples)
        if num_examples <= 0:
            raise ValueError(f"num_examples must be an integer > 0, got {num_examples!r}")
        if not 0 < expected_batch_size <= num_examples:
            raise ValueError(
                f"expected_batch_size must be in (0, num_examples] = (0, {num_examples}], "
                f"got {expected_batch_size!r}")
        seed = seeds.secret_seed() if seed is None else operator.index(seed)
        if seed < 0:
            raise ValueError(f"seed must be None or an integer >= 0, got {seed!r}")
        if overflow not in OVERFLOW_MODES:
            raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, got {overflow!r}")
        if not 0 < max_overflow_probability <= 0.5:
            raise ValueError(
                "max_overflow_probability must be in (0, 0.5], "
                f"got {max_overflow_probability!r}")
        self.num_examples = num_examples
        self.expected_batch_size = expected_batch_size
        self.seed = seed
        self.overflow = overflow
        q = self.sampling_probability
        if max_batch_size is None:
            max_batch_size = min(num_examples, binomial.smallest_size_above(
                num_examples + 1, q, max_overflow_probability))
        max_batch_size = operator.index(max_batch_size)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        self.max_batch_size = max_batch_size
        self.overflow_count = 0
        self.last_overflow = False

    @property
    def sampling_probability(self) -> float:
        """q = expected_batch_size / num_examples."""
        return self.expected_batch_size / self.num_examples

    @property
    def overflow_probability(self) -> float:
        """P(Binomial(num_examples + 1, q) > max_batch_size): the p of the delta slack."""
        return binomial.sf(self.num_examples + 1, self.sampling_probability, self.max_batch_size)

    def sample(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The batch of step `step`, a function of (seed, step) only.

        Args:
          step: int >= 0, the training step.

        Returns:
          (indices, mask): int64 and bool arrays of shape (max_batch_size,).
          The sampled indices come first in increasing order with mask True;
          the remaining slots hold index 0 with mask False. `last_overflow`
          tells whether this draw overflowed.

        Raises:
          RuntimeError: overflow="error" and the draw overflowed, or
            overflow="resample" and no redraw fit in 1000 attempts.
        """
        step = operator.index(step)
        if step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        chosen, overflowed = self._draw(step)
        self.last_overflow = overflowed
        self.overflow_count += overflowed
        indices = np.zeros(self.max_batch_size, np.int64)
        mask = np.zeros(self.max_batch_size, bool)
        indices[:chosen.size] = np.sort(chosen)
        mask[:chosen.size] = True
        return indices, mask

    # What a subclass changes (`jaxdp.sampling.cyclic`): the units a step draws from, the size draw, the stream.
    _domain = _DOMAIN
    _what = "Poisson sample"

    def _units_of_step(self, step: int) -> np.ndarray | None:
        """The units step `step` samples from, increasing; None: all `num_examples`."""
        return None

    def _size(self, rng: KeyStream, n: int) -> int:
        """How many of the step's n units are in its batch: Binomial(n, q)."""
        return rng.binomial(n, self.sampling_probability)

    def _draw(self, step: int) -> tuple[np.ndarray, bool]:
        """(the step's units, whether overflow changed the draw): one rule of overflow for every sampler."""
        members = self._units_of_step(step)
        n, b = (self.num_examples if members is None else members.size), self.max_batch_size
        for attempt in range(_MAX_RESAMPLE_ATTEMPTS):
            rng = KeyStream(seeds.derive_seed(self.seed, self._domain, step, attempt))
            size = self._size(rng, n)
            chosen = rng.subset(n, size)
            if members is not None:
                chosen = members[chosen]
            if size <= b:
                return chosen, attempt > 0
            if self.overflow == "truncate":
                return chosen[rng.subset(size, b)], True
            if self.overflow == "error":
                raise RuntimeError(
                    f"{self._what} of step {step} has {size} examples > max_batch_size "
                    f"= {b} (overflow='error'). Raise max_batch_size or pick "
                    "overflow='truncate' / 'resample'.")
        raise RuntimeError(
            f"overflow='resample': no draw of step {step} fit max_batch_size = {b} in "
            f"{_MAX_RESAMPLE_ATTEMPTS} attempts (expected batch size "
            f"{self.expected_batch_size}); max_batch_size is far too small.")

    def __repr__(self) -> str:
        return (f"PoissonSampler(num_examples={self.num_examples}, "
                f"expected_batch_size={self.expected_batch_size}, "
                f"max_batch_size={self.max_batch_size}, seed=<secret>, "
                f"overflow={self.overflow!r})")
