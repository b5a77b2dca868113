"""Shared helpers for DP tests: tiny models, batches, loss functions, comparisons; the fused_clip case that
the XLA and Pallas reference tests share; the fine-tuning case (random parameters, clipped sums of the
factored path and of the reference); Hugging Face checkpoint files, and random Llama-family checkpoints in
HF's layout with the float64 NumPy forward of HF's modeling code."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxdp
import jaxdp.core.losses
import jaxdp.core.reference  # the vmap oracle: not exported by jaxdp
from jaxdp.models.gpt2 import GPT2, GPT2Config
from jaxdp.models.llama import Llama, LlamaConfig
from jaxdp.models.safetensors_io import read_safetensors, write_safetensors

RTOL = 1e-5  # reference equality in float32 at the highest matmul precision


def lm_loss(model, batch):
    """Per-example mean next-token NLL, zero for masked (padding) examples."""
    nll = jaxdp.core.losses.token_nll(model, batch["tokens"][:, :-1], batch["tokens"][:, 1:])  # frozen head: chunks
    return jnp.where(batch["mask"], nll.mean(axis=-1), 0.0)


def tiny_gpt2(seed=0, *, remat=False, vocab_size=97, seq_len=32, dtype="float32"):
    config = GPT2Config.preset("tiny", vocab_size=vocab_size, seq_len=seq_len, remat=remat, dtype=dtype)
    return GPT2(config, rngs=nnx.Rngs(seed))


def tiny_llama(seed=0, **overrides):
    config = LlamaConfig.preset("tiny", **dict(dict(vocab_size=97, seq_len=32), **overrides))
    return Llama(config, rngs=nnx.Rngs(seed))


def lm_batch(seed, B=6, T=16, vocab_size=97, num_masked=1):
    tokens = jax.random.randint(jax.random.key(seed), (B, T + 1), 0, vocab_size)
    mask = jnp.arange(B) < B - num_masked
    return {"tokens": tokens, "mask": mask}


def by_path(tree):
    """{path tuple: array} of an nnx.State (Variables or plain leaves) or of a path dict."""
    if isinstance(tree, dict) and all(isinstance(k, tuple) for k in tree):
        return tree
    return {tuple(p): (v.get_value() if isinstance(v, nnx.Variable) else v)
            for p, v in nnx.to_flat_state(tree)}


def max_rel_err(actual, expected):
    """max over parameters of max|a - e| / max|e| (normwise relative error).

    In NumPy on the host, in the arrays' dtype (as jnp would compute it): on the device every new
    shape, dtype and sharding would compile its own small subtract / abs / max programs."""
    actual, expected = by_path(actual), by_path(expected)
    assert actual.keys() == expected.keys(), set(actual) ^ set(expected)
    errs = []
    for p in expected:
        a, e = np.asarray(actual[p]), np.asarray(expected[p])
        errs.append(float(np.max(np.abs(a - e)) / np.max(np.abs(e))))
    return max(errs)


@functools.partial(nnx.jit, static_argnums=0)
def reference_grads(loss_fn, model, batch):
    """(losses (B,), {path: per-example gradients (B, ...)}) of the vmap reference, jitted: one compile
    per loss, model structure and batch shape, shared by every test (and test file) that asks for it."""
    return jaxdp.core.reference.per_example_grads(loss_fn, model, batch)


def clip_between(ref_grads):
    """A C strictly between the smallest and largest non-zero per-example norm of `{path: (B, ...)}`
    per-example gradients (on the host: no second compile of the reference for its norms)."""
    sq = sum(np.sum(np.square(np.asarray(g, np.float64).reshape(g.shape[0], -1)), axis=1)
             for g in ref_grads.values())
    n = np.sort(np.sqrt(sq[sq > 0]))
    assert n[0] < n[-1], n
    return float(np.sqrt(n[0] * n[-1]))


def first_updates_fn(loss_fn, txs, **grads_kwargs):
    """A jitted (model, batch) -> [first update of each tx]: every configuration in one compile."""
    grads_fn = jaxdp.per_example_grads(loss_fn, **grads_kwargs)

    @nnx.jit
    def all_updates(model, batch):
        _, grads = grads_fn(model, batch)
        params = nnx.state(model, nnx.Param)
        return [tx.update(grads, tx.init(params), params)[0] for tx in txs]

    return all_updates


def assert_json_close(actual, expected, *, rtol, atol=0.0, where="$"):
    """Two JSON values (dicts, lists, numbers, strings, bools, None) equal, floats within rtol / atol.

    Keys, lengths, types, strings, bools and None compare exactly; only floats compare with a tolerance.
    (pytest.approx compares flat numeric containers only: from pytest 9 it raises on a None or a string.)
    """
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), (where, actual, expected)
        for k in expected:
            assert_json_close(actual[k], expected[k], rtol=rtol, atol=atol, where=f"{where}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), (where, actual, expected)
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_json_close(a, e, rtol=rtol, atol=atol, where=f"{where}[{i}]")
    elif isinstance(expected, float) and isinstance(actual, (int, float)) and not isinstance(actual, bool):
        assert np.isclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True), (where, actual, expected)
    else:
        assert type(actual) is type(expected) and actual == expected, (where, actual, expected)


def write_hf_checkpoint(path, tensors, config):
    """A Hugging Face checkpoint directory: config.json and model.safetensors of {HF name: array}."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    write_safetensors(os.path.join(path, "model.safetensors"), tensors, {"format": "pt"})
    return str(path)


def saved_hf_config_if_bit_identical(path, tensors):
    """The config.json of the checkpoint saved at `path`, after checking that its model.safetensors holds
    exactly the tensors {HF name: float32 array} `tensors`, bit for bit."""
    saved = read_safetensors(os.path.join(path, "model.safetensors"))
    assert set(saved) == set(tensors)
    for name, array in saved.items():
        assert array.dtype == np.float32 and array.tobytes() == tensors[name].tobytes(), name
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


# ------------------------------------------------------------------ Llama-family checkpoints in HF's layout
# The case test_hf_llama (Llama) and test_hf_families (Mistral, Qwen2, Qwen3) share: random weights under a
# config.json's HF tensor names, and the logits HF's modeling code computes from them, in float64 NumPy.


def hf_head_dim(config):
    """A Llama-family config.json's head_dim: its own key (Mistral, Qwen3), or hidden_size / heads."""
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def random_hf_llama_tensors(config, seed):
    """Random weights of a Llama-family config.json under HF's names (`model.` prefix), torch Linear (out, in)
    layout: Qwen2's q/k/v biases, Qwen3's per-head q/k norms, and `lm_head` unless the embeddings are tied."""
    rng = np.random.default_rng(seed)
    H, family = hf_head_dim(config), config["model_type"]
    D, D_FF, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    def normal(*shape, std=0.3):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    t = {"model.embed_tokens.weight": normal(vocab, D), "model.norm.weight": 1 + normal(D, std=0.1)}
    shapes = {"self_attn.q_proj": (n_head * H, D), "self_attn.k_proj": (n_kv * H, D), "self_attn.v_proj": (n_kv * H, D),
              "self_attn.o_proj": (D, n_head * H), "mlp.gate_proj": (D_FF, D), "mlp.up_proj": (D_FF, D),
              "mlp.down_proj": (D, D_FF)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, (o, n) in shapes.items():
            t[p + name + ".weight"] = normal(o, n, std=1 / np.sqrt(n))
            if family == "qwen2" and name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                t[p + name + ".bias"] = normal(o)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[p + norm + ".weight"] = 1 + normal(D, std=0.1)
        if family == "qwen3":
            for norm in ("q_norm", "k_norm"):
                t[p + "self_attn." + norm + ".weight"] = 1 + normal(H, std=0.3)
    if not config["tie_word_embeddings"]:
        t["lm_head.weight"] = normal(vocab, D)
    return t


def hf_inv_freq(config):
    """HF's rotary inverse frequencies, with `_compute_llama3_parameters` when rope_scaling is set (the one
    scaling this reference knows: any other is an error, never silently plain RoPE)."""
    H = hf_head_dim(config)
    inv = 1.0 / config["rope_theta"] ** (np.arange(0, H, 2, dtype=np.float64) / H)
    s = config.get("rope_scaling")
    if s is None:
        return inv
    if s.get("rope_type", s.get("type")) != "llama3":
        raise ValueError(f"hf_llama_forward_f64 computes no rope_scaling={s!r}")
    factor, low, high, old = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv
    llama = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * llama / factor + smooth * llama
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, llama)


def hf_llama_forward_f64(t, tokens_BT, config):
    """Logits as HF's modeling_{llama,mistral,qwen2,qwen3}.py compute them, float64 NumPy, from HF tensor
    names: torch Linear `x @ W.T (+ b)`; Qwen3 RMSNorms q and k per head before rotate-half RoPE (Llama 3's
    scaled frequencies when rope_scaling says so); repeat_kv (head n reads kv head n // rep); Mistral's mask
    `kv_idx <= q_idx and kv_idx > q_idx - sliding_window`."""
    t = {k.removeprefix("model."): np.asarray(v, np.float64) for k, v in t.items()}
    B, T = tokens_BT.shape
    H, family, eps = hf_head_dim(config), config["model_type"], config["rms_norm_eps"]
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    def rms(x, weight):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * weight

    def linear(x, name):
        y = x @ t[name + ".weight"].T
        return y + t[name + ".bias"] if name + ".bias" in t else y

    freqs = np.arange(T)[:, None] * hf_inv_freq(config)[None, :]
    cos, sin = np.cos(np.concatenate([freqs, freqs], -1)), np.sin(np.concatenate([freqs, freqs], -1))

    def rope(x):  # (B, heads, T, H)
        return x * cos + np.concatenate([-x[..., H // 2:], x[..., :H // 2]], -1) * sin

    q_idx, kv_idx = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = kv_idx <= q_idx
    if family == "mistral" and config.get("sliding_window") is not None:
        allowed &= kv_idx > q_idx - config["sliding_window"]
    h = t["embed_tokens.weight"][tokens_BT]
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        x = rms(h, t[p + "input_layernorm.weight"])
        q = linear(x, p + "self_attn.q_proj").reshape(B, T, n_head, H)
        k = linear(x, p + "self_attn.k_proj").reshape(B, T, n_kv, H)
        v = linear(x, p + "self_attn.v_proj").reshape(B, T, n_kv, H)
        if family == "qwen3":
            q, k = rms(q, t[p + "self_attn.q_norm.weight"]), rms(k, t[p + "self_attn.k_norm.weight"])
        q, k, v = rope(q.transpose(0, 2, 1, 3)), rope(k.transpose(0, 2, 1, 3)), v.transpose(0, 2, 1, 3)
        k, v = np.repeat(k, n_head // n_kv, axis=1), np.repeat(v, n_head // n_kv, axis=1)
        s = np.where(allowed, q @ k.transpose(0, 1, 3, 2) * H ** -0.5, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        a = ((w / w.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(B, T, n_head * H)
        h = h + linear(a, p + "self_attn.o_proj")
        x = rms(h, t[p + "post_attention_layernorm.weight"])
        gate = linear(x, p + "mlp.gate_proj")
        h = h + linear(gate / (1 + np.exp(-gate)) * linear(x, p + "mlp.up_proj"), p + "mlp.down_proj")
    head = t["embed_tokens.weight"] if config["tie_word_embeddings"] else t["lm_head.weight"]
    return rms(h, t["norm.weight"]) @ head.T


# ------------------------------------------------------------------ fused_clip against the vmap reference
# The case test_fused_clip_reference (XLA strategies) and test_pallas_fused_clip (the kernels) share.

EXPECTED_BATCH_SIZE = 5.0


def by_block(path):
    """An explicit grouping: one group per transformer block, one for the rest."""
    return path[:2] if path[0] == "blocks" else "embeddings_and_final_norm"


CLIPPINGS = {"flat": "flat", "per_layer": "per_layer", "by_block": by_block}


@functools.lru_cache(maxsize=None)
def gpt2_case_with_reference(remat):
    """model, batch, C and the vmap reference's (losses, {path: per-example grads}), jitted (one compile)."""
    model = tiny_gpt2(seed=11, remat=remat)
    batch = lm_batch(seed=12)
    reference = reference_grads(lm_loss, model, batch)
    return model, batch, clip_between(reference[1]), reference


def gpt2_case(remat):
    """model, batch, C (between the per-example norms) and the reference's {path: per-example grads}."""
    model, batch, C, (_, ref_grads) = gpt2_case_with_reference(remat)
    return model, batch, C, ref_grads


def reference_update(remat, clipping, clip_fn):
    """fused_clip's first update (sigma 0) on `gpt2_case(remat)`, from the reference's clipped sums."""
    _, _, C, ref_grads = gpt2_case(remat)
    sums, _ = jaxdp.core.reference.clipped_sum(ref_grads, C, clipping=CLIPPINGS[clipping], clip_fn=clip_fn)
    return {p: s / EXPECTED_BATCH_SIZE for p, s in sums.items()}


# ------------------------------------------------------------------ fine-tuned models against the vmap reference
# The case test_finetune, test_hf_llama and test_norm_rounding share: a model with random parameters, the
# clipped sums of the factored path beside the reference's, and a planted error the comparison must see.

# Tiny shapes: compile time dominates, and XLA's backend optimisations cost half of it (as experiments/long_context).
FAST_COMPILE = dict(xla_backend_optimization_level=0, xla_llvm_disable_expensive_passes=True)


def fast_jit(fn):
    """`jax.jit` of `fn(graphdef, state, *args)` (graphdef static) with FAST_COMPILE."""
    return jax.jit(fn, static_argnums=0, compiler_options=FAST_COMPILE)


def random_model(build, seed):
    """The model `build()` makes, built abstractly (no eager init: at these shapes its op-by-op compiles cost
    seconds), with every parameter drawn afresh: N(1, 0.1^2) for norm scales, N(0, 0.1^2) otherwise. So
    LoRA's B and the side network's up-projection are not zero (which would zero the per-example gradients
    before them and leave the comparison empty)."""
    graphdef, state = nnx.split(nnx.eval_shape(build))
    rng = np.random.default_rng(seed)
    leaves = [(path, var.replace(jnp.asarray((path[-1] == "scale") + 0.1 * rng.standard_normal(var.shape),
                                             var.dtype)))
              for path, var in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def plant(per_example):
    """A 1% error in the per-example gradients {path: (B, ...)} of the first trainable parameter."""
    first = next(iter(per_example))
    return {p: g * 1.01 if p == first else g for p, g in per_example.items()}


@fast_jit
def clipped_sums_and_reference(graphdef, state, batch, C):
    """Clipped sums of the factored path (flat: ghost norms, per-layer: instantiated) and of the vmap
    reference, and the reference's flat sums with a planted error: one compile per model."""
    model = nnx.merge(graphdef, state)
    _, grads = jaxdp.per_example_grads(lm_loss, fallback=False)(model, batch)
    _, ref = jaxdp.core.reference.per_example_grads(lm_loss, model, batch)
    out = {}
    for clipping, strategy in (("flat", "ghost"), ("per_layer", "instantiate")):
        expected, norms = jaxdp.core.reference.clipped_sum(ref, C, clipping=clipping)
        out[clipping] = {"expected": expected, "norms": norms,
                         "fast": jaxdp.clipped_aggregate(grads, C, clip=jaxdp.ClipSpec(clipping=clipping),
                                                         norms=jaxdp.NormPlan(strategy=strategy))[0]}
    out["flat"]["planted"] = jaxdp.core.reference.clipped_sum(plant(ref), C)[0]
    return out


def clipped_sums_some_clipped(model, batch):
    """`clipped_sums_and_reference` (on the host) at a C strictly between the reference's smallest and largest
    non-zero per-example norms, so that some examples are clipped and some not: a first call (C = 1e6) for the
    norms, a second at that C."""
    graphdef, state = nnx.split(model)
    norms = np.asarray(clipped_sums_and_reference(graphdef, state, batch, jnp.float32(1e6))["flat"]["norms"]["all"])
    norms = np.sort(norms[norms > 0])
    assert norms[0] < norms[-1], norms
    return jax.device_get(clipped_sums_and_reference(graphdef, state, batch, jnp.float32(np.sqrt(norms[0] * norms[-1]))))


def assert_clipped_sums_equal_reference(model, batch):
    """The factored path's clipped sums (flat: ghost norms, per layer: instantiated; some examples clipped)
    equal the vmap reference's within RTOL, and the same comparison fails for a 1% error planted in one
    parameter's per-example gradients."""
    out = clipped_sums_some_clipped(model, batch)
    for clipping, sums in out.items():
        assert max_rel_err(sums["fast"], sums["expected"]) <= RTOL, clipping
    assert max_rel_err(out["flat"]["fast"], out["flat"]["planted"]) > 10 * RTOL
