"""The tripwires of every fine-tuning run (jaxdp.finetune.tripwires, jaxdp.training.finetune_checks) and the
init weights' fingerprint (jaxdp.training.init_weights).

Properties: a frozen leaf changed by one bit is caught and named; a run whose trainable leaves never moved is
caught; a LoRA merge that drops or doubles the product is caught, the real merge passes; the job's run passes
its tripwires and records them in summary.json, and a planted frozen-weight change fails the main with exit
status 1 naming the parameter, summary.json recording it and the outputs kept; the init fingerprint is the
same for a copy of an HF checkpoint with other files beside it and for a run directory whose params.npz was
written again, differs for other weights, and a run recorded with the old whole-directory hash still matches.
"""

import dataclasses
import json
import shutil
import types

import numpy as np
import pytest
from dp_testing import random_model, tiny_gpt2, tiny_llama
from flax import nnx
from job_testing import with_settings, write_tiny_corpus, write_tiny_hf_tokenizer

from experiments import finetune as finetune_main
from experiments.configs import finetune as finetune_config
from jaxdp.core import nn
from jaxdp.finetune import methods, tripwires
from jaxdp.models.gemma import Gemma, GemmaConfig
from jaxdp.models.hf import save_hf
from jaxdp.models.llama import Llama, LlamaConfig
from jaxdp.training import finetune_checks, finetune_job, init_weights, run_dir


def lora_model(seed=0):
    model = tiny_gpt2(seed)
    methods.prepare(model, "lora", rngs=nnx.Rngs(seed), options=methods.LoRA(rank=2))
    return model


def first_leaf(model, kind):
    return nnx.to_flat_state(nnx.state(model, kind))[0]


def test_a_changed_frozen_leaf_is_named():
    model = lora_model()
    loaded = tripwires.digests(model, nn.Frozen)
    assert tripwires.check_frozen(loaded, model) == len(loaded) > 0
    path, var = first_leaf(model, nn.Frozen)
    value = np.array(var.get_value())
    value.reshape(-1).view(np.uint32)[0] ^= 1  # one bit
    var.set_value(value)
    with pytest.raises(tripwires.TripwireError, match=f"frozen parameter {'/'.join(map(str, path))} changed"):
        tripwires.check_frozen(loaded, model)


def test_trainable_leaves_that_never_moved_are_caught():
    model = lora_model()
    initial = tripwires.digests(model, nnx.Param)
    with pytest.raises(tripwires.TripwireError, match="no trainable parameter changed"):
        tripwires.check_trained(initial, model)
    _, var = first_leaf(model, nnx.Param)
    var.set_value(var.get_value() + 1e-3)
    assert tripwires.check_trained(initial, model) == 1


def trained_lora(seed=0):
    model = lora_model(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):  # a trained B: away from its zero init
        var.set_value(0.3 * np.random.default_rng(len(path)).standard_normal(var.get_value().shape))
    return model


def test_the_lora_merge_reproduces_the_logits_and_bad_merges_are_caught():
    model = trained_lora()
    probe = tripwires.probe_tokens(97, 32)
    result = tripwires.check_lora_merge(model, probe)
    assert result["max_abs_diff"] <= result["tolerance"] and result["merged"] == 2

    def dropped(m):  # the base kernels put back without the product
        for path, node in list(nnx.iter_graph(m)):
            if isinstance(node, methods.LoRALinear):
                node.lora_b.kernel.set_value(0 * node.lora_b.kernel.get_value())
        return methods.merge_lora(m)

    def doubled(m):
        for path, node in list(nnx.iter_graph(m)):
            if isinstance(node, methods.LoRALinear):
                node.scale *= 2
        return methods.merge_lora(m)
    for planted in (dropped, doubled):
        with pytest.raises(tripwires.TripwireError, match="LoRA-merged model's logits differ"):
            tripwires.check_lora_merge(model, probe, merge=planted)
    assert tripwires.check_lora_merge(model, probe) == result  # the model was left as it was


def bf16_gemma():
    config = GemmaConfig(vocab_size=97, seq_len=32, n_layer=2, n_head=2, n_kv_head=1, d_model=16, d_ff=32, head_dim=8,
                         query_pre_attn_scalar=12.0, sliding_window=8, dtype="bfloat16")
    return Gemma(config, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("build", [lambda: tiny_gpt2(0, dtype="bfloat16"), lambda: tiny_llama(0, dtype="bfloat16"),
                                   bf16_gemma], ids=["gpt2", "llama", "gemma2"])
def test_a_bfloat16_model_passes_the_merge_check_and_a_bad_merge_still_fails(build):
    """bfloat16 compute rounds the merged and unmerged paths apart by ~1e-2 here: the check runs in float32
    (a bfloat16 run's good merge would otherwise fail), and a doubled LoRA scale is still caught."""
    model = build()
    methods.prepare(model, "lora", rngs=nnx.Rngs(0), options=methods.LoRA(rank=2))
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        var.set_value(0.3 * np.random.default_rng(len(path)).standard_normal(var.get_value().shape).astype(np.float32))
    probe = tripwires.probe_tokens(97, 32)
    result = tripwires.check_lora_merge(model, probe)
    assert result["max_abs_diff"] <= result["tolerance"]
    assert any(getattr(node, "dtype", None) is not None and np.dtype(node.dtype) == np.dtype("bfloat16")
               for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Module))  # the model itself untouched

    def doubled(m):
        for _, node in list(nnx.iter_graph(m)):
            if isinstance(node, methods.LoRALinear):
                node.scale *= 2
        return methods.merge_lora(m)
    with pytest.raises(tripwires.TripwireError, match="LoRA-merged model's logits differ"):
        tripwires.check_lora_merge(model, probe, merge=doubled)


SETTINGS = {"seed": 0, "steps": 2, "checkpoint_every": 2, "log_every": 1, "eval_every": 2, "eval_windows": 8,
            "eval_batch_size": 8, "batch_size": 8, "seq_len": 32, "learning_rate": 1e-2, "warmup_steps": 1,
            "data.validation_fraction": 0.2, "finetune.rank": 4, "finetune.accuracy_examples": 0,
            "finetune.loss_after": "", "compilation_cache_dir": ""}


@pytest.fixture(scope="module")
def hf_init(tmp_path_factory):
    """A tiny HF Llama checkpoint with a tokenizer.json trained on a tiny corpus; the corpus."""
    d = tmp_path_factory.mktemp("tripwires")
    corpus = write_tiny_corpus(d)
    hf = d / "llama"
    hf.mkdir()
    tok = write_tiny_hf_tokenizer(corpus, hf)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), seq_len=32, n_layer=1, n_head=2, n_kv_head=1, d_model=16,
                         d_ff=32)
    save_hf(random_model(lambda: Llama(config, rngs=nnx.Rngs(0)), seed=1), hf)
    return hf, corpus


def job_config(hf_init, workdir):
    hf, corpus = hf_init
    return with_settings(finetune_config.get_config(), dict(SETTINGS, **{
        "workdir": str(workdir), "data.path": str(corpus), "finetune.init": str(hf),
        "data.cache_dir": str(workdir.parent / "cache")}), {})


def test_the_job_passes_its_tripwires_and_a_planted_change_fails_it(hf_init, tmp_path, monkeypatch, capsys):
    config = job_config(hf_init, tmp_path / "run")
    monkeypatch.setattr(finetune_main, "_CONFIG", types.SimpleNamespace(value=config))
    assert finetune_main.main([]) == 0
    summary = json.loads((tmp_path / "run" / run_dir.SUMMARY_FILE).read_text())
    assert summary["tripwires"]["passed"] and summary["tripwires"]["frozen_leaves_unchanged"] > 0
    assert summary["tripwires"]["trainable_leaves_changed"].startswith(("1 of", "2 of", "3 of", "4 of"))
    assert summary["tripwires"]["lora_merge"]["max_abs_diff"] <= summary["tripwires"]["lora_merge"]["tolerance"]
    outputs = sorted(f.name for f in (tmp_path / "run").iterdir())

    real = finetune_checks.final_model

    def planted(p):  # a frozen leaf of the final state changed (what an update reaching it would do)
        before, trained, step = real(p)
        path, var = first_leaf(trained, nn.Frozen)
        var.set_value(var.get_value() * 1.5)
        planted.path = "/".join(map(str, path))
        return before, trained, step
    monkeypatch.setattr(finetune_checks, "final_model", planted)
    capsys.readouterr()
    assert finetune_main.main([]) == 1  # the rerun of the finished run: checked again
    err = capsys.readouterr().err
    assert f"error: tripwire failed: frozen parameter {planted.path} changed" in err
    summary = json.loads((tmp_path / "run" / run_dir.SUMMARY_FILE).read_text())
    assert summary["tripwires"]["passed"] is False and planted.path in summary["tripwires"]["failure"]
    assert sorted(f.name for f in (tmp_path / "run").iterdir()) == outputs  # nothing deleted


def test_the_init_fingerprint_is_the_weights_not_the_directory(hf_init, tmp_path):
    hf, _ = hf_init
    before = init_weights.init_sha256(hf)
    copy = tmp_path / "copy"
    shutil.copytree(hf, copy)
    (copy / "README.md").write_text("notes")
    (copy / "summary.json").write_text("{}")
    assert init_weights.init_sha256(copy) == before
    assert run_dir.tree_sha256(copy) != run_dir.tree_sha256(hf)  # the old hash: the directory's bytes
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config, indent=4, sort_keys=True))  # same config, other bytes
    assert init_weights.init_sha256(copy) == before
    checkpoint = Llama(LlamaConfig(vocab_size=config["vocab_size"], seq_len=32, n_layer=1, n_head=2, n_kv_head=1,
                                   d_model=16, d_ff=32), rngs=nnx.Rngs(5))
    save_hf(checkpoint, copy)  # other weights
    assert init_weights.init_sha256(copy) != before
    legacy = run_dir.tree_sha256(hf)
    assert init_weights.matches(legacy, hf) and init_weights.matches(before, hf)
    assert not init_weights.matches(before, copy)


def test_a_run_directory_fingerprint_ignores_how_params_npz_was_written(tmp_path):
    run = tmp_path / "run"
    (run / run_dir.TOKENIZER_DIR).mkdir(parents=True)
    (run / run_dir.TOKENIZER_DIR / "tokenizer.json").write_text("{}")
    (run / run_dir.CONFIG_FILE).write_text(json.dumps({"model": {"n_layer": 1}, "steps": 3}))
    model = tiny_gpt2(0)
    run_dir.write_model(run / run_dir.MODEL_DIR, model)
    before = init_weights.init_sha256(run)
    (run / run_dir.CONFIG_FILE).write_text(json.dumps({"model": {"n_layer": 1}, "steps": 3, "note": "timing"}))
    (run / "token_cache.json").write_text("{}")
    run_dir.write_model(run / run_dir.MODEL_DIR, model)  # written again
    assert init_weights.init_sha256(run) == before
    _, var = first_leaf(model, nnx.Param)
    var.set_value(var.get_value() + 1)
    run_dir.write_model(run / run_dir.MODEL_DIR, model)
    assert init_weights.init_sha256(run) != before


def test_untrained_model_accepts_a_copy_of_the_init(hf_init, tmp_path):
    """The job's record (config.json's finetune.init_sha256) is the weights' fingerprint."""
    p = finetune_job.prepare(job_config(hf_init, tmp_path / "run"))
    assert p.config_json["finetune"]["init_sha256"] == init_weights.init_sha256(hf_init[0])
    assert dataclasses.is_dataclass(p)
