"""Hugging Face Llama checkpoints in and out of `jaxdp.models.llama.Llama`.

Local checkpoint directories (`jaxdp.models.hf_checkpoint`: `config.json`
and `model.safetensors`, or a sharded index); nothing here reaches a network.

`jaxdp.models.llama` follows HF's `LlamaForCausalLM`: rotate-half RoPE (so q
and k need no permutation), grouped-query attention with query head n on
key/value head n // (n_head / n_kv_head), RMSNorm without offset, SwiGLU, no
biases. HF stores its projections as torch `Linear` weights (out, in), the
transpose of our kernels (in, out); embeddings are (V, D) in both. The head
is `lm_head.weight` (V, D), or tied to `embed_tokens` (`tie_word_embeddings`,
Llama 3.2 1B / 3B), in which case a stored `lm_head.weight` must equal it.
RoPE scaling: none, or Llama 3.1's "llama3" with the low / high frequency
factors 1 / 4 and 8192 original positions of every released Llama 3.x (other
values are refused), read from transformers < 5's `rope_theta` / `rope_scaling`
or transformers 5's `rope_parameters`. Names may carry the `model.` prefix of `LlamaForCausalLM`;
old checkpoints' `rotary_emb.inv_freq` buffers are skipped.

    model = load_hf_llama("llama-3.2-1b/", dtype="bfloat16", remat="full")
    save_hf_llama(model, "out/")
"""

from __future__ import annotations

import os

import numpy as np
from flax import nnx

from jaxdp.models import hf_checkpoint
from jaxdp.models.hf_checkpoint import CONFIG_FILE
from jaxdp.models.llama import Llama, LlamaConfig

OVERRIDABLE = ("dtype", "remat", "attention")  # compute settings; the shapes come from config.json
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_PREFIX = "model."
_BUFFERS = (".rotary_emb.inv_freq",)
_PROJECTIONS = {"self_attn.q_proj": ("attn", "q_proj"), "self_attn.k_proj": ("attn", "k_proj"),
                "self_attn.v_proj": ("attn", "v_proj"), "self_attn.o_proj": ("attn", "o_proj"),
                "mlp.gate_proj": ("mlp", "gate_proj"), "mlp.up_proj": ("mlp", "up_proj"),
                "mlp.down_proj": ("mlp", "down_proj")}


def hf_names(config: LlamaConfig) -> hf_checkpoint.Names:
    """{HF tensor name (without `model.`): (our parameter path, transposed)} for `config`."""
    names = {"embed_tokens.weight": (("embed_tokens", "embedding"), False), "norm.weight": (("norm", "scale"), False)}
    for i in range(config.n_layer):
        for hf, path in _PROJECTIONS.items():
            names[f"layers.{i}.{hf}.weight"] = (("blocks", i, *path, "kernel"), True)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            names[f"layers.{i}.{norm}.weight"] = (("blocks", i, norm, "scale"), False)
    if not config.tie_embeddings:
        names["lm_head.weight"] = (("lm_head", "kernel"), True)
    return names


def _rope(cfg: hf_checkpoint.ConfigReader) -> tuple[float, float | None]:
    """(rope_theta, the llama3 scaling factor or None) of a config in either layout: transformers < 5's
    top-level `rope_theta` / `rope_scaling`, or transformers 5's `rope_parameters` (which holds both);
    ValueError when the two layouts disagree (which would the model use?)."""
    hf, source = cfg.hf, cfg.source
    params = hf.get("rope_parameters")
    theta, scaling = hf.get("rope_theta"), hf.get("rope_scaling")
    key = "rope_scaling"
    for name, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{source}: {name}={value!r} must be an object")
    if params is not None:
        p_theta = params.get("rope_theta", theta)
        if theta is not None and p_theta != theta:
            raise ValueError(f"{source}: rope_theta={theta!r} and rope_parameters['rope_theta']={p_theta!r} disagree")
        p_kind = params.get("rope_type", params.get("type", "default"))
        p_scaling = None if p_kind == "default" else params
        if scaling is not None and p_scaling is not None and any(scaling.get(k) != p_scaling.get(k)
                                                                for k in ("factor", *LLAMA3_ROPE)):
            raise ValueError(f"{source}: rope_scaling={scaling!r} and rope_parameters={params!r} disagree")
        if scaling is not None and p_scaling is None:
            raise ValueError(f"{source}: rope_scaling={scaling!r} but rope_parameters has rope_type {p_kind!r}")
        theta, scaling, key = p_theta, p_scaling, "rope_parameters"
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3" or any(scaling.get(k) != v for k, v in LLAMA3_ROPE.items()):
            raise ValueError(f"{source}: {key}={scaling!r} is not supported; allowed: no scaling, or "
                             f"rope_type 'llama3' with {LLAMA3_ROPE} and any factor")
        if not isinstance(scaling.get("factor"), (int, float)) or isinstance(scaling.get("factor"), bool):
            raise ValueError(f"{source}: {key} has no numeric 'factor'")
        scaling = float(scaling["factor"])
    return cfg.positive("rope_theta", 10000.0, theta), scaling


def config_from_hf(hf: dict, source: str = CONFIG_FILE, **overrides) -> LlamaConfig:
    """`LlamaConfig` of an HF Llama `config.json` dict; ValueError naming `source` and the key otherwise."""
    cfg = hf_checkpoint.ConfigReader(hf, source, "Llama", overrides, OVERRIDABLE)
    need, refuse = cfg.need_int, cfg.refuse
    refuse("model_type", "llama", ("llama",), "only Llama checkpoints load into jaxdp's Llama")
    refuse("hidden_act", "silu", ("silu",), "jaxdp's Llama uses SwiGLU with SiLU")
    refuse("attention_bias", False, (False,), "jaxdp's Llama has no biases")
    refuse("mlp_bias", False, (False,), "jaxdp's Llama has no biases")
    refuse("tie_word_embeddings", False, (False, True), "true or false")
    d, n_head = need("hidden_size"), need("num_attention_heads")
    refuse("head_dim", None, (None, d // n_head), "the head width is hidden_size / num_attention_heads")
    theta, scaling = _rope(cfg)
    return LlamaConfig(vocab_size=need("vocab_size"), seq_len=need("max_position_embeddings"),
                       n_layer=need("num_hidden_layers"), n_head=n_head,
                       n_kv_head=need("num_key_value_heads") if hf.get("num_key_value_heads") else n_head,
                       d_model=d, d_ff=need("intermediate_size"), rope_theta=theta, rope_scaling=scaling,
                       rms_norm_eps=cfg.positive("rms_norm_eps", 1e-6),
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **overrides)


def config_to_hf(config: LlamaConfig) -> dict:
    """The `config.json` dict `transformers`' LlamaForCausalLM reads for `config`."""
    scaling = None if config.rope_scaling is None else dict(LLAMA3_ROPE, rope_type="llama3",
                                                            factor=config.rope_scaling)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "vocab_size": config.vocab_size, "max_position_embeddings": config.seq_len,
            "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
            "num_key_value_heads": config.n_kv_head, "hidden_size": config.d_model,
            "intermediate_size": config.d_ff, "head_dim": config.head_dim, "rope_theta": config.rope_theta,
            "rope_scaling": scaling, "rms_norm_eps": config.rms_norm_eps,
            "tie_word_embeddings": config.tie_embeddings, "attention_bias": False, "mlp_bias": False}


def load_hf_llama(path: str | os.PathLike, **config_overrides) -> Llama:
    """Loads an HF Llama checkpoint directory into a `Llama` (float32 parameters).

    Args:
      path: directory with `config.json` and `model.safetensors` (or
        `model.safetensors.index.json` and the files it names).
      **config_overrides: compute settings of `LlamaConfig` only: `dtype`,
        `remat`, `attention`.

    Raises:
      FileNotFoundError: a file is missing (the message names it).
      ValueError: an unsupported config value, or a missing, unexpected or
        wrongly shaped tensor (the message names the file and the key).
    """
    path = os.fspath(path)
    config = config_from_hf(hf_checkpoint.read_config(path), os.path.join(path, CONFIG_FILE), **config_overrides)
    tensors, source = hf_checkpoint.read_tensors(path, _PREFIX)
    tensors = {name: t for name, t in tensors.items() if not name.endswith(_BUFFERS)}
    if config.tie_embeddings and "lm_head.weight" in tensors:
        head = tensors.pop("lm_head.weight")
        embed = tensors.get("embed_tokens.weight")
        if embed is not None and not np.array_equal(np.asarray(head[0]), np.asarray(embed[0])):
            raise ValueError(f"{head[1]}: tensor 'lm_head.weight' differs from 'embed_tokens.weight' although "
                             f"{CONFIG_FILE} says tie_word_embeddings=true")
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    return hf_checkpoint.load_state(abstract, tensors, source, hf_names(config),
                                    f"a Llama with n_layer={config.n_layer}, tie_word_embeddings="
                                    f"{str(config.tie_embeddings).lower()}")


def save_hf_llama(model: Llama, path: str | os.PathLike, *, dtype: str = "float32") -> None:
    """Writes `model` as an HF Llama checkpoint directory (`config.json`, `model.safetensors`), tensor
    names with the `model.` prefix of `LlamaForCausalLM` (the head as `lm_head.weight`).

    A model with LoRA layers must be merged first (`jaxdp.finetune.methods.merge_lora`); adapters and soft
    prompts have no place in HF's layout and are refused. `dtype`: "float32", "bfloat16" or "float16".
    """
    if not isinstance(model, Llama):
        raise ValueError(f"model must be a jaxdp.models.llama.Llama, got {type(model).__name__}")
    names = {(name if name == "lm_head.weight" else _PREFIX + name): target
             for name, target in hf_names(model.config).items()}
    hf_checkpoint.save_checkpoint(model, path, config_to_hf(model.config), names, dtype, "HF's Llama layout")
