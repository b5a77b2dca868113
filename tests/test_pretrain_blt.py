"""BLT in the job (config.dp.mechanism='blt'), its accounting as one release counted by prefix, the noise-buffer
budget, and the bad inputs of every mechanism.

Properties: the accountant of a BLT run counts the release of the first k steps (its prefix sensitivity under
the run's noise), nondecreasing in k and the run's epsilon at the end, and the budget stop and a restored
tracker count the same; b-min-separated cyclic batches keep every unit's participations b apart; where
jax_privacy is installed, the tiny job with BLT trains from those batches with that accountant's epsilon,
writes the mechanism, its parameters, sensitivity, sampling and DpEvent into privacy.json, resumes bit for
bit (buffers restored) and stops at the budget; without it, 'blt' is one line naming the extra and 'auto'
leaves BLT out. A noise-buffer budget skips the candidates over it. Every bad value is one line, status 2,
before anything is written.
"""

import json
import os
import subprocess
import sys

import dp_accounting
import numpy as np
import pytest
from job_testing import (
    CLI_ENV,
    REPO,
    assert_first_metrics_equal,
    cli_args,
    params_of,
    tiny_cli_overrides,
    tiny_config,
)

from jaxdp import training
from jaxdp.accounting import budget
from jaxdp.accounting import mechanisms as mech_accounting
from jaxdp.noise import mechanisms, strategies
from jaxdp.sampling.cyclic import CyclicPoissonSampler
from jaxdp.training import (
    loop,
    noise_choice,
    planner,
    preparation,
    receipt,
    run_dir,
    steps,
)

SECRET_SEED = 2**127 + 4243
BLT = {"dp.mechanism": "blt", "seed": SECRET_SEED, "sample.num": 0}
# A BLT whose Toeplitz coefficients are non-negative and non-increasing (its sensitivity is then exact for any
# min separation): no jax_privacy needed.
HAND_BLT = mechanisms.BLT((0.9, 0.5), (0.2, 0.1))
needs_jax_privacy = pytest.mark.skipif(not training.config.has_jax_privacy(),
                                       reason="jax_privacy (the extra jaxdp[mf]) is not installed")


def gaussian_epsilon(noise_multiplier, delta):
    """One Gaussian release's epsilon, straight from dp_accounting's PLD (the oracle of the prefix accounting)."""
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    return acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier)).get_epsilon(delta)


# ------------------------------------------------------------------ accounting and sampling (no jax_privacy)


def test_a_prefix_is_one_gaussian_at_the_prefix_sensitivity():
    steps, groups = 12, 3
    choice = noise_choice.blt_choice(steps, HAND_BLT, groups, "test")
    assert choice.participations == 4 and choice.column_norm == strategies.sensitivity(HAND_BLT, steps, groups, 4)
    sampler = CyclicPoissonSampler(1000, 10, groups, seed=1)
    sigma, delta = 1.3, 1e-6
    eps = []
    for k in range(steps + 1):
        run = choice.accounting(k, sampler)
        if k == 0:
            assert mech_accounting.epsilon_for(run, sigma, delta) == 0
            continue
        s_k = strategies.sensitivity(HAND_BLT, k, groups, 4)
        assert run.prefix_sensitivity == pytest.approx(s_k, rel=1e-15)
        got = mech_accounting.epsilon_for(run, sigma, delta, value_discretization_interval=1e-3)
        # the first k releases have sensitivity C' s_k under noise std sigma C' S: a Gaussian at sigma S / s_k
        assert got == pytest.approx(gaussian_epsilon(sigma * choice.column_norm / s_k, delta), rel=1e-9)
        event = run.dp_event(sigma)
        assert isinstance(event, dp_accounting.GaussianDpEvent)
        assert event.noise_multiplier == pytest.approx(sigma * choice.column_norm / s_k, rel=1e-14)
        eps.append(got)
    assert eps == sorted(eps) and eps[0] < eps[-1]
    whole = mech_accounting.MechanismAccounting("blt", steps, sampler.group_sampling_probability, groups,
                                                choice.column_norm, 4)
    assert eps[-1] == pytest.approx(mech_accounting.epsilon_for(whole, sigma, delta, value_discretization_interval=1e-3))
    # calibration of the whole run: the largest epsilon within the target
    target = 2.0
    calibrated = mech_accounting.calibrate_for(whole, target, delta)
    assert target * (1 - 2e-3) <= mech_accounting.epsilon_for(whole, calibrated, delta) <= target
    with pytest.raises(ValueError, match="prefix_sensitivity"):  # a prefix more sensitive than the run
        mech_accounting.MechanismAccounting("blt", 3, 0.1, groups, 1.0, 4, 1.5)


def test_the_step_scales_blt_noise_by_the_runs_sensitivity():
    """DPSpec's draws have std sigma C' S for a BLT carrying its run sensitivity S; a bare BLT is refused."""
    from jaxdp.clipping.rules import noise_std
    from jaxdp.clipping.settings import DPSpec
    blt = mechanisms.BLT(HAND_BLT.buf_decay, HAND_BLT.output_scale, 1.7)
    spec = DPSpec(0.5, 1.3, 8.0, mechanism=blt)
    assert spec.noise_std == noise_std(0.5, 1.3) * 1.7 and spec.privatizer().std == spec.noise_std
    with pytest.raises(TypeError, match="sensitivity"):
        DPSpec(0.5, 1.3, 8.0, mechanism=HAND_BLT)


def test_release_tracker_counts_the_prefix_stops_and_restores():
    steps, groups, sigma, delta = 12, 3, 1.3, 1e-6
    choice = noise_choice.blt_choice(steps, HAND_BLT, groups, "test")
    sampler = CyclicPoissonSampler(1000, 10, groups, seed=1)

    def prefix(k):
        return choice.accounting(k, sampler)

    eps = [mech_accounting.epsilon_for(prefix(k), sigma, delta) for k in range(steps + 1)]
    target = (eps[5] + eps[6]) / 2  # 5 steps fit, 6 do not
    tracker = budget.BudgetTracker.of(prefix(steps), sigma, delta, target_epsilon=target, prefix=prefix)
    assert isinstance(tracker, budget.ReleaseTracker) and tracker.max_steps == 5
    for k in range(5):
        assert tracker.epsilon() == eps[k]
        tracker.step()
    assert tracker.epsilon() == eps[5] and not tracker.can_step()
    with pytest.raises(RuntimeError, match="privacy budget exhausted"):
        tracker.step()
    state = json.loads(json.dumps(tracker.state_dict()))
    restored = budget.BudgetTracker.of(prefix(steps), sigma, delta, target_epsilon=target, prefix=prefix).restored(state)
    assert restored.steps == 5 and restored.epsilon() == tracker.epsilon() and restored.max_steps == 5
    with pytest.raises(ValueError, match="prefix function"):
        budget.BudgetTracker.from_state_dict(state)  # a plain tracker would count it as q = 1 rounds
    with pytest.raises(ValueError, match="needs prefix"):
        budget.BudgetTracker.of(prefix(steps), sigma, delta)
    whole = budget.BudgetTracker.of(prefix(steps), sigma, delta, target_epsilon=eps[-1] * 1.01, prefix=prefix)
    assert whole.max_steps == steps  # never beyond the run the strategy and its sensitivity are for


def test_cyclic_batches_are_b_min_separated():
    """Each unit joins only steps of its group, so any two of its participations are >= b apart; the sensitivity
    with that pattern is the most a unit can move the release (the accounting's assumption)."""
    groups, steps = 4, 24
    sampler = CyclicPoissonSampler(200, 20, groups, max_batch_size=64, seed=7)
    seen = {}
    for t in range(steps):
        indices, mask = sampler.sample(t)
        assert np.all(sampler.groups[indices[mask]] == t % groups)
        for u in indices[mask]:
            seen.setdefault(int(u), []).append(t)
    gaps = [b - a for ts in seen.values() for a, b in zip(ts, ts[1:])]
    assert gaps and min(gaps) >= groups
    assert max(len(ts) for ts in seen.values()) <= strategies.max_participations(steps, groups)


def test_noise_buffer_budget_skips_candidates_over_it():
    memory = planner.BufferMemory(1_000_000, shards=4, budget_bytes=4 * 1_000_000 * 3 // 4)  # 3 buffers' quarter
    assert memory.bytes_of(3) == 3_000_000 and memory.fits(3) and not memory.fits(4)
    assert planner.BufferMemory(10, 3).bytes_of(1) == 14  # ceil(40 / 3): a shard holds at least its part
    cands = (planner.Candidate("dpsgd"), planner.Candidate("bandmf", 4), planner.Candidate("bandmf", 8))
    chosen, table = planner.plan(10_000, 100, 1000, 2.1245, 1e-6, cands, memory=memory)
    assert table[2].skipped is not None and "budget" in table[2].skipped and table[2].buffer_bytes == 7_000_000
    assert chosen.candidate == planner.Candidate("bandmf", 4) and chosen.buffer_bytes == 3_000_000
    free, _ = planner.plan(10_000, 100, 1000, 2.1245, 1e-6, cands, memory=planner.BufferMemory(1_000_000))
    assert free.candidate == planner.Candidate("bandmf", 8)  # the budget changed the choice
    assert "MiB per device" in planner.format_table(table) and "skipped" in planner.format_table(table)
    none, _ = planner.plan(10_000, 100, 1000, 2.1245, 1e-6, cands,
                           memory=planner.BufferMemory(1_000_000, budget_bytes=0))
    assert none.candidate.kind == "dpsgd"  # no buffers: always fits


def test_the_memory_plan_counts_blt_buffers(corpus, tmp_path):
    """config.memory_budget_gb's compiled step holds BLT's buffers (known from config.dp.blt_buffers alone):
    at least 4 x blt_buffers x parameters more than DP-SGD's step (no jax_privacy needed for the shapes)."""
    from flax import nnx

    from jaxdp.training.config import build_model, model_config
    cfg = tiny_config(corpus, tmp_path / "run", **{"dp.mechanism": "blt", "dp.blt_buffers": 4})
    mechanism = noise_choice.planned_mechanism(cfg)
    assert isinstance(mechanism, mechanisms.BLT) and mechanism.num_buffers == 4
    model = nnx.eval_shape(lambda: build_model(model_config(cfg.model, 300, dtype=cfg.dtype, remat=cfg.remat), 0))
    n = preparation._trainable_parameters(cfg, 300, None)
    extra = steps.compiled_step_bytes(cfg, model, 8, 1, mechanism) - steps.compiled_step_bytes(cfg, model, 8, 1)
    assert extra >= 4 * 4 * n


# ------------------------------------------------------------------ the job


@pytest.fixture(scope="module")
def blt_run(corpus, tmp_path_factory):
    if not training.config.has_jax_privacy():
        pytest.skip("jax_privacy (the extra jaxdp[mf]) is not installed")
    workdir = tmp_path_factory.mktemp("blt")
    summary = training.train(tiny_config(corpus, workdir, **BLT), verbose=False)
    return workdir, summary, training.prepare(tiny_config(corpus, workdir, **BLT))


@needs_jax_privacy
def test_blt_trains_from_separated_batches_with_the_prefix_epsilon(blt_run):
    workdir, summary, p = blt_run
    groups = planner.blt_groups(p.num_units, 8, 6)
    assert p.noise.kind == "blt" and p.noise.groups == groups and p.noise.blt.num_buffers == 3
    assert isinstance(p.sampler, CyclicPoissonSampler) and p.sampler.cycle_length == groups
    for step in range(6):
        indices, mask = p.sample(step)
        assert np.all(p.sampler.groups[indices[mask]] == step % groups)
    run = p.accounting()
    assert run.kind == "blt" and run.strategy_sensitivity == strategies.sensitivity(
        p.noise.blt, 6, groups, strategies.max_participations(6, groups))
    rows = training.read_metrics(workdir)
    want = [mech_accounting.epsilon_for(p.accounting(r["step"]), p.noise_multiplier, p.delta_mechanism,
                                        value_discretization_interval=p.pld_interval) for r in rows]
    assert [r["epsilon"] for r in rows] == want and want == sorted(want)
    assert 8.0 * (1 - 2e-3) <= summary["epsilon"] <= 8.0 and summary["steps"] == 6
    r = json.loads((workdir / receipt.PRIVACY_FILE).read_text())
    noise = r["noise_mechanism"]
    assert noise["mechanism"] == "blt" and noise["parameters"]["buf_decay"] == list(p.noise.blt.buf_decay)
    assert noise["parameters"]["buffer_bytes_per_device"] == 3 * 4 * summary["num_params"]
    assert noise["strategy_sensitivity"] == run.strategy_sensitivity and "no amplification" in noise["accounted_as"]
    assert noise["dp_event"] == repr(dp_accounting.GaussianDpEvent(p.noise_multiplier)) and noise["epsilon"] == r["epsilon"]
    assert r["sampling"]["groups"] == groups and "min-separated" in r["sampling"]["method"]
    assert r["mechanism"]["noise_std"] == pytest.approx(p.noise_multiplier * run.strategy_sensitivity, rel=1e-3)
    assert "BLT" in r["in_plain_words"] and "BLT's noise buffers" in r["outside_the_guarantee"]["checkpoints/"]
    model, optimizer, _ = loop._build(p.config, p)  # the checkpoint holds 3 float32 buffers per parameter
    checkpointer = run_dir.Checkpointer(workdir / "checkpoints")
    checkpointer.restore(6, model, optimizer)
    checkpointer.close()
    buffers = [np.asarray(v.get_value()) for v in steps.noise_buffer_variables(optimizer)]
    assert [b.shape for b in buffers] == [(3, *q.shape) for q in params_of(workdir)]
    assert all(b.dtype == np.float32 and np.all(np.isfinite(b)) and np.any(b) for b in buffers)


@needs_jax_privacy
def test_blt_resume_equals_uninterrupted(blt_run, corpus, tmp_path, monkeypatch):
    """Killed after step 3 and rerun = uninterrupted, bit for bit (metrics, parameters, the final checkpoint's
    buffers), also when the optimiser returns a strategy differing in its last digits (another machine): the
    run continues on the kept one."""
    full, _, _ = blt_run
    resumed = tmp_path / "resumed"
    assert training.train(tiny_config(corpus, resumed, **BLT), interrupt_after=3, verbose=False) == {"interrupted_at": 3}
    kept = run_dir.latest_checkpoint_meta(resumed / "checkpoints")
    assert kept["mechanism"]["noise_mechanism"] == "blt" and kept["accountant"]["kind"] == "blt"
    optimise = strategies.blt

    def nearly(*args, **kwargs):
        found = optimise(*args, **kwargs)
        return mechanisms.BLT(tuple(d * (1 + 1e-9) for d in found.buf_decay), found.output_scale)
    monkeypatch.setattr(noise_choice.strategies, "blt", nearly)
    training.train(tiny_config(corpus, resumed, **BLT), verbose=False)
    assert (resumed / "metrics.jsonl").read_bytes() == (full / "metrics.jsonl").read_bytes()
    for a, b in zip(params_of(full), params_of(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
    saved = []
    for workdir in (full, resumed):
        checkpointer = run_dir.Checkpointer(workdir / "checkpoints")
        saved.append([np.asarray(x) for x in checkpointer.saved_leaves(6)])
        checkpointer.close()
    for a, b in zip(*saved, strict=True):  # the buffers among them
        np.testing.assert_array_equal(a, b)


@needs_jax_privacy
def test_blt_on_a_mesh_equals_one_device(blt_run, corpus, tmp_path):
    """The sharded step (ShardedTrainer, ZeRO-1 over 2 devices: the BLT buffers laid out like the gradients)
    gives the single-device run's losses and epsilons to 1e-4. (Under ZeRO-2 each device draws its shard's
    noise from its own key, so the losses differ from one device's, for BandMF as for BLT.)"""
    full, _, _ = blt_run
    training.train(tiny_config(corpus, tmp_path / "mesh", **BLT, mesh__data=2, mesh__zero_stage=1),
                   interrupt_after=4, verbose=False)
    assert_first_metrics_equal(tmp_path / "mesh", full, num_rows=5)


@needs_jax_privacy
def test_blt_budget_stop_counts_the_prefix(blt_run, corpus, tmp_path):
    sigma = 0.8

    def config(target):
        return tiny_config(corpus, tmp_path / "budget", **BLT, **{"dp.noise_multiplier": sigma,
                                                                     "dp.target_epsilon": target})

    eps = lambda p, k: mech_accounting.epsilon_for(p.accounting(k), sigma, p.delta_mechanism,  # noqa: E731
                                                   value_discretization_interval=p.pld_interval)
    target = eps(training.prepare(config(30.0)), 4) * (1 + 1e-6)
    p = training.prepare(config(target))  # delta's slack and the PLD grid depend on the target: p's own epsilons
    stop = max(k for k in range(7) if eps(p, k) <= target)
    assert 2 <= stop < 6
    summary = training.train(config(target), prepared=p, verbose=False)
    assert summary["steps"] == stop and "privacy budget" in summary["stop_reason"]
    assert summary["epsilon"] == eps(p, stop) <= target < eps(p, stop + 1)


def test_auto_offers_blt_only_with_jax_privacy(corpus, tmp_path, monkeypatch):
    cfg = tiny_config(corpus, tmp_path / "auto", **{"dp.mechanism": "auto", "seed": SECRET_SEED})
    labels = ["dpsgd", "bandmf b=2", "bandmf b=4"]
    if training.config.has_jax_privacy():
        p = training.prepare(cfg)
        assert [r.candidate.label for r in p.noise.table] == labels + ["blt 3 buffers"]
        assert p.noise.table[-1].skipped is None and p.noise.table[-1].run.kind == "blt"
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "jax_privacy", None)  # as if not installed
        p = training.prepare(cfg)
    assert [r.candidate.label for r in p.noise.table] == labels
    n = preparation._trainable_parameters(p.config, p.tokenizer.vocab_size, None)
    assert [r.buffer_bytes for r in p.noise.table] == [4 * r.num_buffers * n for r in p.noise.table]
    assert p.noise.buffer_bytes == planner.best(p.noise.table, p.noise.criterion).buffer_bytes


# ------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize("mechanism", ["bandmf", "blt", "auto"])
@pytest.mark.parametrize("overrides,needle", [
    ({"dp.bands": 7}, "config.dp.bands = 7 exceeds config.steps = 6"),
    ({"dp.bands": 4, "batch_size": 500, "steps": 8}, r"config.dp.bands = 4 x config.batch_size = 500 exceeds the \d+"),
    ({"dp.noise_buffer_gb": -1.0}, "config.dp.noise_buffer_gb must be None"),
    ({"dp.blt_buffers": 0}, r"config.dp.blt_buffers must be an integer in \[1, 10\]"),
])
def test_bad_mechanism_values_are_one_line(corpus, tmp_path, monkeypatch, mechanism, overrides, needle):
    if mechanism == "blt":  # checked before jax_privacy is needed
        monkeypatch.setattr(training.config, "has_jax_privacy", lambda: True)
    workdir = tmp_path / "run"
    with pytest.raises(training.ConfigError, match=needle) as e:
        training.prepare(tiny_config(corpus, workdir, **{"dp.mechanism": mechanism, "seed": SECRET_SEED}, **overrides))
    assert "\n" not in str(e.value) and not workdir.exists()


@pytest.mark.parametrize("mechanism,needle", [
    ("bandmf", r"config.dp.mechanism='bandmf' keeps 1 noise buffers .* > config.dp.noise_buffer_gb = 1e-09"),
    ("blt", r"config.dp.mechanism='blt' keeps 3 noise buffers .* > config.dp.noise_buffer_gb = 1e-09"),
])
def test_a_named_mechanism_over_the_buffer_budget_is_refused(corpus, tmp_path, monkeypatch, mechanism, needle):
    monkeypatch.setattr(training.config, "has_jax_privacy", lambda: True)
    bands = {"dp.bands": 2} if mechanism == "bandmf" else {}
    with pytest.raises(training.ConfigError, match=needle) as e:
        training.prepare(tiny_config(corpus, tmp_path / "run", **{"dp.mechanism": mechanism,
                                                                  "dp.noise_buffer_gb": 1e-9}, **bands))
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


@pytest.mark.parametrize("mechanism", ["dpsgd", "bandmf", "blt", "auto"])
def test_every_mechanism_takes_every_unit(corpus, tmp_path, monkeypatch, mechanism):
    """No mechanism is refused for a privacy unit: each samples units (windows, or documents, or users by
    data.id_field) and clips per unit; the cyclic samplers partition the units, whatever they are."""
    if mechanism == "blt" and not training.config.has_jax_privacy():
        pytest.skip("jax_privacy (the extra jaxdp[mf]) is not installed")
    p = training.prepare(tiny_config(corpus, tmp_path / "run", **{
        "dp.mechanism": mechanism, "privacy.unit": "document", "privacy.windows_per_unit": 2, "batch_size": 1,
        "seed": SECRET_SEED}))
    assert p.sampler.num_examples == p.num_units == p.train.num_units and p.noise.kind in ("dpsgd", "bandmf", "blt")
    if p.noise.kind != "dpsgd":
        assert np.bincount(p.sampler.groups).size == p.noise.cycle_length


def _cli(args, env):
    return subprocess.run([sys.executable, "-m", "experiments.pretrain_gpt2", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_blt_without_jax_privacy_exits_2_naming_the_extra(corpus, tmp_path):
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['jax_privacy'] = None  # as if absent\n")
    env = dict(CLI_ENV, PYTHONPATH=os.pathsep.join([str(blocker), CLI_ENV.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = _cli(cli_args(tiny_cli_overrides(corpus, tmp_path / "run", **{"dp.mechanism": "blt"})), env)
    assert proc.returncode == 2 and not (tmp_path / "run").exists(), proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert [x for x in lines if x.startswith("error:")] == [lines[-1]], proc.stderr
    assert lines[-1] == "error: config.dp.mechanism='blt' needs jax_privacy for its strategy: pip install 'jaxdp[mf]'"

