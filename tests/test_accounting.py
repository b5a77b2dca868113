"""Tests for jaxdp.accounting.epsilon: agreement with dp_accounting, calibration, budgets.

Cases are chosen so that PLD stays cheap (few steps, q >= 0.01): the whole
file runs in a few seconds on 2 CPU cores.
"""

import json
import math
import secrets

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp

from jaxdp.accounting import accountant as accounting
from jaxdp.accounting import budget as privacy_budget
from jaxdp.accounting import calibration

# (noise_multiplier, sampling_probability, steps, delta)
_CASES = [
    (1.1, 0.01, 1000, 1e-5),
    (5.0, 0.1, 100, 1e-6),
    (1.5, 0.05, 200, 1e-5),
    (2.0, 1.0, 10, 1e-5),
]


def _direct(accountant, sigma, q, steps, delta, **kwargs):
    """dp_accounting on its own, with its own defaults."""
    acc = rdp.RdpAccountant(**kwargs) if accountant == "rdp" else pld.PLDAccountant(**kwargs)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps))
    return acc.get_epsilon(delta)


# ---------------------------------------------------------------- epsilon


@pytest.mark.parametrize("accountant", accounting.ACCOUNTANTS)
@pytest.mark.parametrize("sigma,q,steps,delta", _CASES)
def test_epsilon_matches_dp_accounting(accountant, sigma, q, steps, delta):
    ours = accounting.epsilon(sigma, q, steps, delta, accountant=accountant)
    direct = _direct(accountant, sigma, q, steps, delta)
    assert isinstance(ours, float)
    assert ours == pytest.approx(direct, rel=0.01)
    if accountant == "rdp":
        # Our orders include dp_accounting's defaults: never looser.
        assert ours <= direct * (1 + 1e-12)


def test_default_pld_discretization_is_accurate():
    sigma, q, steps, delta = 5.0, 0.1, 100, 1e-6
    fine = _direct("pld", sigma, q, steps, delta, value_discretization_interval=1e-5)
    ours = accounting.epsilon(sigma, q, steps, delta, accountant="pld")
    assert ours == pytest.approx(fine, rel=1e-3)


@pytest.mark.parametrize("steps", [1, 10])
def test_pld_without_subsampling_is_the_analytic_gaussian(steps):
    # q = 1: `steps` Gaussian steps are one Gaussian with sigma / sqrt(steps),
    # whose exact epsilon is known (Balle & Wang 2018, arXiv:1805.06530).
    sigma, delta = 2.0, 1e-5
    exact = dp_accounting.get_epsilon_gaussian(sigma / math.sqrt(steps), delta)
    ours = accounting.epsilon(sigma, 1.0, steps, delta, accountant="pld")
    assert exact <= ours * (1 + 1e-9)  # PLD discretisation is pessimistic.
    assert ours == pytest.approx(exact, rel=1e-3)


@pytest.mark.parametrize("accountant", accounting.ACCOUNTANTS)
def test_epsilon_edge_cases(accountant):
    assert accounting.epsilon(0.0, 0.1, 10, 1e-5, accountant=accountant) == math.inf
    assert accounting.epsilon(1.0, 0.1, 0, 1e-5, accountant=accountant) == 0.0
    assert accounting.epsilon(0.0, 0.1, 0, 1e-5, accountant=accountant) == 0.0


def test_epsilon_is_monotone():
    def eps(sigma=1.0, q=0.01, steps=1000):
        return accounting.epsilon(sigma, q, steps, 1e-5)

    assert eps(sigma=0.8) > eps() > eps(sigma=1.2)
    assert eps(steps=500) < eps() < eps(steps=2000)
    assert eps(q=0.005) < eps() < eps(q=0.02)


# ---------------------------------------------------------------- calibration


@pytest.mark.parametrize("accountant,q,steps", [("rdp", 0.01, 1000), ("pld", 0.1, 100)])
@pytest.mark.parametrize("target", [0.5, 2.0])
def test_calibrate_hits_target_from_below(accountant, q, steps, target):
    delta = 1e-5
    sigma = calibration.calibrate_noise_multiplier(target, q, steps, delta,
                                                  accountant=accountant)
    eps = accounting.epsilon(sigma, q, steps, delta, accountant=accountant)
    assert target * (1 - 0.01) <= eps <= target
    # Smallest: 1% less noise overspends (epsilon falls at least as fast as 1/sigma).
    assert accounting.epsilon(0.99 * sigma, q, steps, delta, accountant=accountant) > target


def test_calibrate_respects_rtol():
    sigma = calibration.calibrate_noise_multiplier(3.0, 0.02, 500, 1e-6, rtol=1e-6)
    assert 3.0 * (1 - 1e-6) <= accounting.epsilon(sigma, 0.02, 500, 1e-6) <= 3.0


def test_calibrate_zero_steps_needs_no_noise():
    assert calibration.calibrate_noise_multiplier(1.0, 0.01, 0, 1e-5) == 0.0


# ---------------------------------------------------------------- steps_for_epsilon


@pytest.mark.parametrize("accountant,sigma,q,target", [("rdp", 1.1, 0.01, 2.0),
                                                        ("pld", 5.0, 0.1, 1.0)])
def test_steps_for_epsilon_is_the_boundary(accountant, sigma, q, target):
    delta = 1e-5
    k = calibration.steps_for_epsilon(target, sigma, q, delta, accountant=accountant)
    assert k > 1
    assert accounting.epsilon(sigma, q, k, delta, accountant=accountant) <= target
    assert accounting.epsilon(sigma, q, k + 1, delta, accountant=accountant) > target


def test_steps_for_epsilon_limits():
    assert calibration.steps_for_epsilon(100.0, 10.0, 0.01, 1e-5, max_steps=50) == 50
    assert calibration.steps_for_epsilon(1.0, 0.0, 0.01, 1e-5) == 0  # no noise: no step
    assert calibration.steps_for_epsilon(0.01, 0.5, 1.0, 1e-5) == 0  # one step is too many


# ---------------------------------------------------------------- default delta


def test_default_delta_is_below_a_tenth_of_one_over_n_and_reveals_only_the_magnitude():
    rng = np.random.default_rng(secrets.randbits(64))
    for n in [1, 9, 10, 99, 100, 9_999, 99_999, 21_576, 10**6] + list(rng.integers(1, 10**9, size=20)):
        n = int(n)
        delta = accounting.default_delta(n)
        assert delta == min(10.0 ** -(math.floor(math.log10(n)) + 2), 1e-5), n
        assert delta < 0.1 / n and delta <= 1e-5, n
        # N's order of magnitude determines it: any N' with as many digits gives the same delta.
        assert accounting.default_delta(10 ** (len(str(n)) - 1)) == delta == accounting.default_delta(
            10 ** len(str(n)) - 1), n
    with pytest.raises(ValueError, match="num_examples"):
        accounting.default_delta(0)


# ---------------------------------------------------------------- BudgetTracker


@pytest.mark.parametrize("accountant,sigma,q,steps,target", [
    ("rdp", 1.1, 0.01, 1000, 2.0), ("pld", 5.0, 0.1, 100, 1.0)])
def test_tracker_round_trip_and_refusal(accountant, sigma, q, steps, target):
    delta = 1e-5
    tracker = privacy_budget.BudgetTracker(sigma, q, delta, target_epsilon=target,
                                           accountant=accountant)
    tracker.step(steps)
    state = json.loads(json.dumps(tracker.state_dict()))
    restored = privacy_budget.BudgetTracker.from_state_dict(state)
    assert restored.state_dict() == tracker.state_dict()
    assert restored.steps == steps
    assert restored.epsilon() == tracker.epsilon()
    assert tracker.epsilon() == accounting.epsilon(sigma, q, steps, delta,
                                                   accountant=accountant)

    budget = restored.max_steps  # The last step count within the target:
    assert accounting.epsilon(sigma, q, budget, delta, accountant=accountant) <= target
    assert accounting.epsilon(sigma, q, budget + 1, delta, accountant=accountant) > target
    assert restored.can_step(budget - steps) and not restored.can_step(budget - steps + 1)
    restored.step(budget - steps)
    assert not restored.can_step()
    with pytest.raises(RuntimeError, match="target_epsilon"):
        restored.step()
    assert restored.steps == budget  # The refused step is not counted.
    assert restored.epsilon() <= target


def test_pld_is_the_default_and_tighter():
    assert accounting.ACCOUNTANTS[0] == "pld"
    assert accounting.epsilon(1.1, 0.01, 1000, 1e-5) == accounting.epsilon(1.1, 0.01, 1000, 1e-5, accountant="pld")
    assert accounting.epsilon(1.1, 0.01, 1000, 1e-5) < 0.9 * accounting.epsilon(1.1, 0.01, 1000, 1e-5,
                                                                                 accountant="rdp")


@pytest.mark.parametrize("sigma,q,steps", [(0.31, 0.005, 6), (1.0, 0.001, 2000)])
def test_pld_interval_is_within_rtol_of_ten_times_finer(sigma, q, steps):
    """The chosen grid gives an epsilon (an upper bound at any grid) within 0.1% of a 10x finer one;
    at large epsilon that is the coarsest grid, at small epsilon a finer one."""
    interval = accounting.pld_interval(sigma, q, steps, 1e-5)
    coarse = accounting.epsilon(sigma, q, steps, 1e-5, value_discretization_interval=interval)
    if interval > 1e-4:
        fine = accounting.epsilon(sigma, q, steps, 1e-5, value_discretization_interval=interval / 10)
        assert fine <= coarse <= fine * (1 + 1e-3)
    assert (interval == 1e-2) == (coarse > 1)


def test_pld_falls_back_to_rdp_where_its_grid_would_not_fit_in_memory():
    """sigma 0.5, q 0.5, 10^6 steps: a ~10^10-point PLD; the RDP bound (valid) answers instead."""
    assert accounting.epsilon(0.5, 0.5, 10**6, 1e-5) == accounting.epsilon(0.5, 0.5, 10**6, 1e-5, accountant="rdp")


def test_tracker_without_target_never_refuses():
    tracker = privacy_budget.BudgetTracker(0.5, 0.5, 1e-5)
    assert tracker.max_steps is None
    tracker.step(10**6)
    assert tracker.can_step(10**6)
    assert tracker.epsilon() > 100


def test_tracker_caches_epsilon(monkeypatch):
    calls = []
    real = accounting._epsilon
    monkeypatch.setattr(accounting, "_epsilon", lambda *a: calls.append(a) or real(*a))
    tracker = privacy_budget.BudgetTracker(1.0, 0.01, 1e-5)
    tracker.step(10)
    first = tracker.epsilon()
    assert tracker.epsilon() == first and len(calls) == 1
    tracker.step()
    assert tracker.epsilon() > first and len(calls) == 2


# ---------------------------------------------------------------- validation

_GOOD = {"noise_multiplier": 1.0, "sampling_probability": 0.01, "steps": 10, "delta": 1e-5}


def _epsilon(**overrides):
    kw = {**_GOOD, **overrides}
    return accounting.epsilon(kw.pop("noise_multiplier"), kw.pop("sampling_probability"),
                              kw.pop("steps"), kw.pop("delta"), **kw)


def _calibrate(**overrides):
    kw = {"target_epsilon": 1.0, "sampling_probability": 0.01, "steps": 10,
          "delta": 1e-5, **overrides}
    return calibration.calibrate_noise_multiplier(**kw)


def _steps_for(**overrides):
    kw = {"target_epsilon": 1.0, "noise_multiplier": 1.0, "sampling_probability": 0.01,
          "delta": 1e-5, **overrides}
    return calibration.steps_for_epsilon(**kw)


def _tracker(**overrides):
    kw = {"noise_multiplier": 1.0, "sampling_probability": 0.01, "delta": 1e-5,
          **overrides}
    return privacy_budget.BudgetTracker(**kw)


@pytest.mark.parametrize("call,overrides,match", [
    (_epsilon, {"delta": 0.0}, r"delta .*\(0, 1\)"),
    (_epsilon, {"delta": 1.0}, r"delta .*\(0, 1\)"),
    (_epsilon, {"delta": float("nan")}, r"delta .*\(0, 1\)"),
    (_epsilon, {"noise_multiplier": -0.1}, r"noise_multiplier .*>= 0"),
    (_epsilon, {"sampling_probability": 0.0}, r"sampling_probability .*\(0, 1\]"),
    (_epsilon, {"sampling_probability": 1.5}, r"sampling_probability .*\(0, 1\]"),
    (_epsilon, {"steps": -1}, r"steps .*>= 0"),
    (_epsilon, {"sampling_probability": 3e-17}, r"sampling_probability .* below 1e-12"),  # review 20: eps 0
    (_epsilon, {"accountant": "moments"}, r"accountant .*\('pld', 'rdp'\)"),
    (_epsilon, {"value_discretization_interval": 0.0}, r"value_discretization_interval"),
    (_calibrate, {"target_epsilon": 0.0}, r"target_epsilon .*> 0"),
    (_calibrate, {"target_epsilon": -1.0}, r"target_epsilon .*> 0"),
    (_calibrate, {"delta": 2.0}, r"delta .*\(0, 1\)"),
    (_calibrate, {"steps": -5}, r"steps .*>= 0"),
    (_calibrate, {"accountant": "gdp"}, r"accountant .*\('pld', 'rdp'\)"),
    (_calibrate, {"rtol": 0.0}, r"rtol .*\(0, 1\)"),
    (_steps_for, {"target_epsilon": 0.0}, r"target_epsilon .*> 0"),
    (_steps_for, {"noise_multiplier": -1.0}, r"noise_multiplier .*>= 0"),
    (_steps_for, {"sampling_probability": 0.0}, r"sampling_probability .*\(0, 1\]"),
    (_steps_for, {"max_steps": -1}, r"max_steps .*>= 0"),
    (_tracker, {"delta": 0.0}, r"delta .*\(0, 1\)"),
    (_tracker, {"noise_multiplier": -1.0}, r"noise_multiplier .*>= 0"),
    (_tracker, {"sampling_probability": 2.0}, r"sampling_probability .*\(0, 1\]"),
    (_tracker, {"target_epsilon": 0.0}, r"target_epsilon .*> 0"),
    (_tracker, {"accountant": "RDP"}, r"accountant .*\('pld', 'rdp'\)"),
])
def test_bad_input_raises_value_error_naming_argument(call, overrides, match):
    with pytest.raises(ValueError, match=match):
        call(**overrides)


def test_tracker_bad_step_count():
    tracker = _tracker()
    with pytest.raises(ValueError, match=r"n .*>= 0"):
        tracker.step(-1)
    with pytest.raises(ValueError, match=r"steps .*>= 0"):
        privacy_budget.BudgetTracker.from_state_dict({**tracker.state_dict(), "steps": -3})


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_vanishing_noise_is_infinite_epsilon(accountant):
    """Attacker review 15: at sigma 1e-160 dp_accounting's RDP terms overflowed to NaN and epsilon came back
    0.0 (a job reported "(0, 1e-05)-DP" for no noise); at 1e-200 a ZeroDivisionError. Now inf."""
    for sigma in (1e-101, 1e-160, 1e-200, 5e-324):
        assert accounting.epsilon(sigma, 0.01, 10, 1e-5, accountant=accountant) == math.inf
    assert 1e200 < accounting.epsilon(1e-100, 0.01, 10, 1e-5, accountant=accountant) < math.inf
