"""Gemma 2 and Gemma 3 (text) checkpoints in Hugging Face's layout: `config.json` <-> `GemmaConfig`, load, save.

`jaxdp.models.gemma` follows HF's `Gemma2ForCausalLM` (model_type "gemma2") and `Gemma3ForCausalLM`
("gemma3_text": gemma-3-270m, gemma-3-1b). Tensor names (with the `model.` prefix): `embed_tokens`,
`layers.{i}.self_attn.{q,k,v,o}_proj`, `layers.{i}.mlp.{gate,up,down}_proj`, the four norms
`layers.{i}.{input,post_attention,pre_feedforward,post_feedforward}_layernorm`, Gemma 3's
`layers.{i}.self_attn.{q,k}_norm` (head_dim,), the final `norm`; HF stores the norms' w of `1 + w`
(our `scale`, the same number) and its projections as torch `Linear` weights (out, in). The head is
the tied embedding (`tie_word_embeddings`, every released Gemma 2 / 3; a stored `lm_head.weight` must
equal it) or `lm_head.weight`.

Config keys read, with HF's defaults when absent: the shapes; `head_dim` (256), `query_pre_attn_scalar`
(256), `sliding_window` (4096), `layer_types` (Gemma 2: alternating, sliding first; Gemma 3:
`sliding_window_pattern`, 6), `attn_logit_softcapping` / `final_logit_softcapping` (Gemma 2: 50 / 30;
Gemma 3: none), RoPE in transformers < 5's layout (`rope_theta`, Gemma 3's `rope_local_base_freq` and
`rope_scaling`) or transformers 5's `rope_parameters` (Gemma 3: one object per layer kind).

The multimodal `gemma3` checkpoints (Gemma3ForConditionalGeneration: gemma-3-4b, 12b, 27b) load as their text
model: config.json's `text_config` over Gemma3TextConfig's defaults for the keys it leaves out (the hub's list
only what differs), the tensors under `language_model.model.` (transformers < 5) or `model.language_model.`
(transformers 5); the vision tower and the projector (`vision_tower.`, `multi_modal_projector.`) are skipped.
`save_hf` of such a model writes a gemma3_text checkpoint (Gemma3ForCausalLM): the vision tower is not kept.

Refused by name, before any tensor is read: `hidden_activation` other than the tanh GELU; `attention_bias`; `attention_dropout` > 0;
`use_bidirectional_attention`; a RoPE scaling other than none (Gemma 2) or linear on the full-attention
layers (Gemma 3); any RoPE scaling or base on sliding layers other than Gemma 3's plain local base; a Gemma 3
`attn_logit_softcapping` (HF's Gemma3Attention does not pass it to every attention implementation: which
model is meant is not clear); a sliding layer with `sliding_window` null; `layer_types` naming another kind.

    model = load_hf_gemma("gemma-2-2b/", dtype="bfloat16", remat="full")
    save_hf_gemma(model, "out/")
"""

from __future__ import annotations

import os

import numpy as np
from flax import nnx

from jaxdp.models import hf_checkpoint
from jaxdp.models.gemma import (
    FAMILIES,
    LAYER_TYPES,
    Gemma,
    GemmaConfig,
    default_layer_types,
)
from jaxdp.models.hf_checkpoint import CONFIG_FILE

OVERRIDABLE = ("dtype", "remat", "attention")  # compute settings; the shapes come from config.json
GELU_TANH = ("gelu_pytorch_tanh", "gelu_python_tanh")  # transformers' names of the tanh-approximate GELU
_PREFIX = "model."
MODEL_TYPES = (*FAMILIES, "gemma3")  # the model_types `load_hf_gemma` reads (gemma3: its text model)
# Gemma3TextConfig's defaults for the shape keys a multimodal checkpoint's text_config may leave out
GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                        "max_position_embeddings": 131072}
_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")  # the text model in a gemma3 checkpoint
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
NAMES = {"gemma2": "Gemma 2", "gemma3_text": "Gemma 3"}
_PROJECTIONS = {"self_attn.q_proj": ("attn", "q_proj"), "self_attn.k_proj": ("attn", "k_proj"),
                "self_attn.v_proj": ("attn", "v_proj"), "self_attn.o_proj": ("attn", "o_proj"),
                "mlp.gate_proj": ("mlp", "gate_proj"), "mlp.up_proj": ("mlp", "up_proj"),
                "mlp.down_proj": ("mlp", "down_proj")}
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def hf_names(config: GemmaConfig) -> hf_checkpoint.Names:
    """{HF tensor name (without `model.`): (our parameter path, transposed)} for `config`."""
    names = {"embed_tokens.weight": (("embed_tokens", "embedding"), False), "norm.weight": (("norm", "scale"), False)}
    for i in range(config.n_layer):
        for hf, path in _PROJECTIONS.items():
            names[f"layers.{i}.{hf}.weight"] = (("blocks", i, *path, "kernel"), True)
        for norm in _NORMS:
            names[f"layers.{i}.{norm}.weight"] = (("blocks", i, norm, "scale"), False)
        for norm in ("q_norm", "k_norm") if config.qk_norm else ():
            names[f"layers.{i}.self_attn.{norm}.weight"] = (("blocks", i, "attn", norm, "scale"), False)
    if not config.tie_embeddings:
        names["lm_head.weight"] = (("lm_head", "kernel"), True)
    return names


def _object(cfg: hf_checkpoint.ConfigReader, key: str, value):
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{cfg.source}: {key}={value!r} must be an object")
    return value


def _kind(params: dict | None) -> str:
    return "default" if params is None else params.get("rope_type", params.get("type", "default"))


def _rope_gemma2(cfg: hf_checkpoint.ConfigReader) -> float:
    """Gemma 2's one RoPE base (every layer): `rope_theta`, or transformers 5's `rope_parameters`; any scaling
    is refused."""
    hf, source = cfg.hf, cfg.source
    scaling = _object(cfg, "rope_scaling", hf.get("rope_scaling"))
    params = _object(cfg, "rope_parameters", hf.get("rope_parameters"))
    for key, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        if _kind(value) != "default":
            raise ValueError(f"{source}: {key}={value!r} is not supported (jaxdp's Gemma 2 has plain RoPE); "
                             "allowed: none, or rope_type 'default'")
    theta = hf.get("rope_theta")
    if params is not None and "rope_theta" in params:
        if theta is not None and params["rope_theta"] != theta:
            raise ValueError(f"{source}: rope_theta={theta!r} and rope_parameters['rope_theta']="
                             f"{params['rope_theta']!r} disagree")
        theta = params["rope_theta"]
    return cfg.positive("rope_theta", 10000.0, theta)


def _rope_gemma3(cfg: hf_checkpoint.ConfigReader) -> tuple[float, float, float | None]:
    """Gemma 3's (global base, local base, linear factor of the global layers or None), from transformers < 5's
    `rope_theta` / `rope_local_base_freq` / `rope_scaling` or transformers 5's `rope_parameters` (an object per
    layer kind); ValueError for another scaling, a scaled sliding layer, or two layouts that disagree."""
    hf, source = cfg.hf, cfg.source
    scaling = _object(cfg, "rope_scaling", hf.get("rope_scaling"))
    params = _object(cfg, "rope_parameters", hf.get("rope_parameters"))
    full = dict(scaling or {}, rope_theta=hf["rope_theta"]) if "rope_theta" in hf else dict(scaling or {})
    local = {"rope_theta": hf["rope_local_base_freq"]} if "rope_local_base_freq" in hf else {}
    if params is not None:
        if set(params) - set(LAYER_TYPES):
            raise ValueError(f"{source}: rope_parameters={params!r} is not supported: Gemma 3's has one object per "
                             f"layer kind {LAYER_TYPES}")
        for kind, ours in (("full_attention", full), ("sliding_attention", local)):
            theirs = _object(cfg, f"rope_parameters[{kind!r}]", params.get(kind)) or {}
            for k, v in theirs.items():
                same = k not in ours or ours[k] == v or (k in ("rope_type", "type") and _kind(ours) == _kind(theirs))
                if not same:
                    raise ValueError(f"{source}: rope_parameters[{kind!r}][{k!r}]={v!r} disagrees with the "
                                     f"top-level rope keys ({ours.get(k)!r})")
            ours.update(theirs)
    if _kind(local) != "default":
        raise ValueError(f"{source}: rope_parameters['sliding_attention']={local!r} is not supported (Gemma 3 scales "
                         "the full-attention layers only)")
    kind, factor = _kind(full), None
    if kind == "linear":
        factor = full.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
            raise ValueError(f"{source}: rope_scaling={full!r} (linear) needs a numeric 'factor' >= 1")
        factor = float(factor)
    elif kind != "default":
        raise ValueError(f"{source}: rope_scaling={full!r} is not supported (rope_type {kind!r}); allowed: none, or "
                         "rope_type 'linear' with a factor (on the full-attention layers)")
    return (cfg.positive("rope_theta", 1000000.0, full.get("rope_theta")),
            cfg.positive("rope_local_base_freq", 10000.0, local.get("rope_theta")), factor)


def _cap(cfg: hf_checkpoint.ConfigReader, key: str, default: float | None) -> float | None:
    value = cfg.hf.get(key, default)
    return None if value is None else cfg.positive(key, 1.0, value)


def text_config(hf: dict, source: str) -> dict:
    """The gemma3_text config.json dict of a multimodal gemma3 one: its `text_config` over Gemma3TextConfig's
    defaults (`tie_word_embeddings` the wrapper's when it sets one)."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{source}: model_type 'gemma3' needs a text_config object, got {text!r}")
    if text.get("model_type", "gemma3_text") != "gemma3_text":
        raise ValueError(f"{source}: text_config.model_type={text['model_type']!r} is not supported; allowed: "
                         "'gemma3_text'")
    tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    out = {**GEMMA3_TEXT_DEFAULTS, **text, "model_type": "gemma3_text", "tie_word_embeddings": tie}
    out.pop("architectures", None)
    return out


def config_from_hf(hf: dict, source: str = CONFIG_FILE, **overrides) -> GemmaConfig:
    """`GemmaConfig` of an HF Gemma 2 or Gemma 3 text `config.json` dict (or of a multimodal Gemma 3's text model);
    ValueError naming `source` and the key for anything `jaxdp.models.gemma` does not compute as HF's class would
    (see the module doc)."""
    if hf_checkpoint.model_type(hf, source) == "gemma3":
        hf, source = text_config(hf, source), f"{source} (text_config)"
    family = hf_checkpoint.model_type(hf, source)
    if family not in FAMILIES:
        raise ValueError(f"{source}: model_type={family!r} does not load into jaxdp's Gemma (it loads {FAMILIES})")
    name = NAMES[family]
    cfg = hf_checkpoint.ConfigReader(hf, source, name, overrides, OVERRIDABLE)
    need, refuse = cfg.need_int, cfg.refuse
    refuse("hidden_activation", "gelu_pytorch_tanh", GELU_TANH, f"jaxdp's {name} MLP is GeGLU with the tanh GELU")
    refuse("attention_bias", False, (False,), "jaxdp's Gemma attention has no biases")
    refuse("attention_dropout", 0.0, (0.0, 0, None), "jaxdp has no dropout")
    refuse("use_bidirectional_attention", None, (None, False), "jaxdp's Gemma is causal")
    refuse("tie_word_embeddings", True, (False, True), "true or false")
    if family == "gemma3_text":
        refuse("attn_logit_softcapping", None, (None,), "HF's Gemma 3 attention does not apply it on every path")
    n_layer = need("num_hidden_layers")
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = 2 if family == "gemma2" else hf.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"{source}: sliding_window_pattern={pattern!r} must be an integer >= 1")
        layer_types = ([("sliding_attention" if (i + 1) % pattern else "full_attention") for i in range(n_layer)]
                       if family == "gemma3_text" else list(default_layer_types(family, n_layer)))
    if (not isinstance(layer_types, list) or len(layer_types) != n_layer
            or any(kind not in LAYER_TYPES for kind in layer_types)):
        raise ValueError(f"{source}: layer_types={layer_types!r} is not supported (jaxdp's {name} has layers of "
                         f"the kinds {LAYER_TYPES}, one per layer: {n_layer})")
    if "sliding_window" in hf and hf["sliding_window"] is None and "sliding_attention" in layer_types:
        raise ValueError(f"{source}: sliding_window=None with sliding_attention layers in layer_types is not "
                         "supported (a sliding layer without a window)")
    window = need("sliding_window") if hf.get("sliding_window") is not None else 4096  # HF's default
    if family == "gemma2":
        theta = _rope_gemma2(cfg)
        rope = dict(rope_theta=theta, rope_local_theta=theta, rope_scaling=None)
        caps = dict(attn_softcap=_cap(cfg, "attn_logit_softcapping", 50.0),
                    final_softcap=_cap(cfg, "final_logit_softcapping", 30.0))
    else:
        theta, local, factor = _rope_gemma3(cfg)
        rope = dict(rope_theta=theta, rope_local_theta=local, rope_scaling=factor)
        caps = dict(attn_softcap=None, final_softcap=_cap(cfg, "final_logit_softcapping", None))
    return GemmaConfig(vocab_size=need("vocab_size"), seq_len=need("max_position_embeddings"), n_layer=n_layer,
                       n_head=need("num_attention_heads"), n_kv_head=need("num_key_value_heads"),
                       d_model=need("hidden_size"), d_ff=need("intermediate_size"),
                       head_dim=need("head_dim") if hf.get("head_dim") is not None else 256,
                       query_pre_attn_scalar=cfg.positive("query_pre_attn_scalar", 256.0),
                       rms_norm_eps=cfg.positive("rms_norm_eps", 1e-6), sliding_window=window,
                       layer_types=tuple(layer_types), qk_norm=family == "gemma3_text",
                       tie_embeddings=bool(hf.get("tie_word_embeddings", True)), family=family,
                       **rope, **caps, **overrides)


def config_to_hf(config: GemmaConfig) -> dict:
    """The `config.json` dict HF's class of `config.family` reads for `config` (transformers < 5's keys, which
    transformers 5 also reads); ValueError where that class cannot express it."""
    if config.qk_norm != (config.family == "gemma3_text"):
        raise ValueError(f"GemmaConfig(family={config.family!r}) with qk_norm={config.qk_norm} has no HF layout: "
                         f"{ARCHITECTURES[config.family]} has q/k norms: {config.family == 'gemma3_text'}")
    if config.family == "gemma2" and (config.rope_scaling is not None or config.rope_local_theta != config.rope_theta):
        raise ValueError("GemmaConfig(family='gemma2') has one plain RoPE base (rope_local_theta = rope_theta, no "
                         f"rope_scaling); got {config.rope_local_theta}, {config.rope_theta}, {config.rope_scaling}")
    if config.family == "gemma3_text" and config.attn_softcap is not None:
        raise ValueError("GemmaConfig(family='gemma3_text') with attn_softcap has no HF layout jaxdp trusts")
    hf = {"architectures": [ARCHITECTURES[config.family]], "model_type": config.family,
          "hidden_activation": "gelu_pytorch_tanh", "vocab_size": config.vocab_size,
          "max_position_embeddings": config.seq_len, "num_hidden_layers": config.n_layer,
          "num_attention_heads": config.n_head, "num_key_value_heads": config.n_kv_head,
          "hidden_size": config.d_model, "intermediate_size": config.d_ff, "head_dim": config.head_dim,
          "query_pre_attn_scalar": config.query_pre_attn_scalar, "rms_norm_eps": config.rms_norm_eps,
          "sliding_window": config.sliding_window, "layer_types": list(config.layer_types),
          "attn_logit_softcapping": config.attn_softcap, "final_logit_softcapping": config.final_softcap,
          "rope_theta": config.rope_theta, "tie_word_embeddings": config.tie_embeddings,
          "attention_bias": False, "attention_dropout": 0.0}
    if config.family == "gemma3_text":
        hf.update(rope_local_base_freq=config.rope_local_theta,
                  rope_scaling=None if config.rope_scaling is None else {"rope_type": "linear",
                                                                          "factor": config.rope_scaling})
    return hf


def load_hf_gemma(path: str | os.PathLike, **config_overrides) -> Gemma:
    """Loads an HF Gemma 2 or Gemma 3 text checkpoint directory (or a multimodal Gemma 3's text model) into a
    `Gemma` (float32 parameters).

    Args:
      path: directory with `config.json` and `model.safetensors` (or
        `model.safetensors.index.json` and the files it names).
      **config_overrides: compute settings of `GemmaConfig` only: `dtype`, `remat`, `attention`.

    Raises:
      FileNotFoundError: a file is missing (the message names it).
      ValueError: an unsupported config value, or a missing, unexpected or
        wrongly shaped tensor (the message names the file and the key).
    """
    path = os.fspath(path)
    hf, file = hf_checkpoint.read_config(path), os.path.join(path, CONFIG_FILE)
    config = config_from_hf(hf, file, **config_overrides)
    if hf_checkpoint.model_type(hf, file) == "gemma3":
        tensors, source = hf_checkpoint.read_tensors(path, "")
        tensors = _text_tensors(tensors)
    else:
        tensors, source = hf_checkpoint.read_tensors(path, _PREFIX)
    if config.tie_embeddings and "lm_head.weight" in tensors:
        head = tensors.pop("lm_head.weight")
        embed = tensors.get("embed_tokens.weight")
        if embed is not None and not np.array_equal(np.asarray(head[0]), np.asarray(embed[0])):
            raise ValueError(f"{head[1]}: tensor 'lm_head.weight' differs from 'embed_tokens.weight' although "
                             f"{CONFIG_FILE} says tie_word_embeddings=true")
    abstract = nnx.eval_shape(lambda: Gemma(config, rngs=nnx.Rngs(0)))
    return hf_checkpoint.load_state(abstract, tensors, source, hf_names(config),
                                    f"a {NAMES[config.family]} with n_layer={config.n_layer}, tie_word_embeddings="
                                    f"{str(config.tie_embeddings).lower()}")


def _text_tensors(tensors: dict) -> dict:
    """The text model's tensors of a multimodal gemma3 checkpoint, named as a gemma3_text one's (without
    `model.`); the vision tower's and the projector's dropped; any other name kept (to be refused by name)."""
    out = {}
    for name, value in tensors.items():
        if name.startswith(_OTHER_TOWERS):
            continue
        short = next((name.removeprefix(p) for p in _TEXT_PREFIXES if name.startswith(p)), name)
        short = "lm_head.weight" if short == "language_model.lm_head.weight" else short
        if short in out:
            raise ValueError(f"{value[1]}: tensor {name!r} and another are both the text model's {short!r}")
        out[short] = value
    return out


def save_hf_gemma(model: Gemma, path: str | os.PathLike, *, dtype: str = "float32") -> None:
    """Writes `model` as an HF checkpoint directory (`config.json`, `model.safetensors`) of its `config.family`,
    tensor names with the `model.` prefix (an untied head as `lm_head.weight`).

    A model with LoRA layers must be merged first (`jaxdp.finetune.methods.merge_lora`); adapters and soft
    prompts have no place in HF's layout and are refused. `dtype`: "float32", "bfloat16" or "float16".
    """
    if not isinstance(model, Gemma):
        raise ValueError(f"model must be a jaxdp.models.gemma.Gemma, got {type(model).__name__}")
    names = {(name if name == "lm_head.weight" else _PREFIX + name): target
             for name, target in hf_names(model.config).items()}
    hf_checkpoint.save_checkpoint(model, path, config_to_hf(model.config), names, dtype,
                                  f"HF's {NAMES[model.config.family]} layout")
