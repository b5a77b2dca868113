"""The one-run white-box audit of each noise mechanism (`Claim.noise_mechanism`: DP-SGD, BandMF, BLT with fixed
parameters): it runs the mechanism's noise through the real DP step, samples the records cyclically as the
mechanism's accounting assumes, claims the epsilon `jaxdp.accounting.mechanisms` gives it, stays below that
claim, and sees sigma halved (a higher bound from the same draws) and no noise (a bound above the claim).

A small, fast version (1,000 canaries): at this size no audit shows sigma halved ABOVE the claim; the full-size
run that does (80,000 canaries, delta = 1e-8) is in notebook/2026-11-28-correlated-noise-privacy-tests.md.
"""

import dataclasses
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from jaxdp.accounting import mechanisms as mf
from jaxdp.auditing import runs as audit_runs
from jaxdp.auditing.settings import BlackBoxSettings, Claim, WhiteBoxSettings
from jaxdp.noise import strategies
from jaxdp.noise.mechanisms import BLT, BandMF
from jaxdp.noise.privatizer import GaussianPrivatizer

CLAIM, DELTA, STEPS = 2.0, 1e-5, 4
SETTINGS = WhiteBoxSettings(num_canaries=1000, steps=STEPS)
CLAIMS = {
    "dpsgd": Claim(target_epsilon=CLAIM, delta=DELTA),
    "bandmf": Claim(target_epsilon=CLAIM, delta=DELTA, noise_mechanism=BandMF((0.8082, 0.5889))),
    "blt": Claim(target_epsilon=CLAIM, delta=DELTA, noise_mechanism=BLT((0.9, 0.5), (0.3, 0.2)), cycle_length=2),
}


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_each_mechanism_audits_below_its_claim_and_sees_sigma_halved(name):
    claim = CLAIMS[name]
    correct = audit_runs.white_box_audit(settings=SETTINGS, claim=claim, seed=0)
    record = claim.accounting(1.0, STEPS)
    assert record.kind == name and correct.claimed_epsilon == pytest.approx(CLAIM, rel=1e-3)
    assert correct.claimed_epsilon == pytest.approx(mf.epsilon_for(record, correct.noise_multiplier, DELTA))
    assert 0 <= correct.audit.epsilon <= correct.claimed_epsilon, correct.audit
    halved = audit_runs.white_box_audit(settings=dataclasses.replace(SETTINGS, bug="half_noise"), claim=claim, seed=0)
    assert halved.claimed_epsilon == correct.claimed_epsilon  # the claim does not know the bug
    assert halved.audit.epsilon > correct.audit.epsilon, (halved.audit, correct.audit)
    silent = audit_runs.white_box_audit(settings=SETTINGS, claim=dataclasses.replace(claim, noise_multiplier=0.0),
                                        seed=0)
    assert silent.claimed_epsilon == math.inf and silent.audit.epsilon > 2 * CLAIM, silent.audit


def test_the_claims_are_the_mechanisms_accounting():
    """BandMF: amplified over ceil(4 / 2) = 2 rounds at the group's rate, sensitivity ||c||; BLT: one Gaussian of
    its min-separation sensitivity over the 4 steps at 2 apart; the receipt's name of each."""
    bandmf = CLAIMS["bandmf"].accounting(0.5, STEPS)
    assert (bandmf.rounds, bandmf.sampling_probability, bandmf.cycle_length) == (2, 0.5, 2)
    assert bandmf.strategy_sensitivity == pytest.approx(math.hypot(0.8082, 0.5889))
    blt = CLAIMS["blt"].accounting(1.0, STEPS)
    c = np.array([1.0, 0.3 + 0.2, 0.3 * 0.9 + 0.2 * 0.5, 0.3 * 0.81 + 0.2 * 0.25])  # c_k = sum_i w_i theta_i^(k-1)
    worst = np.linalg.norm(c + np.pad(c, (2, 0))[:4])  # columns 0 and 2: the first two steps 2 apart
    assert blt.rounds == 1 and blt.strategy_sensitivity == pytest.approx(worst, rel=1e-12)
    assert CLAIMS["blt"].mechanism()["noise_mechanism"] == "blt" and "noise_mechanism" not in CLAIMS["dpsgd"].mechanism()
    with pytest.raises(ValueError, match="cycle_length must be 2"):
        Claim(noise_mechanism=BandMF((0.8, 0.6)), cycle_length=3)
    with pytest.raises(ValueError, match="noise_mechanism"):
        Claim(noise_mechanism="bandmf")


def test_the_audit_adds_the_mechanisms_noise(monkeypatch):
    """BandMF reaches fused_clip as its mechanism; BLT's privatizer gets the record's std (sigma C' sensitivity),
    halved under bug="half_noise"."""
    seen = []
    real = GaussianPrivatizer.__post_init__

    def spy(self):
        real(self)
        seen.append((self.std, self.mechanism))

    monkeypatch.setattr(GaussianPrivatizer, "__post_init__", spy)
    settings = WhiteBoxSettings(num_canaries=64, steps=2)
    for name, bug in (("bandmf", "none"), ("blt", "none"), ("blt", "half_noise")):
        claim = dataclasses.replace(CLAIMS[name], noise_multiplier=1.5)
        audit_runs.white_box_audit(settings=dataclasses.replace(settings, bug=bug), claim=claim, seed=0)
        std, mechanism = [s for s in seen if s[0] > 0][-1]  # BLT's clipped sum is a noiseless fused_clip
        assert mechanism == claim.noise_mechanism
        assert std == pytest.approx(claim.noise_std(1.5, 1.0, 2) / (2 if bug == "half_noise" else 1), rel=1e-12)
    with pytest.raises(ValueError, match="DP-SGD's noise only"):
        audit_runs.black_box_audit(None, np.zeros((4, 3), np.int32), 7, claim=CLAIMS["bandmf"],
                                   settings=BlackBoxSettings(num_canaries=2, steps=1, batch_size=2))


def _job(*flags):
    repo = pathlib.Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-m", "experiments.audit", "--config.audit.kind=white_box", *flags],
                          cwd=repo, capture_output=True, text=True, timeout=300)


def test_the_audit_job_audits_bandmf_and_refuses_what_it_cannot():
    out = _job("--config.dp.mechanism=bandmf", "--config.dp.bands=2", "--config.audit.num_canaries=200",
               "--config.seed=0")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("one-run audit (white_box") and "claimed epsilon  2" in out.stdout
    out = _job("--config.dp.mechanism=auto")  # refused before any compute: one line, status 2
    assert out.returncode == 2 and "config.dp.mechanism must be 'dpsgd', or" in out.stderr, out.stderr[-2000:]
    assert len([line for line in out.stderr.splitlines() if line.startswith("error:")]) == 1
    import importlib.util
    path = pathlib.Path(__file__).parents[1] / "experiments" / "configs" / "audit.py"
    spec = importlib.util.spec_from_file_location("audit_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    with config.unlocked():
        config.dp.mechanism, config.dp.bands = "bandmf", 2
    with pytest.raises(ValueError, match="config.dp.mechanism must be 'dpsgd' for the black-box audit"):
        audit_runs.check_audit_config(config)


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_the_matched_filters_see_each_groups_signal_through_white_noise(name):
    """v_g^T C^{-1} z has the variance of one draw for every g (the noise is the same whatever the group), and
    v_g^T 1_g = ||C 1_g||, the norm of a group-g unit's contribution through C: for the group of step 0 the
    claim's sensitivity (BandMF: sqrt(2 rounds) ||c||; BLT: its min-separation sensitivity)."""
    claim = CLAIMS[name]
    filters = audit_runs._matched_filters(claim.noise_mechanism, STEPS, claim.cycle_length)
    c = strategies.strategy_matrix(claim.noise_mechanism, STEPS)
    np.testing.assert_allclose(np.linalg.norm(filters @ np.linalg.inv(c), axis=1), 1.0, rtol=1e-12)
    first = (np.arange(STEPS) % claim.cycle_length == 0).astype(float)
    record = claim.accounting(1.0, STEPS)
    want = record.strategy_sensitivity * (math.sqrt(record.rounds) if name != "blt" else 1.0)
    assert filters[0] @ first == pytest.approx(want, rel=1e-9)
