"""Hugging Face Llama import / export: logits against a float64 NumPy Llama in HF's layout, round trip, errors."""

import json
import os

import numpy as np
import pytest
from dp_testing import (
    hf_llama_forward_f64,
    random_hf_llama_tensors,
    saved_hf_config_if_bit_identical,
    write_hf_checkpoint,
)
from flax import nnx

from jaxdp.models.hf_llama import load_hf_llama, save_hf_llama
from jaxdp.models.safetensors_io import read_safetensors, write_safetensors

N_LAYER, N_HEAD, N_KV, D, D_FF, VOCAB = 2, 4, 2, 32, 48, 61
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
             "num_hidden_layers": N_LAYER, "num_attention_heads": N_HEAD, "num_key_value_heads": N_KV,
             "hidden_size": D, "intermediate_size": D_FF, "vocab_size": VOCAB, "max_position_embeddings": 64,
             "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}}
TIED = dict(HF_CONFIG, tie_word_embeddings=True, rope_scaling=None, rope_theta=10000.0)


@pytest.mark.parametrize("config", [HF_CONFIG, TIED], ids=["untied-llama3-rope", "tied-plain-rope"])
def test_logits_equal_float64_hf_forward(tmp_path, config):
    tensors = random_hf_llama_tensors(config, seed=1)
    model = load_hf_llama(write_hf_checkpoint(tmp_path, tensors, config))
    tokens = np.random.default_rng(2).integers(0, VOCAB, (3, 40))
    expected = hf_llama_forward_f64(tensors, tokens, config)
    actual = np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens), np.float64)
    assert np.abs(expected).max() > 1.0  # logits of order one: the comparison is not of near-zeros
    err = np.abs(actual - expected).max() / np.abs(expected).max()
    assert err <= 1e-5, err
    # Planted: a small change of one weight, the key / value head grouping, or the RoPE scaling is caught.
    k = "model.layers.1.self_attn.k_proj.weight"
    planted = dict(tensors, **{k: tensors[k] + 1e-3})
    assert np.abs(hf_llama_forward_f64(planted, tokens, config) - actual).max() / np.abs(expected).max() > 1e-5
    swapped = dict(tensors, **{k: np.roll(tensors[k], D // N_HEAD, axis=0)})
    assert np.abs(hf_llama_forward_f64(swapped, tokens, config) - actual).max() / np.abs(expected).max() > 1e-5
    other = dict(config, rope_theta=config["rope_theta"] * 2)
    assert np.abs(hf_llama_forward_f64(tensors, tokens, other) - actual).max() / np.abs(expected).max() > 1e-5


def test_round_trip_is_byte_identical(tmp_path):
    tensors = random_hf_llama_tensors(HF_CONFIG, seed=3)
    model = load_hf_llama(write_hf_checkpoint(tmp_path / "in", tensors, HF_CONFIG), dtype="bfloat16", remat="full")
    assert model.config.dtype == "bfloat16" and model.config.rope_scaling == 8.0
    save_hf_llama(model, tmp_path / "out")
    written = saved_hf_config_if_bit_identical(tmp_path / "out", tensors)
    assert {k: written[k] for k in HF_CONFIG if k != "architectures"} == \
        {k: v for k, v in HF_CONFIG.items() if k != "architectures"}
    assert load_hf_llama(tmp_path / "out").config == load_hf_llama(tmp_path / "in").config


def test_bad_checkpoints_are_named(tmp_path):
    good = random_hf_llama_tensors(HF_CONFIG, seed=4)
    k = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=f"model.safetensors: tensor '{k[6:]}' has shape"):
        load_hf_llama(write_hf_checkpoint(tmp_path / "shape", dict(good, **{k: good[k].T.copy()}), HF_CONFIG))
    with pytest.raises(ValueError, match="model.safetensors: tensor 'lm_head.weight' is missing"):
        load_hf_llama(write_hf_checkpoint(tmp_path / "nohead", {n: v for n, v in good.items() if n != "lm_head.weight"},
                                          HF_CONFIG))
    tied = dict(random_hf_llama_tensors(TIED, seed=4), **{"lm_head.weight": good["lm_head.weight"]})
    with pytest.raises(ValueError, match="lm_head.weight.*differs.*tie_word_embeddings"):
        load_hf_llama(write_hf_checkpoint(tmp_path / "untied", tied, TIED))
    for key, value, match in [("hidden_act", "gelu", "hidden_act='gelu'.*allowed"),
                              ("attention_bias", True, "attention_bias"),
                              ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling=.*llama3"),
                              ("intermediate_size", None, "missing key 'intermediate_size'")]:
        path = write_hf_checkpoint(tmp_path / key, good, dict(HF_CONFIG, **{key: value}))
        with pytest.raises(ValueError, match="config.json: " + match):
            load_hf_llama(path)
    with pytest.raises(ValueError, match=r"config_overrides may only set"):
        load_hf_llama(write_hf_checkpoint(tmp_path / "ok", good, HF_CONFIG), n_layer=1)


def _sharded(path, tensors, weight_map, config=HF_CONFIG, files=None):
    """A sharded checkpoint: `files` {file: tensor names} (default: by weight_map) and the index."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    files = files or {f: [n for n, g in weight_map.items() if g == f] for f in set(weight_map.values())}
    for file, names in files.items():
        write_safetensors(os.path.join(path, file), {n: tensors[n] for n in names})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    return str(path)


def test_attacker_built_checkpoints_are_refused(tmp_path):
    """The attacker's review 7: a checkpoint that would load as another model, or read outside its
    directory, is a ValueError naming the file; transformers 5's rope_parameters layout loads the same
    model as the old keys."""
    good = random_hf_llama_tensors(HF_CONFIG, seed=4)
    names = sorted(good)
    half = {n: ("a.safetensors" if i % 2 else "b.safetensors") for i, n in enumerate(names)}
    model = load_hf_llama(_sharded(tmp_path / "sharded", good, half))  # the well-formed sharded one loads
    assert model.config.rope_theta == 500000.0 and model.config.rope_scaling == 8.0
    outside = dict(half, **{names[0]: "../victim/secret.safetensors"})
    with pytest.raises(ValueError, match=r"index.json: weight_map\[.*'../victim/secret.safetensors' is not a file name"):
        load_hf_llama(_sharded(tmp_path / "outside", good, outside, files={"a.safetensors": names}))
    moved = {"a.safetensors": [n for n in names if half[n] == "a.safetensors"] + [names[0]],
             "b.safetensors": [n for n in names if half[n] == "b.safetensors" and n != names[0]]}
    with pytest.raises(ValueError, match="is not in this file by model.safetensors.index.json"):
        load_hf_llama(_sharded(tmp_path / "moved", good, half, files=moved))
    dropped = {f: [n for n in ns if n != names[1]] for f, ns in
               {"a.safetensors": [n for n in names if half[n] == "a.safetensors"],
                "b.safetensors": [n for n in names if half[n] == "b.safetensors"]}.items()}
    with pytest.raises(ValueError, match="are missing from the files it maps them to"):
        load_hf_llama(_sharded(tmp_path / "dropped", good, half, files=dropped))
    twice = dict(good, **{"norm.weight": np.zeros_like(good["model.norm.weight"])})  # with and without model.
    with pytest.raises(ValueError, match="are both 'norm.weight'"):
        load_hf_llama(write_hf_checkpoint(tmp_path / "twice", twice, HF_CONFIG))
    ints = dict(good, **{"model.norm.weight": np.ones(D, np.int64)})
    with pytest.raises(ValueError, match="'norm.weight' is int64, not a float"):
        load_hf_llama(write_hf_checkpoint(tmp_path / "ints", ints, HF_CONFIG))
    with pytest.raises(ValueError, match="num_hidden_layers=2.5 must be an integer"):
        load_hf_llama(write_hf_checkpoint(tmp_path / "frac", good, dict(HF_CONFIG, num_hidden_layers=2.5)))
    new_layout = {k: v for k, v in HF_CONFIG.items() if k not in ("rope_theta", "rope_scaling")}
    new_layout["rope_parameters"] = dict(HF_CONFIG["rope_scaling"], rope_theta=500000.0)
    same = load_hf_llama(write_hf_checkpoint(tmp_path / "v5", good, new_layout))
    assert (same.config.rope_theta, same.config.rope_scaling) == (500000.0, 8.0)
    plain = dict(new_layout, rope_parameters={"rope_type": "default", "rope_theta": 20000.0})
    assert load_hf_llama(write_hf_checkpoint(tmp_path / "v5plain", good, plain)).config.rope_scaling is None
    with pytest.raises(ValueError, match="rope_theta=10000.0 and rope_parameters.*disagree"):
        load_hf_llama(write_hf_checkpoint(tmp_path / "clash", good, dict(new_layout, rope_theta=10000.0)))
    # Attacker review 8: JSON's Infinity / NaN counts and scales, non-finite or float32-overflowing weights.
    for key, value in (("num_hidden_layers", float("inf")), ("num_hidden_layers", float("nan")),
                       ("rope_theta", float("inf")), ("rms_norm_eps", float("nan"))):
        with pytest.raises(ValueError, match=f"config.json: {key}=.* must be a"):
            load_hf_llama(write_hf_checkpoint(tmp_path / f"{key}{value}", good, dict(HF_CONFIG, **{key: value})))
    for value in (np.nan, 1e300):
        weights = dict(good, **{"model.norm.weight": np.full(D, value, np.float64)})
        with pytest.raises(ValueError, match=rf"model.safetensors: tensor 'norm.weight' holds {D} non-finite"):
            load_hf_llama(write_hf_checkpoint(tmp_path / f"nonfinite{value}", weights, HF_CONFIG))


def test_malformed_safetensors_are_refused(tmp_path):
    """Overlapping data_offsets, fractional or negative shapes: ValueErrors naming the file and tensor."""
    import struct

    def raw(path, header, data=bytes(64)):
        encoded = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
        return path
    overlap = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
               "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}
    with pytest.raises(ValueError, match="tensors 'a' and 'b' share bytes"):
        read_safetensors(raw(tmp_path / "overlap.safetensors", overlap))
    for shape in ([4.5], [-4], [True]):
        bad = {"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 16]}}
        with pytest.raises(ValueError, match="tensor 'a' has a malformed header entry"):
            read_safetensors(raw(tmp_path / "shape.safetensors", bad))
    huge = {"a": {"dtype": "F32", "shape": [2**62, 4], "data_offsets": [0, 0]}}  # 2^64 bytes: int64 wraps to 0
    with pytest.raises(ValueError, match=r"tensor 'a' has data_offsets \[0, 0\] that do not hold"):
        read_safetensors(raw(tmp_path / "huge.safetensors", huge))


def test_dp_lora_on_imported_llama_equals_reference(tmp_path):
    """DP-LoRA on q / v of an imported Llama: clipped sums equal the vmap reference (flat and per layer)."""
    from dp_testing import assert_clipped_sums_equal_reference, lm_batch

    from jaxdp.finetune import methods as finetune
    from jaxdp.finetune.settings import LoRA

    model = load_hf_llama(write_hf_checkpoint(tmp_path, random_hf_llama_tensors(HF_CONFIG, seed=5), HF_CONFIG))
    finetune.prepare(model, "lora", options=LoRA(rank=4, targets=("attn/q_proj", "attn/v_proj")), rngs=nnx.Rngs(6))
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):  # LoRA's B starts at 0: give it values
        var.set_value(0.1 * np.random.default_rng(len(path)).standard_normal(var.shape).astype(np.float32))
    assert {p[-2] for p in finetune.trainable_paths(model)} == {"lora_a", "lora_b"}
    batch = lm_batch(seed=7, B=4, T=10, vocab_size=VOCAB)
    assert_clipped_sums_equal_reference(model, batch)
    with pytest.raises(ValueError, match="'bitfit' leaves no trainable parameter in this Llama"):
        finetune.prepare(load_hf_llama(tmp_path), "bitfit", rngs=nnx.Rngs(0))
