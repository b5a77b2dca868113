"""The one-run audit can fail: white box with gradient canaries on the real DP step (issue 15 item 2).

A run claiming epsilon = 2 (sigma calibrated by PLD, 4 full-batch steps, delta = 1e-5) with
m = 2000 gradient canaries: without noise, or with clipping skipped, the audit's 95% lower
bound exceeds the claim; with the correct step it does not.
"""

import dataclasses
import json
import pathlib

import dp_testing
import numpy as np
import pytest
from flax import nnx

from jaxdp.accounting import accountant as accounting
from jaxdp.accounting import calibration
from jaxdp.auditing import runs as audit_runs
from jaxdp.auditing.settings import BlackBoxSettings, Claim, WhiteBoxSettings
from jaxdp.core import nn
from jaxdp.noise import seeds
from jaxdp.training import receipt

CLAIM = 2.0


@pytest.fixture(scope="module")
def sigma():
    """The noise multiplier that white_box_audit's defaults (q = 1, 4 steps) calibrate to CLAIM."""
    return calibration.calibrate_noise_multiplier(CLAIM, 1.0, 4, 1e-5, accountant="pld")


@pytest.fixture(scope="module")
def correct():
    return audit_runs.white_box_audit(claim=Claim(target_epsilon=CLAIM), seed=0)


def _audit(sigma, bug="none", **claim):
    return audit_runs.white_box_audit(settings=WhiteBoxSettings(bug=bug), claim=Claim(noise_multiplier=sigma, **claim),
                                      seed=0)


def test_correct_run_bound_at_most_claim(sigma, correct):
    assert correct.noise_multiplier == pytest.approx(sigma)
    assert correct.claimed_epsilon == pytest.approx(CLAIM, rel=1e-3)
    assert 0 <= correct.audit.epsilon <= correct.claimed_epsilon
    assert correct.audit.num_canaries == 2000 and abs(correct.audit.num_included - 1000) < 100


def test_no_noise_bound_far_above_claim(correct):
    result = _audit(0.0)
    assert result.claimed_epsilon == np.inf
    assert result.audit.epsilon > 2 * correct.claimed_epsilon, result.audit


@pytest.mark.parametrize("l2_norm_clip", [1.0, 20.0])
def test_skipped_clipping_bound_above_claim(sigma, l2_norm_clip):
    """At any C: the canaries' norm is 10 C (attacker review 16: a fixed 10 was never clipped at C >= 10)."""
    result = _audit(sigma, bug="no_clipping", l2_norm_clip=l2_norm_clip)
    assert result.claimed_epsilon == pytest.approx(CLAIM, rel=1e-3)  # the claim does not know the bug
    assert result.audit.epsilon > CLAIM, result.audit
    assert result.audit.max_epsilon > CLAIM


def test_audit_job_config_checks_and_report(correct):
    """The audit job refuses, naming the field, what it cannot audit; its report states claim, bound and verdict."""
    import importlib.util
    path = pathlib.Path(__file__).parents[1] / "experiments" / "configs" / "audit.py"
    spec = importlib.util.spec_from_file_location("audit_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    audit_runs.check_audit_config(module.get_config())
    for field, value, needle in (("audit.kind", "grey_box", "config.audit.kind must be one of"),
                                 ("dp.delta", None, "config.dp.delta must be set"),
                                 ("privacy.unit", "user", "config.privacy.unit must be 'window'"),
                                 ("dp.method", "two_pass", "config.dp.method 'bookkeeping'")):
        config = module.get_config()
        parent, leaf = field.split(".")
        with config.unlocked():
            setattr(config[parent], leaf, value)
        with pytest.raises(ValueError, match=needle):
            audit_runs.check_audit_config(config)
    text = audit_runs.report(correct, "white_box", "32 synthetic records", 1.5)
    assert f"claimed epsilon  {correct.claimed_epsilon:.4g}" in text and "time             1.5 s" in text
    assert ("within the claim" in text or "CANNOT DETECT" in text) and "EXCEEDS" not in text
    exceeding = dataclasses.replace(correct, claimed_epsilon=correct.audit.epsilon / 2)
    assert "EXCEEDS the claim" in audit_runs.report(exceeding, "white_box", "", 0.0)


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
    result = audit_runs.black_box_audit(model, windows, 97, settings=BlackBoxSettings(num_canaries=16, steps=2,
                                                                                      batch_size=16),
                                        claim=Claim(noise_multiplier=1.0), seed=0)
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
        WhiteBoxSettings(**kwargs)
    with pytest.raises(ValueError, match="bug"):
        BlackBoxSettings(bug="noise")
    with pytest.raises(ValueError, match="canary_norm"):  # 10 C, at C = 0
        audit_runs.white_box_audit(claim=Claim(l2_norm_clip=0.0))
    with pytest.raises(TypeError, match="settings must be a WhiteBoxSettings"):
        audit_runs.white_box_audit(settings=BlackBoxSettings())


def test_the_old_keywords_run_the_same_audit_with_a_deprecation_warning():
    """The keywords before `WhiteBoxSettings` / `Claim` run the same audit (same scores, bit for bit) for one
    release; a setting they carry does reach the run."""
    settings, claim = WhiteBoxSettings(num_canaries=64, steps=1, sampling_probability=0.5), Claim(noise_multiplier=1.0)
    new = audit_runs.white_box_audit(settings=settings, claim=claim, seed=0)
    with pytest.warns(DeprecationWarning, match=r"settings=WhiteBoxSettings\(num_canaries=.*claim=Claim\("):
        old = audit_runs.white_box_audit(num_canaries=64, steps=1, sampling_probability=0.5, noise_multiplier=1.0,
                                         seed=0)
    np.testing.assert_array_equal(old.scores, new.scores)
    assert (old.claimed_epsilon, old.mechanism) == (new.claimed_epsilon, new.mechanism)
    with pytest.warns(DeprecationWarning):
        halved = audit_runs.white_box_audit(num_canaries=64, steps=1, sampling_probability=0.5, noise_multiplier=0.5,
                                            seed=0)
    assert not np.array_equal(halved.scores, new.scores)
    with pytest.raises(TypeError, match="together"):
        audit_runs.white_box_audit(claim=claim, noise_multiplier=1.0)


def _run_receipt(tmp_path, **mechanism) -> None:
    receipt.write_privacy_receipt(tmp_path, {
        "dp": True, "epsilon": 2.5, "delta": 1e-5, "accountant": "pld", "audits": [],
        "guarantee": "(2.5, 1e-05)-DP for adding or removing one training window",
        "mechanism": {"clipping": "flat", "clip_fn": "abadi", "secure_noise": False, **mechanism}})


def test_audit_is_recorded_in_the_receipt(correct, tmp_path):
    """Every audit is appended to a DP run's privacy.json with its own claim, bound and ceiling; a resumed
    run's rewrite keeps them. Refused (attacker reviews 11 and 16): a planted bug, no noise, a claim above
    the run's epsilon, an audit that could not have caught anything, another mechanism, a pinned-seed audit
    of the run's own data, a non-DP or malformed receipt, a symlink. An audit of the run's data composes."""
    _run_receipt(tmp_path)
    receipt.record_audit(tmp_path, correct, "white_box")
    written = receipt.record_audit(tmp_path, correct, "white_box")  # a second audit does not replace the first
    assert written["epsilon"] == 2.5 and len(written["audits"]) == 2 and "guarantee_with_audits" not in written
    entry = written["audits"][0]
    assert entry["lower_bound"] == correct.audit.epsilon and entry["claimed_epsilon"] == pytest.approx(CLAIM, rel=1e-3)
    assert entry["max_attainable"] > CLAIM and entry["exceeds_claim"] is False and entry["trained_on_run_data"] is False
    assert entry["kind"] == "white_box" and entry["num_canaries"] == 2000 and entry["clip_fn"] == "abadi"
    refused = [
        (dataclasses.replace(correct, bug="half_noise"), "planted bug"),
        (dataclasses.replace(correct, noise_multiplier=0.0, claimed_epsilon=float("inf")), "without a finite claim"),
        (dataclasses.replace(correct, claimed_epsilon=3.0), "above this run's 2.5"),
        (dataclasses.replace(correct, audit=dataclasses.replace(correct.audit, max_epsilon=1.9)), "could not have"),
        (dataclasses.replace(correct, mechanism={**correct.mechanism, "clip_fn": "automatic"}), "clip_fn 'automatic'"),
        (dataclasses.replace(correct, mechanism={**correct.mechanism, "accountant": "rdp"}), "accountant 'rdp'"),
    ]
    for result, match in refused:
        with pytest.raises(ValueError, match=match):
            receipt.record_audit(tmp_path, result, "white_box")
    # A black-box audit of the run's own data: refused with a pinned seed; else it composes with the run.
    data = tmp_path / "private.jsonl"
    data.write_text('{"text": "a private record"}\n')
    (tmp_path / "config.json").write_text(json.dumps({"data": {"path": str(data)}}))
    with pytest.raises(ValueError, match="pinned seed"):
        receipt.record_audit(tmp_path, correct, "black_box", data=str(data))
    written = receipt.record_audit(tmp_path, dataclasses.replace(correct, seed_pinned=False), "black_box", data=str(data))
    assert written["audits"][-1]["trained_on_run_data"] is True
    assert written["guarantee_with_audits"].startswith(f"({2.5 + correct.claimed_epsilon:.6g}, 2e-05)-DP")
    assert written["guarantee"].endswith("see guarantee_with_audits")
    _run_receipt(tmp_path)  # the run rewrites its receipt (a resume): the audits and the composition stay
    kept = json.loads((tmp_path / receipt.PRIVACY_FILE).read_text())
    assert len(kept["audits"]) == 3 and "guarantee_with_audits" in kept
    assert kept["guarantee"].count("see guarantee_with_audits") == 1
    assert receipt.record_audit(tmp_path, correct, "white_box")["guarantee"].count("guarantee_with_audits") == 1
    # What the CLI checks before an audit runs (the walkthrough: a planted bug and a claim above the run's
    # epsilon were refused only after the audit); a claim calibrated to the run's own target (~1e-7 above its
    # epsilon) is the run's guarantee and is accepted.
    receipt.check_recordable(kept, correct.mechanism, claim=2.5 * (1 + 1e-6))
    with pytest.raises(ValueError, match="planted bug"):
        receipt.check_recordable(kept, correct.mechanism, bug="no_clipping")
    with pytest.raises(ValueError, match="above this run's 2.5"):
        receipt.check_recordable(kept, correct.mechanism, claim=2.51)
    with pytest.raises(ValueError, match="delta 0.3 is above this run's"):  # review 19: (eps, 0.3) was recorded
        receipt.check_recordable(kept, correct.mechanism, delta=0.3)
    with pytest.raises(ValueError, match="pinned seed"):  # the CLI checks it before a black box runs
        receipt.audit_on_run_data(tmp_path, str(data), seed_pinned=True)
    # A run with a guessable seed has no guarantee, composed with audits or not (review 19: it said DP there).
    void = dict(kept, guarantee=receipt.GUESSABLE_SEED_NOTE + "(2.5, 1e-05)-DP ...")
    written = receipt.write_privacy_receipt(tmp_path, void)
    assert written["guarantee_with_audits"].startswith("NONE as run")
    for content, match in (([1, 2], "not a JSON object"), ({"dp": "false"}, "non-DP"),
                           ({"dp": True, "epsilon": None}, "no finite epsilon")):
        (tmp_path / receipt.PRIVACY_FILE).write_text(json.dumps(content))
        with pytest.raises(ValueError, match=match):
            receipt.record_audit(tmp_path, correct, "white_box")
    with pytest.raises(ValueError, match="no privacy.json"):
        receipt.record_audit(tmp_path / "elsewhere", correct, "white_box")


def test_receipt_writes_are_atomic_and_refuse_symlinks(tmp_path, monkeypatch):
    """A write that fails midway (a full disk) leaves the old receipt whole; a symlinked privacy.json (another
    run's) is written through by neither the run nor an audit (attacker review 16)."""
    import os
    _run_receipt(tmp_path)
    before = (tmp_path / receipt.PRIVACY_FILE).read_text()

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        receipt.write_privacy_receipt(tmp_path, {"dp": False})
    monkeypatch.undo()
    assert (tmp_path / receipt.PRIVACY_FILE).read_text() == before
    other = tmp_path / "other"
    other.mkdir()
    _run_receipt(other)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / receipt.PRIVACY_FILE).symlink_to(other / receipt.PRIVACY_FILE)
    with pytest.raises(ValueError, match="symlink"):
        receipt.write_privacy_receipt(tmp_path / "mine", {"dp": False})
    with pytest.raises(ValueError, match="symlink"):
        receipt.audit_target(tmp_path / "mine")


def test_the_audit_runs_the_audited_mechanism(monkeypatch):
    """clipping, clip_fn, secure_noise and the accountant reach fused_clip and the claim (attacker review 16:
    the audit ran flat, Abadi, plain noise and PLD whatever the run had)."""
    seen = {}
    real = audit_runs.fused_clip

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(audit_runs, "fused_clip", spy)
    mechanism = dict(clipping="per_layer", clip_fn="automatic", secure_noise=True, accountant="rdp")
    result = audit_runs.white_box_audit(settings=WhiteBoxSettings(num_canaries=64, steps=2, sampling_probability=0.5),
                                        claim=Claim(noise_multiplier=1.0, **mechanism), seed=0)
    assert (seen["clip"].clipping, seen["clip"].clip_fn, seen["secure_noise"]) == ("per_layer", "automatic", True)
    assert result.mechanism == {**mechanism, "l2_norm_clip": 1.0}
    assert result.claimed_epsilon == pytest.approx(accounting.epsilon(1.0, 0.5, 2, 1e-5, accountant="rdp"))
    with pytest.raises(ValueError, match="accountant"):
        Claim(accountant="moments")


def test_audit_noise_key_is_the_roots_256_bit_noise_key(monkeypatch):
    """Attacker review 18: both audits drew their noise key from 31 PCG64 bits; it is the root's `audit_noise`
    domain, an rbg key as the job's (a mutation back to `jax.random.key(rng.integers(2**31))` fails here)."""
    import jax

    from jaxdp.noise import draws as noise
    seen, real = [], audit_runs._privatizer

    def spy(*args, key, **kwargs):
        seen.append(key)
        return real(*args, key=key, **kwargs)

    monkeypatch.setattr(audit_runs, "_privatizer", spy)
    windows = np.random.default_rng(0).integers(0, 97, size=(48, 17))
    claim = Claim(noise_multiplier=1.0)
    audit_runs.black_box_audit(_Bigram(0), windows, 97, claim=claim, seed=0,
                               settings=BlackBoxSettings(num_canaries=16, steps=1, batch_size=16))
    audit_runs.white_box_audit(settings=WhiteBoxSettings(num_canaries=64, steps=1, sampling_probability=0.5),
                               claim=claim, seed=0)
    want = noise.noise_key_from_seed(seeds.derive_seed(0, "audit_noise"))
    assert len(seen) == 2
    for key in seen:
        assert jax.random.key_impl(key) == jax.random.key_impl(want)
        np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(want))


def test_the_audit_job_prints_its_report_without_library_logs():
    """The job's output opens with the report: absl INFO lines (jax probing for libtpu.so) are not shown."""
    import re
    import subprocess
    import sys
    repo = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "experiments.audit", "--config.audit.kind=white_box"], cwd=repo,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("one-run audit (white_box")
    assert not re.search(r"^[IWEF]\d{4} ", out.stderr, re.MULTILINE), out.stderr[:500]
