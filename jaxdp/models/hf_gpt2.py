"""Hugging Face GPT-2 checkpoints in and out of `jaxdp.models.gpt2.GPT2`.

Local checkpoint directories (`jaxdp.models.hf_checkpoint`: `config.json`
and `model.safetensors`, or a sharded index); nothing here reaches a network.

HF's GPT-2 stores its projections as `Conv1D` weights of shape (in, out), the
layout of our `jaxdp.core.nn.Linear` kernels, so no tensor is transposed; its
fused `c_attn` splits into q | k | v along the output axis and each into
heads `(n_head, head_dim)`, as `jaxdp.models.gpt2.Attention` does. The head is
tied to `wte` (`lm_head.weight`, when present, must equal it). HF's causal
mask buffers (`h.{i}.attn.bias`, `h.{i}.attn.masked_bias`) are not
parameters and are skipped. Names may carry the `transformer.` prefix of
`GPT2LMHeadModel`.

    model = load_hf_gpt2("gpt2-local/", dtype="bfloat16", remat="full")
    save_hf_gpt2(model, "out/")
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from flax import nnx

from jaxdp.models import hf_checkpoint, layers
from jaxdp.models.gpt2 import GPT2, GPT2Config
from jaxdp.models.hf_checkpoint import CONFIG_FILE

OVERRIDABLE = ("dtype", "remat", "attention", "scan_layers")  # compute settings; the shapes come from config.json
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # the tanh GELU of jaxdp's GPT-2
_BUFFERS = (".attn.bias", ".attn.masked_bias")  # HF's causal-mask buffers, not parameters
_PREFIX = "transformer."


def hf_names(n_layer: int) -> hf_checkpoint.Names:
    """{HF tensor name: (our parameter path, False)} for a GPT-2 of `n_layer` blocks (HF's Conv1D
    weights are (in, out), as our kernels: nothing is transposed)."""
    names = {"wte.weight": ("wte", "embedding"), "wpe.weight": ("wpe", "embedding"),
             "ln_f.weight": ("ln_f", "scale"), "ln_f.bias": ("ln_f", "bias")}
    ours = {"ln_1": ("ln_1",), "ln_2": ("ln_2",), "attn.c_attn": ("attn", "c_attn"),
            "attn.c_proj": ("attn", "c_proj"), "mlp.c_fc": ("mlp", "c_fc"), "mlp.c_proj": ("mlp", "c_proj")}
    for i in range(n_layer):
        for hf, path in ours.items():
            is_norm = hf.startswith("ln_")
            names[f"h.{i}.{hf}.weight"] = ("blocks", i, *path, "scale" if is_norm else "kernel")
            names[f"h.{i}.{hf}.bias"] = ("blocks", i, *path, "bias")
    return {hf: (path, False) for hf, path in names.items()}


def config_from_hf(hf: dict, source: str = CONFIG_FILE, **overrides) -> GPT2Config:
    """`GPT2Config` of an HF GPT-2 `config.json` dict; ValueError naming `source` and the key otherwise."""
    cfg = hf_checkpoint.ConfigReader(hf, source, "GPT-2", overrides, OVERRIDABLE)
    need, refuse = cfg.need_int, cfg.refuse
    refuse("model_type", "gpt2", ("gpt2",), "only GPT-2 checkpoints load into jaxdp's GPT2")
    refuse("activation_function", "gelu_new", ACTIVATIONS, "jaxdp's GPT-2 uses the tanh GELU")
    refuse("tie_word_embeddings", True, (True,), "jaxdp's GPT-2 ties its head to wte")
    refuse("scale_attn_weights", True, (True,), "attention is scaled by 1/sqrt(head_dim)")
    refuse("scale_attn_by_inverse_layer_idx", False, (False,), "no per-layer attention scaling")
    refuse("add_cross_attention", False, (False,), "decoder-only")
    d = need("n_embd")
    n_inner = need("n_inner") if hf.get("n_inner") is not None else 4 * d
    if n_inner % d:
        raise ValueError(f"{source}: n_inner={n_inner} must be a multiple of n_embd={d}")
    return GPT2Config(vocab_size=need("vocab_size"), seq_len=need("n_positions", "n_ctx"),
                      n_layer=need("n_layer"), n_head=need("n_head"), d_model=d,
                      mlp_ratio=n_inner // d, layer_norm_epsilon=cfg.positive("layer_norm_epsilon", 1e-5),
                      **overrides)


def config_to_hf(config: GPT2Config) -> dict:
    """The `config.json` dict `transformers`' GPT2LMHeadModel reads for `config`."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
            "vocab_size": config.vocab_size, "n_positions": config.seq_len, "n_ctx": config.seq_len,
            "n_embd": config.d_model, "n_layer": config.n_layer, "n_head": config.n_head,
            "n_inner": config.mlp_ratio * config.d_model, "layer_norm_epsilon": config.layer_norm_epsilon,
            "tie_word_embeddings": True, "torch_dtype": "float32"}


def load_hf_gpt2(path: str | os.PathLike, **config_overrides) -> GPT2:
    """Loads an HF GPT-2 checkpoint directory into a `GPT2` (float32 parameters).

    Args:
      path: directory with `config.json` and `model.safetensors` (or
        `model.safetensors.index.json` and the files it names).
      **config_overrides: compute settings of `GPT2Config` only: `dtype`,
        `remat`, `attention`, `scan_layers` (the blocks stacked, `jaxdp.models.layers`).

    Raises:
      FileNotFoundError: a file is missing (the message names it).
      ValueError: an unsupported config value, or a missing, unexpected or
        wrongly shaped tensor (the message names the file and the key).
    """
    path = os.fspath(path)
    config = config_from_hf(hf_checkpoint.read_config(path), os.path.join(path, CONFIG_FILE), **config_overrides)
    tensors, source = hf_checkpoint.read_tensors(path, _PREFIX)
    head = tensors.pop("lm_head.weight", None)
    if head is not None and "wte.weight" in tensors and not np.array_equal(
            np.asarray(head[0]), np.asarray(tensors["wte.weight"][0])):
        raise ValueError(f"{head[1]}: tensor 'lm_head.weight' differs from 'wte.weight'; jaxdp's GPT-2 ties them")
    tensors = {name: t for name, t in tensors.items() if not name.endswith(_BUFFERS)}
    # files hold the unrolled layout: read into it, then stack the blocks if scan_layers
    abstract = nnx.eval_shape(lambda: GPT2(dataclasses.replace(config, scan_layers=False), rngs=nnx.Rngs(0)))
    model = hf_checkpoint.load_state(abstract, tensors, source, hf_names(config.n_layer),
                                     f"a GPT-2 with n_layer={config.n_layer}")
    return layers.with_layout(model, config.scan_layers)


def save_hf_gpt2(model: GPT2, path: str | os.PathLike, *, dtype: str = "float32") -> None:
    """Writes `model` as an HF GPT-2 checkpoint directory (`config.json`, `model.safetensors`).

    Frozen and trainable parameters alike are written. A model with LoRA
    layers must be merged first (`jaxdp.finetune.methods.merge_lora`); adapters and
    soft prompts have no place in HF's GPT-2 layout and are refused.

    Args:
      model: a `GPT2`.
      path: the directory (created if needed; existing files are overwritten).
      dtype: the stored dtype, one of "float32", "bfloat16", "float16".
    """
    if not isinstance(model, GPT2):
        raise ValueError(f"model must be a jaxdp.models.gpt2.GPT2, got {type(model).__name__}")
    hf_checkpoint.save_checkpoint(layers.unrolled(model), path, config_to_hf(model.config),
                                  hf_names(model.config.n_layer), dtype,
                                  "HF's GPT-2 layout")
