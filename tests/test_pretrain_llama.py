"""The pretraining job with `model.family = "llama"` (experiments/configs/llama_tiny.py) at tiny sizes.

Properties: the job trains a Llama end to end (the loss drops, metrics.jsonl
and samples are written, `load_for_generation` loads it back as the trained
model and `experiments.generate` samples from it); on a (2, 4) mesh (ZeRO-1,
context parallel, remat) it gives the single-device run's metrics; a bad
family, a field of the other family or a bad Llama shape is refused before
the workdir is touched.
"""

import json

import pytest
from job_testing import assert_first_metrics_equal, run_cli, tiny_config

from experiments.configs import default, llama_tiny
from jaxdp import training
from jaxdp.models.llama import Llama

# The TINY sizes of job_testing (1 block, width 32, 2 heads) plus Llama's own fields.
LLAMA = {"model.n_kv_head": 1, "model.d_ff": 64}


@pytest.fixture(scope="module")
def llama_run(corpus, tmp_path_factory):
    """An uninterrupted DP run of llama_tiny.py at the TINY sizes."""
    workdir = tmp_path_factory.mktemp("llama")
    summary = training.train(tiny_config(corpus, workdir, base=llama_tiny, **LLAMA), verbose=False)
    return workdir, summary


def test_llama_run_learns_and_generates(llama_run, corpus):
    workdir, summary = llama_run
    rows = training.read_metrics(workdir)
    assert [r["step"] for r in rows] == list(range(7))
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 2, 4, 6]
    eps = [r["epsilon"] for r in rows]
    assert eps == sorted(eps) and 0 < eps[-1] <= 8.0
    assert summary == json.loads((workdir / "summary.json").read_text())
    assert summary["model"] == "llama"
    assert summary["val_loss"] < summary["initial_val_loss"]
    assert (workdir / "samples.txt").read_text().count("[continuation]") == 1

    # The loaded model is the trained one: it reproduces the run's final validation loss.
    model, tokenizer, _ = training.load_for_generation(workdir)
    assert isinstance(model, Llama) and model.config.n_kv_head == 1
    p = training.prepare(tiny_config(corpus, workdir, base=llama_tiny, **LLAMA))
    val_loss = training.evaluate(model, p.valid, p.eval_indices, p.config.eval_batch_size)
    assert val_loss == pytest.approx(summary["val_loss"], rel=1e-5)
    ids = training.generate(model, tokenizer.encode("The Congress"), 5, seed=0)
    assert len(ids) == 5 and all(0 <= i < tokenizer.vocab_size for i in ids)

    out = run_cli([f"--workdir={workdir}", "--prompt=The Congress", "--num_tokens=5", "--num_samples=2"],
                  module="experiments.generate")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("The Congress") == 2


def test_llama_mesh_run_equals_single_device(llama_run, corpus, tmp_path):
    """5 steps on a (data, seq) = (2, 4) mesh of fake CPU devices (ZeRO-1, context parallel, remat="full")
    give the single-device run's train / validation losses and epsilons to 1e-4."""
    workdir, _ = llama_run
    config = tiny_config(corpus, tmp_path / "sharded", base=llama_tiny, remat="full",
                         mesh__data=2, mesh__seq=4, mesh__zero_stage=1, **LLAMA)
    training.train(config, interrupt_after=5, verbose=False)
    assert_first_metrics_equal(tmp_path / "sharded", workdir, num_rows=6)


@pytest.mark.parametrize("base,overrides,needle", [
    (llama_tiny, {"model.family": "gpt3"},
     r"config.model.family must be one of \('gpt2', 'llama', 'gemma2', 'gemma3_text'\), got 'gpt3'"),
    (default, {"model.family": "llama"}, r"family='llama' needs config.model.\{n_kv_head, d_ff, rope_theta"),
    (llama_tiny, {"model.family": "gpt2"}, r"family='gpt2' needs config.model.\{mlp_ratio\}"),
    (llama_tiny, {"model.n_kv_head": 3}, "divisible by config.model.n_kv_head"),
    (llama_tiny, {"model.d_model": 36, "model.n_head": 4}, "must be even for RoPE"),
    (llama_tiny, {"model.rope_scaling": 0.5}, "rope_scaling"),
], ids=["unknown_family", "llama_without_its_fields", "gpt2_without_its_fields", "n_kv_head", "odd_head_dim",
        "rope_scaling"])
def test_bad_model_config_is_rejected_before_touching_workdir(corpus, tmp_path, base, overrides, needle):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "keep.txt").write_text("precious")
    settings = dict(LLAMA, **overrides) if base is llama_tiny else overrides
    c = tiny_config(corpus, workdir, base=base, **settings)
    with pytest.raises(training.ConfigError, match=needle) as e:
        training.prepare(c)
    assert "\n" not in str(e.value)
    assert [p.name for p in workdir.iterdir()] == ["keep.txt"]
