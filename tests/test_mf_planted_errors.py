"""Privacy checks of the correlated-noise mechanisms, each shown to fail on a planted error:

  - a unit sampled at a step outside its group (cyclic Poisson sampling, BandMF's amplification);
  - a sensitivity off by one participation (BandMF's rounds, BLT's min-separation sensitivity): the
    accountant's epsilon changes, and a check that reads the participations off the real sampler sees it;
  - noise added twice under gradient accumulation (noise once per logical batch): the released noise of a
    logical batch, mapped back through C, must be std^2-white, and equal the unaccumulated run's.
"""

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

import jaxdp
from jaxdp.accounting import mechanisms as mf
from jaxdp.noise import strategies
from jaxdp.noise.mechanisms import BLT, DPSGD, BandMF
from jaxdp.noise.privatizer import GaussianPrivatizer
from jaxdp.sampling import cyclic

DELTA = 1e-6
CLIP_SENSITIVITY = math.sqrt(1 + 2.0**-12)  # C' for C = 1


# ------------------------------------------------------------------ the sampler: units only in their group


def participations(sampler, steps):
    """{unit: the steps it was sampled at}, read from the sampler's batches."""
    out: dict[int, list[int]] = {}
    for t in range(steps):
        indices, mask = sampler.sample(t)
        for u in indices[mask]:
            out.setdefault(int(u), []).append(t)
    return out


def check_cyclic_participation(sampler, steps):
    """What amplified BandMF / min-separated BLT assume of the batches: each unit only at steps t with
    t mod b = its group in the secret partition (`sampler.groups`), hence at least b apart."""
    for unit, at in participations(sampler, steps).items():
        assert all(t % sampler.cycle_length == sampler.groups[unit] for t in at), (unit, at)
        assert all(b - a >= sampler.cycle_length for a, b in zip(at, at[1:])), (unit, at)


def test_units_are_sampled_only_in_their_groups_steps():
    check_cyclic_participation(cyclic.CyclicPoissonSampler(90, 20, cycle_length=4, max_batch_size=90, seed=3), 24)


def test_a_unit_sampled_outside_its_group_is_caught():
    """A planted error in the sampling path itself: one unit moved into another group's member list (what the
    sampler draws from) while the partition the accountant assumes keeps it in its own group."""
    sampler = cyclic.CyclicPoissonSampler(90, 20, cycle_length=4, max_batch_size=90, seed=3)
    unit = int(sampler._members[0][0])
    sampler._members[0] = sampler._members[0][1:]
    sampler._members[1] = np.sort(np.append(sampler._members[1], unit))
    assert sampler.groups[unit] == 0
    with pytest.raises(AssertionError):
        check_cyclic_participation(sampler, 24)  # q_b = 20 x 4 / 90: the unit is drawn at a step of group 1


# ------------------------------------------------------------------ a sensitivity off by one participation


def max_participations_seen(steps, cycle_length):
    """The most participations of one unit over `steps` steps of the real cyclic sampler at q_b = 1."""
    sampler = cyclic.CyclicPoissonSampler(12, 12 / cycle_length, cycle_length=cycle_length, seed=1)
    return max(len(at) for at in participations(sampler, steps).values())


def brute_force_sensitivity(mechanism, steps, min_sep, k):
    """max over all patterns of <= k steps at least min_sep apart of ||sum of C's columns|| (C dense here)."""
    c = strategies.toeplitz_coefs(mechanism, steps)
    rows, cols = np.indices((steps, steps))
    dense = np.where(rows >= cols, c[np.clip(rows - cols, 0, steps - 1)], 0.0)
    best = 0.0
    for j in range(1, k + 1):
        for pattern in itertools.combinations(range(steps), j):
            if all(b - a >= min_sep for a, b in zip(pattern, pattern[1:])):
                best = max(best, float(np.linalg.norm(dense[:, list(pattern)].sum(axis=1))))
    return best


def true_epsilon(record, mechanism, sigma):
    """The epsilon of the noise the step adds (std = record.noise_std(C', sigma)) under the participations the
    real sampler allows: BandMF as DP-SGD over the seen rounds at sensitivity ||c||, BLT as one Gaussian of the
    brute-forced sensitivity."""
    std = record.noise_std(CLIP_SENSITIVITY, sigma)
    k = max_participations_seen(record.steps, record.cycle_length)
    if record.kind == "bandmf":
        truth = mf.MechanismAccounting("bandmf", record.steps, record.sampling_probability, record.cycle_length,
                                       mechanism.column_norm)
        if truth.rounds != k:
            pytest.fail(f"the accountant counts {truth.rounds} rounds, the sampler allows {k}")
        return mf.epsilon_for(truth, std / (CLIP_SENSITIVITY * mechanism.column_norm), DELTA)
    sens = brute_force_sensitivity(mechanism, record.steps, record.cycle_length, k)
    return mf.epsilon_for(dataclasses.replace(record, strategy_sensitivity=sens), std / (CLIP_SENSITIVITY * sens),
                          DELTA)


BANDMF = BandMF((0.7, 0.5, 0.4, 0.3))
BLT2 = BLT((0.9, 0.5), (0.3, 0.2))


def blt_record(steps, min_sep, participations=None):
    sens = strategies.sensitivity(BLT2, steps, min_sep, participations)
    return mf.MechanismAccounting("blt", steps, 1.0, min_sep, sens, participations)


@pytest.mark.parametrize("steps", [9, 10, 12])
def test_the_claims_equal_the_epsilon_of_what_ran(steps):
    sigma = 1.3
    bandmf = mf.MechanismAccounting("bandmf", steps, 1.0, 4, BANDMF.column_norm)
    assert mf.epsilon_for(bandmf, sigma, DELTA) == pytest.approx(true_epsilon(bandmf, BANDMF, sigma), rel=1e-12)
    blt = blt_record(steps, 3)
    assert mf.epsilon_for(blt, sigma, DELTA) == pytest.approx(true_epsilon(blt, BLT2, sigma), rel=1e-9)


def test_bandmf_rounds_off_by_one_participation_are_caught(monkeypatch):
    """Planted: the accountant counts floor(steps / b) rounds (a unit of group 0 joins ceil(steps / b) steps)."""
    sigma, record = 1.3, mf.MechanismAccounting("bandmf", 10, 1.0, 4, BANDMF.column_norm)
    right = mf.epsilon_for(record, sigma, DELTA)
    monkeypatch.setattr(mf.MechanismAccounting, "rounds", property(lambda self: self.steps // self.cycle_length))
    assert mf.epsilon_for(record, sigma, DELTA) < 0.9 * right  # the accountant's epsilon changes
    with pytest.raises(pytest.fail.Exception, match="2 rounds, the sampler allows 3"):
        true_epsilon(record, BANDMF, sigma)


def test_blt_sensitivity_off_by_one_participation_is_caught():
    """Planted: BLT's sensitivity for one participation fewer than `steps` allow at min_sep apart (10 steps,
    min_sep 3: 4 participations, 0, 3, 6, 9). The noise std scales with the claimed sensitivity, so the
    noise that ran is smaller than the claim assumes, and its true epsilon is above the claim."""
    sigma, steps, min_sep = 1.3, 10, 3
    assert strategies.max_participations(steps, min_sep) == max_participations_seen(steps, min_sep) == 4
    planted = blt_record(steps, min_sep, participations=3)
    right = blt_record(steps, min_sep)
    assert planted.strategy_sensitivity < right.strategy_sensitivity
    assert mf.epsilon_for(planted, sigma, DELTA) == pytest.approx(mf.epsilon_for(right, sigma, DELTA))  # same event
    assert true_epsilon(planted, BLT2, sigma) > 1.05 * mf.epsilon_for(planted, sigma, DELTA)  # ... not what ran
    assert true_epsilon(right, BLT2, sigma) == pytest.approx(mf.epsilon_for(right, sigma, DELTA), rel=1e-9)


# ------------------------------------------------------------------ noise once per logical batch


SHAPE = (64, 64)  # 4096 noise values per step
STEPS = 4


def logical_batch_noise(tx, accumulation_steps):
    """The noise x EBS of each logical batch, (STEPS, *SHAPE) float64, for zero per-example gradients; the
    micro-steps between logical batch ends must release exact zeros."""
    params = {"w": jnp.zeros(SHAPE)}
    grads = {"w": jnp.zeros((2, *SHAPE))}
    state, out = tx.init(params), []
    update = jax.jit(lambda g, s: tx.update(g, s, params))
    for i in range(STEPS * accumulation_steps):
        u, state = update(grads, state)
        if (i + 1) % accumulation_steps:
            assert not np.any(np.asarray(u["w"])), f"noise released at micro-step {i}"
        else:
            out.append(np.asarray(u["w"], np.float64) * 2.0)
    return np.stack(out)


def check_noise_once(noise, mechanism, std):
    """Each logical batch's draws z_t = (C x)_t are white with variance std^2: sum(z_t^2) / std^2 within the
    two-sided 1e-9 quantiles of chi^2(4096) (false failure < 1e-8 over the steps; twice the noise is ~2x)."""
    c = strategies.strategy_matrix(mechanism, len(noise))
    z = np.einsum("ts,s...->t...", c, noise).reshape(len(noise), -1)
    df = z.shape[1]
    lo, hi = stats.chi2.ppf(1e-9, df), stats.chi2.isf(1e-9, df)
    for t, row in enumerate(z):
        assert lo <= float(row @ row) / std**2 <= hi, (t, float(row @ row) / std**2 / df)


MECHANISMS = {"dpsgd": DPSGD(), "bandmf": BANDMF}


def fused(mechanism, accumulation_steps=1):
    return jaxdp.fused_clip(1.0, 1.3, expected_batch_size=2.0, key=jax.random.key(11), mechanism=mechanism,
                            accumulation_steps=accumulation_steps)


def std_of(mechanism):
    return 1.3 * CLIP_SENSITIVITY * math.sqrt(sum(c * c for c in getattr(mechanism, "coefs", (1.0,))))


def summed_micro_batches(inner, k):
    """`inner`'s releases summed over k micro-batches, released on the last (zeros before)."""
    def init(params):
        return inner.init(params), jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.int32)

    def update(grads, state, params=None):
        updates, inner_state = inner.update(grads, state[0], params)
        total = jax.tree.map(jnp.add, state[1], updates)
        last = (state[2] + 1) % k == 0
        out = jax.tree.map(lambda a: jnp.where(last, a, 0.0), total)
        return out, (inner_state, jax.tree.map(lambda a: jnp.where(last, 0.0, a), total), state[2] + 1)

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_noise_is_added_once_per_logical_batch(name):
    mechanism = MECHANISMS[name]
    once = logical_batch_noise(fused(mechanism), 1)
    check_noise_once(once, mechanism, std_of(mechanism))
    for k in (2, 3):  # the same key: the same draws, once per logical batch, whatever the accumulation
        np.testing.assert_array_equal(logical_batch_noise(fused(mechanism, k), k), once)


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_noise_added_twice_under_accumulation_is_caught(name, monkeypatch):
    """Two planted errors: the privatizer applied twice per logical batch, and noise added per micro-batch (a
    fused_clip without accumulation, its noisy micro-batch releases summed into the logical batch: optax
    issue 527's mistake)."""
    mechanism, k = MECHANISMS[name], 2
    with pytest.raises(AssertionError, match=r"^\(\d+, "):  # the chi^2 check of a logical batch
        check_noise_once(logical_batch_noise(summed_micro_batches(fused(mechanism), k), k), mechanism,
                         std_of(mechanism))

    original = GaussianPrivatizer.update

    def twice(self, sums, state):
        out, state = original(self, sums, state)
        return original(self, jax.tree.map(lambda o: o * self.expected_batch_size, out), state)

    monkeypatch.setattr(GaussianPrivatizer, "update", twice)
    with pytest.raises(AssertionError, match=r"^\(\d+, "):
        check_noise_once(logical_batch_noise(fused(mechanism, k), k), mechanism, std_of(mechanism))
