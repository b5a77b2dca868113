"""Cyclic Poisson sampling (`jaxdp.sampling.cyclic`): a secret partition with independent uniform groups,
each step sampling only its group, at rate q_b."""

import numpy as np
import pytest
from scipy import stats

from jaxdp.noise import seeds
from jaxdp.sampling import cyclic
from jaxdp.sampling.poisson import PoissonSampler


def sampled(sampler, steps):
    """{step: the sampled units}."""
    out = {}
    for t in range(steps):
        indices, mask = sampler.sample(t)
        out[t] = indices[mask]
    return out


def off_group_units(sampler, batches):
    """Units sampled at a step that is not their group's: the sampler's claim, read from its batches."""
    return sorted({int(u) for t, units in batches.items() for u in units
                   if sampler.groups[u] != t % sampler.cycle_length})


def test_every_unit_is_in_exactly_one_group():
    sampler = cyclic.CyclicPoissonSampler(1000, 10, cycle_length=7, seed=3)
    assert sampler.groups.shape == (1000,) and set(np.unique(sampler.groups)) <= set(range(7))
    members = np.concatenate(sampler._members)
    np.testing.assert_array_equal(np.sort(members), np.arange(1000))  # each unit once
    for g, m in enumerate(sampler._members):
        assert np.all(sampler.groups[m] == g)


def test_units_are_sampled_only_at_their_groups_steps_at_rate_q_b():
    """N = 240, b = 4, q_b = 0.3, 800 steps: each unit's group is visited 200 times. A unit's count is
    Binomial(200, 0.3) (none outside its group's steps); every unit within its two-sided 1e-8 quantiles and
    the total within 5 standard deviations: false-failure probability below 240 x 1e-8 + 6e-7 < 4e-6."""
    n, b, q_b, steps = 240, 4, 0.3, 800
    sampler = cyclic.CyclicPoissonSampler(n, q_b * n / b, cycle_length=b, max_batch_size=n, seed=11)
    assert sampler.group_sampling_probability == pytest.approx(q_b)
    batches = sampled(sampler, steps)
    assert off_group_units(sampler, batches) == [] and sampler.overflow_count == 0
    counts = np.bincount(np.concatenate(list(batches.values())), minlength=n)
    visits = steps // b
    lo, hi = stats.binom.ppf(1e-8 / 2, visits, q_b), stats.binom.isf(1e-8 / 2, visits, q_b)
    assert lo <= counts.min() and counts.max() <= hi
    total, mean, sd = counts.sum(), n * visits * q_b, np.sqrt(n * visits * q_b * (1 - q_b))
    assert abs(total - mean) <= 5 * sd


def test_a_unit_in_the_wrong_group_is_caught():
    """A planted error: one unit moved to another group after the batches were built from the true one."""
    sampler = cyclic.CyclicPoissonSampler(60, 6, cycle_length=3, max_batch_size=60, seed=5)
    batches = sampled(sampler, 30)
    unit = int(batches[0][0])
    sampler.groups[unit] = (sampler.groups[unit] + 1) % 3
    assert off_group_units(sampler, batches) == [unit]


def test_the_partition_is_uniform_and_independent_of_other_streams():
    """Group sizes of 70,000 units over 7 groups: chi-square with 6 degrees of freedom below its 1e-6
    quantile (false-failure probability 1e-6)."""
    groups = cyclic.partition(123, 70_000, 7)
    counts = np.bincount(groups, minlength=7)
    chi2 = ((counts - 10_000) ** 2 / 10_000).sum()
    assert chi2 < stats.chi2.isf(1e-6, 6)
    np.testing.assert_array_equal(groups, cyclic.partition(123, 70_000, 7))
    assert seeds.derive_seed(123, cyclic.PARTITION_DOMAIN) != seeds.derive_seed(123, cyclic._DOMAIN, 0, 0)


def test_two_seeds_give_different_partitions():
    a = cyclic.partition(1, 500, 4)
    b = cyclic.partition(2, 500, 4)
    assert (a != b).mean() > 0.5  # independent partitions agree on ~1/4 of the units


def test_the_default_partition_is_secret():
    """seed=None draws 128 bits of OS entropy: not a seed anyone can search for, a different partition each
    time, none of the partitions of the small seeds one would guess, and not printed."""
    one, two = (cyclic.CyclicPoissonSampler(400, 10, cycle_length=4) for _ in range(2))
    assert not seeds.guessable_seed(one.seed) and one.seed != two.seed
    assert (one.groups != two.groups).any()
    guesses = [cyclic.partition(s, 400, 4) for s in range(100)]
    assert not any(np.array_equal(one.groups, g) for g in guesses)
    assert "seed=<secret>" in repr(one) and str(one.seed) not in repr(one)


def test_a_resumed_sampler_draws_the_same_batches():
    a = cyclic.CyclicPoissonSampler(300, 5, cycle_length=5, seed=9)
    b = cyclic.CyclicPoissonSampler(300, 5, cycle_length=5, seed=9)
    for t in (0, 7, 123):
        np.testing.assert_array_equal(a.sample(t)[0], b.sample(t)[0])
    np.testing.assert_array_equal(a.groups, b.groups)


def test_overflow_and_max_batch_size_are_the_poisson_samplers():
    sampler = cyclic.CyclicPoissonSampler(1000, 20, cycle_length=4, seed=1)
    poisson = PoissonSampler(1000, 20, seed=1)
    assert sampler.max_batch_size == poisson.max_batch_size
    assert sampler.overflow_probability == poisson.overflow_probability
    small = cyclic.CyclicPoissonSampler(1000, 20, cycle_length=4, max_batch_size=5, seed=1)
    indices, mask = small.sample(0)
    assert mask.sum() == 5 and small.last_overflow and np.all(small.groups[indices[mask]] == 0)
    strict = cyclic.CyclicPoissonSampler(1000, 20, cycle_length=4, max_batch_size=5, seed=1, overflow="error")
    with pytest.raises(RuntimeError, match="max_batch_size"):
        strict.sample(0)


def test_edge_cases():
    whole = cyclic.CyclicPoissonSampler(12, 3, cycle_length=4, seed=2)  # q_b = 1: the whole group
    assert whole.group_sampling_probability == 1.0
    for t in range(8):
        indices, mask = whole.sample(t)
        np.testing.assert_array_equal(indices[mask], np.flatnonzero(whole.groups == t % 4))
    sparse = cyclic.CyclicPoissonSampler(3, 0.1, cycle_length=3, seed=4)  # groups may be empty
    for t in range(6):
        sparse.sample(t)
    with pytest.raises(ValueError, match="group sampling probability"):
        cyclic.CyclicPoissonSampler(100, 30, cycle_length=4)
    with pytest.raises(ValueError, match="cycle_length"):
        cyclic.CyclicPoissonSampler(100, 1, cycle_length=0)
