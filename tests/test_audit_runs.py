"""The one-run audit can fail: white box with gradient canaries on the real DP step (issue 15 item 2).

A run claiming epsilon = 2 (sigma calibrated by PLD, 4 full-batch steps, delta = 1e-5) with
m = 2000 gradient canaries: without noise, or with clipping skipped, the audit's 95% lower
bound exceeds the claim; with the correct step it does not.
"""

import dataclasses
import json

import numpy as np
import pytest

import dp_testing
from flax import nnx
from jaxdp import accounting, calibration
from jaxdp import audit_runs
from jaxdp import nn
from jaxdp.training import receipt

CLAIM = 2.0


@pytest.fixture(scope="module")
def sigma():
    """The noise multiplier that white_box_audit's defaults (q = 1, 4 steps) calibrate to CLAIM."""
    return calibration.calibrate_noise_multiplier(CLAIM, 1.0, 4, 1e-5, accountant="pld")


@pytest.fixture(scope="module")
def correct():
    return audit_runs.white_box_audit(target_epsilon=CLAIM, seed=0)


def _audit(sigma, **kwargs):
    return audit_runs.white_box_audit(noise_multiplier=sigma, seed=0, **kwargs)


def test_correct_run_bound_at_most_claim(sigma, correct):
    assert correct.noise_multiplier == pytest.approx(sigma)
    assert correct.claimed_epsilon == pytest.approx(CLAIM, rel=1e-3)
    assert 0 <= correct.audit.epsilon <= correct.claimed_epsilon
    assert correct.audit.num_canaries == 2000 and abs(correct.audit.num_included - 1000) < 100


def test_no_noise_bound_far_above_claim(correct):
    result = _audit(0.0)
    assert result.claimed_epsilon == np.inf
    assert result.audit.epsilon > 2 * correct.claimed_epsilon, result.audit


def test_skipped_clipping_bound_above_claim(sigma):
    result = _audit(sigma, bug="no_clipping")
    assert result.claimed_epsilon == pytest.approx(CLAIM, rel=1e-3)  # the claim does not know the bug
    assert result.audit.epsilon > CLAIM, result.audit


def test_halved_noise_raises_the_bound(sigma, correct):
    # Same seed, same draws, noise std halved: the scores separate better. At this size the bound
    # stays below 2; with 80,000 canaries and delta = 1e-8 it exceeds 2 (experiments.audit, WORKSPACE.md).
    result = _audit(sigma, bug="half_noise")
    assert result.audit.epsilon > correct.audit.epsilon, (result.audit, correct.audit)


class _Bigram(nnx.Module):
    """The smallest language model from jaxdp layers (a tiny GPT-2 compiles 5x slower)."""

    def __init__(self, seed):
        self.embed = nn.Embed(97, 8, rngs=nnx.Rngs(seed))
        self.head = nn.Linear(8, 97, rngs=nnx.Rngs(seed + 1))

    def __call__(self, tokens_BT):
        return self.head(self.embed(tokens_BT))


def test_black_box_audit_scores_loss_drops():
    windows = np.random.default_rng(0).integers(0, 97, size=(48, 17))
    model = _Bigram(0)
    result = audit_runs.black_box_audit(model, windows, 97, num_canaries=16, steps=2, batch_size=16,
                                        noise_multiplier=1.0, seed=0)
    q = 16 / (48 + 8)
    assert result.sampling_probability == pytest.approx(q)
    assert result.claimed_epsilon == pytest.approx(
        accounting.epsilon(result.noise_multiplier, q, 2, 1e-5, accountant="pld"))
    before = dp_testing.lm_loss(_Bigram(0),
                                {"tokens": result.canaries, "mask": np.ones(16, bool)})
    np.testing.assert_allclose(result.loss_before, before, rtol=1e-5)
    np.testing.assert_allclose(result.scores, result.loss_before - result.loss_after)
    assert np.all(result.loss_after != result.loss_before) and result.audit.epsilon >= 0


@pytest.mark.parametrize("kwargs, name", [
    (dict(bug="noise"), "bug"), (dict(num_canaries=0), "num_canaries"),
    (dict(sampling_probability=1.5), "sampling_probability"), (dict(canary_norm=0.0), "canary_norm"),
])
def test_errors_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        audit_runs.white_box_audit(**kwargs)


def test_audit_is_recorded_in_the_receipt(correct, sigma, tmp_path):
    """The lower bound goes into a DP run's privacy.json; a planted-bug or noiseless audit, or a non-DP
    receipt, is refused."""
    receipt.write_privacy_receipt(tmp_path, {"dp": True, "epsilon": 1.5, "audit_lower_bound": None})
    receipt.record_audit(tmp_path, correct, "white_box")
    written = json.loads((tmp_path / receipt.PRIVACY_FILE).read_text())
    assert written["audit_lower_bound"] == correct.audit.epsilon and written["epsilon"] == 1.5
    assert written["audit"]["claimed_epsilon"] == pytest.approx(CLAIM, rel=1e-3)
    assert written["audit"]["kind"] == "white_box" and written["audit"]["num_canaries"] == 2000
    with pytest.raises(ValueError, match="planted bug"):
        receipt.record_audit(tmp_path, dataclasses.replace(correct, bug="half_noise"), "white_box")
    # Attacker review 11: a noiseless audit (claimed epsilon inf) on private data went into the receipt.
    with pytest.raises(ValueError, match="noise_multiplier 0 .*without a finite claim"):
        receipt.record_audit(tmp_path, dataclasses.replace(correct, noise_multiplier=0.0,
                                                            claimed_epsilon=float("inf")), "white_box")
    receipt.write_privacy_receipt(tmp_path, {"dp": False})
    with pytest.raises(ValueError, match="non-DP"):
        receipt.record_audit(tmp_path, correct, "white_box")
    with pytest.raises(ValueError, match="no privacy.json"):
        receipt.record_audit(tmp_path / "elsewhere", correct, "white_box")
