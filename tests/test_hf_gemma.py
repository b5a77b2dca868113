"""Gemma 2 and Gemma 3 text checkpoints through `jaxdp.load_hf` / `save_hf` (issue 38, items 1, 2 and 5).

Tiny random checkpoints in HF's tensor names and config.json layout (Gemma2ForCausalLM, Gemma3ForCausalLM) give
the logits of an independent float64 NumPy forward written from HF's modeling_gemma2.py / modeling_gemma3.py
(norms without their + 1, missing soft-caps and each other piece of Gemma's math are caught); they round-trip
bit for bit; per-example gradients of every parameter (the (1 + w) norm scales, the q/k norms, the tied head
under the final soft-cap) equal the vmap reference with no fallback; unsupported values are refused by name.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_testing import (
    RTOL,
    assert_clipped_sums_equal_reference,
    fast_jit,
    lm_batch,
    lm_loss,
    max_rel_err,
    saved_hf_config_if_bit_identical,
    write_hf_checkpoint,
)
from flax import nnx

import jaxdp
import jaxdp.core.reference  # the vmap oracle: not exported by jaxdp
from jaxdp.core import nn, terms
from jaxdp.models import hf_gemma
from jaxdp.models.gemma import Gemma, GemmaConfig

N_LAYER, D, D_FF, VOCAB, N_HEAD, N_KV, HEAD_DIM = 3, 32, 48, 61, 4, 2, 16
COMMON = {"hidden_activation": "gelu_pytorch_tanh", "num_hidden_layers": N_LAYER, "hidden_size": D,
          "intermediate_size": D_FF, "num_attention_heads": N_HEAD, "num_key_value_heads": N_KV, "head_dim": HEAD_DIM,
          "vocab_size": VOCAB, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "attention_bias": False,
          "attention_dropout": 0.0, "initializer_range": 0.02, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
          "query_pre_attn_scalar": 24, "sliding_window": 5, "tie_word_embeddings": True, "use_cache": True,
          "torch_dtype": "float32"}
# As HF writes them (gemma-2-2b: hidden_act beside hidden_activation, no layer_types; gemma-3-1b / 270m with
# layer_types, rope_local_base_freq and a linear rope_scaling as the 4B+ text configs have), at tiny sizes and
# with soft-caps small enough to bite on random weights.
CONFIGS = {
    "gemma2": dict(COMMON, architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_act="gelu_pytorch_tanh",
                   rope_theta=10000.0, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                   cache_implementation="hybrid", transformers_version="4.42.4"),
    "gemma3_text": dict(COMMON, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", rope_theta=1000000.0,
                        rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        sliding_window_pattern=2, attn_logit_softcapping=None, final_logit_softcapping=None,
                        transformers_version="4.53.0"),
}
FAMILIES = sorted(CONFIGS)
PROMPT = np.random.default_rng(0).integers(0, VOCAB, (2, 24))  # longer than the window of 5


def layer_types(config):
    """HF's `layer_types` (Gemma2Config / Gemma3TextConfig.__post_init__ when the key is absent)."""
    if config.get("layer_types") is not None:
        return config["layer_types"]
    pattern = 2 if config["model_type"] == "gemma2" else config.get("sliding_window_pattern", 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(config["num_hidden_layers"])]


def random_hf_gemma_tensors(config, seed):
    """Random weights under HF's names (`model.` prefix; torch Linear (out, in)); norm weights are the w of
    (1 + w), drawn around 0 as trained Gemma checkpoints hold them."""
    rng = np.random.default_rng(seed)
    H, n_head, n_kv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    d, f, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]

    def normal(*shape, std=0.3):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    t = {"model.embed_tokens.weight": normal(vocab, d), "model.norm.weight": normal(d, std=0.2)}
    shapes = {"self_attn.q_proj": (n_head * H, d), "self_attn.k_proj": (n_kv * H, d), "self_attn.v_proj": (n_kv * H, d),
              "self_attn.o_proj": (d, n_head * H), "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d),
              "mlp.down_proj": (d, f)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, (o, n) in shapes.items():
            t[p + name + ".weight"] = normal(o, n, std=1 / np.sqrt(n))
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            t[p + norm + ".weight"] = normal(d, std=0.2)
        if config["model_type"] == "gemma3_text":
            for norm in ("q_norm", "k_norm"):
                t[p + "self_attn." + norm + ".weight"] = normal(H, std=0.3)
    if not config["tie_word_embeddings"]:
        t["lm_head.weight"] = normal(vocab, d)
    return t


def hf_gemma_forward_f64(t, tokens_BT, config, drop=()):
    """Logits as HF's modeling_gemma2.py / modeling_gemma3.py compute them, in float64 NumPy, from HF tensor names.

    Gemma{2,3}RMSNorm: x / sqrt(mean x^2 + eps) * (1 + w); the embedding times hidden_size ** 0.5; per layer
    `h + post_attention_layernorm(attn(input_layernorm(h)))`, then `h + post_feedforward_layernorm(mlp(
    pre_feedforward_layernorm(h)))`; the MLP down(gelu_tanh(gate(x)) * up(x)); Gemma 3 RMSNorms q and k per
    head before rotate-half RoPE, whose base is rope_local_base_freq on sliding layers and rope_theta (inv_freq
    / factor for a linear rope_scaling) on full ones; scores q k^T * query_pre_attn_scalar ** -0.5, then Gemma 2's
    `tanh(s / cap) * cap`, then the mask (causal; sliding layers also `kv_idx > q_idx - sliding_window`); repeat_kv;
    the head (embed_tokens when tied) and `tanh(logits / cap) * cap` with final_logit_softcapping.

    `drop` names pieces to leave out (to show the comparison sees each): "norm offset", "embed scale",
    "query_pre_attn_scalar", "attn softcap", "final softcap", "local rope", "rope scaling", "window", "post norms",
    "q/k norms", "gelu tanh" (exact GELU instead)."""
    t = {k.removeprefix("model."): np.asarray(v, np.float64) for k, v in t.items()}
    B, T = tokens_BT.shape
    family, eps, H = config["model_type"], config["rms_norm_eps"], config["head_dim"]
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    def rms(x, weight):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * (weight if "norm offset" in drop else 1 + weight)

    def linear(x, name):
        return x @ t[name + ".weight"].T

    def gelu(x):
        if "gelu tanh" in drop:
            from math import erf
            return 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    def cap(x, value):
        return x if value is None else np.tanh(x / value) * value

    def inv_freq(kind):
        if family == "gemma2":
            base, factor = config["rope_theta"], 1.0
        elif kind == "sliding_attention" and "local rope" not in drop:
            base, factor = config["rope_local_base_freq"], 1.0
        else:
            scaling = config.get("rope_scaling") or {}
            base = config["rope_theta"]
            factor = scaling.get("factor", 1.0) if scaling.get("rope_type") == "linear" and "rope scaling" not in drop else 1.0
        return 1.0 / base ** (np.arange(0, H, 2, dtype=np.float64) / H) / factor

    def rope(x, kind):  # (B, heads, T, H)
        freqs = np.arange(T)[:, None] * inv_freq(kind)[None, :]
        cos, sin = np.cos(np.concatenate([freqs, freqs], -1)), np.sin(np.concatenate([freqs, freqs], -1))
        return x * cos + np.concatenate([-x[..., H // 2:], x[..., :H // 2]], -1) * sin

    scaling = (H if "query_pre_attn_scalar" in drop else config["query_pre_attn_scalar"]) ** -0.5
    attn_cap = config.get("attn_logit_softcapping") if family == "gemma2" and "attn softcap" not in drop else None
    final_cap = None if "final softcap" in drop else config.get("final_logit_softcapping")
    q_idx, kv_idx = np.arange(T)[:, None], np.arange(T)[None, :]
    post = (lambda x, w: x) if "post norms" in drop else rms
    h = t["embed_tokens.weight"][tokens_BT] * (1.0 if "embed scale" in drop else config["hidden_size"] ** 0.5)
    for i, kind in enumerate(layer_types(config)):
        p = f"layers.{i}."
        x = rms(h, t[p + "input_layernorm.weight"])
        q = linear(x, p + "self_attn.q_proj").reshape(B, T, n_head, H)
        k = linear(x, p + "self_attn.k_proj").reshape(B, T, n_kv, H)
        v = linear(x, p + "self_attn.v_proj").reshape(B, T, n_kv, H)
        if family == "gemma3_text" and "q/k norms" not in drop:
            q, k = rms(q, t[p + "self_attn.q_norm.weight"]), rms(k, t[p + "self_attn.k_norm.weight"])
        q, k, v = rope(q.transpose(0, 2, 1, 3), kind), rope(k.transpose(0, 2, 1, 3), kind), v.transpose(0, 2, 1, 3)
        k, v = np.repeat(k, n_head // n_kv, axis=1), np.repeat(v, n_head // n_kv, axis=1)
        allowed = kv_idx <= q_idx
        if kind == "sliding_attention" and "window" not in drop:
            allowed &= kv_idx > q_idx - config["sliding_window"]
        s = np.where(allowed, cap(q @ k.transpose(0, 1, 3, 2) * scaling, attn_cap), -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        a = ((w / w.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(B, T, n_head * H)
        h = h + post(linear(a, p + "self_attn.o_proj"), t[p + "post_attention_layernorm.weight"])
        x = rms(h, t[p + "pre_feedforward_layernorm.weight"])
        m = linear(gelu(linear(x, p + "mlp.gate_proj")) * linear(x, p + "mlp.up_proj"), p + "mlp.down_proj")
        h = h + post(m, t[p + "post_feedforward_layernorm.weight"])
    head = t["embed_tokens.weight"] if config["tie_word_embeddings"] else t["lm_head.weight"]
    return cap(rms(h, t["norm.weight"]) @ head.T, final_cap)


@nnx.jit
def logits_of(model, tokens):
    return model(tokens)


def rel_err(actual, expected):
    return float(np.abs(np.asarray(actual, np.float64) - expected).max() / np.abs(expected).max())


def load(tmp_path, family, seed, **change):
    config = dict(CONFIGS[family], **change)
    tensors = random_hf_gemma_tensors(config, seed)
    return jaxdp.load_hf(write_hf_checkpoint(tmp_path, tensors, config)), tensors, config


def _planted(family, model):
    """{name: logits of `model` with a piece of Gemma's math removed (a bug the comparison must catch)}."""
    out = {}
    m = nnx.clone(model)
    for _, node in nnx.iter_graph(m):
        if isinstance(node, nn.RMSNorm):
            node.scale_offset = 0.0
    out["norms without their + 1"] = logits_of(m, PROMPT)
    if model.config.final_softcap is not None:
        m = nnx.clone(model)
        m.config = dataclasses.replace(model.config, final_softcap=None)
        out["final soft-cap missing"] = logits_of(m, PROMPT)
    if family == "gemma2":
        m = nnx.clone(model)
        for block in m.blocks:
            block.attn.cap = None
        out["attention soft-cap missing"] = logits_of(m, PROMPT)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_float64_hf_forward(tmp_path, family):
    model, tensors, config = load(tmp_path, family, seed=1)
    assert isinstance(model, Gemma) and model.config.family == family
    assert model.config.layer_types == tuple(config["layer_types"] if "layer_types" in config else
                                             ("sliding_attention", "full_attention", "sliding_attention"))
    expected = hf_gemma_forward_f64(tensors, PROMPT, config)
    assert np.abs(expected).max() > 1.0  # logits of order one: the comparison is not of near-zeros
    err = rel_err(logits_of(model, PROMPT), expected)
    assert err <= 1e-5, err
    for name, logits in _planted(family, model).items():  # each would fail the comparison above
        assert rel_err(logits, expected) > 100 * 1e-5, name
    pieces = ["norm offset", "embed scale", "query_pre_attn_scalar", "window", "post norms", "gelu tanh"]
    pieces += (["attn softcap", "final softcap"] if family == "gemma2" else
               ["local rope", "rope scaling", "q/k norms"])
    for piece in pieces:  # the reference without each piece is 10x the tolerance away from our logits
        assert rel_err(logits_of(model, PROMPT), hf_gemma_forward_f64(tensors, PROMPT, config, drop=(piece,))) > 1e-4, piece


def test_untied_head_and_default_layer_types(tmp_path):
    """Gemma 3 with an untied lm_head and no layer_types (sliding_window_pattern 2 decides); Gemma 2 without the
    soft-cap keys (HF's defaults 50 / 30 apply)."""
    config = {k: v for k, v in dict(CONFIGS["gemma3_text"], tie_word_embeddings=False).items() if k != "layer_types"}
    tensors = random_hf_gemma_tensors(config, seed=2)
    model = jaxdp.load_hf(write_hf_checkpoint(tmp_path / "g3", tensors, config))
    assert model.lm_head is not None and list(model.config.layer_types) == layer_types(config)
    assert rel_err(logits_of(model, PROMPT), hf_gemma_forward_f64(tensors, PROMPT, config)) <= 1e-5
    g2 = {k: v for k, v in CONFIGS["gemma2"].items() if not k.endswith("softcapping")}
    config = hf_gemma.config_from_hf(g2)
    assert (config.attn_softcap, config.final_softcap) == (50.0, 30.0)
    assert config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_identical(tmp_path, family):
    config = CONFIGS[family]
    tensors = random_hf_gemma_tensors(config, seed=3)
    model = jaxdp.load_hf(write_hf_checkpoint(tmp_path / "in", tensors, config), dtype="bfloat16", remat="full")
    assert model.config.dtype == "bfloat16"
    jaxdp.save_hf(model, tmp_path / "out")
    written = saved_hf_config_if_bit_identical(tmp_path / "out", tensors)
    assert written["model_type"] == family and written["architectures"] == config["architectures"]
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim",
                "rope_theta", "tie_word_embeddings", "max_position_embeddings", "rms_norm_eps", "sliding_window",
                "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        assert written[key] == config[key], key
    assert written["layer_types"] == layer_types(config)
    reloaded = jaxdp.load_hf(tmp_path / "out")
    assert reloaded.config == jaxdp.load_hf(tmp_path / "in").config


# Published config.json values (the keys that shape the model) and parameter counts (tied heads).
PUBLISHED = {
    "gemma-2-2b": (dict(model_type="gemma2", hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                        max_position_embeddings=8192), 2_614_341_888),
    "gemma-2-9b": (dict(model_type="gemma2", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
                        max_position_embeddings=8192), 9_241_705_984),
    "gemma-3-1b": (dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                        max_position_embeddings=32768, sliding_window=512, rope_local_base_freq=10000,
                        rope_theta=1000000, rope_scaling=None, sliding_window_pattern=6), 999_885_952),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_have_published_sizes(name):
    hf, count = PUBLISHED[name]
    config = hf_gemma.config_from_hf(hf)
    model = nnx.eval_shape(lambda: Gemma(config, rngs=nnx.Rngs(0)))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == config.num_params == count
    if name == "gemma-3-1b":  # five sliding layers, then a full one
        assert config.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)


def test_transformers_5_rope_parameters_layout():
    """transformers 5 writes Gemma 3's RoPE as one object per layer kind: read the same as the old keys."""
    old = CONFIGS["gemma3_text"]
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}
    new["rope_parameters"] = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert hf_gemma.config_from_hf(new) == hf_gemma.config_from_hf(old)
    bad = dict(old, rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0}})
    with pytest.raises(ValueError, match=r"rope_parameters\['full_attention'\]\['factor'\]=8.0 disagrees"):
        hf_gemma.config_from_hf(bad)


@pytest.mark.parametrize("family, change, match", [
    ("gemma3_text", {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
     "model_type 'gemma3' needs a text_config object"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported"),
    ("gemma2", {"attention_bias": True}, "attention_bias=True is not supported"),
    ("gemma2", {"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
    ("gemma2", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling=.* is not supported"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     "layer_types=.* is not supported"),
    ("gemma2", {"sliding_window": None}, "sliding_window=None with sliding_attention layers"),
    ("gemma2", {"attn_logit_softcapping": 0}, "attn_logit_softcapping=0 must be a finite number > 0"),
    ("gemma3_text", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling=.*yarn.* is not supported"),
    ("gemma3_text", {"rope_scaling": {"rope_type": "linear"}}, r"rope_scaling=.*linear.* \(linear\) needs a numeric 'factor'"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not supported"),
    ("gemma3_text", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     r"rope_parameters\['sliding_attention'\]=.* is not supported"),
])
def test_unsupported_config_values_are_named(tmp_path, family, change, match):
    path = write_hf_checkpoint(tmp_path, random_hf_gemma_tensors(CONFIGS[family], seed=6), dict(CONFIGS[family], **change))
    with pytest.raises(ValueError, match="config.json: " + match):
        jaxdp.load_hf(path)


@pytest.mark.parametrize("family, drop, match", [
    ("gemma2", "model.layers.1.post_feedforward_layernorm.weight",
     r"tensor 'layers.1.post_feedforward_layernorm.weight' is missing \(a Gemma 2 with n_layer=3"),
    ("gemma3_text", "model.layers.0.self_attn.k_norm.weight", "tensor 'layers.0.self_attn.k_norm.weight' is missing"),
])
def test_missing_tensors_are_named(tmp_path, family, drop, match):
    tensors = {k: v for k, v in random_hf_gemma_tensors(CONFIGS[family], seed=7).items() if k != drop}
    with pytest.raises(ValueError, match="model.safetensors: " + match):
        jaxdp.load_hf(write_hf_checkpoint(tmp_path, tensors, CONFIGS[family]))


@fast_jit
def _fast_and_reference(graphdef, state, batch, uncapped_graphdef=None):
    """{path: per-example gradients} of the factored path (no fallback) and of the vmap reference (and of the
    reference for `uncapped_graphdef`, the model without its final soft-cap): one compile per model."""
    model = nnx.merge(graphdef, state)
    _, grads = jaxdp.per_example_grads(lm_loss, fallback=False)(model, batch)
    _, ref = jaxdp.core.reference.per_example_grads(lm_loss, model, batch)
    fast = {tuple(p): sum(terms.instantiate(t) for t in v.get_value().terms) for p, v in nnx.to_flat_state(grads)}
    if uncapped_graphdef is None:
        return fast, ref, None
    return fast, ref, jaxdp.core.reference.per_example_grads(lm_loss, nnx.merge(uncapped_graphdef, state), batch)[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_per_example_grads_equal_reference(tmp_path, family):
    """Every parameter's per-example gradient ((1 + w) norm scales, q/k norms, the tied embedding through the
    final soft-cap) equals the vmap reference with fallback=False (Gemma 3 with remat "dots"); Gemma 2's clipped
    sums too, flat and per layer (the shared clipping code; its soft-capped tied head is the case to watch)."""
    model, _, _ = load(tmp_path, family, seed=9)
    if family == "gemma3_text":  # under activation checkpointing (the blocks recomputed in the backward)
        model = jaxdp.load_hf(tmp_path, remat="dots")
    batch = lm_batch(seed=10, B=4, T=12, vocab_size=VOCAB)  # 12 tokens: the window of 5 masks keys
    uncapped = None
    if family == "gemma2":  # the final soft-cap moves the head's per-example gradient: the comparison must see it
        m = nnx.clone(model)
        m.config = dataclasses.replace(model.config, final_softcap=None)
        uncapped = nnx.graphdef(m)
    graphdef, state = nnx.split(model)
    fast, ref, ref_uncapped = jax.device_get(_fast_and_reference(graphdef, state, batch, uncapped))
    own = {"gemma2": ("blocks", 1, "post_feedforward_layernorm", "scale"),
           "gemma3_text": ("blocks", 1, "attn", "k_norm", "scale")}[family]
    assert own in fast and ("embed_tokens", "embedding") in fast
    assert max_rel_err(fast, ref) <= RTOL, max_rel_err(fast, ref)
    if family == "gemma2":  # tied head under both soft-caps: its clipped sums (flat, per layer; some clipped)
        assert max_rel_err(fast, ref_uncapped) > 100 * RTOL
        assert_clipped_sums_equal_reference(model, batch)


def test_per_example_grads_bf16(tmp_path):
    """bf16 compute: the factored per-example gradients equal the bf16 vmap reference within bf16's eps (2^-7:
    two roundings of 2^-8; the tied embedding's two terms are summed in another order than the reference's)."""
    tensors = random_hf_gemma_tensors(CONFIGS["gemma2"], seed=11)
    bf16 = jaxdp.load_hf(write_hf_checkpoint(tmp_path, tensors, CONFIGS["gemma2"]), dtype="bfloat16")
    batch = lm_batch(seed=12, B=3, T=10, vocab_size=VOCAB)
    fast, ref, _ = jax.device_get(_fast_and_reference(*nnx.split(bf16), batch))
    err = max_rel_err(fast, ref)
    assert err <= float(jnp.finfo(jnp.bfloat16).eps), err


def test_layer_without_rule_is_refused_by_name(tmp_path):
    """A norm that is not a jaxdp layer (flax's own RMSNorm: no tap) is named, never skipped."""
    model, _, _ = load(tmp_path, "gemma3_text", seed=13)
    model.blocks[2].post_feedforward_layernorm = nnx.RMSNorm(D, epsilon=1e-6, rngs=nnx.Rngs(0))
    batch = lm_batch(seed=14, B=2, T=6, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="no per-example gradient rule covers parameter.*blocks/2/post_feedforward"):
        nnx.jit(jaxdp.per_example_grads(lm_loss, fallback=False))(model, batch)  # raised while tracing


def test_gemma_config_checks_and_save_layouts(tmp_path):
    with pytest.raises(ValueError, match="GemmaConfig.family must be one of"):
        GemmaConfig(family="gemma")
    with pytest.raises(ValueError, match="GemmaConfig.layer_types must be 2 of"):
        GemmaConfig(n_layer=2, layer_types=("full_attention",))
    config = GemmaConfig(vocab_size=VOCAB, seq_len=32, n_layer=1, n_head=2, n_kv_head=1, d_model=16, d_ff=32,
                         head_dim=8, family="gemma2", qk_norm=True)
    model = nnx.eval_shape(lambda: Gemma(config, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"GemmaConfig\(family='gemma2'\) with qk_norm=True has no HF layout"):
        jaxdp.save_hf(model, tmp_path / "out")
    fresh = Gemma(dataclasses.replace(config, qk_norm=False), rngs=nnx.Rngs(1))
    assert float(jnp.abs(fresh.blocks[0].input_layernorm.scale[...]).max()) == 0.0  # w of (1 + w) starts at 0
    jaxdp.save_hf(fresh, tmp_path / "fresh")
    again = jaxdp.load_hf(tmp_path / "fresh")
    tokens = PROMPT[:, :8] % VOCAB
    np.testing.assert_array_equal(logits_of(again, tokens), logits_of(fresh, tokens))


@pytest.mark.parametrize("family", FAMILIES)
def test_context_parallel_forward_equals_plain(tmp_path, family):
    """Sequence sharded over 4 devices (keys and values all-gathered, masks and RoPE on global positions): the
    logits of the plain model, for the soft-capped attention (Gemma 2) and the shared one (Gemma 3)."""
    from jax.sharding import PartitionSpec as P

    model, _, _ = load(tmp_path, family, seed=15)
    mesh = jax.make_mesh((4,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    graphdef, state = nnx.split(model)

    def shard(state, tokens):
        return nnx.merge(graphdef, state)(tokens, seq_axis="seq")

    sharded = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=(P(), P(None, "seq")), out_specs=P(None, "seq")))
    tokens = jnp.asarray(PROMPT[:, :16])
    np.testing.assert_allclose(sharded(state, tokens), logits_of(model, tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_float64_per_example_grads_equal_reference(family):
    """In float64 (x64 mode, parameters and compute) every parameter's per-example gradient equals the
    reference to 1e-12 relative: the rules ((1 + w) norms, soft-capped tied head) are exact, not merely close."""
    config = hf_gemma.config_from_hf(CONFIGS[family], dtype="float64")
    with jax.enable_x64(True):
        model = Gemma(config, rngs=nnx.Rngs(16))
        rng = np.random.default_rng(17)
        nnx.update(model, jax.tree.map(lambda a: jnp.asarray(0.3 * rng.standard_normal(a.shape), jnp.float64),
                                       nnx.state(model)))
        fast, ref, _ = jax.device_get(_fast_and_reference(*nnx.split(model), lm_batch(seed=18, B=3, T=10,
                                                                                       vocab_size=VOCAB)))
    assert all(np.asarray(v).dtype == np.float64 for v in fast.values())
    assert max_rel_err(fast, ref) <= 1e-12, max_rel_err(fast, ref)


def _multimodal(config, tensors, prefix):
    """A multimodal gemma3 checkpoint (Gemma3ForConditionalGeneration) around the gemma3_text `config` / `tensors`:
    the text model under `prefix`, a sparse text_config over Gemma3TextConfig's defaults, a vision tower and a
    projector (random tensors under their names)."""
    text = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version", "torch_dtype")}
    rng = np.random.default_rng(19)
    t = {prefix + k.removeprefix("model."): v for k, v in tensors.items()}
    outer = "model." if prefix.startswith("model.") else ""  # transformers 5 nests every tower under model.
    t[outer + "vision_tower.vision_model.embeddings.patch_embedding.weight"] = rng.standard_normal((8, 3, 2, 2))
    t[outer + "multi_modal_projector.mm_input_projection_weight"] = rng.standard_normal((8, D))
    t = {k: np.asarray(v, np.float32) for k, v in t.items()}
    hf = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
          "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8}, "mm_tokens_per_image": 4,
          "boi_token_index": 3, "eoi_token_index": 4, "image_token_index": 5}
    return hf, t


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_multimodal_gemma3_loads_its_text_model(tmp_path, prefix):
    """Gemma3ForConditionalGeneration (transformers < 5 and 5 names): the text model's logits equal the float64
    forward of its tensors; the vision tower is skipped; save_hf writes a gemma3_text checkpoint of them."""
    config = CONFIGS["gemma3_text"]
    tensors = random_hf_gemma_tensors(config, seed=20)
    hf, wrapped = _multimodal(config, tensors, prefix)
    model = jaxdp.load_hf(write_hf_checkpoint(tmp_path / "mm", wrapped, hf))
    assert model.config.family == "gemma3_text"
    assert rel_err(logits_of(model, PROMPT), hf_gemma_forward_f64(tensors, PROMPT, config)) <= 1e-5
    jaxdp.save_hf(model, tmp_path / "text")
    assert saved_hf_config_if_bit_identical(tmp_path / "text", tensors)["model_type"] == "gemma3_text"
    bad = dict(wrapped, **{prefix + "layers.0.mlp.extra.weight": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\) \['layers.0.mlp.extra.weight'\]"):
        jaxdp.load_hf(write_hf_checkpoint(tmp_path / "bad", bad, hf))


def test_multimodal_text_config_defaults():
    """The hub's gemma-3-4b text_config lists only what differs from Gemma3TextConfig: the rest are its defaults."""
    hf = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
          "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                          "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                          "sliding_window": 1024}}
    config = hf_gemma.config_from_hf(hf)
    assert (config.vocab_size, config.n_head, config.n_kv_head, config.head_dim, config.seq_len) == (
        262208, 8, 4, 256, 131072)
    assert (config.rope_theta, config.rope_local_theta, config.rope_scaling) == (1e6, 1e4, 8.0)
    assert config.layer_types[4:7] == ("sliding_attention", "full_attention", "sliding_attention")
    assert config.tie_embeddings and config.final_softcap is None and config.query_pre_attn_scalar == 256
