"""Mistral, Qwen2 and Qwen3 checkpoints through `jaxdp.load_hf` / `save_hf` (issue 38, items 1, 2 and 5).

Tiny random checkpoints in each family's HF tensor names and config.json layout load, round-trip bit for
bit, and give the logits of an independent float64 NumPy forward written from HF's modeling code (a planted
transposed weight, dropped bias, dropped norm or dropped window is caught); per-example gradients of every
parameter (q/k/v biases and per-head q/k norm scales included) equal the vmap reference with no fallback;
unsupported values and missing tensors are refused by name before any compute.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_testing import (
    RTOL,
    assert_clipped_sums_equal_reference,
    by_path,
    hf_head_dim,
    hf_llama_forward_f64,
    lm_batch,
    lm_loss,
    max_rel_err,
    random_hf_llama_tensors,
    saved_hf_config_if_bit_identical,
    tiny_gpt2,
    write_hf_checkpoint,
)
from flax import nnx

import jaxdp
import jaxdp.core.reference  # the vmap oracle: not exported by jaxdp
from jaxdp.core import terms
from jaxdp.models import attention
from jaxdp.models.gpt2 import GPT2
from jaxdp.models.hf_gpt2 import save_hf_gpt2
from jaxdp.models.llama import Llama, LlamaConfig

N_LAYER, D, D_FF, VOCAB, N_HEAD, N_KV = 2, 32, 48, 61, 4, 2
COMMON = {"hidden_act": "silu", "num_hidden_layers": N_LAYER, "hidden_size": D, "intermediate_size": D_FF,
          "num_attention_heads": N_HEAD, "num_key_value_heads": N_KV, "vocab_size": VOCAB,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "attention_dropout": 0.0, "initializer_range": 0.02,
          "bos_token_id": 1, "eos_token_id": 2, "use_cache": True, "torch_dtype": "float32",
          "transformers_version": "4.51.0"}
# As HF writes them (Mistral-7B-v0.1 with a NeMo-like head_dim != hidden / heads; Qwen2.5-0.5B; Qwen3-0.6B).
CONFIGS = {
    "mistral": dict(COMMON, architectures=["MistralForCausalLM"], model_type="mistral", head_dim=12,
                    sliding_window=8, rope_theta=10000.0, tie_word_embeddings=False),
    "qwen2": dict(COMMON, architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1000000.0,
                  rope_scaling=None, sliding_window=32768, use_sliding_window=False, max_window_layers=N_LAYER,
                  tie_word_embeddings=True),
    "qwen3": dict(COMMON, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16,
                  attention_bias=False, rope_theta=1000000.0, rope_scaling=None, sliding_window=None,
                  use_sliding_window=False, max_window_layers=N_LAYER, layer_types=["full_attention"] * N_LAYER,
                  tie_word_embeddings=False),
}
FAMILIES = sorted(CONFIGS)
PROMPT = np.random.default_rng(0).integers(0, VOCAB, (2, 24))  # longer than Mistral's window of 8


@nnx.jit
def logits_of(model, tokens):
    return model(tokens)


def rel_err(actual, expected):
    return float(np.abs(np.asarray(actual, np.float64) - expected).max() / np.abs(expected).max())


def _set(model, path, fn):
    """Replaces the parameter at `path` (a tuple) by `fn(value)`: a planted loader bug."""
    node = model
    for key in path[:-1]:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    var = getattr(node, path[-1])
    var.set_value(fn(var.get_value()))


def _planted(family, model, config):
    """{name: logits of `model` with a loader bug planted, or the reference without a piece of the math}."""
    out = {}
    if family == "qwen2":  # q_proj and o_proj are square here: a missing transpose would load without error
        for path, name in ((("blocks", 1, "attn", "o_proj", "kernel"), "o_proj not transposed"),
                           (("blocks", 0, "attn", "q_proj", "kernel"), "q_proj not transposed")):
            m = nnx.clone(model)
            _set(m, path, lambda w: w.T)
            out[name] = logits_of(m, PROMPT)
        for proj in ("q_proj", "k_proj", "v_proj"):
            m = nnx.clone(model)
            _set(m, ("blocks", 0, "attn", proj, "bias"), jnp.zeros_like)
            out[f"{proj} bias dropped"] = logits_of(m, PROMPT)
    if family == "qwen3":
        for norm in ("q_norm", "k_norm"):
            m = nnx.clone(model)
            setattr(m.blocks[1].attn, norm, None)  # the norm not applied at all
            out[f"{norm} dropped"] = logits_of(m, PROMPT)
            m = nnx.clone(model)
            _set(m, ("blocks", 1, "attn", norm, "scale"), jnp.ones_like)
            out[f"{norm} weight not loaded"] = logits_of(m, PROMPT)
    if family == "mistral":
        m = nnx.clone(model)
        for block in m.blocks:
            block.attn.window = None
        out["sliding window dropped"] = logits_of(m, PROMPT)
    return out


# Published config.json values (the keys that shape the model) and parameter counts.
PUBLISHED = {
    "Mistral-7B-v0.1": (dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, sliding_window=4096,
                             max_position_embeddings=32768, rope_theta=10000.0, tie_word_embeddings=False),
                        7_241_732_096),
    "Qwen2.5-0.5B": (dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, sliding_window=32768,
                          use_sliding_window=False, max_window_layers=24, max_position_embeddings=32768,
                          rope_theta=1000000.0, tie_word_embeddings=True), 494_032_768),
    "Qwen2.5-7B": (dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, sliding_window=131072,
                        use_sliding_window=False, max_window_layers=28, max_position_embeddings=131072,
                        rope_theta=1000000.0, tie_word_embeddings=False), 7_615_616_512),
    "Qwen3-0.6B": (dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                        attention_bias=False, sliding_window=None, use_sliding_window=False, max_window_layers=28,
                        max_position_embeddings=40960, rope_theta=1000000, tie_word_embeddings=True), 596_049_920),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_have_published_sizes(name):
    """The config.json of a released checkpoint gives its published parameter count (shapes only)."""
    from jaxdp.models.hf_llama import config_from_hf

    hf, count = PUBLISHED[name]
    config = config_from_hf(dict(hf, hidden_act="silu", rms_norm_eps=1e-6))
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == config.num_params == count


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_float64_hf_forward(tmp_path, family):
    config = CONFIGS[family]
    tensors = random_hf_llama_tensors(config, seed=1)
    model = jaxdp.load_hf(write_hf_checkpoint(tmp_path, tensors, config))
    assert isinstance(model, Llama) and model.config.family == family
    assert model.config.head_dim == hf_head_dim(config)
    expected = hf_llama_forward_f64(tensors, PROMPT, config)
    assert np.abs(expected).max() > 1.0  # logits of order one: the comparison is not of near-zeros
    err = rel_err(logits_of(model, PROMPT), expected)
    assert err <= 1e-5, err
    planted = _planted(family, model, config)
    assert planted
    for name, logits in planted.items():  # each would fail the comparison above
        assert rel_err(logits, expected) > 100 * 1e-5, name


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_identical(tmp_path, family):
    config = CONFIGS[family]
    tensors = random_hf_llama_tensors(config, seed=3)
    model = jaxdp.load_hf(write_hf_checkpoint(tmp_path / "in", tensors, config), dtype="bfloat16", remat="full")
    assert model.config.dtype == "bfloat16"
    jaxdp.save_hf(model, tmp_path / "out")
    written = saved_hf_config_if_bit_identical(tmp_path / "out", tensors)
    assert written["model_type"] == family and written["architectures"] == config["architectures"]
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "rope_theta",
                "tie_word_embeddings", "max_position_embeddings", "rms_norm_eps"):
        assert written[key] == config[key], key
    assert written["head_dim"] == hf_head_dim(config)
    assert written.get("sliding_window") == (config["sliding_window"] if family == "mistral" else None)
    reloaded = jaxdp.load_hf(tmp_path / "out")
    assert reloaded.config == jaxdp.load_hf(tmp_path / "in").config


def test_model_type_from_architectures_and_gpt2_through_load_hf(tmp_path):
    """Without model_type the architectures class decides; GPT-2 and Llama keep loading through load_hf."""
    config = {k: v for k, v in CONFIGS["qwen2"].items() if k != "model_type"}
    tensors = random_hf_llama_tensors(CONFIGS["qwen2"], seed=4)
    assert jaxdp.load_hf(write_hf_checkpoint(tmp_path / "q", tensors, config)).config.family == "qwen2"
    gpt2 = tiny_gpt2(seed=5)
    save_hf_gpt2(gpt2, tmp_path / "gpt2")
    loaded = jaxdp.load_hf(tmp_path / "gpt2")
    assert isinstance(loaded, GPT2) and loaded.config == dataclasses.replace(gpt2.config, remat="none")
    ours, theirs = by_path(nnx.state(loaded, nnx.Param)), by_path(nnx.state(gpt2, nnx.Param))
    assert ours.keys() == theirs.keys() and all(np.array_equal(ours[p], theirs[p]) for p in ours)
    jaxdp.save_hf(loaded, tmp_path / "gpt2_again")
    assert jaxdp.load_hf(tmp_path / "gpt2_again").config == loaded.config


def _without(tensors, name):
    return {k: v for k, v in tensors.items() if k != name}


@pytest.mark.parametrize("family, change, match", [
    ("qwen2", {"model_type": "mixtral"}, r"model_type='mixtral' is not supported; jaxdp loads"),
    ("qwen2", {"model_type": None, "architectures": ["MixtralForCausalLM"]}, "no model_type, and architectures="),
    ("qwen2", {"architectures": ["Qwen3ForCausalLM"]},
     r"architectures=\['Qwen3ForCausalLM'\] is a checkpoint of \['qwen3'\], but model_type='qwen2'"),
    ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     "rope_scaling=.*yarn.*is not supported"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True is not supported.*max_window_layers"),
    ("qwen3", {"use_sliding_window": True}, "use_sliding_window=True is not supported"),
    ("qwen3", {"attention_bias": True}, "attention_bias=True is not supported"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types=.* is not supported"),
    ("mistral", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types=.* is not supported"),
    ("mistral", {"sliding_window": 0}, "sliding_window=0 must be an integer >= 1"),
    ("mistral", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ("mistral", {"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
])
def test_unsupported_config_values_are_named(tmp_path, family, change, match):
    config = {k: v for k, v in dict(CONFIGS[family], **change).items() if v is not None or k not in change}
    path = write_hf_checkpoint(tmp_path, random_hf_llama_tensors(CONFIGS[family], seed=6), config)
    with pytest.raises(ValueError, match="config.json: " + match):
        jaxdp.load_hf(path)


@pytest.mark.parametrize("family, drop, match", [
    ("qwen2", "model.layers.1.self_attn.k_proj.bias", "tensor 'layers.1.self_attn.k_proj.bias' is missing "
                                                      r"\(a Qwen2 with n_layer=2"),
    ("qwen3", "model.layers.0.self_attn.q_norm.weight", "tensor 'layers.0.self_attn.q_norm.weight' is missing"),
    ("mistral", "lm_head.weight", "tensor 'lm_head.weight' is missing"),
])
def test_missing_tensors_are_named(tmp_path, family, drop, match):
    tensors = _without(random_hf_llama_tensors(CONFIGS[family], seed=7), drop)
    with pytest.raises(ValueError, match="model.safetensors: " + match):
        jaxdp.load_hf(write_hf_checkpoint(tmp_path, tensors, CONFIGS[family]))


def test_other_families_tensors_and_layouts_are_refused(tmp_path):
    """A Qwen3 checkpoint's q/k norms under a qwen2 config, a config no HF class expresses on save."""
    qwen3 = random_hf_llama_tensors(dict(CONFIGS["qwen3"], head_dim=8), seed=8)
    untied_qwen2 = dict(CONFIGS["qwen2"], tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\) \['layers.0.self_attn.k_norm.weight'"):
        jaxdp.load_hf(write_hf_checkpoint(tmp_path / "q", qwen3, untied_qwen2))
    config = LlamaConfig.preset("tiny", qkv_bias=True)  # family "llama": HF's Llama has no q/k/v-only biases
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"LlamaConfig\(family='llama'\) with qkv_bias=True has no HF layout"):
        jaxdp.save_hf(model, tmp_path / "out")
    with pytest.raises(ValueError, match="model must be a jaxdp.models.gpt2.GPT2, "):
        jaxdp.save_hf(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), tmp_path / "out")
    with pytest.raises(ValueError, match="LlamaConfig.family must be one of"):
        LlamaConfig.preset("tiny", family="gemma2")
    with pytest.raises(ValueError, match="LlamaConfig.sliding_window must be None or an integer >= 1"):
        LlamaConfig.preset("tiny", sliding_window=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_per_example_grads_equal_reference(tmp_path, family):
    """Every parameter's per-example gradient (biases and q/k norm scales included) equals the vmap reference,
    with fallback=False (a parameter no rule covers would raise); the clipped sums too, flat and per layer."""
    model = jaxdp.load_hf(write_hf_checkpoint(tmp_path, random_hf_llama_tensors(CONFIGS[family], seed=9), CONFIGS[family]))
    batch = lm_batch(seed=10, B=4, T=12, vocab_size=VOCAB)  # 12 tokens: Mistral's window of 8 masks keys

    @nnx.jit
    def both(model, batch):
        _, grads = jaxdp.per_example_grads(lm_loss, fallback=False)(model, batch)
        _, ref = jaxdp.core.reference.per_example_grads(lm_loss, model, batch)
        flat = {tuple(p): sum(terms.instantiate(t) for t in v.get_value().terms)
                for p, v in nnx.to_flat_state(grads)}
        return flat, ref

    fast, ref = jax.device_get(both(model, batch))
    new = {"qwen2": ("attn", "q_proj", "bias"), "qwen3": ("attn", "q_norm", "scale"),
           "mistral": ("attn", "o_proj", "kernel")}[family]
    assert ("blocks", 1, *new) in fast  # the family's own parameters are among those compared
    assert max_rel_err(fast, ref) <= RTOL, max_rel_err(fast, ref)
    assert_clipped_sums_equal_reference(model, batch)


def test_layer_without_rule_is_refused_by_name(tmp_path):
    """A q norm that is not a jaxdp layer (flax's own RMSNorm: no tap) is named, never skipped."""
    model = jaxdp.load_hf(write_hf_checkpoint(tmp_path, random_hf_llama_tensors(CONFIGS["qwen3"], seed=11),
                                              CONFIGS["qwen3"]))
    model.blocks[0].attn.q_norm = nnx.RMSNorm(hf_head_dim(CONFIGS["qwen3"]), epsilon=1e-6, rngs=nnx.Rngs(0))
    batch = lm_batch(seed=12, B=2, T=6, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="no per-example gradient rule covers parameter.*blocks/0/attn/q_norm/scale"):
        nnx.jit(jaxdp.per_example_grads(lm_loss, fallback=False))(model, batch)  # raised while tracing


def test_sliding_window_under_context_parallelism():
    """The window on global positions: 4 sequence shards give the unsharded attention."""
    from jax.sharding import PartitionSpec as P

    from jaxdp.core import sequence_shards

    mesh = jax.make_mesh((4,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 16, 4 if i == 0 else 2, 8)) for i in range(3))
    whole = attention.causal_attention(q, k, v, jnp.arange(16), window=5, implementation="xla")

    def shard(q, k, v):
        positions = sequence_shards.seq_offset(q.shape[1], "seq") + jnp.arange(q.shape[1])
        return attention.causal_attention(q, k, v, positions, seq_axis="seq", window=5)

    spec = P(None, "seq")
    sharded = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))(q, k, v)
    np.testing.assert_allclose(sharded, whole, rtol=1e-6, atol=1e-6)
    unwindowed = attention.causal_attention(q, k, v, jnp.arange(16), implementation="xla")
    assert np.abs(np.asarray(unwindowed - whole)).max() > 1e-3


def test_bitfit_trains_the_qwen2_biases(tmp_path):
    """bitfit on Qwen2: the q/k/v biases alone train, their per-example gradients (a Linear's bias term with
    its kernel frozen) equal the vmap reference with no fallback."""
    from jaxdp.finetune import methods as finetune

    model = jaxdp.load_hf(write_hf_checkpoint(tmp_path, random_hf_llama_tensors(CONFIGS["qwen2"], seed=13),
                                              CONFIGS["qwen2"]))
    finetune.prepare(model, "bitfit", rngs=nnx.Rngs(0))
    assert sorted(finetune.trainable_paths(model)) == sorted(
        ("blocks", i, "attn", proj, "bias") for i in range(N_LAYER) for proj in ("q_proj", "k_proj", "v_proj"))
    batch = lm_batch(seed=14, B=4, T=10, vocab_size=VOCAB)

    @nnx.jit
    def both(model, batch):
        _, grads = jaxdp.per_example_grads(lm_loss, fallback=False)(model, batch)
        _, ref = jaxdp.core.reference.per_example_grads(lm_loss, model, batch)
        return {tuple(p): sum(terms.instantiate(t) for t in v.get_value().terms)
                for p, v in nnx.to_flat_state(grads)}, ref

    fast, ref = jax.device_get(both(model, batch))
    assert max_rel_err(fast, ref) <= RTOL
