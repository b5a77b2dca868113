"""The job's noise mechanisms (config.dp.mechanism = dpsgd | bandmf | auto, config.dp.bands) on the tiny config.

Properties: a BandMF run streams the strategy's correlated noise from cyclic Poisson batches (each step only
its group's units), its sigma and every logged epsilon are the amplified BandMF accountant's
(`jaxdp.accounting.mechanisms`), its receipt names the mechanism, coefficients, sensitivity, sampling and
DpEvent and no secret (root seed, partition); a run killed and resumed equals an uninterrupted one (the
buffers are restored exactly) and a resume under another mechanism is refused; the mesh step equals the
single-device step; the budget stop counts rounds; "auto" prints and records the planner's table and runs
its choice; bad values are one-line errors. DP-SGD's outputs are tests/test_pretrain.py's.
"""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from job_testing import (
    TINY,
    assert_first_metrics_equal,
    assert_only_checkpoints_hold,
    cli_args,
    params_of,
    run_cli,
    tiny_cli_overrides,
    tiny_config,
    with_settings,
)

from experiments.configs import finetune as finetune_config
from jaxdp import training
from jaxdp.accounting import budget
from jaxdp.accounting import mechanisms as mech_accounting
from jaxdp.noise import seeds, strategies
from jaxdp.sampling.cyclic import CyclicPoissonSampler
from jaxdp.training import finetune_job, loop, planner, receipt, run_dir, steps

SECRET_SEED = 2**127 + 4242  # pinned (runs are compared bit for bit) and not guessable: the receipt holds a guarantee
BANDMF = {"dp.mechanism": "bandmf", "dp.bands": 2, "seed": SECRET_SEED}


def bandmf_config(corpus, workdir, **overrides):
    return tiny_config(corpus, workdir, **dict(BANDMF, **overrides))


@pytest.fixture(scope="module")
def bandmf_run(corpus, tmp_path_factory):
    """An uninterrupted BandMF (b = 2) run of the tiny config, and its `prepare`."""
    workdir = tmp_path_factory.mktemp("bandmf")
    summary = training.train(bandmf_config(corpus, workdir), verbose=False)
    return workdir, summary, training.prepare(bandmf_config(corpus, workdir))


def accountant_epsilon(p, steps):
    """The epsilon `jaxdp.accounting.mechanisms` gives `steps` steps of the run `p` (a Prepared)."""
    return mech_accounting.epsilon_for(p.accounting(steps), p.noise_multiplier, p.delta_mechanism,
                                       accountant=p.config.accountant, value_discretization_interval=p.pld_interval)


def test_bandmf_trains_from_cyclic_batches_with_the_accountants_epsilon(bandmf_run, corpus, tmp_path):
    workdir, summary, p = bandmf_run
    assert p.noise.kind == "bandmf" and p.noise.coefs == strategies.bandmf(6, 2).coefs
    assert isinstance(p.sampler, CyclicPoissonSampler) and p.sampler.cycle_length == 2
    for step in range(6):  # the loop's batches: each step only its group's units
        indices, mask = p.sample(step)
        assert mask.any() and np.all(p.sampler.groups[indices[mask]] == step % 2)
    run = p.accounting()
    assert (run.kind, run.cycle_length, run.rounds) == ("bandmf", 2, 3)
    assert run.sampling_probability == pytest.approx(2 * 8 / p.num_units)  # q_b: the expected batch stays 8
    assert run.strategy_sensitivity == pytest.approx(1.0, abs=1e-12)
    # sigma calibrated for 3 rounds at q_b; every logged epsilon is the accountant's at that step
    assert accountant_epsilon(p, 6) <= 8.0 and accountant_epsilon(p, 6) >= 8.0 * (1 - 1e-3)
    rows = training.read_metrics(workdir)
    assert [r["epsilon"] for r in rows] == [accountant_epsilon(p, r["step"]) for r in rows]
    assert rows[1]["epsilon"] == rows[2]["epsilon"] < rows[3]["epsilon"]  # steps 1 and 2 are one round
    assert summary["epsilon"] == rows[-1]["epsilon"] and summary["steps"] == 6
    assert summary["val_loss"] < summary["initial_val_loss"]
    dpsgd = training.prepare(tiny_config(corpus, tmp_path / "dpsgd", seed=SECRET_SEED))
    assert dpsgd.noise.kind == "dpsgd" and not isinstance(dpsgd.sampler, CyclicPoissonSampler)
    assert p.noise_multiplier > dpsgd.noise_multiplier  # 3 rounds at 2q cost more per round than 6 at q
    # the checkpoint holds the buffers: one float32 (1, *shape) array per parameter, the last step's noise
    model, optimizer, _ = loop._build(p.config, p)
    assert all(not np.any(v.get_value()) for v in steps.noise_buffer_variables(optimizer))  # zeros at the start
    checkpointer = run_dir.Checkpointer(workdir / "checkpoints")
    checkpointer.restore(6, model, optimizer)
    checkpointer.close()
    buffers = [np.asarray(v.get_value()) for v in steps.noise_buffer_variables(optimizer)]
    params = params_of(workdir)
    assert [b.shape for b in buffers] == [(1, *q.shape) for q in params]
    assert all(b.dtype == np.float32 and np.all(np.isfinite(b)) and np.any(b) for b in buffers)


def test_bandmf_receipt_states_the_mechanism_and_holds_no_secret(bandmf_run):
    workdir, summary, p = bandmf_run
    r = json.loads((workdir / receipt.PRIVACY_FILE).read_text())
    noise, q_b = r["noise_mechanism"], p.accounting().sampling_probability
    assert noise["mechanism"] == "bandmf" and noise["steps"] == 6
    params = noise["parameters"]
    assert params["bands"] == 2 and params["coefficients"] == list(strategies.bandmf(6, 2).coefs)
    assert params["coefficients_sha256"] == p.noise.coefs_sha256 and "bandmf(steps=6, bands=2)" in params[
        "coefficients_from"]
    assert noise["strategy_sensitivity"] == pytest.approx(1.0, abs=1e-12)
    assert noise["sampling"]["kind"] == "cyclic_poisson" and noise["sampling"]["cycle_length"] == 2
    assert noise["sampling"]["sampling_probability"] == q_b == r["sampling"]["group_sampling_probability"]
    assert noise["dp_event"] == repr(p.accounting(6).dp_event(p.noise_multiplier)) and "count=3" in noise["dp_event"]
    assert noise["epsilon"] == r["epsilon"] == summary["epsilon"] and noise["delta"] == r["delta_mechanism"]
    assert r["sampling"]["groups"] == 2 and r["sampling"]["method"].startswith("cyclic Poisson")
    assert r["sampling"]["sampling_probability"] == summary["sampling_probability"]  # q: the per-step marginal
    assert r["mechanism"]["noise_multiplier"] == p.noise_multiplier and "BandMF" in r["mechanism"]["noise_added"]
    assert r["guarantee"].startswith("(") and "DP-BandMF with 2 bands" in r["in_plain_words"]
    assert "buffers" in r["outside_the_guarantee"]["checkpoints/"] and "noise_plan" not in r
    audit = {"clipping": "flat", "clip_fn": "abadi", "secure_noise": False, "accountant": "pld"}  # a DP-SGD audit
    with pytest.raises(ValueError, match=r"noise_mechanism 'dpsgd' \(run: 'bandmf'\)"):
        receipt.check_same_mechanism(r, audit)  # it would not test this run's noise
    dp_config = json.loads((workdir / "config.json").read_text())["dp"]
    assert (dp_config["mechanism"], dp_config["bands"]) == ("bandmf", 2)
    # No file a user would share holds the root seed, a seed derived from it, or the partition
    derived = [seeds.derive_seed(SECRET_SEED, d) for d in (seeds.SAMPLER, seeds.NOISE, seeds.INIT)]
    groups = p.sampler.groups
    needles = [str(x).encode() for x in [SECRET_SEED, *derived]] + [
        groups.tobytes(), groups.astype(np.int32).tobytes(), groups.astype(np.uint8).tobytes(),
        json.dumps(groups.tolist()).encode(), ", ".join(map(str, groups[:64])).encode(),
        "".join(map(str, groups[:64])).encode()]
    assert_only_checkpoints_hold(workdir, needles, {"privacy.json", "config.json", "metrics.jsonl", "summary.json"},
                                 str(SECRET_SEED).encode())


def test_bandmf_resume_equals_uninterrupted_and_refuses_another_mechanism(bandmf_run, corpus, tmp_path):
    """Killed after step 3 (checkpoint at 2: the buffers hold step 2's noise) and rerun = uninterrupted, bit
    for bit: metrics, parameters and the final checkpoint's state (buffers included). Before the rerun, a
    resume under another mechanism or bands is refused, by config.json and, without it, by the checkpoint."""
    full, _, _ = bandmf_run
    resumed = tmp_path / "resumed"
    assert training.train(bandmf_config(corpus, resumed), interrupt_after=3, verbose=False) == {"interrupted_at": 3}
    kept = run_dir.latest_checkpoint_meta(resumed / "checkpoints")["mechanism"]
    assert kept["noise_mechanism"] == "bandmf" and kept["bands"] == 2
    assert kept["strategy_coefs"] == list(strategies.bandmf(6, 2).coefs)
    for other, needle in (({"dp.mechanism": "dpsgd", "dp.bands": None}, "dp.bands, dp.mechanism"),
                          ({"dp.bands": 3}, "dp.bands"), ({"dp.mechanism": "auto"}, "dp.mechanism")):
        with pytest.raises(training.ConfigError, match=f"different config .*{needle}"):
            training.prepare(bandmf_config(corpus, resumed, **other))
    (resumed / "config.json").rename(tmp_path / "config.json")
    try:  # the checkpoint's record alone refuses it too
        with pytest.raises(training.ConfigError, match="another mechanism.*config.dp.mechanism: 'bandmf' -> None"
                                                       ".*noise_mechanism: 'bandmf' -> None"):
            training.prepare(bandmf_config(corpus, resumed, **{"dp.mechanism": "dpsgd", "dp.bands": None}))
    finally:
        (tmp_path / "config.json").rename(resumed / "config.json")
    training.train(bandmf_config(corpus, resumed), verbose=False)
    assert (resumed / "metrics.jsonl").read_bytes() == (full / "metrics.jsonl").read_bytes()
    for a, b in zip(params_of(full), params_of(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
    saved = []
    for workdir in (full, resumed):
        checkpointer = run_dir.Checkpointer(workdir / "checkpoints")
        saved.append([np.asarray(x) for x in checkpointer.saved_leaves(6)])
        checkpointer.close()
    for a, b in zip(*saved, strict=True):
        np.testing.assert_array_equal(a, b)
    assert json.loads((resumed / "privacy.json").read_text())["epsilon"] == json.loads(
        (full / "privacy.json").read_text())["epsilon"]


def test_bandmf_on_a_mesh_equals_one_device(bandmf_run, corpus, tmp_path):
    """The sharded step (ShardedTrainer, ZeRO-1 over 2 devices: the buffers replicated like the gradients)
    gives the single-device run's losses and epsilons to 1e-4."""
    full, _, _ = bandmf_run
    training.train(bandmf_config(corpus, tmp_path / "mesh", mesh__data=2, mesh__zero_stage=1), interrupt_after=4,
                   verbose=False)
    assert_first_metrics_equal(tmp_path / "mesh", full, num_rows=5)


def test_fine_tuning_keeps_buffers_for_the_trainable_parameters_only(bandmf_run, corpus, tmp_path):
    """The fine-tuning job (the same loop, another model builder): LoRA on the BandMF run's weights with b = 3
    keeps 2 buffers per LoRA leaf and none for the frozen weights, and its receipt names the mechanism."""
    init, _, _ = bandmf_run
    settings = {k: v for k, v in TINY.items() if not k.startswith("model.") and k != "data.tokenizer"}
    settings.update({"workdir": str(tmp_path / "lora"), "data.path": str(corpus), "finetune.init": str(init),
                     "finetune.loss_after": "", "finetune.accuracy_examples": 0, "finetune.rank": 2,
                     "privacy.unit": "window", "dp.mechanism": "bandmf", "dp.bands": 3, "steps": 3,
                     "checkpoint_every": 3, "eval_every": 3})
    p = finetune_job.prepare(with_settings(finetune_config.get_config(), settings, {}))
    summary = training.train(p.config, prepared=p, verbose=False)
    assert summary["steps"] == 3 and summary["epsilon"] == accountant_epsilon(p, 3)
    model, optimizer, _ = loop._build(p.config, p)
    trainable = [x.shape for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    assert 0 < sum(np.prod(s) for s in trainable) < 1000  # the LoRA factors only
    assert [v.get_value().shape for v in steps.noise_buffer_variables(optimizer)] == [(2, *s) for s in trainable]
    r = json.loads((tmp_path / "lora" / "privacy.json").read_text())
    assert r["noise_mechanism"]["parameters"]["bands"] == 3 and r["sampling"]["groups"] == 3
    # the buffers' memory counts the trainable parameters only
    assert r["noise_mechanism"]["parameters"]["buffer_bytes_per_device"] == 2 * 4 * sum(np.prod(s) for s in trainable)


def test_bandmf_budget_stop_counts_rounds(corpus, tmp_path):
    """A fixed sigma and a target about 2 rounds of b = 2 spend: the run stops after a whole round (an even
    step), at the accountant's epsilon, before the step that starts the next round."""
    sigma = 0.5

    def config(target):
        return bandmf_config(corpus, tmp_path / "budget", steps=8, checkpoint_every=8, eval_every=8,
                             **{"dp.noise_multiplier": sigma, "dp.target_epsilon": target, "sample.num": 0})

    target = accountant_epsilon(training.prepare(config(8.0)), 4) * (1 + 1e-6)  # 4 steps = 2 rounds
    p = training.prepare(config(target))  # delta's slack depends on the target: the run's own accountant
    stop = budget.BudgetTracker.of(p.accounting(), sigma, p.delta_mechanism, target_epsilon=target,
                                   value_discretization_interval=p.pld_interval).max_steps
    assert 2 <= stop < 8 and stop % 2 == 0
    summary = training.train(config(target), prepared=p, verbose=False)
    assert summary["steps"] == stop and "privacy budget" in summary["stop_reason"]
    assert summary["epsilon"] == accountant_epsilon(p, stop) <= target < accountant_epsilon(p, stop + 1)


def test_auto_prints_records_and_runs_the_planners_choice(corpus, tmp_path, capfd):
    cfg = tiny_config(corpus, tmp_path / "auto", **{"dp.mechanism": "auto", "seed": SECRET_SEED, "sample.num": 0})
    p = training.prepare(cfg)
    blt_buffers = (3,) if training.config.has_jax_privacy() else ()  # BLT where jax_privacy is installed
    # auto ranks by each step's own noise (the jobs' AdamW); by the prefix sums' noise BandMF would win here.
    candidates = planner.default_candidates(p.num_units, 8, 6, blt_buffers=blt_buffers)
    chosen, table = planner.plan(p.num_units, 8, 6, 8.0, p.delta_mechanism, candidates, criterion="steps")
    by_sums, _ = planner.plan(p.num_units, 8, 6, 8.0, p.delta_mechanism, candidates)
    labels = ["dpsgd", "bandmf b=2", "bandmf b=4"] + ["blt 3 buffers"] * len(blt_buffers)
    assert [r.candidate.label for r in table] == labels
    assert by_sums.candidate.kind == "bandmf" and chosen.candidate.kind == "dpsgd"
    assert p.noise.kind == "dpsgd" and p.noise.criterion == "steps" and type(p.sampler).__name__ == "PoissonSampler"
    assert accountant_epsilon(p, 6) <= 8.0
    training.train(cfg, prepared=p, interrupt_after=1, verbose=True)
    err = capfd.readouterr().err
    assert err.count("the planner's table") == 1 and planner.format_table(p.noise.table, "steps") in err
    assert [r.step_error for r in p.noise.table] == [r.step_error for r in table]  # with the buffers' bytes added
    assert "MiB per device" in planner.format_table(p.noise.table)
    assert "noise mechanism: dpsgd" in err and "the least RMS noise per step" in err
    r = receipt.privacy_receipt(cfg, p, steps=6, epsilon=accountant_epsilon(p, 6), overflowed_steps=0)
    plan = r["noise_plan"]
    assert plan["chosen"] == "dpsgd" and plan["rule"].startswith("the least RMS noise of each step's release")
    assert [row["mechanism"] for row in plan["rows"]] == labels
    assert [row["chosen"] for row in plan["rows"]] == [r_ is chosen for r_ in table]
    assert [row["step_rms_error"] for row in plan["rows"]] == [r_.step_error for r_ in table]
    assert "planner" in r["noise_mechanism"]["parameters"]["chosen_by"]


def test_budget_tracker_counts_rounds_as_the_mechanism_accountant():
    run = mech_accounting.MechanismAccounting("bandmf", 0, 0.02, 3, 1.0)
    tracker = budget.BudgetTracker.of(run, 0.9, 1e-6, target_epsilon=3.0, value_discretization_interval=1e-3)
    for s in range(12):
        want = mech_accounting.epsilon_for(mech_accounting.MechanismAccounting("bandmf", s, 0.02, 3, 1.0), 0.9, 1e-6,
                                           value_discretization_interval=1e-3)
        assert tracker.epsilon() == want, s
        tracker.step()
    max_steps = tracker.max_steps
    assert max_steps % 3 == 0 and max_steps > 0
    eps = lambda s: mech_accounting.epsilon_for(mech_accounting.MechanismAccounting("bandmf", s, 0.02, 3, 1.0),
                                               0.9, 1e-6, value_discretization_interval=1e-3)
    assert eps(max_steps) <= 3.0 < eps(max_steps + 1)
    restored = budget.BudgetTracker.from_state_dict(tracker.state_dict())
    assert restored.cycle_length == 3 and restored.epsilon() == tracker.epsilon()
    dpsgd = budget.BudgetTracker.of(mech_accounting.MechanismAccounting("dpsgd", 0, 0.02), 0.9, 1e-6)
    assert "cycle_length" not in dpsgd.state_dict()  # a DP-SGD checkpoint's accountant is as before
    with pytest.raises(ValueError, match="blt"):
        budget.BudgetTracker.of(mech_accounting.MechanismAccounting("blt", 6, 0.02, 3, 1.5), 0.9, 1e-6)


@pytest.mark.parametrize("overrides,needle", [
    ({"dp.mechanism": "bandmc"}, r"config.dp.mechanism must be one of \('dpsgd', 'bandmf', 'blt', 'auto'\), got "
                                 r"'bandmc'"),
    ({"dp.mechanism": "bandmf", "dp.bands": -1}, "config.dp.bands must be None or 0"),
    ({"dp.bands": 2}, "config.dp.bands = 2 applies to config.dp.mechanism='bandmf', 'blt' or 'auto'"),
    ({"dp.mechanism": "bandmf", "dp.bands": 7}, "config.dp.bands = 7 exceeds config.steps = 6"),
    ({"dp.mechanism": "bandmf", "dp.bands": 4, "batch_size": 500, "steps": 8},
     r"config.dp.bands = 4 x config.batch_size = 500 exceeds the \d+ training units"),
    ({"dp.mechanism": "auto", "dp.noise_multiplier": 1.0}, "config.dp.mechanism='auto' calibrates sigma"),
    ({"dp.mechanism": "auto", "memory_budget_gb": 1.0}, "config.memory_budget_gb counts the noise buffers"),
])
def test_bad_mechanism_is_refused_before_touching_workdir(corpus, tmp_path, overrides, needle):
    workdir = tmp_path / "run"
    with pytest.raises(training.ConfigError, match=needle) as e:
        training.prepare(tiny_config(corpus, workdir, **overrides))
    assert "\n" not in str(e.value) and not workdir.exists()


def test_cli_bad_mechanism_exits_2_with_one_line(corpus, tmp_path):
    proc = run_cli(cli_args(tiny_cli_overrides(corpus, tmp_path / "run", **{"dp.mechanism": "bandmc"})))
    assert proc.returncode == 2 and not (tmp_path / "run").exists()
    errors = [line for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
    assert errors == [proc.stderr.strip().splitlines()[-1]], proc.stderr  # one error line, the last
    assert errors[0].startswith("error: config.dp.mechanism must be one of"), proc.stderr
