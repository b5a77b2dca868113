"""Helpers for running the jobs on tiny inputs: the tiny pretraining settings, a tiny real-text corpus, configs
and command lines at those settings, a job run as a subprocess, and what a finished run holds."""

import gzip
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from experiments.configs import default
from jaxdp import training

REPO = pathlib.Path(__file__).resolve().parents[1]
CORPUS = REPO / "jaxdp" / "data" / "corpora" / "sotu.jsonl.gz"

TINY = {
    "seed": 0,  # pinned: runs are compared bit for bit (the default, None, draws a secret root per run)
    "steps": 6, "checkpoint_every": 2, "log_every": 1, "eval_every": 2, "eval_windows": 16,
    "eval_batch_size": 8, "sample.num": 1, "sample.tokens": 4, "batch_size": 8,
    "seq_len": 16, "learning_rate": 1e-2, "warmup_steps": 1,
    "model.n_layer": 1, "model.n_head": 2, "model.d_model": 32, "model.max_seq_len": 16,
    "data.tokenizer": "bpe300",
}


def write_tiny_corpus(directory: pathlib.Path) -> pathlib.Path:
    """A small real-text corpus: 12 State of the Union addresses, 4000 characters each."""
    with gzip.open(CORPUS, "rt") as f:
        docs = [json.loads(line)["text"][:4000] for _, line in zip(range(12), f)]
    path = directory / "tiny.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return path


def write_tiny_hf_tokenizer(corpus: pathlib.Path, directory: pathlib.Path):
    """A byte-level BPE tokenizer.json (vocabulary 300, <s> and </s>) trained on `corpus`, with its
    tokenizer_config.json, written into `directory` as HF saves them; returns the tokenizer."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    docs = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return tok


def tiny_config(corpus, workdir, base=default, **overrides):
    """`base.get_config()` (a module of experiments/configs) at the TINY sizes, plus `overrides` ("a__b": a.b)."""
    c = base.get_config()
    settings = dict(TINY, **{"workdir": str(workdir), "data.path": str(corpus),
                             "data.cache_dir": str(pathlib.Path(corpus).parent / "cache")})
    return with_settings(c, settings, overrides)


def with_settings(c, settings: dict, overrides: dict):
    """`c` with each dotted key of `settings`, then of `overrides` ("a__b": a.b), set in place."""
    settings = dict(settings, **{k.replace("__", "."): v for k, v in overrides.items()})
    for key, value in settings.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        setattr(node, leaf, value)
    return c


def cli_args(config_overrides: dict) -> list[str]:
    return [f"--config.{k}={v}" for k, v in config_overrides.items()]


def tiny_cli_overrides(corpus, workdir, **extra):
    d = dict(TINY, workdir=str(workdir), **{"data.path": str(corpus),
                                            "data.cache_dir": str(pathlib.Path(corpus).parent / "cache")})
    d.update(extra)
    return d


CLI_ENV = dict(os.environ, JAX_PLATFORMS="cpu")  # the session's compilation cache: tests/conftest.py


def run_cli(args, module="experiments.pretrain_gpt2", **kw):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=CLI_ENV,
                          capture_output=True, text=True, timeout=300, **kw)


def params_of_model(model):
    import jax
    from flax import nnx
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def params_of(workdir):
    return params_of_model(training.load_for_generation(workdir)[0])


def assert_first_metrics_equal(workdir, reference_workdir, *, num_rows):
    """workdir's metrics.jsonl is the first num_rows rows of reference_workdir's, to 1e-4."""
    got = training.read_metrics(workdir)
    want = training.read_metrics(reference_workdir)[:num_rows]
    assert [r["step"] for r in got] == list(range(num_rows))
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for key in g:
            if g[key] is not None:
                assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), (g["step"], key)


def assert_only_checkpoints_hold(workdir, needles: list[bytes], public_names: set[str], found_in_checkpoints: bytes):
    """No file a user would share (all but checkpoints/) holds any of `needles`; the public files include
    `public_names`; and the search can fail: `found_in_checkpoints` is found in a checkpoint file."""
    workdir = pathlib.Path(workdir)
    files = [f for f in workdir.rglob("*") if f.is_file()]
    public = [f for f in files if f.relative_to(workdir).parts[0] != "checkpoints"]
    assert {f.name for f in public} >= public_names
    for f in public:
        data = f.read_bytes()
        assert not [n for n in needles if n in data], f
    assert any(found_in_checkpoints in f.read_bytes() for f in files if f not in public)  # the search works
