"""The pretraining job and the sharded step on two real JAX processes (jax.distributed on localhost, gloo).

Two processes with two CPU devices each run the job on a (data, seq) = (1, 4) mesh (each process holds
half of every sampled window: the packed batch puts real examples first, so a data-sharded mesh would
give process 1 only padding), from a secret root seed (process 0's, broadcast), are interrupted after a
checkpoint and resumed through the CLI; the result must equal one process with four devices pinned to
the checkpoint's root (up to the collectives' summation order), with the run directory written by
process 0 alone. `ShardedDPStep` itself runs a (2, 2) mesh under ZeRO-3 on a batch without padding, and
refuses a batch that differs between the processes (hosts sampling their own batches: sensitivity 2C).
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from dp_testing import assert_json_close
from job_testing import REPO, cli_args, params_of, tiny_cli_overrides, tiny_config

from jaxdp import training
from jaxdp.training import run_dir

MESH = {"mesh.data": 1, "mesh.seq": 4}
RUN = {"seed": None, "steps": 4, "checkpoint_every": 2, "log_every": 1, "eval_every": 2, "sample.num": 1}

# A process of the job stopped after `interrupt_after` steps, as if killed there (the CLI cannot).
_INTERRUPTED_WORKER = """
import json, sys
from ml_collections import config_dict
from experiments.configs import default
from jaxdp import training
training.maybe_initialize_distributed()
config = default.get_config()
for key, value in json.loads(sys.argv[1]).items():
    node = config
    *parents, leaf = key.split(".")
    for p in parents:
        node = node[p]
    setattr(node, leaf, value)
print(json.dumps(training.train(config, interrupt_after=int(sys.argv[2]), verbose=False)))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(argv_of, num_processes=2, succeed=True):
    """Runs `argv_of(process_id)` as the processes of one jax.distributed job; their (stdout, stderr),
    each process exiting with status 0 (`succeed`) or not."""
    port = _free_port()
    procs = []
    for i in range(num_processes):
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
                   JAX_NUM_PROCESSES=str(num_processes), JAX_PROCESS_ID=str(i),
                   XLA_FLAGS="--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0")
        procs.append(subprocess.Popen(argv_of(i), cwd=REPO, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert (p.returncode == 0) == succeed, err[-3000:]
        assert p.returncode in (0, 2), err[-3000:]  # a refusal is one line and status 2, never a crash
    gloo = lambda line: "peer ranks" in line  # gloo's threads log their connections to stdout, interleaved
    return [("".join(line for line in out.splitlines(keepends=True) if not gloo(line)), err) for out, err in outs]


def test_two_processes_train_as_one_with_a_broadcast_secret_root(corpus, tmp_path):
    workdir = tmp_path / "two"
    settings = tiny_cli_overrides(corpus, workdir, **MESH, **RUN)
    worker = [sys.executable, "-c", _INTERRUPTED_WORKER, json.dumps(settings), "3"]
    outs = _launch(lambda i: worker)
    assert [json.loads(out.splitlines()[-1]) for out, _ in outs] == [{"interrupted_at": 3}] * 2
    assert training.read_metrics(workdir)[-1]["step"] == 3  # process 0 logged; the checkpoint is at 2

    cli = [sys.executable, "-m", "experiments.pretrain_gpt2", *cli_args({k: v for k, v in settings.items()
                                                                        if v is not None})]
    (out0, err0), (out1, err1) = _launch(lambda i: cli)
    assert f"run: {workdir}" in out0 and "resuming" in err0
    assert "run:" not in out1 and "resuming" not in err1  # process 0 reports for both

    root = run_dir.latest_checkpoint_meta(workdir / "checkpoints")["root_seed"]
    one = tmp_path / "one"
    pinned = {k.replace(".", "__"): v for k, v in {**MESH, **RUN, "seed": root}.items()}
    training.train(tiny_config(corpus, one, **pinned), verbose=False)
    # One process with four devices pinned to the broadcast root: the same run. Two processes
    # drawing their own roots would sample different batches and add different noise.
    for a, b in zip(params_of(one), params_of(workdir), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    got, want = training.read_metrics(workdir), training.read_metrics(one)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(5))
    for g, w in zip(got, want):
        assert_json_close(g, w, rtol=1e-5, atol=1e-6)
    assert (workdir / "samples.txt").read_text() == (one / "samples.txt").read_text()
    receipts = [json.loads((d / "privacy.json").read_text()) for d in (workdir, one)]
    assert receipts[0].pop("randomness").startswith("a 128-bit root seed from the operating system")
    assert receipts[1].pop("randomness").startswith("config.seed pinned")
    assert receipts[0] == receipts[1]
    summaries = [json.loads((d / "summary.json").read_text()) for d in (workdir, one)]
    for s in summaries:
        del s["tokens_per_s"]
    assert_json_close(summaries[0], summaries[1], rtol=1e-5)
    assert not list(workdir.glob("*.tmp")) and not list(workdir.glob("*/*.tmp"))


def test_processes_that_disagree_are_refused_before_training(corpus, tmp_path):
    """Hosts given different configs would each place their own slices of their own batches: refused, naming
    the field."""
    settings = tiny_cli_overrides(corpus, tmp_path / "run", **MESH, **RUN)
    argv = lambda i: [sys.executable, "-m", "experiments.pretrain_gpt2", *cli_args(
        {k: v for k, v in dict(settings, learning_rate=0.01 * (i + 1)).items() if v is not None})]
    for _, err in _launch(argv, succeed=False):
        assert "processes disagree on config.learning_rate;" in err.splitlines()[-1]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_process_that_stops_is_named_not_waited_for(corpus, tmp_path):
    """Process 1 cannot read its data (e.g. a host without the file): it exits with its error, and process 0
    says so within seconds instead of waiting for it (or dying later in an opaque collective)."""
    settings = tiny_cli_overrides(corpus, tmp_path / "run", **MESH, **RUN)
    argv = lambda i: [sys.executable, "-m", "experiments.pretrain_gpt2", *cli_args(
        {k: v for k, v in dict(settings, **({"data.path": str(tmp_path / "missing.jsonl")} if i else {})).items()
         if v is not None})]
    (_, err0), (_, err1) = _launch(argv, succeed=False)
    assert "corpus path does not exist" in err1.splitlines()[-1]
    assert "process 1 of 2 exited before agreeing" in err0.splitlines()[-1]


def test_single_process_jobs_refuse_to_run_once_per_host(monkeypatch):
    """Fine-tuning and the audit run in one process: launched on several hosts they would each train from
    their own secret root into one directory; they refuse before reading anything."""
    import importlib.util

    from jaxdp.auditing import runs as audit_runs
    from jaxdp.training import finetune_job
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1")
    configs = {}
    for name in ("finetune", "audit"):
        spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / "configs" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        configs[name] = module.get_config()
    with pytest.raises(training.ConfigError, match="unset JAX_COORDINATOR_ADDRESS"):
        finetune_job.prepare(configs["finetune"])
    with pytest.raises(ValueError, match="unset JAX_COORDINATOR_ADDRESS"):
        audit_runs.check_audit_config(configs["audit"])


# ShardedDPStep on a (2, 2) mesh under ZeRO-3, two steps on an unpadded batch; then a third whose batch
# differs on process 1. Process 0 saves the parameters after two steps to argv[1].
_STEP_WORKER = """
import sys
sys.path.insert(0, "tests")
from jaxdp import training
training.maybe_initialize_distributed()
import jax, numpy as np, optax
from dp_testing import tiny_gpt2
from jaxdp import sharding
from jaxdp.core import losses
from jaxdp.sharding import processes
from jaxdp.clipping.settings import DPSpec
step = sharding.ShardedDPStep(losses.cp_lm_losses, optax.adam(1e-2, eps=1e-3), sharding.make_mesh(2, 2),
                              DPSpec(l2_norm_clip=0.05, noise_multiplier=2.0, expected_batch_size=6.0),
                              key=jax.random.key(7), zero_stage=3)
state = step.init(tiny_gpt2(seed=1))
tokens = np.random.default_rng(3).integers(0, 97, (8, 17))
batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones(8, bool)}
for _ in range(2):
    state, _ = step(state, batch)
params = processes.fetch(state.params)
if jax.process_index() == 0:
    np.savez(sys.argv[1], *[np.asarray(x) for x in jax.tree.leaves(params)])
if jax.process_index() == 1:
    batch["inputs"] = (batch["inputs"] + 1) % 97
for kind in (np.asarray, jax.numpy.asarray):  # host arrays, process-local jax arrays
    try:
        step(state, jax.tree.map(kind, batch))
    except processes.Disagreement as e:
        print("REFUSED", e)
"""


def test_sharded_step_on_two_processes_zero3_and_batches_that_differ(tmp_path):
    import jax
    import optax
    from dp_testing import tiny_gpt2

    from jaxdp import sharding
    from jaxdp.clipping.settings import DPSpec
    from jaxdp.core import losses
    outs = _launch(lambda i: [sys.executable, "-c", _STEP_WORKER, str(tmp_path / "two.npz")])
    for out, _ in outs:
        assert out.count("REFUSED ShardedDPStep batch: the 2 processes disagree on batch;") == 2, out[-2000:]
    step = sharding.ShardedDPStep(losses.cp_lm_losses, optax.adam(1e-2, eps=1e-3), sharding.make_mesh(2, 2),
                                  DPSpec(l2_norm_clip=0.05, noise_multiplier=2.0, expected_batch_size=6.0),
                                  key=jax.random.key(7), zero_stage=3)
    state = step.init(tiny_gpt2(seed=1))
    tokens = np.random.default_rng(3).integers(0, 97, (8, 17))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones(8, bool)}
    for _ in range(2):
        state, _ = step(state, batch)
    with np.load(tmp_path / "two.npz") as two:
        got = [two[f"arr_{i}"] for i in range(len(two.files))]
    want = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
