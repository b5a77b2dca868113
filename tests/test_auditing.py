"""The one-run audit's bound (`jaxdp.auditing.bound`): equal to jax_privacy's, valid, and able to fail."""

import numpy as np
import pytest

from jaxdp.auditing import bound as auditing

# jax-privacy 2.0.0, `jax_privacy.auditing._epsilon_one_run(0, m, r, v, 0.05, delta)` and
# `_one_run_p_value(m, r, v, eps, delta)`, run on this machine (2026-11-23) in a separate venv:
# (m canaries, r guesses, v correct, delta) -> epsilon lower bound at 95%.
JAX_PRIVACY_EPSILON = [
    ((1000, 100, 100, 1e-5), 3.465376229385333),
    ((1000, 100, 95, 1e-5), 2.165175787875041),
    ((1000, 100, 60, 1e-5), 0.04954866357098898),
    ((10000, 500, 450, 1e-6), 1.946011939029222),
    ((2000, 1000, 1000, 1e-5), 5.7554144397418305),
    ((100, 10, 10, 1e-5), 1.0482370467107913),
    ((5000, 1000, 900, 1e-4), 1.986206237819815),
]
JAX_PRIVACY_P_VALUE = [
    ((1000, 100, 90, 1.0, 1e-5), 0.0008412885614385309),
    ((1000, 100, 90, 2.0, 1e-5), 0.3449868367938024),
    ((1000, 100, 90, 2.0, 0.0), 0.3425540546249235),
    ((200, 50, 40, 0.5, 1e-3), 0.033925524572245805),
]
# `CanaryScoreAuditor(in, out).epsilon_one_run(0.05, 1e-5, threshold_strategy=Explicit(t))` with t the
# k-th highest score, on the scores below: the same one-sided top-k guess.
JAX_PRIVACY_TOP_K = [(20, 1.8102072020271343), (40, 2.5424568044826734), (100, 2.7183190095881398)]


@pytest.mark.parametrize("args, expected", JAX_PRIVACY_EPSILON)
def test_epsilon_equals_jax_privacy(args, expected):
    m, r, v, delta = args
    assert auditing.one_run_epsilon(m, r, v, delta=delta) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("args, expected", JAX_PRIVACY_P_VALUE)
def test_p_value_equals_jax_privacy(args, expected):
    assert auditing.one_run_p_value(*args) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("k, expected", JAX_PRIVACY_TOP_K)
def test_scores_top_k_equals_jax_privacy(k, expected):
    rng = np.random.default_rng(0)
    included = rng.random(400) < 0.5
    scores = rng.normal(size=400) + 2.0 * included
    result = auditing.epsilon_lower_bound(scores, included, delta=1e-5, k_plus=k)
    assert result.epsilon == pytest.approx(expected, abs=1e-5)
    assert result.num_guesses == k and result.num_hypotheses == 1


def test_p_value_grows_with_epsilon_and_delta():
    eps = np.linspace(0, 5, 26)
    p = [auditing.one_run_p_value(1000, 200, 180, e, 1e-5) for e in eps]
    assert np.all(np.diff(p) >= 0) and p[0] < 1e-3 and p[-1] > 0.5
    assert auditing.one_run_p_value(1000, 200, 180, 2.0, 1e-3) > auditing.one_run_p_value(1000, 200, 180, 2.0, 0)


def _randomized_response(eps, m, rng):
    """An exactly eps-DP release per canary: each canary's bit, flipped with probability 1/(1 + e^eps)."""
    included = auditing.draw_inclusion(m, rng)
    keep = rng.random(m) < np.exp(eps) / (1 + np.exp(eps))
    return np.where(keep, included, ~included).astype(np.float64), included


def test_bound_is_valid_and_has_power_on_an_eps_dp_mechanism():
    # Validity: an eps-DP mechanism gives a bound above eps in at most 5% of runs (Theorem 3.1).
    # Power: the same audit is not vacuous (it gets within a factor 2 of eps on average).
    eps, m, trials = 1.0, 1000, 200
    rng = np.random.default_rng(1)
    bounds = []
    for _ in range(trials):
        scores, included = _randomized_response(eps, m, rng)
        bounds.append(auditing.epsilon_lower_bound(scores, included, delta=1e-5, k_plus=250, k_minus=250).epsilon)
    bounds = np.array(bounds)
    assert np.mean(bounds > eps) <= 0.10, np.mean(bounds > eps)  # 5% expected; 10% has P < 0.2% by chance
    assert np.mean(bounds) > eps / 2, np.mean(bounds)


def test_union_bound_over_guesses():
    rng = np.random.default_rng(2)
    included = auditing.draw_inclusion(1000, rng)
    scores = rng.normal(size=1000) + 3.0 * included
    one = auditing.epsilon_lower_bound(scores, included, delta=1e-5, k_plus=100)
    both = auditing.epsilon_lower_bound(scores, included, delta=1e-5, ks=[(100, 0), (10, 0)])
    alone = auditing.one_run_epsilon(1000, 100, one.num_correct, delta=1e-5, confidence=0.975)
    assert both.num_hypotheses == 2 and both.epsilon >= alone - 1e-9 and alone < one.epsilon


def test_guesses_and_scores():
    g = auditing.guesses(np.array([0.1, 5.0, -3.0, 2.0, 0.0]), k_plus=2, k_minus=1)
    np.testing.assert_array_equal(g, [0, 1, -1, 1, 0])
    np.testing.assert_allclose(auditing.loss_drop_scores([3.0, 2.0], [1.0, 2.5]), [2.0, -0.5])
    update = {"w": np.array([[1.0, -2.0], [0.5, 0.0]]), "b": np.array([3.0])}
    canaries = {"w": np.stack([np.eye(2), np.zeros((2, 2))]), "b": np.array([[0.0], [2.0]])}
    np.testing.assert_allclose(auditing.gradient_scores(canaries, update), [-1.0, -6.0])


@pytest.mark.parametrize("call, name", [
    (lambda: auditing.one_run_epsilon(10, 5, 5, delta=1.5), "delta"),
    (lambda: auditing.one_run_epsilon(10, 5, 5, delta=1e-5, confidence=1.0), "confidence"),
    (lambda: auditing.one_run_p_value(10, 11, 5, 1.0, 0.0), "num_guesses"),
    (lambda: auditing.guesses(np.zeros(4), k_plus=3, k_minus=2), "k_plus"),
    (lambda: auditing.epsilon_lower_bound(np.zeros(4), np.zeros(4), delta=1e-5), "included"),
    (lambda: auditing.epsilon_lower_bound(np.zeros(4), np.zeros(4, bool), delta=1e-5, ks=[(1, 0)], k_plus=1),
     "ks"),
    (lambda: auditing.draw_inclusion(0, np.random.default_rng(0)), "num_canaries"),
])
def test_errors_name_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()
