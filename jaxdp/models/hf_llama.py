"""Hugging Face Llama, Mistral, Qwen2 and Qwen3 checkpoints in and out of `jaxdp.models.llama.Llama`.

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

Mistral, Qwen2 / Qwen2.5 and Qwen3 checkpoints are Llama checkpoints with a
switch (same tensor names, `LlamaConfig.family` keeps their `model_type`):

  mistral  `sliding_window` (MistralConfig's 4096 when the key is absent, null:
           none) -> `LlamaConfig.sliding_window`; `head_dim` may differ from
           hidden_size / num_attention_heads (Mistral NeMo);
  qwen2    q / k / v biases (`self_attn.{q,k,v}_proj.bias`, o_proj has none,
           whatever `attention_bias` says: Qwen2 hard-codes them);
  qwen3    per-head `self_attn.{q,k}_norm.weight` (head_dim,) before RoPE,
           `head_dim` 128 when the key is absent (Qwen3Config's default).

Refused, by name, before any tensor is read: another `model_type`, a RoPE
scaling other than none / llama3, `hidden_act` other than silu, `attention_bias`
or `mlp_bias` (Llama, Mistral, Qwen3: their o_proj would have a bias too),
`attention_dropout` > 0, Qwen's `use_sliding_window` (windows on the layers
from `max_window_layers` on: a layer kind we lack), and `layer_types` naming
any layer other than the one kind the config implies.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from flax import nnx

from jaxdp.models import hf_checkpoint, layers
from jaxdp.models.hf_checkpoint import CONFIG_FILE
from jaxdp.models.llama import FAMILIES, Llama, LlamaConfig

OVERRIDABLE = ("dtype", "remat", "attention", "scan_layers")  # compute settings; the shapes come from config.json
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_PREFIX = "model."
_BUFFERS = (".rotary_emb.inv_freq",)
ARCHITECTURES = {family: arch for arch, family in hf_checkpoint.ARCHITECTURES.items() if family in FAMILIES}
NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
# what HF's class of each family expresses: (q/k/v biases, q/k norms, a sliding window allowed)
_SWITCHES = {"llama": (False, False, False), "mistral": (False, False, True), "qwen2": (True, False, False),
             "qwen3": (False, True, False)}
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
        for proj in ("q_proj", "k_proj", "v_proj") if config.qkv_bias else ():
            names[f"layers.{i}.self_attn.{proj}.bias"] = (("blocks", i, "attn", proj, "bias"), False)
        for norm in ("q_norm", "k_norm") if config.qk_norm else ():
            names[f"layers.{i}.self_attn.{norm}.weight"] = (("blocks", i, "attn", norm, "scale"), False)
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
    """`LlamaConfig` of an HF Llama, Mistral, Qwen2 or Qwen3 `config.json` dict (`model_type`, or the class its
    `architectures` names; "llama" when it has neither); ValueError naming `source` and the key otherwise."""
    family = hf_checkpoint.model_type(hf, source, default="llama")
    if family not in FAMILIES:
        raise ValueError(f"{source}: model_type={family!r} does not load into jaxdp's Llama (it loads {FAMILIES})")
    name = NAMES[family]
    cfg = hf_checkpoint.ConfigReader(hf, source, name, overrides, OVERRIDABLE)
    need, refuse = cfg.need_int, cfg.refuse
    refuse("hidden_act", "silu", ("silu",), f"jaxdp's {name} uses SwiGLU with SiLU")
    refuse("mlp_bias", False, (False,), "jaxdp's MLP has no biases")
    if family != "qwen2":  # Qwen2 hard-codes q / k / v biases and reads no attention_bias
        refuse("attention_bias", False, (False,), f"{name}'s attention_bias puts biases on q, k, v and o_proj; "
                                                  "jaxdp's attention has none")
    refuse("attention_dropout", 0.0, (0.0,), "jaxdp has no dropout")
    refuse("tie_word_embeddings", False, (False, True), "true or false")
    d, n_head, n_layer = need("hidden_size"), need("num_attention_heads"), need("num_hidden_layers")
    head_dim = need("head_dim") if hf.get("head_dim") is not None else (128 if family == "qwen3" else d // n_head)
    window = None
    if family == "mistral":  # MistralConfig's default is 4096 when the key is absent; null: no window
        window = 4096 if "sliding_window" not in hf else None if hf["sliding_window"] is None else need("sliding_window")
    elif family in ("qwen2", "qwen3"):
        refuse("use_sliding_window", False, (False,), f"{name} then uses sliding windows on the layers from "
                                                      "max_window_layers on: a layer kind jaxdp lacks")
    kind = "full_attention" if window is None else "sliding_attention"
    layer_types = hf.get("layer_types")
    if layer_types is not None and layer_types != [kind] * n_layer:
        raise ValueError(f"{source}: layer_types={layer_types!r} is not supported (jaxdp's {name} has "
                         f"{n_layer} layers of one kind here: {kind!r})")
    theta, scaling = _rope(cfg)
    return LlamaConfig(vocab_size=need("vocab_size"), seq_len=need("max_position_embeddings"),
                       n_layer=n_layer, n_head=n_head,
                       n_kv_head=need("num_key_value_heads") if hf.get("num_key_value_heads") else n_head,
                       d_model=d, d_ff=need("intermediate_size"), rope_theta=theta, rope_scaling=scaling,
                       rms_norm_eps=cfg.positive("rms_norm_eps", 1e-6),
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)), head_dim=head_dim,
                       qkv_bias=family == "qwen2", qk_norm=family == "qwen3", sliding_window=window,
                       family=family, **overrides)


def check_layout(config: LlamaConfig) -> None:
    """ValueError unless HF's class of `config.family` computes what `config` does (its switches)."""
    bias, norm, window = _SWITCHES[config.family]
    wrong = [f"{field}={value!r}" for field, value, ok in (
        ("qkv_bias", config.qkv_bias, config.qkv_bias == bias), ("qk_norm", config.qk_norm, config.qk_norm == norm),
        ("sliding_window", config.sliding_window, window or config.sliding_window is None)) if not ok]
    if wrong:
        raise ValueError(f"LlamaConfig(family={config.family!r}) with {', '.join(wrong)} has no HF layout: "
                         f"{ARCHITECTURES[config.family]} has q/k/v biases: {bias}, q/k norms: {norm}, a sliding "
                         f"window: {window}; set family to the one that matches")


def config_to_hf(config: LlamaConfig) -> dict:
    """The `config.json` dict `transformers`' class of `config.family` (LlamaForCausalLM, ...) reads for
    `config`; ValueError where that class cannot express it (`check_layout`)."""
    check_layout(config)
    scaling = None if config.rope_scaling is None else dict(LLAMA3_ROPE, rope_type="llama3",
                                                            factor=config.rope_scaling)
    hf = {"architectures": [ARCHITECTURES[config.family]], "model_type": config.family, "hidden_act": "silu",
          "vocab_size": config.vocab_size, "max_position_embeddings": config.seq_len,
          "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
          "num_key_value_heads": config.n_kv_head, "hidden_size": config.d_model,
          "intermediate_size": config.d_ff, "head_dim": config.head_dim, "rope_theta": config.rope_theta,
          "rope_scaling": scaling, "rms_norm_eps": config.rms_norm_eps,
          "tie_word_embeddings": config.tie_embeddings, "attention_dropout": 0.0}
    if config.family in ("llama", "qwen3"):
        hf.update(attention_bias=False)
    if config.family == "llama":
        hf.update(mlp_bias=False)
    if config.family == "mistral":
        hf.update(sliding_window=config.sliding_window)
    if config.family in ("qwen2", "qwen3"):
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.n_layer)
    return hf


def load_hf_llama(path: str | os.PathLike, **config_overrides) -> Llama:
    """Loads an HF Llama, Mistral, Qwen2 or Qwen3 checkpoint directory into a `Llama` (float32 parameters).

    Args:
      path: directory with `config.json` and `model.safetensors` (or
        `model.safetensors.index.json` and the files it names).
      **config_overrides: compute settings of `LlamaConfig` only: `dtype`,
        `remat`, `attention`, `scan_layers` (the blocks stacked, `jaxdp.models.layers`).

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
    # files hold the unrolled layout: read into it, then stack the blocks if scan_layers
    abstract = nnx.eval_shape(lambda: Llama(dataclasses.replace(config, scan_layers=False), rngs=nnx.Rngs(0)))
    model = hf_checkpoint.load_state(abstract, tensors, source, hf_names(config),
                                    f"a {NAMES[config.family]} with n_layer={config.n_layer}, tie_word_embeddings="
                                    f"{str(config.tie_embeddings).lower()}")
    return layers.with_layout(model, config.scan_layers)


def save_hf_llama(model: Llama, path: str | os.PathLike, *, dtype: str = "float32") -> None:
    """Writes `model` as an HF checkpoint directory (`config.json`, `model.safetensors`) of its
    `config.family` (Llama, Mistral, Qwen2, Qwen3: `config_to_hf`), tensor names with the `model.` prefix of
    `LlamaForCausalLM` and its siblings (the head as `lm_head.weight`).

    A model with LoRA layers must be merged first (`jaxdp.finetune.methods.merge_lora`); adapters and soft
    prompts have no place in HF's layout and are refused. `dtype`: "float32", "bfloat16" or "float16".
    """
    if not isinstance(model, Llama):
        raise ValueError(f"model must be a jaxdp.models.llama.Llama, got {type(model).__name__}")
    names = {(name if name == "lm_head.weight" else _PREFIX + name): target
             for name, target in hf_names(model.config).items()}
    hf_checkpoint.save_checkpoint(layers.unrolled(model), path, config_to_hf(model.config), names, dtype,
                                  f"HF's {NAMES[model.config.family]} layout")
