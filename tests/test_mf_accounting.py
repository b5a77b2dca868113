"""Accounting of the noise mechanisms (`jaxdp.accounting.mechanisms`): the DpEvent of each, its epsilon equal
to dp_accounting's PLD on the event built by hand and to jax_privacy 2.0.0's (tests/data/mf_reference.json),
calibration, the noise std convention and the receipt's record."""

import json
import math
import pathlib
import subprocess
import sys

import dp_accounting
import pytest

from jaxdp.accounting import mechanisms as mf

ROOT = pathlib.Path(__file__).resolve().parents[1]
REFERENCE = json.loads((ROOT / "tests" / "data" / "mf_reference.json").read_text())
DELTA = 1e-6


def pld_epsilon(event, delta=DELTA):
    accountant = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, 1e-4)
    return accountant.compose(event).get_epsilon(delta)


def run_for(case):
    if case["event"] == "gaussian":
        return mf.MechanismAccounting("blt", 100, 0.01, 4, strategy_sensitivity=5.0)
    kind = "dpsgd" if case["bands"] == 1 else "bandmf"
    return mf.MechanismAccounting(kind, case["steps"], case["q"], case["bands"])


@pytest.mark.parametrize("case", REFERENCE["epsilon"], ids=lambda c: "_".join(
    str(c.get(k, "")) for k in ("event", "steps", "bands", "q", "sigma")))
def test_epsilon_equals_jax_privacy_and_the_event_by_hand(case):
    run = run_for(case)
    got = mf.epsilon_for(run, case["sigma"], case["delta"])
    assert got == pytest.approx(case["epsilon"], rel=1e-9)
    assert got == pytest.approx(pld_epsilon(run.dp_event(case["sigma"]), case["delta"]), rel=1e-9)


def test_the_events_are_the_ones_named():
    sigma = 1.3
    poisson = dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(sigma))
    assert mf.MechanismAccounting("dpsgd", 10, 0.01).dp_event(sigma) == dp_accounting.SelfComposedDpEvent(poisson, 10)
    # ceil(10 / 4) = 3 rounds: a planted floor (2) would under-count a unit's third participation.
    assert mf.MechanismAccounting("bandmf", 10, 0.01, 4).dp_event(sigma) == dp_accounting.SelfComposedDpEvent(
        poisson, 3)
    assert mf.MechanismAccounting("blt", 10, 0.5, 4, 2.0).dp_event(sigma) == dp_accounting.GaussianDpEvent(sigma)
    assert mf.MechanismAccounting("blt", 0, 0.5, 4, 2.0).rounds == 0
    # BandMF with one band is DP-SGD.
    assert mf.MechanismAccounting("bandmf", 10, 0.01, 1).dp_event(sigma) == mf.MechanismAccounting(
        "dpsgd", 10, 0.01).dp_event(sigma)


@pytest.mark.parametrize("steps, dpsgd, bandmf4", [(100, 0.9542, 0.7090), (1000, 2.1245, 1.2321)])
def test_the_research_report_numbers(steps, dpsgd, bandmf4):
    """q = 0.01 (q_b = 0.01 for BandMF b = 4), sigma = 1, delta = 1e-6."""
    assert mf.epsilon_for(mf.MechanismAccounting("dpsgd", steps, 0.01), 1.0, DELTA) == pytest.approx(dpsgd, abs=1e-3)
    assert mf.epsilon_for(mf.MechanismAccounting("bandmf", steps, 0.01, 4), 1.0, DELTA) == pytest.approx(
        bandmf4, abs=1e-3)
    blt = mf.MechanismAccounting("blt", steps, 0.01, 100, strategy_sensitivity=3.7)
    assert mf.epsilon_for(blt, 1.0, DELTA) == pytest.approx(4.8866, abs=1e-3)


@pytest.mark.parametrize("run", [mf.MechanismAccounting("dpsgd", 200, 0.02),
                                 mf.MechanismAccounting("bandmf", 200, 0.08, 4),
                                 mf.MechanismAccounting("blt", 200, 1.0, 50, 2.0)], ids=lambda r: r.kind)
def test_calibration_meets_the_target_from_below(run):
    sigma = mf.calibrate_for(run, 1.5, DELTA, value_discretization_interval=1e-3)
    epsilon = mf.epsilon_for(run, sigma, DELTA, value_discretization_interval=1e-3)
    assert (1 - 1e-3) * 1.5 <= epsilon <= 1.5
    assert mf.calibrate_for(mf.MechanismAccounting(run.kind, 0, run.sampling_probability, run.cycle_length,
                                                   run.strategy_sensitivity), 1.5, DELTA) == 0.0


def test_noise_std_is_sigma_times_both_sensitivities():
    assert mf.noise_std("dpsgd", 2.0, 1.5, 1.0) == 3.0
    assert mf.noise_std("bandmf", 2.0, 1.5, 1.0) == 3.0
    assert mf.noise_std("blt", 2.0, 1.5, 4.0) == 12.0
    run = mf.MechanismAccounting("blt", 100, 0.1, 10, strategy_sensitivity=4.0)
    assert run.noise_std(2.0, 1.5) == 12.0
    with pytest.raises(ValueError, match="strategy_sensitivity"):
        mf.noise_std("dpsgd", 1.0, 1.0, 2.0)
    with pytest.raises(ValueError, match="kind"):
        mf.noise_std("dp-ftrl", 1.0, 1.0, 1.0)


def test_an_unamplified_run_without_its_sensitivity_is_caught():
    """A planted error: a BLT std of sigma x clip (the sensitivity left out) is not what the record prescribes,
    and the epsilon it would really have is far above the claim."""
    run = mf.MechanismAccounting("blt", 100, 0.1, 10, strategy_sensitivity=4.0)
    assert run.noise_std(1.0, 1.0) != mf.noise_std("blt", 1.0, 1.0, 1.0)
    real = mf.epsilon_for(run, 1.0 / 4.0, DELTA)  # the noise multiplier of std sigma x clip: sigma / sens
    assert real > 3 * mf.epsilon_for(run, 1.0, DELTA)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="ftrl", steps=1, sampling_probability=0.1), "kind"),
    (dict(kind="dpsgd", steps=-1, sampling_probability=0.1), "steps"),
    (dict(kind="dpsgd", steps=1, sampling_probability=1.5), "sampling_probability"),
    (dict(kind="dpsgd", steps=1, sampling_probability=0.1, cycle_length=2), "dpsgd"),
    (dict(kind="bandmf", steps=1, sampling_probability=0.1, cycle_length=0), "cycle_length"),
    (dict(kind="blt", steps=1, sampling_probability=0.1, strategy_sensitivity=0.0), "strategy_sensitivity"),
    (dict(kind="blt", steps=1, sampling_probability=0.1, participations=0), "participations"),
])
def test_bad_records_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mf.MechanismAccounting(**kwargs)


def test_describe_is_the_receipts_record():
    run = mf.MechanismAccounting("bandmf", 100, 0.04, 4)
    record = mf.describe(run, 1.4397, DELTA, parameters={"coefs": [0.68, 0.48, 0.41, 0.36]})
    json.dumps(record)
    assert record["mechanism"] == "bandmf" and record["parameters"]["coefs"][0] == 0.68
    assert record["sampling"]["kind"] == "cyclic_poisson" and record["sampling"]["cycle_length"] == 4
    assert "count=25" in record["dp_event"] and "sampling_probability=0.04" in record["dp_event"]
    assert record["noise_std_per_clip_sensitivity"] == 1.4397
    assert record["epsilon"] == pytest.approx(mf.epsilon_for(run, 1.4397, DELTA))
    blt = mf.describe(mf.MechanismAccounting("blt", 100, 1.0, 100, 3.0), 2.0, DELTA)
    assert blt["dp_event"] == "GaussianDpEvent(noise_multiplier=2.0)" and blt["noise_std_per_clip_sensitivity"] == 6.0
    assert "not amplified" in blt["sampling"]["kind"] and math.isfinite(blt["epsilon"])


def test_host_side_modules_import_no_jax():
    code = ("import sys, jaxdp.accounting.mechanisms, jaxdp.sampling.cyclic; "
            "print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
