"""The pretraining job on two real JAX processes (jax.distributed on localhost, gloo collectives).

Two processes with two CPU devices each run one (data, seq) = (2, 2) mesh under ZeRO-3, from a
secret root seed (process 0's, broadcast), are interrupted after a checkpoint and resumed through
the CLI. The result must equal one process with four devices pinned to the checkpoint's root (up
to the collectives' summation order), with the run directory written by process 0 alone.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from jaxdp import training
from jaxdp.training import run_dir
from test_pretrain import REPO, cli_args, params_of, tiny_cli_overrides, tiny_config, write_tiny_corpus

MESH = {"mesh.data": 2, "mesh.seq": 2, "mesh.zero_stage": 3}
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
    gloo = lambda line: "peer ranks" in line  # gloo's threads log their connections to stdout, interleaved
    return [("".join(line for line in out.splitlines(keepends=True) if not gloo(line)), err) for out, err in outs]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"))


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
        assert g == pytest.approx(w, rel=1e-5, abs=1e-6)
    assert (workdir / "samples.txt").read_text() == (one / "samples.txt").read_text()
    receipts = [json.loads((d / "privacy.json").read_text()) for d in (workdir, one)]
    assert receipts[0].pop("randomness").startswith("a 128-bit root seed from the operating system")
    assert receipts[1].pop("randomness").startswith("config.seed pinned")
    assert receipts[0] == receipts[1]
    summaries = [json.loads((d / "summary.json").read_text()) for d in (workdir, one)]
    for s in summaries:
        del s["tokens_per_s"]
    assert summaries[0] == pytest.approx(summaries[1], rel=1e-5)
    assert not list(workdir.glob("*.tmp")) and not list(workdir.glob("*/*.tmp"))


def test_processes_that_disagree_are_refused_before_training(corpus, tmp_path):
    """Hosts given different configs would each place their own slices of their own batches: refused."""
    settings = tiny_cli_overrides(corpus, tmp_path / "run", **MESH, **RUN)
    argv = lambda i: [sys.executable, "-c", _INTERRUPTED_WORKER,
                      json.dumps(dict(settings, learning_rate=0.01 * (i + 1))), "1"]
    for _, err in _launch(argv, succeed=False):
        assert "processes of this run disagree on config" in err.splitlines()[-1]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
