"""Hugging Face GPT-2 checkpoints in and out of `jaxdp.models.gpt2.GPT2`.

A checkpoint directory holds `config.json` and `model.safetensors` (or a
sharded `model.safetensors.index.json` and its files), as written by
`transformers`' `save_pretrained` or downloaded from the hub. Local files
only: nothing here reaches a network.

HF's GPT-2 stores its projections as `Conv1D` weights of shape (in, out), the
layout of our `jaxdp.nn.Linear` kernels, so no tensor is transposed; its
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

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdp.models.gpt2 import GPT2, GPT2Config
from jaxdp.models.safetensors_io import read_safetensors, write_safetensors

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
OVERRIDABLE = ("dtype", "remat", "attention")  # compute settings; the shapes come from config.json
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # the tanh GELU of jaxdp's GPT-2
_BUFFERS = (".attn.bias", ".attn.masked_bias")  # HF's causal-mask buffers, not parameters
_PREFIX = "transformer."
_SAVE_DTYPES = ("float32", "bfloat16", "float16")


def hf_names(n_layer: int) -> dict[str, tuple]:
    """{HF tensor name: our parameter path} for a GPT-2 of `n_layer` blocks."""
    names = {"wte.weight": ("wte", "embedding"), "wpe.weight": ("wpe", "embedding"),
             "ln_f.weight": ("ln_f", "scale"), "ln_f.bias": ("ln_f", "bias")}
    ours = {"ln_1": ("ln_1",), "ln_2": ("ln_2",), "attn.c_attn": ("attn", "c_attn"),
            "attn.c_proj": ("attn", "c_proj"), "mlp.c_fc": ("mlp", "c_fc"), "mlp.c_proj": ("mlp", "c_proj")}
    for i in range(n_layer):
        for hf, path in ours.items():
            is_norm = hf.startswith("ln_")
            names[f"h.{i}.{hf}.weight"] = ("blocks", i, *path, "scale" if is_norm else "kernel")
            names[f"h.{i}.{hf}.bias"] = ("blocks", i, *path, "bias")
    return names


def config_from_hf(hf: dict, source: str = CONFIG_FILE, **overrides) -> GPT2Config:
    """`GPT2Config` of an HF GPT-2 `config.json` dict; ValueError naming `source` and the key otherwise."""
    bad = sorted(set(overrides) - set(OVERRIDABLE))
    if bad:
        raise ValueError(f"config_overrides may only set {OVERRIDABLE} (the shapes come from {source}); got {bad}")

    def need(key, *alternatives):
        for k in (key, *alternatives):
            if hf.get(k) is not None:
                return hf[k]
        raise ValueError(f"{source}: missing key {key!r} (an HF GPT-2 config.json has it)")

    def refuse(key, default, allowed, why):
        value = hf.get(key, default)
        if value not in allowed:
            raise ValueError(f"{source}: {key}={value!r} is not supported ({why}); allowed: {allowed}")

    refuse("model_type", "gpt2", ("gpt2",), "only GPT-2 checkpoints load into jaxdp's GPT2")
    refuse("activation_function", "gelu_new", ACTIVATIONS, "jaxdp's GPT-2 uses the tanh GELU")
    refuse("tie_word_embeddings", True, (True,), "jaxdp's GPT-2 ties its head to wte")
    refuse("scale_attn_weights", True, (True,), "attention is scaled by 1/sqrt(head_dim)")
    refuse("scale_attn_by_inverse_layer_idx", False, (False,), "no per-layer attention scaling")
    refuse("add_cross_attention", False, (False,), "decoder-only")
    d = int(need("n_embd"))
    n_inner = hf.get("n_inner") or 4 * d
    if n_inner % d:
        raise ValueError(f"{source}: n_inner={n_inner} must be a multiple of n_embd={d}")
    return GPT2Config(vocab_size=int(need("vocab_size")), seq_len=int(need("n_positions", "n_ctx")),
                      n_layer=int(need("n_layer")), n_head=int(need("n_head")), d_model=d,
                      mlp_ratio=n_inner // d, layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
                      **overrides)


def config_to_hf(config: GPT2Config) -> dict:
    """The `config.json` dict `transformers`' GPT2LMHeadModel reads for `config`."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
            "vocab_size": config.vocab_size, "n_positions": config.seq_len, "n_ctx": config.seq_len,
            "n_embd": config.d_model, "n_layer": config.n_layer, "n_head": config.n_head,
            "n_inner": config.mlp_ratio * config.d_model, "layer_norm_epsilon": config.layer_norm_epsilon,
            "tie_word_embeddings": True, "torch_dtype": "float32"}


def _read_config(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"HF checkpoint {path!r} has no {CONFIG_FILE} (expected {file})")
    try:
        with open(file) as f:
            hf = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return hf


def _read_tensors(path: str) -> tuple[dict[str, tuple[np.ndarray, str]], str]:
    """({name without the `transformer.` prefix: (array, the file it came from)}, the weights file or index)."""
    single, index = os.path.join(path, WEIGHTS_FILE), os.path.join(path, INDEX_FILE)
    if os.path.isfile(single):
        files, source = [single], single
    elif os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: missing its 'weight_map' object")
        files, source = [os.path.join(path, name) for name in dict.fromkeys(weight_map.values())], index
    else:
        others = [n for n in ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack")
                  if os.path.exists(os.path.join(path, n))]
        hint = f"; found {others}: re-save it with safe_serialization=True" if others else ""
        raise FileNotFoundError(f"HF checkpoint {path!r} has neither {WEIGHTS_FILE} nor {INDEX_FILE}{hint}")
    tensors = {}
    for file in files:
        for name, array in read_safetensors(file).items():
            tensors[name.removeprefix(_PREFIX)] = (array, file)
    return tensors, source


def load_hf_gpt2(path: str | os.PathLike, **config_overrides) -> GPT2:
    """Loads an HF GPT-2 checkpoint directory into a `GPT2` (float32 parameters).

    Args:
      path: directory with `config.json` and `model.safetensors` (or
        `model.safetensors.index.json` and the files it names).
      **config_overrides: compute settings of `GPT2Config` only: `dtype`,
        `remat`, `attention`.

    Raises:
      FileNotFoundError: a file is missing (the message names it).
      ValueError: an unsupported config value, or a missing, unexpected or
        wrongly shaped tensor (the message names the file and the key).
    """
    path = os.fspath(path)
    config = config_from_hf(_read_config(path), os.path.join(path, CONFIG_FILE), **config_overrides)
    tensors, source = _read_tensors(path)
    names = hf_names(config.n_layer)
    head = tensors.pop("lm_head.weight", None)
    unexpected = sorted(n for n in tensors if n not in names and not n.endswith(_BUFFERS))
    if unexpected:
        raise ValueError(f"{tensors[unexpected[0]][1]}: unexpected tensor(s) {unexpected[:8]} for a GPT-2 with "
                         f"n_layer={config.n_layer} (from {CONFIG_FILE})")
    abstract = nnx.eval_shape(lambda: GPT2(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    by_path = {path_: hf for hf, path_ in names.items()}
    leaves = []
    for var_path, var in nnx.to_flat_state(state):
        hf = by_path[tuple(var_path)]
        if hf not in tensors:
            raise ValueError(f"{source}: tensor {hf!r} is missing (n_layer={config.n_layer} in {CONFIG_FILE})")
        array, file = tensors[hf]
        if tuple(array.shape) != tuple(var.shape):
            raise ValueError(f"{file}: tensor {hf!r} has shape {tuple(array.shape)}, expected {tuple(var.shape)} "
                             f"from {CONFIG_FILE}")
        leaves.append((var_path, var.replace(jnp.asarray(np.asarray(array, dtype=np.float32)))))
    if head is not None and not np.array_equal(np.asarray(head[0]), np.asarray(tensors["wte.weight"][0])):
        raise ValueError(f"{head[1]}: tensor 'lm_head.weight' differs from 'wte.weight'; jaxdp's GPT-2 ties them")
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def save_hf_gpt2(model: GPT2, path: str | os.PathLike, *, dtype: str = "float32") -> None:
    """Writes `model` as an HF GPT-2 checkpoint directory (`config.json`, `model.safetensors`).

    Frozen and trainable parameters alike are written. A model with LoRA
    layers must be merged first (`jaxdp.finetune.merge_lora`); adapters and
    soft prompts have no place in HF's GPT-2 layout and are refused.

    Args:
      model: a `GPT2`.
      path: the directory (created if needed; existing files are overwritten).
      dtype: the stored dtype, one of "float32", "bfloat16", "float16".
    """
    if not isinstance(model, GPT2):
        raise ValueError(f"model must be a jaxdp.models.gpt2.GPT2, got {type(model).__name__}")
    if dtype not in _SAVE_DTYPES:
        raise ValueError(f"dtype must be one of {_SAVE_DTYPES}, got {dtype!r}")
    names = hf_names(model.config.n_layer)
    values = {tuple(p): var.get_value() for p, var in nnx.to_flat_state(nnx.state(model))}
    extra = sorted("/".join(map(str, p)) for p in set(values) - set(names.values()))
    if extra:
        raise ValueError(f"model has variables HF's GPT-2 layout has no place for: {extra[:8]}; merge LoRA "
                         "layers with jaxdp.finetune.merge_lora, and save adapters / soft prompts with nnx state")
    out_dtype = jnp.dtype(dtype)
    tensors = {hf: np.asarray(jax.device_get(values[p])).astype(out_dtype) for hf, p in names.items()}
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    hf_config = dict(config_to_hf(model.config), torch_dtype=dtype)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(hf_config, f, indent=2)
    write_safetensors(os.path.join(path, WEIGHTS_FILE), tensors, {"format": "pt"})
