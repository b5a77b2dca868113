"""The fine-tuning job from HF Mistral, Qwen2 and Qwen3 checkpoints (issue 38): `config.finetune.init=<dir>`.

A tiny checkpoint of each family (save_hf of random weights, with a tokenizer.json beside it) resolves to
`config.model.family='llama'` with the family's switches (Mistral's window, shorter than the windows it
trains on; Qwen2's q/k/v biases; Qwen3's q/k norms and head width), trains DP-LoRA on q and v for two steps,
keeps every frozen weight (biases and q/k norm scales included) bit for bit and moves the LoRA factors.
"""

import json

import numpy as np
import pytest
from dp_testing import random_model
from flax import nnx
from job_testing import write_tiny_corpus, write_tiny_hf_tokenizer

from experiments.configs import finetune as finetune_config
from jaxdp import training
from jaxdp.core import nn
from jaxdp.models.hf import save_hf
from jaxdp.models.llama import Llama, LlamaConfig
from jaxdp.training import finetune_job, run_dir

SETTINGS = {"seed": 0, "steps": 2, "checkpoint_every": 2, "log_every": 1, "eval_every": 2, "eval_windows": 8,
            "eval_batch_size": 8, "batch_size": 8, "seq_len": 32, "learning_rate": 1e-2, "warmup_steps": 1,
            "data.validation_fraction": 0.2, "finetune.rank": 4, "finetune.accuracy_examples": 0,
            "finetune.loss_after": ""}
SWITCHES = {"mistral": dict(sliding_window=8, head_dim=12), "qwen2": dict(qkv_bias=True, tie_embeddings=True),
            "qwen3": dict(qk_norm=True, head_dim=12)}
OWN = {"mistral": ("o_proj", "kernel"), "qwen2": ("q_proj", "base", "bias"), "qwen3": ("q_norm", "scale")}


@pytest.fixture(scope="module")
def corpus_and_tokenizer(tmp_path_factory):
    """A tiny real-text corpus and a byte-level BPE tokenizer.json trained on it, as HF saves one."""
    d = tmp_path_factory.mktemp("corpus")
    corpus = write_tiny_corpus(d)
    write_tiny_hf_tokenizer(corpus, d)
    return corpus, d


def flat(model, kind):
    return {tuple(k): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model, kind))}


@pytest.mark.parametrize("family", sorted(SWITCHES))
def test_hf_family_checkpoint_trains_dp_lora(corpus_and_tokenizer, tmp_path, family):
    corpus, tokenizer_dir = corpus_and_tokenizer
    hf_dir = tmp_path / family
    hf_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf_dir / name).write_bytes((tokenizer_dir / name).read_bytes())
    vocab = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["vocab"]
    config = LlamaConfig(vocab_size=len(vocab), seq_len=32, n_layer=1, n_head=2, n_kv_head=1, d_model=16, d_ff=32,
                         family=family, **SWITCHES[family])
    checkpoint = random_model(lambda: Llama(config, rngs=nnx.Rngs(0)), seed=1)
    save_hf(checkpoint, hf_dir)

    c = finetune_config.get_config()
    settings = dict(SETTINGS, workdir=str(tmp_path / "run"), **{"data.path": str(corpus), "finetune.init": str(hf_dir),
                                                                "data.cache_dir": str(tmp_path / "cache")})
    for key, value in settings.items():
        *parents, leaf = key.split(".")
        node = c
        for part in parents:
            node = node[part]
        setattr(node, leaf, value)
    p = finetune_job.prepare(c)
    model = p.config.model
    assert model.family == "llama" and model.head_dim == config.head_dim
    assert (model.qkv_bias, model.qk_norm, model.sliding_window) == (config.qkv_bias, config.qk_norm,
                                                                      config.sliding_window)
    assert p.model_config.sliding_window is None or p.model_config.sliding_window < p.config.seq_len
    training.train(p.config, prepared=p, verbose=False)

    before = p.build_model(p.derive_seed("init"))
    after = p.build_model(p.derive_seed("init"))
    ckpt = run_dir.Checkpointer(p.workdir / run_dir.CHECKPOINT_DIR)
    ckpt.restore_model(ckpt.latest_step(), after)
    ckpt.close()
    weights, frozen = flat(checkpoint, nnx.Param), flat(after, nn.Frozen)
    assert ("blocks", 0, "attn", *OWN[family]) in frozen  # the family's own parameter is among those checked
    assert len(frozen) == len(weights)
    for path, value in frozen.items():  # bit for bit the checkpoint's
        np.testing.assert_array_equal(value, weights[tuple(k for k in path if k != "base")])
    trained, initial = flat(after, nnx.Param), flat(before, nnx.Param)
    assert sorted({path[-3] for path in trained}) == ["q_proj", "v_proj"]
    assert all(not np.array_equal(trained[k], initial[k]) for k in trained if k[-2] == "lora_b")
