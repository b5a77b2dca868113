"""Strategies (`jaxdp.noise.strategies`): equal to jax_privacy 2.0.0 on the same inputs (frozen values in
tests/data/mf_reference.json, written by tests/data/make_mf_reference.py; a live cross-check when jax_privacy
imports), and to brute force on small cases."""

import itertools
import json
import math
import pathlib
import sys

import numpy as np
import pytest

from jaxdp.noise import strategies
from jaxdp.noise.mechanisms import BLT, DPSGD, BandMF

REFERENCE = json.loads((pathlib.Path(__file__).parent / "data" / "mf_reference.json").read_text())
FIXED = REFERENCE["bandmf_fixed"]


def assert_minsep_sensitivities_equal(mechanism, n, expected):
    """Our squared min-separation sensitivities equal jax_privacy's {"min_sep,k": value} (k "None": any number
    of participations), within 1e-9 relative."""
    for key, value in expected.items():
        min_sep, k = key.split(",")
        got = strategies.sensitivity(mechanism, n, int(min_sep), None if k == "None" else int(k)) ** 2
        assert got == pytest.approx(value, rel=1e-9), key


@pytest.mark.parametrize("n", sorted(FIXED["n"]))
def test_banded_toeplitz_functions_equal_jax_privacy(n):
    ref, mechanism, n = FIXED["n"][n], BandMF(tuple(FIXED["coef"])), int(n)
    np.testing.assert_allclose(strategies.inverse_coefs(mechanism, n), ref["inverse_coef"], rtol=0, atol=1e-12)
    pq = strategies.per_query_error(mechanism, n)
    np.testing.assert_allclose(pq, ref["per_query_error"], rtol=1e-12)
    assert np.mean(pq) == pytest.approx(ref["loss_mean"], rel=1e-12)  # ||coef|| = 1: loss = error
    assert pq[-1] == pytest.approx(ref["loss_max"], rel=1e-12)
    assert_minsep_sensitivities_equal(mechanism, n, ref["minsep_sensitivity_squared"])


@pytest.mark.parametrize("case", REFERENCE["blt_fixed"], ids=lambda c: f"blt{len(c['buf_decay'])}")
def test_blt_functions_equal_jax_privacy(case):
    mechanism, n = BLT(tuple(case["buf_decay"]), tuple(case["output_scale"])), case["n"]
    np.testing.assert_allclose(strategies.toeplitz_coefs(mechanism, n), case["toeplitz_coefs"], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(strategies.inverse_coefs(mechanism, n), case["inverse_toeplitz_coefs"],
                               rtol=1e-9, atol=1e-14)
    pq = strategies.per_query_error(mechanism, n)
    np.testing.assert_allclose(pq, case["per_query_error"], rtol=1e-9)
    single = strategies.sensitivity(mechanism, n, 1, 1) ** 2
    assert single == pytest.approx(case["sensitivity_squared"], rel=1e-9)
    assert pq[-1] == pytest.approx(case["max_error"], rel=1e-9)
    assert pq[-1] * single == pytest.approx(case["max_loss"], rel=1e-9)
    assert_minsep_sensitivities_equal(mechanism, n, case["minsep_sensitivity_squared"])


@pytest.mark.parametrize("case", REFERENCE["bandmf_optimised"], ids=lambda c: f"n{c['n']}_b{c['bands']}")
def test_bandmf_reaches_jax_privacys_loss(case):
    """Compared by loss (the optimum is flat): within 1e-9 relative. (1000, 2) is where an unconstrained
    first L-BFGS step overflows C^{-1}."""
    n, b = case["n"], case["bands"]
    mechanism = strategies.bandmf(n, b)
    c = np.array(mechanism.coefs)
    assert len(c) == b and np.linalg.norm(c) == pytest.approx(1.0, abs=1e-12)
    assert np.all(c > 0) and np.all(np.diff(c) <= 0)
    assert np.mean(strategies.per_query_error(mechanism, n)) == pytest.approx(case["loss_mean"], rel=1e-9)
    np.testing.assert_allclose(c, case["coef"], atol=1e-6)


@pytest.mark.parametrize("case", REFERENCE["blt_optimised"], ids=lambda c: f"minsep{c['min_sep']}_{c['error']}")
def test_blt_loss_of_jax_privacys_optimum(case):
    """Our sensitivity and error of the BLT jax_privacy optimised give its loss."""
    mechanism, n = BLT(tuple(case["buf_decay"]), tuple(case["output_scale"])), case["n"]
    sens2 = strategies.sensitivity(mechanism, n, case["min_sep"], case["participations"]) ** 2
    assert sens2 == pytest.approx(case["sensitivity_squared"], rel=1e-9)
    pq = strategies.per_query_error(mechanism, n)
    error = pq.max() if case["error"] == "max" else pq.mean()
    assert error * sens2 == pytest.approx(case["loss"], rel=1e-9)


def test_loss_gradient_equals_finite_differences():
    c = np.array([0.7, 0.45, 0.4, 0.2])
    _, grad = strategies._bandmf_loss_and_grad(c, 50)
    eps = 1e-6
    numeric = [(strategies._bandmf_loss_and_grad(c + eps * e, 50)[0]
                - strategies._bandmf_loss_and_grad(c - eps * e, 50)[0]) / (2 * eps) for e in np.eye(4)]
    np.testing.assert_allclose(grad, numeric, rtol=1e-6)


@pytest.mark.parametrize("mechanism", [DPSGD(), BandMF((0.7, 0.5, 0.4, 0.3)), BLT((0.9, 0.5), (0.3, 0.2))],
                         ids=["dpsgd", "bandmf", "blt"])
def test_error_equals_the_dense_workload_times_inverse(mechanism):
    n = 30
    a_cinv = np.tril(np.ones((n, n))) @ np.linalg.inv(strategies.strategy_matrix(mechanism, n))
    np.testing.assert_allclose(strategies.per_query_error(mechanism, n), (a_cinv ** 2).sum(axis=1), rtol=1e-10)
    assert strategies.prefix_sum_rms_error(mechanism, n) == pytest.approx(
        math.sqrt(np.mean((a_cinv ** 2).sum(axis=1))), rel=1e-10)


def test_dpsgd_error_and_sensitivity():
    for n in (1, 7, 100):
        assert strategies.prefix_sum_rms_error(DPSGD(), n) == pytest.approx(math.sqrt((n + 1) / 2), rel=1e-12)
        assert strategies.prefix_sum_rms_error(BandMF((1.0,)), n) == pytest.approx(math.sqrt((n + 1) / 2))
    assert strategies.sensitivity(DPSGD(), 100, 4) == pytest.approx(5.0)
    assert strategies.sensitivity(DPSGD(), 100, 4, 3) == pytest.approx(math.sqrt(3))


def brute_force_sensitivity(mechanism, n, min_sep, participations):
    """max over every participation pattern of ||sum of C's columns||."""
    c_matrix = strategies.strategy_matrix(mechanism, n)
    best = 0.0
    for k in range(1, participations + 1):
        for steps in itertools.combinations(range(n), k):
            if all(b - a >= min_sep for a, b in zip(steps, steps[1:])):
                best = max(best, np.linalg.norm(c_matrix[:, list(steps)].sum(axis=1)))
    return best


@pytest.mark.parametrize("mechanism", [BandMF((0.7, 0.5, 0.4, 0.3)), BLT((0.9, 0.5), (0.3, 0.2)),
                                       BandMF((0.5, -0.6, 0.62))], ids=["bandmf", "blt", "signed_bandmf"])
@pytest.mark.parametrize("min_sep, participations", [(1, 2), (2, 3), (3, 4), (4, 3)])
def test_sensitivity_equals_brute_force(mechanism, min_sep, participations):
    n = 11
    if isinstance(mechanism, BandMF) and mechanism.coefs[1] < 0 and min_sep < mechanism.bands:
        with pytest.raises(ValueError, match="non-increasing"):
            strategies.sensitivity(mechanism, n, min_sep, participations)
        return
    expected = brute_force_sensitivity(mechanism, n, min_sep, participations)
    assert strategies.sensitivity(mechanism, n, min_sep, participations) == pytest.approx(expected, rel=1e-12)


def test_one_participation_is_the_first_columns_norm_for_any_signs():
    mechanism = BandMF((0.5, -0.6, 0.62))
    assert strategies.sensitivity(mechanism, 11, 1, 1) == pytest.approx(brute_force_sensitivity(mechanism, 11, 1, 1))
    assert strategies.sensitivity(mechanism, 11, 1, 1) == pytest.approx(np.linalg.norm(mechanism.coefs))


def test_a_sensitivity_off_by_one_participation_is_caught():
    mechanism = BandMF((0.7, 0.5, 0.4, 0.3))
    expected = brute_force_sensitivity(mechanism, 11, 2, 3)
    assert strategies.sensitivity(mechanism, 11, 2, 2) != pytest.approx(expected, rel=1e-3)


def test_bandmf_arguments_and_cache():
    assert strategies.bandmf(10, 1) == BandMF((1.0,))
    with pytest.raises(ValueError, match="bands"):
        strategies.bandmf(4, 5)
    with pytest.raises(ValueError, match="steps"):
        strategies.bandmf(0, 1)
    assert strategies.bandmf(64, 4) is not strategies.bandmf(64, 4)  # a new dataclass ...
    assert strategies._optimise_bandmf.cache_info().hits >= 1  # ... of cached coefficients


def test_blt_without_jax_privacy_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax_privacy", None)  # `import jax_privacy...` raises ImportError
    monkeypatch.setitem(sys.modules, "jax_privacy.matrix_factorization", None)
    strategies._optimise_blt.cache_clear()
    with pytest.raises(ImportError, match=r"jaxdp\[mf\]"):
        strategies.blt(17, 2)


def test_blt_arguments_are_checked_first():
    with pytest.raises(ValueError, match="buffers"):
        strategies.blt(10, 0)
    with pytest.raises(ValueError, match="min_sep"):
        strategies.blt(10, 2, min_sep=0)
    with pytest.raises(ValueError, match="error"):
        strategies.blt(10, 2, error="rms")


def test_live_cross_check_with_jax_privacy():
    """When jax_privacy is installed (the `jaxdp[mf]` extra): our BandMF optimum, sensitivity and error
    against its functions on fresh inputs, and `blt` against a direct call."""
    pytest.importorskip("jax_privacy")
    import jax
    import jax.numpy as jnp
    from jax_privacy.matrix_factorization import buffered_toeplitz, toeplitz
    assert not jax.config.jax_enable_x64
    with jax.enable_x64(True):
        n, b = 300, 6
        theirs = toeplitz.optimize_banded_toeplitz(n=n, bands=b)
        ours = strategies.bandmf(n, b)
        assert float(toeplitz.loss(jnp.asarray(ours.coefs), n)) == pytest.approx(
            float(toeplitz.loss(theirs, n)), rel=1e-9)
        for min_sep, k in ((1, None), (2, 5), (6, None)):
            assert strategies.sensitivity(ours, n, min_sep, k) ** 2 == pytest.approx(float(
                toeplitz.minsep_sensitivity_squared(jnp.asarray(ours.coefs), min_sep=min_sep, max_participations=k,
                                                    n=n)), rel=1e-9)
        np.testing.assert_allclose(strategies.per_query_error(ours, n), toeplitz.per_query_error(
            strategy_coef=jnp.asarray(ours.coefs), n=n), rtol=1e-9)
        blt = strategies.blt(100, 2, error="max")
        direct = buffered_toeplitz.optimize(n=100, min_buffers=2, max_buffers=2)
        mechanism = BLT(tuple(np.asarray(direct.buf_decay)), tuple(np.asarray(direct.output_scale)))
        assert blt == mechanism
        assert strategies.per_query_error(blt, 100)[-1] * strategies.sensitivity(blt, 100, 1, 1) ** 2 == \
            pytest.approx(float(buffered_toeplitz.max_loss(direct, 100)), rel=1e-9)
    assert not jax.config.jax_enable_x64
