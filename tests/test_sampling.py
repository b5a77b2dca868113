"""Tests for jaxdp.sampling.poisson: Poisson statistics, reproducibility, secret seeds, layout, overflow."""

import math
import secrets
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

from jaxdp.noise import chacha, seeds
from jaxdp.sampling import binomial
from jaxdp.sampling import poisson as sampling

# Tolerances are in standard deviations of the statistic under test. With the
# seeds fixed the tests are deterministic; Z makes a false failure under a
# fresh seed unlikely (two-sided normal tail at 6 sigma: 2e-9 per check).
Z = 6.0


def _batches(sampler, steps):
    return [sampler.sample(s) for s in steps]


def _included(batch):
    indices, mask = batch
    return indices[mask]


def _exact_tail(n, q, b):
    """P(Binomial(n, q) > b), summed term by term with math.comb."""
    return math.fsum(math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(b + 1, n + 1))


# ---------------------------------------------------------------- statistics


def test_inclusion_rate_matches_q():
    n, expected, steps = 100, 10, 2000
    q = expected / n
    sampler = sampling.PoissonSampler(n, expected, seed=1)
    counts = np.zeros(n)
    for indices, mask in _batches(sampler, range(steps)):
        np.add.at(counts, indices[mask], 1)
    # Every inclusion is an independent Bernoulli(q): the total is
    # Binomial(n * steps, q) and each example's count is Binomial(steps, q).
    total_sd = math.sqrt(n * steps * q * (1 - q))
    assert abs(counts.sum() - n * steps * q) <= Z * total_sd
    # Per example, with a union bound over the n examples: z = 6.5 gives
    # n * 8e-11 < 1e-8.
    per_example_sd = math.sqrt(steps * q * (1 - q))
    assert np.abs(counts - steps * q).max() <= 6.5 * per_example_sd


def test_batch_size_is_binomial():
    n, expected, steps = 1000, 50, 2000
    q = expected / n
    sampler = sampling.PoissonSampler(n, expected, seed=2)
    sizes = np.array([mask.sum() for _, mask in _batches(sampler, range(steps))])
    var = n * q * (1 - q)
    assert abs(sizes.mean() - expected) <= Z * math.sqrt(var / steps)
    # The size varies like Binomial(n, q) (a fixed-size sampler would have 0
    # variance). Sample variance ~ var * chi2(steps - 1) / (steps - 1), whose
    # relative sd is sqrt(2 / (steps - 1)) (binomial excess kurtosis is tiny).
    assert abs(sizes.var(ddof=1) / var - 1) <= Z * math.sqrt(2 / (steps - 1))
    assert sampler.sampling_probability == q


def test_full_sampling_probability_takes_everything():
    sampler = sampling.PoissonSampler(17, 17)
    assert sampler.max_batch_size == 17
    indices, mask = sampler.sample(3)
    np.testing.assert_array_equal(indices, np.arange(17))
    assert mask.all()


# ---------------------------------------------------------------- determinism


def test_same_seed_and_step_reproduce_in_any_order():
    a = sampling.PoissonSampler(500, 20, seed=7)
    b = sampling.PoissonSampler(500, 20, seed=7)
    forward = _batches(a, range(10))
    backward = _batches(b, reversed(range(10)))[::-1]  # e.g. a resumed run
    for (i1, m1), (i2, m2) in zip(forward, backward, strict=True):
        np.testing.assert_array_equal(i1, i2)
        np.testing.assert_array_equal(m1, m2)


def test_different_steps_and_seeds_differ():
    a = sampling.PoissonSampler(500, 20, seed=7)
    b = sampling.PoissonSampler(500, 20, seed=8)
    batches = [tuple(i[m]) for i, m in _batches(a, range(20))]
    assert len(set(batches)) == 20
    assert not np.array_equal(a.sample(0)[0], b.sample(0)[0])


def test_draw_is_chacha20_of_the_derived_seed():
    # Documented contract: step s, attempt a draws from the ChaCha20 keystream (a CSPRNG) keyed by
    # derive_seed(seed, "poisson", s, a): a Binomial size by inverse CDF, then Floyd's uniform subset;
    # any int >= 0 is a seed.
    seed, step = secrets.randbits(200), secrets.randbelow(2**40)
    sampler = sampling.PoissonSampler(300, 30, seed=seed)
    stream = sampling.KeyStream(seeds.derive_seed(seed, "poisson", step, 0))
    expected = stream.subset(300, stream.binomial(300, 0.1))
    indices, mask = sampler.sample(step)
    np.testing.assert_array_equal(indices[mask], expected)
    words = sampling.KeyStream(seed).words64(40)   # the keystream itself, two 32-bit words per draw
    raw = chacha.stream(seeds.seed_words(seed, 8), np.zeros(3, np.uint32), 80).astype(np.uint64)
    np.testing.assert_array_equal(words, (raw[0::2] << np.uint64(32)) | raw[1::2])


def test_keystream_draws_are_uniform():
    """Exact uniform integers (a bound that is not a power of two, where a modulo would be biased), a
    binomial with the exact mean and variance, and subsets holding every element equally often."""
    rng = sampling.KeyStream(secrets.randbits(256))
    with pytest.raises(ValueError, match="bound must be in"):  # review 20: 2^64 + 1 looped forever
        rng.below(2**64 + 1)
    assert 0 <= rng.below(2**64) < 2**64
    draws = np.array([rng.below(6) for _ in range(12_000)])
    counts = np.bincount(draws, minlength=6)
    assert draws.max() < 6 and ((counts - 2000) ** 2 / 2000).sum() < 30   # chi-square, 5 dof: p ~ 1e-5
    sizes = np.array([rng.binomial(1000, 0.3) for _ in range(4000)])
    assert abs(sizes.mean() - 300) < Z * math.sqrt(210 / 4000)
    assert abs(sizes.var() / 210 - 1) < Z * math.sqrt(2 / 4000)
    hits = np.zeros(50)
    for _ in range(2000):
        chosen = rng.subset(50, 10)
        assert len(set(chosen)) == 10 and chosen.max() < 50
        hits[chosen] += 1
    assert np.abs(hits - 400).max() < Z * math.sqrt(400 * 0.8)


def _draw_of(rng, n, q):
    size = rng.binomial(n, q)
    return np.sort(rng.choice(n, size=size, replace=False, shuffle=False))


def test_no_draw_shares_the_stream_of_the_bare_seed():
    # NumPy drops trailing zeros of a seed list: default_rng([s, 0, 0]) is default_rng(s), which
    # made step 0's draw the stream that seeded the job's data split. No step may draw from the
    # bare seed's stream, nor from another step's.
    seed = secrets.randbelow(2**32)
    assert np.array_equal(_draw_of(np.random.default_rng([seed, 0, 0]), 300, 0.1),
                          _draw_of(np.random.default_rng(seed), 300, 0.1))  # the NumPy pitfall
    sampler = sampling.PoissonSampler(300, 30, seed=seed)
    bare = _draw_of(np.random.default_rng(seed), 300, 0.1)
    draws = [tuple(i[m]) for i, m in _batches(sampler, range(20))]
    assert tuple(bare) not in draws, seed
    assert len(set(draws)) == 20, seed


def test_default_seed_is_secret_and_fresh():
    a, b = sampling.PoissonSampler(500, 20), sampling.PoissonSampler(500, 20)
    assert a.seed != b.seed and a.seed >= 0 and b.seed >= 0
    assert a.seed.bit_length() > 64 or b.seed.bit_length() > 64  # 128-bit draws (2**-64 to fail)
    assert not np.array_equal(a.sample(0)[0], b.sample(0)[0])
    assert str(a.seed) not in repr(a)  # a logged sampler does not print its seed


# ---------------------------------------------------------------- layout


def test_layout_included_first_then_padding():
    n = 1000
    sampler = sampling.PoissonSampler(n, 40, seed=3)
    for indices, mask in _batches(sampler, range(50)):
        assert indices.shape == mask.shape == (sampler.max_batch_size,)
        assert indices.dtype == np.int64 and mask.dtype == np.bool_
        k = int(mask.sum())
        assert mask[:k].all() and not mask[k:].any()
        assert (np.diff(indices[:k]) > 0).all()  # increasing, no repeats
        assert indices[:k].min(initial=0) >= 0 and indices[:k].max(initial=0) < n
        assert (indices[k:] == 0).all()
        assert not sampler.last_overflow
    assert sampler.overflow_count == 0


# ---------------------------------------------------------------- overflow

# N = 100, q = 0.03, 4 slots: P(Binomial(100, 0.03) > 4) ~ 0.18 per step.
_N, _EXPECTED, _SLOTS, _STEPS = 100, 3, 4, 300


def _unbounded(seed):
    return sampling.PoissonSampler(_N, _EXPECTED, max_batch_size=_N, seed=seed)


@pytest.mark.parametrize("overflow", sampling.OVERFLOW_MODES)
def test_modes_agree_when_the_draw_fits(overflow):
    full = _unbounded(0)
    small = sampling.PoissonSampler(_N, _EXPECTED, max_batch_size=_SLOTS, seed=0,
                                    overflow=overflow)
    for step in range(_STEPS):
        full_idx, full_mask = full.sample(step)
        if full_mask.sum() <= _SLOTS:
            indices, mask = small.sample(step)
            np.testing.assert_array_equal(indices, full_idx[:_SLOTS])
            np.testing.assert_array_equal(mask, full_mask[:_SLOTS])
            assert not small.last_overflow


def test_truncate_keeps_a_random_subset_and_counts():
    full = _unbounded(0)
    small = sampling.PoissonSampler(_N, _EXPECTED, max_batch_size=_SLOTS, seed=0)
    overflows = 0
    for step in range(_STEPS):
        full_idx, full_mask = full.sample(step)
        indices, mask = small.sample(step)
        kept, drawn = set(indices[mask]), set(full_idx[full_mask])
        assert kept <= drawn
        assert len(kept) == min(len(drawn), _SLOTS)
        assert small.last_overflow == (len(drawn) > _SLOTS)
        overflows += len(drawn) > _SLOTS
    assert overflows > 0
    assert small.overflow_count == overflows


def test_truncate_keeps_a_uniform_subset():
    # An overflowing draw of m examples keeps a uniform `slots`-subset, so the
    # number kept from the first half of the data is hypergeometric given the
    # draw. Sum it over steps and compare with the summed mean and variance.
    slots = 10
    full = sampling.PoissonSampler(_N, 30, max_batch_size=_N, seed=4)
    small = sampling.PoissonSampler(_N, 30, max_batch_size=slots, seed=4)
    kept_low, mean, var = 0, 0.0, 0.0
    for step in range(400):
        drawn, kept = _included(full.sample(step)), _included(small.sample(step))
        m, p_low = drawn.size, (drawn < _N // 2).mean()
        if m > slots:
            kept_low += int((kept < _N // 2).sum())
            mean += slots * p_low
            var += slots * p_low * (1 - p_low) * (m - slots) / (m - 1)
    assert abs(kept_low - mean) <= Z * math.sqrt(var)


def test_resample_redraws_until_it_fits():
    full = _unbounded(0)
    small = sampling.PoissonSampler(_N, _EXPECTED, max_batch_size=_SLOTS, seed=0,
                                    overflow="resample")
    again = sampling.PoissonSampler(_N, _EXPECTED, max_batch_size=_SLOTS, seed=0,
                                    overflow="resample")
    overflows = 0
    for step in range(_STEPS):
        _, full_mask = full.sample(step)
        indices, mask = small.sample(step)
        assert mask.sum() <= _SLOTS
        overflowed = full_mask.sum() > _SLOTS
        assert small.last_overflow == overflowed
        overflows += overflowed
        again_idx, again_mask = again.sample(step)  # redraws are deterministic too
        np.testing.assert_array_equal(indices, again_idx)
        np.testing.assert_array_equal(mask, again_mask)
    assert overflows > 0
    assert small.overflow_count == overflows


def test_resample_gives_up_when_nothing_fits():
    sampler = sampling.PoissonSampler(100, 50, max_batch_size=1, overflow="resample")
    with pytest.raises(RuntimeError, match="resample"):
        sampler.sample(0)


def test_error_mode_raises_on_overflow():
    full = _unbounded(0)
    small = sampling.PoissonSampler(_N, _EXPECTED, max_batch_size=_SLOTS, seed=0,
                                    overflow="error")
    step = next(s for s in range(_STEPS) if full.sample(s)[1].sum() > _SLOTS)
    with pytest.raises(RuntimeError, match="max_batch_size"):
        small.sample(step)



def _size_law(lo, th):
    """The probability of each size lo, lo + 1, ... that `binomial.draw` gives a uniform 128-bit integer."""
    return [Fraction(b - a, 2**binomial.UNIFORM_BITS) for a, b in zip((0,) + th[:-1], th)]


def _float64_thresholds(n, q):
    """The float64 inverse CDF the sampler used before (a planted error for the test below)."""
    lo, pmf = binomial.table(n, q)
    cdf = np.cumsum(np.array([float(p) for p in pmf]))
    return lo, tuple(int(min(c / cdf[-1], 1.0) * 2**53) << 75 for c in cdf)


@pytest.mark.parametrize("n,q", [(40, 0.3), (300, 0.1), (600, 0.004), (257, 1 - 2.0**-20)])
def test_drawn_size_is_binomial_to_2_pow_minus_127(n, q):
    """Each size's probability under `draw` is the exact binomial pmf (math.comb, q as its binary fraction) to
    2^-127; the float64 inverse CDF the sampler used before is off by > 1e-19 somewhere (attacker review 18:
    1e-14 to 7e-13 of total variation per step at n = 1e5-1e7, paid nowhere in delta)."""
    exact_q = Fraction(q)
    lo, th = binomial.thresholds(n, q)
    exact = [math.comb(n, k) * exact_q**k * (1 - exact_q) ** (n - k) for k in range(lo, lo + len(th))]
    assert sum(exact) > 1 - Fraction(1, 10**300)  # the window holds all but < 2e-300
    worst = max(abs(p - e) for p, e in zip(_size_law(lo, th), exact))
    assert worst <= Fraction(1, 2**127), float(worst)
    lo, pmf = binomial.table(n, q)
    assert max(abs(Fraction(p) - e) for p, e in zip(pmf, exact)) < Fraction(1, 10**45)
    assert binomial.draw(np.int64(n), np.float32(q), 2**127) == binomial.draw(n, float(np.float32(q)), 2**127)
    lo, th64 = _float64_thresholds(n, q)
    assert max(abs(p - e) for p, e in zip(_size_law(lo, th64), exact)) > Fraction(1, 10**19)


def test_binomial_tails_stay_exact_at_huge_n():
    """sf at n = 1e14 (the float64 pmf without normalisation gave 0.88x the tail; review 18) against
    Poisson(100), which Binomial(1e14, 1e-12) equals to ~1e-10; and tails far below float64's resolution."""
    n, q, k = 10**14, 1e-12, 130
    lam = Decimal(n) * Decimal(q)
    term, head = (-lam).exp(), Decimal(0)
    for j in range(k + 1):
        head += term
        term = term * lam / (j + 1)
    assert binomial.sf(n, q, k) == pytest.approx(float(1 - head), rel=1e-6)
    def tail(n, q, b):  # exact, where _exact_tail's floats underflow
        q = Fraction(q)
        return sum(math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(b + 1, n + 1))
    assert binomial.sf(300, 0.01, 120) / float(tail(300, 0.01, 120)) == pytest.approx(1, rel=1e-12)  # ~1e-156
    b = binomial.smallest_size_above(301, 0.01, 1e-150)
    assert tail(301, 0.01, b) < Fraction(1e-150) <= tail(301, 0.01, b - 1)

# ---------------------------------------------------------------- default size


@pytest.mark.parametrize("n,expected", [(200, 20), (50, 25), (1000, 3), (300, 270),
                                        (500, 0.5)])
@pytest.mark.parametrize("max_overflow_probability", [1e-9, 1e-3])
def test_default_max_batch_size_is_smallest_safe(n, expected, max_overflow_probability):
    sampler = sampling.PoissonSampler(n, expected,
                                      max_overflow_probability=max_overflow_probability)
    b, q = sampler.max_batch_size, expected / n
    # Safe on the data set and on its larger neighbour (n + 1 examples) ...
    assert _exact_tail(n, q, b) < max_overflow_probability
    assert _exact_tail(n + 1, q, b) < max_overflow_probability
    # ... and the smallest such size (for the neighbour).
    if b > 1:
        assert _exact_tail(n + 1, q, b - 1) >= max_overflow_probability
    assert sampler.overflow_probability == pytest.approx(_exact_tail(n + 1, q, b),
                                                         rel=1e-9, abs=1e-300)


def test_overflow_probability_of_an_explicit_size():
    sampler = sampling.PoissonSampler(_N, _EXPECTED, max_batch_size=_SLOTS)
    assert sampler.overflow_probability == pytest.approx(
        _exact_tail(_N + 1, _EXPECTED / _N, _SLOTS), rel=1e-9)


# ---------------------------------------------------------------- delta slack


def test_overflow_slack_formula():
    eps, steps, p = 8.0, 150, 2.5e-12
    assert sampling.overflow_slack(eps, steps, p) == pytest.approx((1 + math.exp(eps)) * steps * p, rel=1e-12)
    assert sampling.overflow_slack(1000.0, 10, 0.0) == 0.0  # no overflow: no slack, even where e^eps overflows
    assert sampling.overflow_slack(1000.0, 10, 0.5) == math.inf
    with pytest.raises(ValueError):
        sampling.overflow_slack(1.0, 10, 1.5)


def test_max_batch_size_for_delta_is_the_smallest_within_a_tenth_of_delta():
    seed = secrets.randbits(64)
    rng = np.random.default_rng(seed)
    for _ in range(6):
        n = int(rng.integers(50, 1000))  # _exact_tail's binomial coefficients fit a float
        expected = float(rng.uniform(0.5, n / 4))
        steps, eps, delta = int(rng.integers(1, 5000)), float(rng.uniform(0.5, 12)), 10.0 ** -rng.uniform(3, 8)
        b = sampling.max_batch_size_for_delta(n, expected, steps, eps, delta)

        def slack(size):  # from the exact tail on N + 1 examples (the larger neighbour)
            return (1 + math.exp(eps)) * steps * _exact_tail(n + 1, expected / n, size)

        case = (seed, n, expected, steps, eps, delta, b)
        assert slack(b) <= delta / 10 * (1 + 1e-9), case
        assert b == 1 or slack(b - 1) >= delta / 10 * (1 - 1e-9), case
        sampler = sampling.PoissonSampler(n, expected, max_batch_size=b)
        assert sampling.overflow_slack(eps, steps, sampler.overflow_probability) <= delta / 10 * (1 + 1e-9), case
    # A tighter share of delta needs a larger batch; an impossible one takes N + 1 (never overflows).
    assert (sampling.max_batch_size_for_delta(1000, 20, 100, 8.0, 1e-5, slack_fraction=1e-3)
            > sampling.max_batch_size_for_delta(1000, 20, 100, 8.0, 1e-5))
    assert sampling.max_batch_size_for_delta(1000, 20, 100, 800.0, 1e-5) == 1001


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("args,kwargs,match", [
    ((0, 1), {}, "num_examples"),
    ((-5, 1), {}, "num_examples"),
    ((100, 0), {}, "expected_batch_size"),
    ((100, -3), {}, "expected_batch_size"),
    ((100, 101), {}, r"expected_batch_size .*\(0, 100\]"),
    ((100, 10), {"max_batch_size": 0}, "max_batch_size"),
    ((100, 10), {"overflow": "drop"}, r"overflow .*\('truncate', 'resample', 'error'\)"),
    ((100, 10), {"seed": -1}, "seed"),
    ((100, 10), {"max_overflow_probability": 0.0}, "max_overflow_probability"),
])
def test_bad_input_raises_value_error_naming_argument(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sampling.PoissonSampler(*args, **kwargs)


def test_bad_step_raises_value_error():
    with pytest.raises(ValueError, match="step"):
        sampling.PoissonSampler(100, 10).sample(-1)
