"""The fine-tuning job (jaxdp.training.finetune_job, jaxdp.data.tasks, experiments/finetune.py) on tiny inputs.

Properties: a synthetic file in the format of the vaderSentiment sdist's Rotten Tomatoes snippets,
read through the sdist's nested archives, becomes the sentiment jsonl; a tiny GPT-2 run directory
(pretrain_gpt2's layout: config.json, tokenizer/, model/params.npz) fine-tuned with DP-LoRA for 3
steps keeps every frozen parameter bit for bit and moves the trainable ones, and leaves the run
directory of the pretraining job (privacy.json, metrics, summary with the held-out accuracy);
interrupted and resumed equals uninterrupted; bad input is one line before the workdir is touched;
an HF checkpoint initialises with the GPT-2 tokenizer; an HF Llama checkpoint with the tokenizer.json
beside it (its own end-of-text token) trains DP-LoRA on q and v, GPT-2-only methods refused; the accuracy's log-probabilities are the
language model's, and its label / predicted fractions and majority-class baseline are what they say; the
loss counts the label only (config.finetune.loss_after) or, with '', the text; a soft prompt that overflows
the init's positions shortens seq_len (one note, config.json records it); a rerun rewrites no accuracy.
"""

import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

import jax
import numpy as np
import pytest
from flax import nnx
from job_testing import with_settings

from experiments.configs import finetune as finetune_config
from jaxdp import training
from jaxdp.core import nn
from jaxdp.core.losses import completion_losses, lm_losses
from jaxdp.data import tasks
from jaxdp.data.tokenizer import Tokenizer, train_bpe_tokenizer
from jaxdp.finetune import methods as finetune
from jaxdp.models.gpt2 import GPT2, GPT2Config
from jaxdp.models.hf_gpt2 import save_hf_gpt2
from jaxdp.models.hf_llama import save_hf_llama
from jaxdp.models.llama import Llama, LlamaConfig
from jaxdp.training import finetune_job, run_dir
from jaxdp.training import receipt as receipt_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
GOOD = ("a gorgeous, moving film", "sharp and funny", "the best picture of the year", "a warm delight")
BAD = ("a tedious mess", "dull and lifeless", "the worst script in years", "an ugly bore")
MODEL = {"family": "gpt2", "n_layer": 1, "n_head": 2, "d_model": 32, "mlp_ratio": 4, "max_seq_len": 32}
TINY = {"seed": 0, "steps": 3, "checkpoint_every": 2, "log_every": 1, "eval_every": 2, "eval_windows": 8,
        "eval_batch_size": 8, "batch_size": 8, "seq_len": 32, "learning_rate": 1e-2, "warmup_steps": 1,
        "data.validation_fraction": 0.2, "finetune.rank": 4, "finetune.accuracy_examples": 16}


def snippets_file_text(n=120) -> str:
    """Lines of movieReviewSnippets_GroundTruth.txt: ID<tab>RATING<tab>SNIPPET, CRLF; one rated 0."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(1, n + 1):
        positive = i % 2 == 0
        score = 0.0 if i == 7 else float(rng.uniform(0.2, 3.5)) * (1 if positive else -1)
        words = GOOD if positive else BAD
        lines.append(f"{i}\t{score:.11g}\t{words[i % 4]}, {words[(i // 4) % 4]} ({i}).")
    return "\r\n".join(lines) + "\r\n"


def _tar_gz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """(the sentiment jsonl, the parsed snippets): from a fake sdist nested like vaderSentiment-3.3.2's."""
    d = tmp_path_factory.mktemp("task")
    inner = _tar_gz({tasks.SNIPPETS_FILE: snippets_file_text().encode()})
    sdist = d / "vaderSentiment-3.3.2.tar.gz"
    sdist.write_bytes(_tar_gz({f"vaderSentiment-3.3.2/{tasks.INNER_ARCHIVE}": inner}))
    snippets = tasks.read_snippets(sdist)
    (d / "plain.txt").write_text(snippets_file_text())
    assert snippets == tasks.read_snippets(d / "plain.txt")  # the sdist and the extracted file agree
    path = d / "sentiment.jsonl"
    assert tasks.write_sentiment_jsonl(snippets, path) == len(snippets) - 1  # the neutral one dropped
    return path, snippets


def test_other_domains_of_the_archive(tmp_path):
    """Amazon / NYT ids are text ("1_2"); a domain is read from its own member; bad domains are named."""
    amazon = "1_1\t-0.9\tno picture at all.\r\n1_2\t1.5\tworks great.\r\n"
    archive = tmp_path / "hutto_ICWSM_2014.tar.gz"
    archive.write_bytes(_tar_gz({tasks.SNIPPETS_FILE: snippets_file_text(4).encode(),
                                 tasks.DOMAINS["amazon"]: amazon.encode()}))
    assert tasks.read_snippets(archive, "amazon") == [("1_1", -0.9, "no picture at all."), ("1_2", 1.5, "works great.")]
    assert [uid for uid, _, _ in tasks.read_snippets(archive)] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"domain must be one of \['amazon', 'movie', 'nyt', 'tweets'\], got 'imdb'"):
        tasks.read_snippets(archive, "imdb")
    with pytest.raises(ValueError, match="holds neither .* nor hutto_ICWSM_2014/tweets_GroundTruth.txt"):
        tasks.read_snippets(archive, "tweets")
    out = tmp_path / "other.jsonl"
    cli = [sys.executable, "-m", "experiments.rotten_tomatoes", f"--source={archive}", f"--out={out}"]
    done = subprocess.run(cli + ["--domains=movie,amazon"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [
        "movie:1", "movie:2", "movie:3", "movie:4", "amazon:1_1", "amazon:1_2"]
    bad = subprocess.run(cli + ["--domains=movie,imdb"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --domains") and "imdb" in bad.stderr


@pytest.fixture(scope="module")
def init_run(task, tmp_path_factory):
    """A tiny GPT-2 in a pretrain_gpt2 run directory (the files fine-tuning reads from it)."""
    d = tmp_path_factory.mktemp("pretrained")
    docs = [json.loads(line)["text"] for line in task[0].read_text().splitlines()]
    tokenizer = train_bpe_tokenizer(docs, 300)
    tokenizer.save(d / run_dir.TOKENIZER_DIR)
    (d / run_dir.CONFIG_FILE).write_text(json.dumps({"model": MODEL, "dtype": "float32"}))
    mc = training.model_config(MODEL, tokenizer.vocab_size, dtype="float32", remat=False)
    run_dir.write_model(d / run_dir.MODEL_DIR, training.build_model(mc, 1))
    return d


def config_of(task, init, workdir, **overrides):
    c = finetune_config.get_config()
    settings = dict(TINY, workdir=str(workdir), **{"data.path": str(task[0]), "finetune.init": str(init),
                                                   "data.cache_dir": str(pathlib.Path(task[0]).parent / "cache")})
    return with_settings(c, settings, overrides)


def run_job(config, **kw):
    p = finetune_job.prepare(config)
    out = training.train(p.config, prepared=p, verbose=False, **kw)
    return p, out


def checkpoint_model(p):
    """The model as training left it: every variable (trainable and frozen) from the final checkpoint."""
    model = p.build_model(p.derive_seed("init"))
    ckpt = run_dir.Checkpointer(p.workdir / run_dir.CHECKPOINT_DIR)
    ckpt.restore_model(ckpt.latest_step(), model)
    ckpt.close()
    return model


def flat(model, kind):
    return {tuple(k): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model, kind))}


@pytest.fixture(scope="module")
def lora_run(task, init_run, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("runs") / "lora"
    p, summary = run_job(config_of(task, init_run, workdir))
    accuracy = finetune_job.add_accuracy(p)
    return p, summary, accuracy


def test_frozen_parameters_stay_trainable_ones_move(lora_run):
    p, summary, accuracy = lora_run
    before, after = p.build_model(p.derive_seed("init")), checkpoint_model(p)
    frozen = flat(before, nn.Frozen)
    assert len(frozen) == 4 + 12 * MODEL["n_layer"]  # every parameter of the pretrained GPT-2
    for path, value in flat(after, nn.Frozen).items():
        np.testing.assert_array_equal(value, frozen[path])
    trained, initial = flat(after, nnx.Param), flat(before, nnx.Param)
    assert sorted(path[-2] for path in trained) == ["lora_a", "lora_b"]
    assert all(not np.array_equal(trained[k], initial[k]) for k in trained)
    assert summary["num_params"] == sum(v.size for v in trained.values())  # trainable only
    # model/params.npz (the shareable result) holds the trained parameters, and load_finetuned puts them back
    for path, value in flat(finetune_job.load_finetuned(p), nnx.Param).items():
        np.testing.assert_array_equal(value, trained[path])


def test_run_directory_of_the_pretraining_job(lora_run, init_run):
    p, summary, accuracy = lora_run
    for name in ("config.json", "metrics.jsonl", "summary.json", "privacy.json", "model/params.npz",
                 "tokenizer/tokenizer.json"):
        assert (p.workdir / name).is_file(), name
    assert [r["step"] for r in training.read_metrics(p.workdir)] == [0, 1, 2, 3]
    receipt = json.loads((p.workdir / "privacy.json").read_text())
    assert receipt["dp"] and 0 < receipt["epsilon"] <= 8 and receipt["unit"] == "document"
    assert "accuracy" in json.dumps(receipt["outside_the_guarantee"])
    # the init weights: needed to use the model, outside this epsilon (the attacker's review, 2026-11-24)
    # the tokenizer is the init's, not learned from this run's data (attacker review 8)
    assert receipt["guarantee"].endswith("given the number N of training documents and the init weights and their "
                                         "tokenizer (see outside_the_guarantee)")
    assert "tokenizer/ (the init's)" in receipt["outside_the_guarantee"]
    assert not any("trained bpe" in k for k in receipt["outside_the_guarantee"])
    assert receipt["init_weights"]["name"] == init_run.name and "the init weights (config.finetune.init)" in \
        receipt["outside_the_guarantee"]
    assert receipt["init_weights"]["sha256"] == p.init_key and str(init_run.parent) not in json.dumps(receipt)
    assert receipt["init_weights"]["their_guarantee"].startswith("unknown")  # init_run has no privacy.json
    (init_run / "privacy.json").write_text(json.dumps({"dp": True, "guarantee": "(2, 1e-05)-DP for ..."}))
    try:
        known = receipt_lib._init_weights(p)["their_guarantee"]
    finally:
        (init_run / "privacy.json").unlink()
    assert known == "(2, 1e-05)-DP for ..."
    # review 14: a run-directory init without privacy.json was "unknown" even when its config.json says it ran
    # without DP on this very data (its tokenizer was then called "not learned from this run's data")
    original = (init_run / "config.json").read_text()
    copy, other = init_run.parent / "copy.jsonl", init_run.parent / "other.jsonl"
    copy.write_bytes(pathlib.Path(p.config.data.path).read_bytes())  # review 15: a copy is the same data
    other.write_text('{"text": "other data"}\n')
    for enabled, path, expected, same, tokenizer_note in (
            (False, p.config.data.path, "none: the init run trained without DP", True, "without privacy"),
            (False, str(copy), "none: the init run trained without DP", True, "without privacy"),
            (True, str(other), "not stated: an unfinished DP run", False, "not learned from this run's data"),
            (True, "relative/elsewhere.jsonl", "not stated: an unfinished DP run", "unknown", "could not be compared")):
        (init_run / "config.json").write_text(json.dumps({"model": MODEL, "dtype": "float32",
                                                          "dp": {"enabled": enabled}, "data": {"path": path}}))
        try:
            init = receipt_lib._init_weights(p)
            outside = receipt_lib.privacy_receipt(p.config, p, steps=3, epsilon=1.0,
                                                  overflowed_steps=0)["outside_the_guarantee"]
        finally:
            (init_run / "config.json").write_text(original)
        assert init["their_guarantee"].startswith(expected) and init["trained_on_this_data"] == same, path
        assert tokenizer_note in outside["tokenizer/ (the init's)"], path
    saved = json.loads((p.workdir / "config.json").read_text())
    assert saved["model"] == MODEL and saved["data"]["tokenizer"] == str((init_run / "tokenizer").resolve())
    assert p.tokenizer.fingerprint == Tokenizer.load(init_run / "tokenizer").fingerprint
    on_disk = json.loads((p.workdir / "summary.json").read_text())["heldout_accuracy"]
    assert on_disk == accuracy and accuracy["examples"] == min(16, len(finetune_job.heldout_documents(p.config)))
    assert 0 <= accuracy["accuracy"] <= 1 and accuracy["examples"] > 0


def test_interrupt_and_resume_equals_uninterrupted(lora_run, task, init_run, tmp_path):
    """Also (attacker review 14): other init weights under the same finetune.init path are refused on resume
    (the trainable weights had trained on the old ones; privacy.json would quote the new ones)."""
    p_full, _, _ = lora_run
    init = tmp_path / "init"
    shutil.copytree(init_run, init)
    config = config_of(task, init, tmp_path / "resumed")
    _, out = run_job(config, interrupt_after=3)  # checkpoint at 2, metrics of step 3 written
    assert out == {"interrupted_at": 3}
    params = init / run_dir.MODEL_DIR / run_dir.PARAMS_FILE
    original = params.read_bytes()
    mc = training.model_config(MODEL, Tokenizer.load(init / "tokenizer").vocab_size, dtype="float32", remat=False)
    run_dir.write_model(init / run_dir.MODEL_DIR, training.build_model(mc, 2))
    with pytest.raises(training.ConfigError, match="trained from other init weights"):
        run_job(config)
    params.write_bytes(original)
    p, _ = run_job(config)
    assert (p.workdir / "metrics.jsonl").read_bytes() == (p_full.workdir / "metrics.jsonl").read_bytes()
    full, resumed = flat(checkpoint_model(p_full), nnx.Param), flat(checkpoint_model(p), nnx.Param)
    for path in full:
        np.testing.assert_array_equal(resumed[path], full[path])


def test_a_fine_tuning_run_is_not_an_init(lora_run, task, tmp_path):
    """Attacker review 15: a fine-tuning run directory given as finetune.init failed with a raw KeyError."""
    p, _, _ = lora_run
    with pytest.raises(training.ConfigError, match="is a fine-tuning run") as e:
        finetune_job.prepare(config_of(task, p.workdir, tmp_path / "chained"))
    assert "\n" not in str(e.value)


def test_generation_reads_a_fine_tuning_run(lora_run, init_run, tmp_path):
    """`experiments.generate` on a fine-tuning run (the fresh-user walkthrough: a KeyError, since model/ holds
    only the trained LoRA parameters): the init weights with the run's parameters on them, logits equal to the
    job's own model; a moved init is one line naming it; a soft prompt leaves fewer positions for tokens."""
    p, _, _ = lora_run
    model, tokenizer, _ = training.load_for_generation(p.workdir)
    tokens = np.random.default_rng().integers(0, tokenizer.vocab_size, (2, 16)).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(finetune_job.load_finetuned(p)(tokens)))
    assert len(training.generate(model, [1, 2, 3], 4, seed=0)) == 4
    moved = tmp_path / "run"
    shutil.copytree(p.workdir, moved)
    cfg = json.loads((moved / run_dir.CONFIG_FILE).read_text())
    cfg["finetune"]["init"] = str(tmp_path / "gone")
    (moved / run_dir.CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(training.ConfigError, match="this is a fine-tuning run: .* trained, which go on its init") as e:
        training.load_for_generation(moved)
    assert "\n" not in str(e.value)
    # The same files elsewhere load; other weights under the init path are refused (attacker review 19: up to
    # 0.72 of logit silently off), and config.json keeps the init as an absolute path.
    assert json.loads((p.workdir / run_dir.CONFIG_FILE).read_text())["finetune"]["init"] == str(init_run.resolve())
    shutil.copytree(init_run, tmp_path / "copy")
    cfg["finetune"]["init"] = str(tmp_path / "copy")
    (moved / run_dir.CONFIG_FILE).write_text(json.dumps(cfg))
    np.testing.assert_array_equal(np.asarray(training.load_for_generation(moved)[0](tokens)), np.asarray(model(tokens)))
    mc = training.model_config(MODEL, tokenizer.vocab_size, dtype="float32", remat=False)
    run_dir.write_model(tmp_path / "copy" / run_dir.MODEL_DIR, training.build_model(mc, 7))
    with pytest.raises(training.ConfigError, match="not those the run trained from"):
        training.load_for_generation(moved)
    full = dict(cfg, finetune=dict(cfg["finetune"], method="full", init=str(tmp_path / "gone")))
    assert isinstance(finetune_job.untrained_model(full, mc, moved), GPT2)  # model/ holds every parameter
    prompted = finetune.add_soft_prompt(nnx.clone(model), length=5, rngs=nnx.Rngs(0))
    assert len(training.generate(prompted, list(range(40)), 3, seed=0)) == 3  # seq_len 32 - 5 positions
    with pytest.raises(ValueError, match="top_k must be"):
        training.generate(model, [1], 1, top_k=-5)


def test_init_fingerprint_follows_symlinks_and_skips_the_run(tmp_path):
    """Attacker review 15: `tree_sha256` did not enter a symlinked folder (other weights behind
    init/model -> elsewhere passed the resume check), and a run directory inside the init folder changed the
    hash with each of its own checkpoints (its resume was refused)."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "params.npz").write_bytes(b"weights A")
    init = tmp_path / "init"
    init.mkdir()
    (init / "config.json").write_text("{}")
    (init / "model").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (init / "loop").symlink_to(init, target_is_directory=True)  # a cycle is walked once
    run = init / "finetunes" / "ft1"
    run.mkdir(parents=True)
    before = run_dir.tree_sha256(init, exclude=run)
    (run / "checkpoint").write_bytes(b"step 2")
    assert run_dir.tree_sha256(init, exclude=run) == before
    (tmp_path / "elsewhere" / "params.npz").write_bytes(b"weights B")
    assert run_dir.tree_sha256(init, exclude=run) != before


def _unchanged(workdir):
    workdir.mkdir()
    (workdir / "keep.txt").write_text("precious")
    return {f.name: f.read_bytes() for f in workdir.iterdir()}


@pytest.mark.parametrize("overrides,needle", [
    ({"finetune.method": "prefix"}, "config.finetune.method must be one of"),
    ({"finetune.init": "/nonexistent/run"}, "is not a directory"),
    ({"finetune.init": None}, "config.finetune.init is required"),
    ({"data.tokenizer": "gpt2"}, "config.data.tokenizer must be 'init'"),
    ({"finetune.rank": 0}, "config.finetune: rank must be"),
    ({"finetune.lora_targets": ("attn/nope",)}, "config.finetune.lora_targets: 'attn/nope' names no projection of a gpt2"),
    ({"mesh.data": 2}, "single-device step"),
    ({"finetune.method": "prompt", "finetune.prompt_length": 32}, r"prompt_length \(32\) leaves no position"),
    ({"finetune.method": "prompt", "seq_len": 24, "finetune.prompt_length": 4, "sample.num": 1}, "sample.num"),
    ({"finetune.loss_after": "\nVerdict:"}, "Verdict:' is followed by no target in any training window"),
])
def test_bad_input_is_one_line_before_the_workdir_is_touched(task, init_run, tmp_path, overrides, needle):
    workdir = tmp_path / "run"
    before = _unchanged(workdir)
    with pytest.raises(training.ConfigError, match=needle) as e:
        finetune_job.prepare(config_of(task, init_run, workdir, **overrides))
    assert "\n" not in str(e.value)
    assert {f.name: f.read_bytes() for f in workdir.iterdir()} == before


def test_the_loss_counts_the_label_or_the_whole_text(lora_run, task, init_run, tmp_path):
    p, _, _ = lora_run  # the shipped config: the text after "\nSentiment:" (jaxdp.data.tasks.PROMPT)
    assert p.config.finetune.loss_after == tasks.PROMPT
    assert p.loss_fn is completion_losses(p.tokenizer.encode(tasks.PROMPT))
    for whole_text in ("", None):
        whole = finetune_job.prepare(config_of(task, init_run, tmp_path / "run", finetune__loss_after=whole_text))
        assert whole.loss_fn is lm_losses and not (tmp_path / "run").exists()


def test_init_run_without_parameters_is_refused_before_the_workdir(task, init_run, tmp_path):
    """A pretraining run killed before its first checkpoint (config.json, tokenizer/, an empty checkpoints/)."""
    import shutil
    shutil.copytree(init_run, tmp_path / "killed", ignore=shutil.ignore_patterns(run_dir.MODEL_DIR))
    (tmp_path / "killed" / run_dir.CHECKPOINT_DIR).mkdir()
    with pytest.raises(training.ConfigError, match="has no parameters yet"):
        finetune_job.prepare(config_of(task, tmp_path / "killed", tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_cli_bad_method_exits_2_with_one_line(task, init_run, tmp_path):
    workdir = tmp_path / "cli"
    out = subprocess.run([sys.executable, "-m", "experiments.finetune", f"--config.workdir={workdir}",
                          f"--config.finetune.init={init_run}", f"--config.data.path={task[0]}",
                          "--config.finetune.method=prefix"], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-2000:]
    assert "config.finetune.method" in lines[0] and not workdir.exists()


def test_cli_prompt_notes_the_shortened_seq_len_and_prints_the_baseline(task, init_run, tmp_path):
    """`experiments.finetune --config.finetune.method=prompt` from a default-shaped init: exit 0, one `note:`
    line on stderr naming the seq_len that ran, and the accuracy printed against the majority class."""
    workdir = tmp_path / "cli"
    flags = [f"--config.{k}={v}" for k, v in dict(TINY, steps=1, checkpoint_every=1, eval_every=1).items()]
    out = subprocess.run([sys.executable, "-m", "experiments.finetune", f"--config.workdir={workdir}",
                          f"--config.finetune.init={init_run}", f"--config.data.path={task[0]}",
                          f"--config.data.cache_dir={tmp_path / 'cache'}", "--config.finetune.method=prompt",
                          "--config.finetune.prompt_length=4", *flags], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-2000:]
    notes = [line for line in out.stderr.splitlines() if "note:" in line]
    assert len(notes) == 1 and notes[0].startswith("note: config.seq_len 32 + config.finetune.prompt_length 4"), \
        out.stderr[-2000:]
    assert "config.seq_len=28" in notes[0] and json.loads((workdir / "config.json").read_text())["seq_len"] == 28
    accuracy = json.loads((workdir / "summary.json").read_text())["heldout_accuracy"]
    lines = out.stdout.splitlines()
    (i,) = [i for i, line in enumerate(lines) if line.strip().startswith("accuracy")]
    assert f"{accuracy['accuracy']:.4f} on {accuracy['examples']} held-out snippets (majority class " \
        f"{accuracy['majority_class_accuracy']:.4f}" in lines[i]
    assert lines[i + 1].strip() == tasks.against_majority(accuracy)


def test_hf_checkpoint_initialises_with_the_gpt2_tokenizer(task, tmp_path):
    """An HF checkpoint written by save_hf_gpt2: the GPT-2 tokenizer, its shape, its weights frozen."""
    hf = GPT2(GPT2Config(vocab_size=50257, seq_len=32, n_layer=1, n_head=2, d_model=16), rngs=nnx.Rngs(3))
    save_hf_gpt2(hf, tmp_path / "hf")
    p = finetune_job.prepare(config_of(task, tmp_path / "hf", tmp_path / "run", finetune__method="bitfit"))
    assert p.tokenizer.name == "gpt2" and p.config.data.tokenizer == "gpt2"
    assert p.model_config.d_model == 16 and p.config.model.max_seq_len == 32
    model = p.build_model(0)
    weights = {tuple(k): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(hf))}
    for path, value in {**flat(model, nn.Frozen), **flat(model, nnx.Param)}.items():
        np.testing.assert_array_equal(value, weights[path])
    assert all(path[-1] == "bias" for path in flat(model, nnx.Param))
    assert not (tmp_path / "run").exists()
    small = GPT2(GPT2Config(vocab_size=300, seq_len=32, n_layer=1, n_head=2, d_model=16), rngs=nnx.Rngs(3))
    save_hf_gpt2(small, tmp_path / "hf300")
    with pytest.raises(training.ConfigError, match="vocab_size .300. differs"):
        finetune_job.prepare(config_of(task, tmp_path / "hf300", tmp_path / "run"))


def llama_tokenizer_dir(task, d):
    """A Llama-style tokenizer directory: tokenizer.json without <|endoftext|>, tokenizer_config.json naming
    </s> as its end of sequence (HF's layout)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    docs = [json.loads(line)["text"] for line in task[0].read_text().splitlines()]
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}, "bos_token": "<s>"}))
    return tok


def test_hf_llama_checkpoint_trains_lora_with_its_own_tokenizer(task, tmp_path):
    """An HF Llama directory (save_hf_llama + tokenizer.json): the model and tokenizer are the checkpoint's,
    documents end with its </s>, LoRA defaults to q_proj and v_proj, the frozen weights stay the
    checkpoint's bit for bit after DP training, and GPT-2-only methods are one-line errors."""
    hf_dir = tmp_path / "llama"
    vocab = llama_tokenizer_dir(task, hf_dir).get_vocab_size(with_added_tokens=True)
    llama = Llama(LlamaConfig(vocab_size=vocab, seq_len=32, n_layer=1, n_head=2, n_kv_head=1, d_model=16, d_ff=32,
                              rms_norm_eps=1e-5), rngs=nnx.Rngs(4))
    save_hf_llama(llama, hf_dir)
    p, summary = run_job(config_of(task, hf_dir, tmp_path / "run", steps=2, checkpoint_every=2))
    assert p.tokenizer.eot_token == "</s>" and p.tokenizer.eot_id == p.tokenizer._tok.token_to_id("</s>")
    assert p.config.model.family == "llama" and p.config.model.n_kv_head == 1
    assert p.config.data.tokenizer == str(hf_dir.resolve())
    assert (p.train.get(np.arange(len(p.train)))[..., :-1] == p.tokenizer.eot_id).any()  # documents end with </s>
    after = checkpoint_model(p)
    assert after.config.rms_norm_eps == 1e-5  # the checkpoint's, not LlamaConfig's default
    weights = flat(llama, nnx.Param)
    frozen = flat(after, nn.Frozen)
    assert len(frozen) == len(weights)
    for path, value in frozen.items():
        np.testing.assert_array_equal(value, weights[tuple(k for k in path if k != "base")])
    trained = flat(after, nnx.Param)
    assert sorted({path[-3] for path in trained}) == ["q_proj", "v_proj"] and summary["num_params"] > 0
    for method in ("side", "prompt", "reversible"):
        with pytest.raises(training.ConfigError, match=f"method '{method}' is built on GPT-2's modules") as e:
            finetune_job.prepare(config_of(task, hf_dir, tmp_path / "refused", finetune__method=method))
        assert "\n" not in str(e.value) and not (tmp_path / "refused").exists()
    weights = (hf_dir / "model.safetensors").read_bytes()   # attacker review 8: a corrupt weights file is one
    (hf_dir / "model.safetensors").write_bytes(weights[:-64])  # line from prepare, before the job writes anything
    with pytest.raises(training.ConfigError, match=r"config.finetune.init: .*model.safetensors: tensor") as e:
        finetune_job.prepare(config_of(task, hf_dir, tmp_path / "refused"))
    assert "\n" not in str(e.value) and not (tmp_path / "refused").exists()
    (hf_dir / "tokenizer.json").unlink()
    with pytest.raises(training.ConfigError, match="needs the tokenizer it was trained with"):
        finetune_job.prepare(config_of(task, hf_dir, tmp_path / "refused"))


def test_accuracy_rows_read_the_run(lora_run, tmp_path):
    """Also a run directory written before the accuracy fields were named for what they count
    ("positive_fraction": of the labels): the labels' fraction and the baseline, the predictions' unknown."""
    p, summary, accuracy = lora_run
    (row,) = finetune_job.accuracy_rows([p.workdir])
    assert row["method"] == "lora" and row["dp"] and row["epsilon"] == summary["epsilon"] < float("inf")
    assert {k: row[k] for k in finetune_job.ACCURACY_FIELDS} == accuracy and accuracy["examples"] > 0
    with pytest.raises(ValueError, match="not a finished fine-tuning run"):
        finetune_job.accuracy_rows([tmp_path])
    old = tmp_path / "old"
    shutil.copytree(p.workdir, old)
    stored = json.loads((old / "summary.json").read_text())
    stored["heldout_accuracy"] = {"accuracy": 0.518, "examples": 1000, "positive_fraction": 0.482}
    (old / "summary.json").write_text(json.dumps(stored))
    (row,) = finetune_job.accuracy_rows([old])
    assert {k: row[k] for k in finetune_job.ACCURACY_FIELDS} == {
        "accuracy": 0.518, "examples": 1000, "label_positive_fraction": 0.482, "predicted_positive_fraction": None,
        "majority_class_accuracy": pytest.approx(0.518)}


def test_a_rerun_rewrites_no_accuracy(lora_run, task, init_run):
    """A rerun of a finished run (the job's train, then add_accuracy) leaves its summary.json (held-out
    accuracy in it) as it is: same bytes, same modification time (set to a day ago first, so a rewrite
    within the clock's tick is still seen); add_accuracy returns the stored accuracy."""
    p, _, accuracy = lora_run
    path = p.workdir / "summary.json"
    before = path.read_bytes()
    day_ago = path.stat().st_mtime_ns - 86_400 * 10**9
    os.utime(path, ns=(day_ago, day_ago))
    assert finetune_job.add_accuracy(p) == accuracy
    rerun, summary = run_job(config_of(task, init_run, p.workdir))
    assert summary["heldout_accuracy"] == finetune_job.add_accuracy(rerun) == accuracy
    assert path.read_bytes() == before and path.stat().st_mtime_ns == day_ago


def test_a_prompt_that_overflows_shortens_seq_len(task, init_run, tmp_path):
    """The default-shaped case (the init's max positions == config.seq_len, as pretrain_gpt2's default run
    and the finetune config): prompt tuning trains with seq_len = positions - prompt_length, says so once,
    config.json records the seq_len that ran, and the accuracy is scored at that length. A prompt that fits
    changes nothing and says nothing; nor does one refused by a later check."""
    notes = []
    config = config_of(task, init_run, tmp_path / "prompt", finetune__method="prompt", finetune__prompt_length=4,
                       steps=2, checkpoint_every=2)
    assert config.seq_len == MODEL["max_seq_len"] == 32
    p = finetune_job.prepare(config, notice=notes.append)
    assert p.config.seq_len == 28 and config.seq_len == 32  # the caller's config is not modified
    assert len(notes) == 1 and "config.seq_len=28" in notes[0] and "\n" not in notes[0]
    p, summary = run_job(config)
    assert summary["steps"] == 2 and json.loads((p.workdir / "config.json").read_text())["seq_len"] == 28
    assert finetune_job.load_finetuned(p).soft_prompt.length == 4
    assert finetune_job.add_accuracy(p)["examples"] > 0
    fits = []
    p = finetune_job.prepare(config_of(task, init_run, tmp_path / "fits", finetune__method="prompt",
                                       finetune__prompt_length=4, seq_len=28), notice=fits.append)
    assert p.config.seq_len == 28 and fits == []
    refused = []  # a later check fails: its one-line error, no note before it
    with pytest.raises(training.ConfigError, match="followed by no target"):
        finetune_job.prepare(config_of(task, init_run, tmp_path / "refused", finetune__method="prompt",
                                       finetune__prompt_length=4, finetune__loss_after="\nVerdict:"),
                             notice=refused.append)
    assert refused == [] and not (tmp_path / "refused").exists()


def test_against_majority_says_what_the_accuracy_means():
    """Single-class predictions are named; within two standard errors of the majority class is "at" it."""
    def result(accuracy, predicted, positive=0.482, n=1000):
        return {"accuracy": accuracy, "examples": n, "label_positive_fraction": positive,
                "predicted_positive_fraction": predicted, "majority_class_accuracy": max(positive, 1 - positive)}
    assert tasks.against_majority(result(0.518, 0.0)).startswith("predicts only 'negative' for every snippet")
    assert "(at the majority-class baseline)" in tasks.against_majority(result(0.518, 0.0))
    assert "(below the majority-class baseline)" in tasks.against_majority(result(0.482, 1.0))
    noise = 2 * np.sqrt(0.518 * 0.482 / 1000)  # 0.0316
    assert tasks.against_majority(result(0.518 + noise - 1e-3, 0.3)).startswith("at the majority-class baseline")
    assert tasks.against_majority(result(0.601, 0.4)) == \
        "above the majority-class baseline by 0.083 (2 standard errors: 0.032)"
    assert tasks.against_majority(result(0.45, 0.6)).startswith("below the majority-class baseline by 0.068")
    assert tasks.against_majority(result(0.601, None)).startswith("above the majority-class baseline by 0.083")
    assert tasks.against_majority(result(0.601, 0.4, n=100)).startswith("at the majority-class baseline")


def test_accuracy_scores_the_language_model(lora_run):
    """continuation_logprobs = minus the LM loss of the label tokens of the whole document."""
    p, _, _ = lora_run
    model = finetune_job.load_finetuned(p)
    tok = p.tokenizer
    documents = [d for d in finetune_job.heldout_documents(p.config) if len(tok.encode(d)) <= 33][:3]
    for doc in documents:
        snippet, label = tasks.split_text(doc)
        (got,) = tasks.continuation_logprobs(model, tok, [snippet + tasks.PROMPT], " " + label, seq_len=32,
                                             batch_size=8)  # add_accuracy's shapes: compiled once
        ids, n_label = tok.encode(doc), len(tok.encode(" " + label))
        assert ids[-n_label:] == tok.encode(" " + label)  # the document tokenises as context + continuation
        np.testing.assert_allclose(got, _token_logprobs(model, ids)[len(ids) - n_label - 1:].sum(), rtol=1e-5)
    documents = finetune_job.heldout_documents(p.config)[:12]
    acc = tasks.sentiment_accuracy(model, tok, documents, seq_len=32, batch_size=8)
    contexts = [tasks.split_text(d)[0] + tasks.PROMPT for d in documents]
    scores = [tasks.continuation_logprobs(model, tok, contexts, " " + lab, seq_len=32, batch_size=8)
              for lab in tasks.LABELS]
    truth = [tasks.LABELS.index(tasks.split_text(d)[1]) for d in documents]
    predicted = np.argmax(scores, axis=0)
    labels = [json.loads(line)["label"] for line in pathlib.Path(p.config.data.path).read_text().splitlines()
              if json.loads(line)["text"] in documents]  # the jsonl's own label field
    positive = labels.count("positive")
    assert len(labels) == 12 and 0 < positive < 12
    assert acc == {"accuracy": np.mean(predicted == truth), "examples": 12, "label_positive_fraction": positive / 12,
                   "predicted_positive_fraction": np.mean(predicted == tasks.LABELS.index("positive")),
                   "majority_class_accuracy": max(positive, 12 - positive) / 12}


def _token_logprobs(model, ids):
    """log p(ids[t + 1] | ids[:t + 1]) for each t, by a plain forward over a fixed-shape window."""
    tokens = np.zeros((1, 32), np.int32)
    tokens[0, :len(ids) - 1] = ids[:-1]
    logp = np.asarray(_log_softmax(model, tokens))[0]
    return logp[np.arange(len(ids) - 1), np.asarray(ids[1:])]


@nnx.jit
def _log_softmax(model, tokens):
    return jax.nn.log_softmax(model(tokens).astype(np.float32), axis=-1)
