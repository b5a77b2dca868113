"""Cyclic Poisson sampling for amplified BandMF (host-side NumPy).

Amplified BandMF (Choquette-Choo et al., arXiv:2306.08153; `jaxdp.accounting.mechanisms`, kind "bandmf")
is accounted as DP-SGD over ceil(steps / b) rounds only if the batches are drawn like this:

  1. once per run, every unit is assigned to one of b groups, each unit's group drawn independently and
     uniformly (a secret random partition: the groups' sizes are random, Binomial(N, 1/b));
  2. step t samples the units of group t mod b, each independently with probability q_b.

A unit then joins steps of one residue class mod b only, so its participations are at least b apart, and
within its group it is Poisson-sampled at q_b. The expected batch is q_b N / b (`expected_batch_size`); the
noisy sum is divided by it, never by the realised count.

Why independent assignment, not an equal split. Under add-or-remove-one adjacency the neighbouring data
sets have N and N + 1 units; the analysis couples the two runs so that every other unit's group and
sampling are the same with or without the added one, which holds when groups are drawn per unit. An equal
split (shuffle, then cut into b groups of N // b, dropping N mod b units, jax_privacy's `EQUAL_SPLIT`) ties
every unit's group to N and to the others: adding one unit changes which units share a group and which are
dropped, so the neighbours differ in more than one unit's participation. It is valid for replace-one
adjacency only, where N is fixed.

The partition and every draw come from the ChaCha20 keystream (`jaxdp.sampling.poisson.KeyStream`) of the
secret seed: the partition from `derive_seed(seed, PARTITION_DOMAIN)` (exact uniform groups by rejection on
32-bit words), step t's draw (attempt a) from `derive_seed(seed, "cyclic_poisson", t, a)`: an exact
Binomial(|group|, q_b) size against `jaxdp.sampling.binomial`'s thresholds and a uniform subset (Floyd). So a
resumed run reproduces the partition and batches from the seed and the step alone. Whoever knows the seed or
the partition knows which steps a unit can join: keep both secret (`seed=None`: 128 bits of OS entropy).

Fixed shapes and overflow are `PoissonSampler`'s (same `max_batch_size`, "truncate" / "resample" / "error"
and the delta slack `overflow_slack(epsilon, T, p)`): over the partition and the draw together, a step's
sample from N + 1 units has size exactly Binomial(N + 1, q_b / b) (each unit is in the step's group with
probability 1/b and then sampled with q_b, independently), so `overflow_probability` and the default
`max_batch_size` are the Poisson sampler's at q = expected_batch_size / N, and the union bound over steps
holds although the steps share one partition.
"""

from __future__ import annotations

import bisect
import operator

import numpy as np

from jaxdp.noise import seeds
from jaxdp.sampling import binomial
from jaxdp.sampling.poisson import DEFAULT_MAX_OVERFLOW_PROBABILITY, KeyStream, PoissonSampler

PARTITION_DOMAIN = "cyclic_partition"  # derive_seed(seed, PARTITION_DOMAIN): the stream of the partition
_DOMAIN = "cyclic_poisson"  # derive_seed(seed, _DOMAIN, step, attempt): the stream of one draw


def partition(seed: int, num_units: int, groups: int) -> np.ndarray:
    """Each unit's group, (num_units,) int64, drawn independently and uniformly from range(groups) by the
    ChaCha20 stream of `derive_seed(seed, PARTITION_DOMAIN)` (exact: 32-bit words at or above the largest
    multiple of `groups` below 2^32 are rejected)."""
    num_units, groups = operator.index(num_units), operator.index(groups)
    if num_units < 1 or not 1 <= groups < 2**32:
        raise ValueError(f"need num_units >= 1 and groups in [1, 2^32), got {num_units!r}, {groups!r}")
    rng = KeyStream(seeds.derive_seed(seed, PARTITION_DOMAIN))
    limit = np.uint64(2**32 - 2**32 % groups)
    out, filled = np.empty(num_units, np.int64), 0
    while filled < num_units:
        words = rng.words64(-(-(num_units - filled) // 2) + 16)
        halves = np.stack([words >> np.uint64(32), words & np.uint64(0xFFFFFFFF)], axis=1).ravel()
        accepted = halves[halves < limit][:num_units - filled]
        out[filled:filled + accepted.size] = (accepted % np.uint64(groups)).astype(np.int64)
        filled += accepted.size
    return out


class CyclicPoissonSampler(PoissonSampler):
    """Cyclic Poisson batches of fixed shape (module docstring), reproducible per step.

    Args:
      num_examples: N, the number of units, > 0.
      expected_batch_size: the expected batch per step, q_b N / b; q_b = expected_batch_size x b / N must
        be at most 1.
      cycle_length: b, the number of groups (the BandMF bands; a BLT's min separation), >= 1. 1 is Poisson
        sampling of all units.
      max_batch_size, seed, overflow, max_overflow_probability: as `PoissonSampler`'s.

    Attributes:
      groups: (N,) int64, each unit's group (secret, as the seed).
      group_sampling_probability: q_b, the probability the accountant uses ("bandmf").

    Example::

      >>> sampler = CyclicPoissonSampler(1000, 10, cycle_length=4, max_batch_size=32, seed=0)
      >>> indices, mask = sampler.sample(step=6)        # units of group 6 % 4 = 2 only
      >>> bool((sampler.groups[indices[mask]] == 2).all())
      True
    """

    def __init__(self, num_examples: int, expected_batch_size: float, cycle_length: int, *,
                 max_batch_size: int | None = None, seed: int | None = None, overflow: str = "truncate",
                 max_overflow_probability: float = DEFAULT_MAX_OVERFLOW_PROBABILITY):
        super().__init__(num_examples, expected_batch_size, max_batch_size=max_batch_size, seed=seed,
                         overflow=overflow, max_overflow_probability=max_overflow_probability)
        cycle_length = operator.index(cycle_length)
        if not 1 <= cycle_length <= self.num_examples:
            raise ValueError(f"cycle_length must be an integer in [1, num_examples] = [1, {self.num_examples}], "
                             f"got {cycle_length!r}")
        q_b = expected_batch_size * cycle_length / self.num_examples
        if q_b > 1:
            raise ValueError(f"expected_batch_size {expected_batch_size!r} x cycle_length {cycle_length} exceeds "
                             f"num_examples {self.num_examples}: the group sampling probability would be {q_b:g} > 1")
        self.cycle_length = cycle_length
        self.group_sampling_probability = q_b
        self.groups = partition(self.seed, self.num_examples, cycle_length)
        order = np.argsort(self.groups, kind="stable")
        bounds = np.cumsum(np.bincount(self.groups, minlength=cycle_length))[:-1]
        self._members = np.split(order, bounds)  # each group's units, increasing
        self._thresholds: dict[int, tuple[int, tuple[int, ...]]] = {}  # group size -> binomial thresholds

    def group_of_step(self, step: int) -> int:
        return operator.index(step) % self.cycle_length

    def _size(self, rng: KeyStream, n: int) -> int:
        """Binomial(n, q_b) as `KeyStream.binomial`, its thresholds kept per group size (b may exceed the
        binomial module's cache)."""
        q = self.group_sampling_probability
        if n == 0 or q >= 1:
            return n
        if n not in self._thresholds:
            self._thresholds[n] = binomial.thresholds(n, q)
        lo, th = self._thresholds[n]
        high, low = (int(w) for w in rng.words64(2))
        return lo + bisect.bisect_right(th, (high << 64) | low)

    _domain = _DOMAIN
    _what = "cyclic Poisson sample"

    def _units_of_step(self, step: int) -> np.ndarray:
        return self._members[self.group_of_step(step)]

    def __repr__(self) -> str:
        return (f"CyclicPoissonSampler(num_examples={self.num_examples}, "
                f"expected_batch_size={self.expected_batch_size}, cycle_length={self.cycle_length}, "
                f"max_batch_size={self.max_batch_size}, seed=<secret>, overflow={self.overflow!r})")
