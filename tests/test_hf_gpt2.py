"""Hugging Face GPT-2 import / export: logits against a float64 NumPy GPT-2 in HF's layout, round trip, errors."""

import json
import os
import struct

import numpy as np
import pytest
from dp_testing import write_hf_checkpoint
from flax import nnx

from jaxdp.models.hf_gpt2 import load_hf_gpt2, save_hf_gpt2
from jaxdp.models.safetensors_io import read_safetensors

N_LAYER, N_HEAD, N_EMBD, VOCAB, N_POS = 2, 2, 32, 61, 24
HF_CONFIG = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
             "n_layer": N_LAYER, "n_head": N_HEAD, "n_embd": N_EMBD, "vocab_size": VOCAB,
             "n_positions": N_POS, "n_ctx": N_POS, "n_inner": None, "layer_norm_epsilon": 1e-5,
             "bos_token_id": 0, "eos_token_id": 0}


def random_hf_tensors(seed, prefix=""):
    """A random GPT-2 in HF's names and Conv1D (in, out) layout, weights large enough for O(1) logits."""
    rng = np.random.default_rng(seed)
    d = N_EMBD

    def normal(*shape, std=0.3):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    t = {"wte.weight": normal(VOCAB, d), "wpe.weight": normal(N_POS, d),
         "ln_f.weight": 1 + normal(d, std=0.1), "ln_f.bias": normal(d, std=0.1)}
    for i in range(N_LAYER):
        h = f"h.{i}."
        for ln in ("ln_1", "ln_2"):
            t[h + ln + ".weight"], t[h + ln + ".bias"] = 1 + normal(d, std=0.1), normal(d, std=0.1)
        for name, (p, q) in {"attn.c_attn": (d, 3 * d), "attn.c_proj": (d, d),
                             "mlp.c_fc": (d, 4 * d), "mlp.c_proj": (4 * d, d)}.items():
            t[h + name + ".weight"], t[h + name + ".bias"] = normal(p, q, std=1 / np.sqrt(p)), normal(q, std=0.1)
        t[h + "attn.bias"] = np.tril(np.ones((N_POS, N_POS), np.float32))[None, None]  # HF's mask buffer
    return {prefix + k: v for k, v in t.items()}


def write_checkpoint(path, tensors, config=HF_CONFIG):
    return write_hf_checkpoint(path, tensors, config)


def hf_forward_f64(t, tokens_BT):
    """GPT-2 logits as HF's modeling_gpt2 computes them, in float64 NumPy, from HF tensor names."""
    t = {k: np.asarray(v, np.float64) for k, v in t.items()}
    B, T = tokens_BT.shape
    hd = N_EMBD // N_HEAD

    def ln(x, name):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * t[name + ".weight"] + t[name + ".bias"]

    def conv1d(x, name):  # HF Conv1D: x @ weight (in, out) + bias
        return x @ t[name + ".weight"] + t[name + ".bias"]

    def gelu_new(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    h = t["wte.weight"][tokens_BT] + t["wpe.weight"][np.arange(T)]
    causal = np.tril(np.ones((T, T), bool))
    for i in range(N_LAYER):
        p = f"h.{i}."
        q, k, v = np.split(conv1d(ln(h, p + "ln_1"), p + "attn.c_attn"), 3, axis=-1)
        q, k, v = (a.reshape(B, T, N_HEAD, hd).transpose(0, 2, 1, 3) for a in (q, k, v))
        s = np.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd), -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        a = (w / w.sum(-1, keepdims=True)) @ v
        h = h + conv1d(a.transpose(0, 2, 1, 3).reshape(B, T, N_EMBD), p + "attn.c_proj")
        h = h + conv1d(gelu_new(conv1d(ln(h, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
    return ln(h, "ln_f") @ t["wte.weight"].T


def test_logits_equal_float64_hf_forward(tmp_path):
    tensors = random_hf_tensors(seed=1)
    model = load_hf_gpt2(write_checkpoint(tmp_path, tensors))
    tokens = np.random.default_rng(2).integers(0, VOCAB, (3, 20))
    expected = hf_forward_f64(tensors, tokens)
    actual = np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens), np.float64)
    assert np.abs(expected).max() > 1.0  # logits of order one: the comparison is not of near-zeros
    err = np.abs(actual - expected).max() / np.abs(expected).max()
    assert err <= 1e-5, err
    # The comparison fails for a small change of one layer's weights (not only for gross errors).
    planted = dict(tensors, **{"h.1.mlp.c_fc.bias": tensors["h.1.mlp.c_fc.bias"] + 1e-3})
    assert np.abs(hf_forward_f64(planted, tokens) - actual).max() / np.abs(expected).max() > 1e-5


def test_prefixed_names_and_stored_tied_head(tmp_path):
    """GPT2LMHeadModel's save_pretrained: `transformer.` names and `lm_head.weight` (= wte) stored too."""
    tensors = random_hf_tensors(seed=1)
    prefixed = {"transformer." + k: v for k, v in tensors.items()}
    prefixed["lm_head.weight"] = tensors["wte.weight"]
    plain = nnx.state(load_hf_gpt2(write_checkpoint(tmp_path / "plain", tensors)))
    other = nnx.state(load_hf_gpt2(write_checkpoint(tmp_path / "prefixed", prefixed)))
    for (path, a), (_, b) in zip(nnx.to_flat_state(plain), nnx.to_flat_state(other)):
        assert np.array_equal(a.get_value(), b.get_value()), path


def test_round_trip_is_byte_identical(tmp_path):
    tensors = random_hf_tensors(seed=3)
    model = load_hf_gpt2(write_checkpoint(tmp_path / "in", tensors), dtype="bfloat16", remat="full")
    assert model.config.dtype == "bfloat16" and model.config.n_layer == N_LAYER
    save_hf_gpt2(model, tmp_path / "out")
    saved = read_safetensors(tmp_path / "out" / "model.safetensors")
    assert set(saved) == {k for k in tensors if not k.endswith(".attn.bias")}
    for name, array in saved.items():
        assert array.dtype == np.float32 and array.tobytes() == tensors[name].tobytes(), name
    again = load_hf_gpt2(tmp_path / "out")
    assert again.config == load_hf_gpt2(tmp_path / "out", dtype="float32").config
    with open(tmp_path / "out" / "config.json") as f:
        assert {k: v for k, v in json.load(f).items() if k in ("n_layer", "n_embd", "n_positions")} == \
            {"n_layer": N_LAYER, "n_embd": N_EMBD, "n_positions": N_POS}


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_gpt2(tmp_path)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(HF_CONFIG, f)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="model.safetensors.*pytorch_model.bin"):
        load_hf_gpt2(tmp_path)


def test_bad_tensors_name_file_and_key(tmp_path):
    good = random_hf_tensors(seed=4)
    bad_shape = dict(good, **{"h.1.attn.c_proj.weight": np.zeros((N_EMBD, N_EMBD + 1), np.float32)})
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'h.1.attn.c_proj.weight' has shape"):
        load_hf_gpt2(write_checkpoint(tmp_path / "shape", bad_shape))
    missing = {k: v for k, v in good.items() if k != "h.0.ln_2.bias"}
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'h.0.ln_2.bias' is missing"):
        load_hf_gpt2(write_checkpoint(tmp_path / "missing", missing))
    extra = dict(good, **{"h.2.ln_1.weight": np.ones(N_EMBD, np.float32)})
    with pytest.raises(ValueError, match=r"model.safetensors: unexpected tensor.*h.2.ln_1.weight"):
        load_hf_gpt2(write_checkpoint(tmp_path / "extra", extra))
    untied = dict(good, **{"lm_head.weight": good["wte.weight"] + 1})
    with pytest.raises(ValueError, match="lm_head.weight.*ties"):
        load_hf_gpt2(write_checkpoint(tmp_path / "untied", untied))
    path = write_checkpoint(tmp_path / "corrupt", good)
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))
    with pytest.raises(ValueError, match="model.safetensors: not a safetensors file"):
        load_hf_gpt2(path)


@pytest.mark.parametrize("key, value, match", [
    ("activation_function", "relu", "activation_function='relu'.*allowed"),
    ("tie_word_embeddings", False, "tie_word_embeddings"),
    ("n_inner", 50, "n_inner=50"),
    ("n_embd", None, "missing key 'n_embd'"),
])
def test_unsupported_config_is_named(tmp_path, key, value, match):
    path = write_checkpoint(tmp_path, random_hf_tensors(seed=5), dict(HF_CONFIG, **{key: value}))
    with pytest.raises(ValueError, match="config.json: " + match):
        load_hf_gpt2(path)


def test_only_compute_settings_may_be_overridden(tmp_path):
    path = write_checkpoint(tmp_path, random_hf_tensors(seed=6))
    allowed = r"\('dtype', 'remat', 'attention', 'scan_layers'\)"
    with pytest.raises(ValueError, match=r"config_overrides may only set " + allowed):
        load_hf_gpt2(path, n_layer=1)
