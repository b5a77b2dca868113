"""The fine-tuning job from HF Gemma 2 and Gemma 3 checkpoints (issue 38): `config.finetune.init=<dir>`.

A tiny checkpoint of each (save_hf of random weights, a tokenizer.json beside it) resolves to
`config.model.family` gemma2 / gemma3_text with every field of its `GemmaConfig` (layer kinds, window shorter
than the windows trained on, soft-caps, local / global RoPE bases, q/k norms), trains two DP steps with LoRA
(q_proj and v_proj, the family's default) or full fine-tuning, and keeps every frozen weight bit for bit
while the trained ones move. A multimodal Gemma 3 directory fine-tunes its text model.
"""

import json

import numpy as np
import pytest
from dp_testing import random_model
from flax import nnx
from job_testing import with_settings, write_tiny_corpus, write_tiny_hf_tokenizer

from experiments.configs import finetune as finetune_config
from jaxdp import training
from jaxdp.core import nn
from jaxdp.models.gemma import Gemma, GemmaConfig
from jaxdp.models.hf import save_hf
from jaxdp.training import config as config_lib
from jaxdp.training import finetune_job, run_dir

SETTINGS = {"seed": 0, "steps": 2, "checkpoint_every": 2, "log_every": 1, "eval_every": 2, "eval_windows": 8,
            "eval_batch_size": 8, "batch_size": 8, "seq_len": 32, "learning_rate": 1e-2, "warmup_steps": 1,
            "data.validation_fraction": 0.2, "finetune.rank": 4, "finetune.accuracy_examples": 0,
            "finetune.loss_after": ""}
FAMILY = {"gemma2": dict(attn_softcap=5.0, final_softcap=3.0),
          "gemma3_text": dict(attn_softcap=None, final_softcap=None, qk_norm=True, rope_theta=1e6, rope_scaling=4.0,
                              layer_types=("sliding_attention", "full_attention"))}


@pytest.fixture(scope="module")
def corpus_and_tokenizer(tmp_path_factory):
    """A tiny real-text corpus and a byte-level BPE tokenizer.json trained on it, as HF saves one."""
    d = tmp_path_factory.mktemp("corpus")
    corpus = write_tiny_corpus(d)
    write_tiny_hf_tokenizer(corpus, d)
    return corpus, d


def flat(model, kind):
    return {tuple(k): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model, kind))}


def _run(corpus_and_tokenizer, tmp_path, family, method):
    corpus, tokenizer_dir = corpus_and_tokenizer
    hf_dir = tmp_path / family
    hf_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf_dir / name).write_bytes((tokenizer_dir / name).read_bytes())
    vocab = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["vocab"]
    config = GemmaConfig(vocab_size=len(vocab), seq_len=32, n_layer=2, n_head=2, n_kv_head=1, d_model=16, d_ff=32,
                         head_dim=8, query_pre_attn_scalar=12.0, sliding_window=8, family=family, **FAMILY[family])
    checkpoint = random_model(lambda: Gemma(config, rngs=nnx.Rngs(0)), seed=1)
    save_hf(checkpoint, hf_dir)

    c = with_settings(finetune_config.get_config(), dict(SETTINGS, workdir=str(tmp_path / "run")),
                      {"data.path": str(corpus), "finetune.init": str(hf_dir), "data.cache_dir": str(tmp_path / "cache"),
                       "finetune.method": method})
    p = finetune_job.prepare(c)
    assert p.config.model.family == family
    assert dict(p.model_config.__dict__, dtype=None, remat=None) == dict(config.__dict__, dtype=None, remat=None)
    training.train(p.config, prepared=p, verbose=False)

    before = p.build_model(p.derive_seed("init"))
    after = p.build_model(p.derive_seed("init"))
    ckpt = run_dir.Checkpointer(p.workdir / run_dir.CHECKPOINT_DIR)
    ckpt.restore_model(ckpt.latest_step(), after)
    ckpt.close()
    return checkpoint, before, after


def test_gemma2_checkpoint_trains_dp_lora(corpus_and_tokenizer, tmp_path):
    checkpoint, before, after = _run(corpus_and_tokenizer, tmp_path, "gemma2", "lora")
    weights, frozen = flat(checkpoint, nnx.Param), flat(after, nn.Frozen)
    assert len(frozen) == len(weights) and ("blocks", 1, "post_feedforward_layernorm", "scale") in frozen
    for path, value in frozen.items():  # bit for bit the checkpoint's
        np.testing.assert_array_equal(value, weights[tuple(k for k in path if k != "base")])
    trained, initial = flat(after, nnx.Param), flat(before, nnx.Param)
    assert sorted({path[-3] for path in trained}) == ["q_proj", "v_proj"]
    assert all(not np.array_equal(trained[k], initial[k]) for k in trained if k[-2] == "lora_b")


def test_gemma3_checkpoint_trains_full(corpus_and_tokenizer, tmp_path):
    checkpoint, _, after = _run(corpus_and_tokenizer, tmp_path, "gemma3_text", "full")
    weights, trained = flat(checkpoint, nnx.Param), flat(after, nnx.Param)
    assert trained.keys() == weights.keys() and ("blocks", 0, "attn", "q_norm", "scale") in trained
    assert not flat(after, nn.Frozen)
    moved = [k for k in trained if not np.array_equal(trained[k], weights[k])]
    assert len(moved) == len(trained), sorted(set(trained) - set(moved))  # every parameter, norms included


def test_gemma_config_model_is_checked():
    """A gemma2 config.model with a bad field is one ConfigError naming it."""
    c = finetune_config.get_config()
    fields = {name: getattr(GemmaConfig(n_layer=2), name) for name in config_lib.GEMMA_FIELDS if name != "max_seq_len"}
    model = dict(fields, family="gemma2", max_seq_len=64, layer_types=["sliding_attention", "chunked"])
    with c.unlocked():
        c.model = model
        c.seq_len = 32
    with pytest.raises(config_lib.ConfigError, match="config.model: GemmaConfig.layer_types must be 2 of"):
        config_lib._validate_model(c)


def test_gemma3_checkpoint_trains_dp_adapters(corpus_and_tokenizer, tmp_path):
    checkpoint, _, after = _run(corpus_and_tokenizer, tmp_path, "gemma3_text", "adapter")
    weights, frozen, trained = flat(checkpoint, nnx.Param), flat(after, nn.Frozen), flat(after, nnx.Param)
    assert trained and {path[-3] for path in trained if path[-1] != "scale"} == {"adapter"}, sorted(trained)
    assert len(frozen) + len([p for p in trained if p[-1] == "scale"]) == len(weights)  # norms train (Houlsby)
    for path, value in frozen.items():  # bit for bit the checkpoint's
        np.testing.assert_array_equal(value, weights[tuple(k for k in path if k != "base")])


def test_multimodal_gemma3_checkpoint_resolves_to_its_text_model(corpus_and_tokenizer, tmp_path):
    """A Gemma3ForConditionalGeneration directory: the job fine-tunes its text model (config.model.family
    gemma3_text, the text_config's shapes); the model it builds is the text model with its weights."""
    from jaxdp.models.safetensors_io import read_safetensors, write_safetensors

    corpus, tokenizer_dir = corpus_and_tokenizer
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    config = GemmaConfig(vocab_size=len(vocab), seq_len=32, n_layer=2, n_head=2, n_kv_head=1, d_model=16, d_ff=32,
                         head_dim=8, sliding_window=8, family="gemma3_text", **FAMILY["gemma3_text"])
    text = random_model(lambda: Gemma(config, rngs=nnx.Rngs(0)), seed=2)
    save_hf(text, tmp_path / "text")
    mm = tmp_path / "mm"
    mm.mkdir()
    tensors = {"language_model.model." + k.removeprefix("model."): v
               for k, v in read_safetensors(str(tmp_path / "text" / "model.safetensors")).items()}
    tensors["vision_tower.vision_model.post_layernorm.weight"] = np.ones(4, np.float32)
    write_safetensors(str(mm / "model.safetensors"), tensors, {"format": "pt"})
    text_config = json.loads((tmp_path / "text" / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                "model_type": "gemma3", "text_config": text_config}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (mm / name).write_bytes((tokenizer_dir / name).read_bytes())
    c = with_settings(finetune_config.get_config(), dict(SETTINGS, workdir=str(tmp_path / "run")),
                      {"data.path": str(corpus), "finetune.init": str(mm),
                       "data.cache_dir": str(tmp_path / "cache")})
    resolved, kind = finetune_job.resolve(c)
    assert kind == "hf" and resolved.model.family == "gemma3_text" and resolved.model.n_layer == 2
    loaded = finetune_job._pretrained(str(mm), kind, config_lib.model_config(resolved.model, len(vocab),
                                                                             dtype="float32", remat=False))
    assert flat(loaded, nnx.Param).keys() == flat(text, nnx.Param).keys()
    assert all(np.array_equal(v, flat(text, nnx.Param)[k]) for k, v in flat(loaded, nnx.Param).items())
