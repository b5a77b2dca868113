"""Hugging Face checkpoint directories: what `hf_gpt2`, `hf_llama` and `hf_gemma` share.

A checkpoint directory holds `config.json` and `model.safetensors` (or a
sharded `model.safetensors.index.json` and its files), as written by
`transformers`' `save_pretrained` or downloaded from the hub. Local files
only: nothing here reaches a network. Each model module maps HF tensor names
to its parameter paths (`Names`: name -> (path, transposed)); `load_state`
fills an abstract model from the tensors with errors that name the file and
the key, `save_checkpoint` writes the directory back.
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdp.models.safetensors_io import read_safetensors, write_safetensors

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SAVE_DTYPES = ("float32", "bfloat16", "float16")
FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16")  # what a weight may be stored as
# {HF tensor name: (our parameter path, whether HF stores it transposed: torch's Linear (out, in))}
Names = dict[str, tuple[tuple, bool]]
# {transformers class in config.json's `architectures`: the model_type it is a checkpoint of}
ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2",
                 "Gemma3ForCausalLM": "gemma3_text", "Gemma3ForConditionalGeneration": "gemma3"}
# what jaxdp loads: gpt2, llama, ..., gemma2, gemma3_text, gemma3 (its text model: `hf_gemma`)
MODEL_TYPES = tuple(dict.fromkeys(ARCHITECTURES.values()))


def read_config(path: str) -> dict:
    """The directory's `config.json` as a dict; FileNotFoundError / ValueError naming the file."""
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


def model_type(hf: dict, source: str, default: str | None = None) -> str:
    """The checkpoint's family: `model_type`, or the one its `architectures` name when it has none (else
    `default`); ValueError naming `source` for a family jaxdp does not load, an `architectures` list naming
    another family's class, or neither key (without a default)."""
    kind, architectures = hf.get("model_type"), hf.get("architectures")
    if architectures is not None and (not isinstance(architectures, list)
                                      or not all(isinstance(a, str) for a in architectures)):
        raise ValueError(f"{source}: architectures={architectures!r} must be a list of class names")
    named = sorted({ARCHITECTURES[a] for a in architectures or () if a in ARCHITECTURES})
    if kind is None:
        if len(named) == 1:
            kind = named[0]
        elif default is not None and not named:
            kind = default
        else:
            raise ValueError(f"{source}: no model_type, and architectures={architectures!r} names no one class of "
                             f"{sorted(ARCHITECTURES)}")
    if kind not in MODEL_TYPES:
        raise ValueError(f"{source}: model_type={kind!r} is not supported; jaxdp loads {MODEL_TYPES}")
    if any(n != kind for n in named):
        raise ValueError(f"{source}: architectures={architectures!r} is a checkpoint of {named}, but "
                         f"model_type={kind!r}")
    return kind


class ConfigReader:
    """Reads an HF `config.json` dict with errors that name the file (`source`) and the key."""

    def __init__(self, hf: dict, source: str, model: str, overrides: dict, overridable: tuple):
        bad = sorted(set(overrides) - set(overridable))
        if bad:
            raise ValueError(f"config_overrides may only set {overridable} (the shapes come from {source}); "
                             f"got {bad}")
        self.hf, self.source, self.model = hf, source, model

    def need(self, key: str, *alternatives: str):
        """The value of `key` (or of the first alternative present); ValueError when none is."""
        for k in (key, *alternatives):
            if self.hf.get(k) is not None:
                return self.hf[k]
        raise ValueError(f"{self.source}: missing key {key!r} (an HF {self.model} config.json has it)")

    def need_int(self, key: str, *alternatives: str) -> int:
        """`need`, for a count: an integer >= 1 (2.0 is 2; 2.5 or True is a ValueError, not a smaller model)."""
        value = self.need(key, *alternatives)
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or value != int(value) or value < 1):
            raise ValueError(f"{self.source}: {key}={value!r} must be an integer >= 1")
        return int(value)

    def positive(self, key: str, default: float, value=None) -> float:
        """The number at `key` (`default` when absent; or `value`, read from elsewhere under that name) as a
        finite float > 0; ValueError naming the file and key for anything else (a string, a bool, 0, inf)."""
        value = self.hf.get(key, default) if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"{self.source}: {key}={value!r} must be a finite number > 0")
        return float(value)

    def refuse(self, key: str, default, allowed: tuple, why: str) -> None:
        """ValueError unless the value of `key` (`default` when absent) is one of `allowed`."""
        value = self.hf.get(key, default)
        if value not in allowed:
            raise ValueError(f"{self.source}: {key}={value!r} is not supported ({why}); allowed: {allowed}")


def read_tensors(path: str, prefix: str) -> tuple[dict[str, tuple[np.ndarray, str]], str]:
    """({name without `prefix`: (array, the file it came from)}, the weights file or index)."""
    single, index = os.path.join(path, WEIGHTS_FILE), os.path.join(path, INDEX_FILE)
    weight_map = None
    if os.path.isfile(single):
        files, source = [single], single
    elif os.path.isfile(index):
        weight_map = _weight_map(index)
        files, source = [os.path.join(path, name) for name in dict.fromkeys(weight_map.values())], index
    else:
        others = [n for n in ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack")
                  if os.path.exists(os.path.join(path, n))]
        hint = f"; found {others}: re-save it with safe_serialization=True" if others else ""
        raise FileNotFoundError(f"HF checkpoint {path!r} has neither {WEIGHTS_FILE} nor {INDEX_FILE}{hint}")
    tensors, seen = {}, set()
    for file in files:
        for name, array in read_safetensors(file).items():
            seen.add(name)
            if weight_map is not None and weight_map.get(name) != os.path.basename(file):
                raise ValueError(f"{file}: tensor {name!r} is not in this file by {INDEX_FILE} "
                                 f"(which maps it to {weight_map.get(name)!r})")
            short = name.removeprefix(prefix)
            if short in tensors:  # e.g. both "transformer.wte.weight" and "wte.weight": which is the model?
                raise ValueError(f"{file}: tensor {name!r} and another in {tensors[short][1]} are both "
                                 f"{short!r} (with or without the {prefix!r} prefix)")
            tensors[short] = (array, file)
    if weight_map is not None:
        missing = sorted(set(weight_map) - seen)
        if missing:
            raise ValueError(f"{source}: tensor(s) {missing[:8]} are missing from the files it maps them to")
    return tensors, source


def _weight_map(index: str) -> dict[str, str]:
    """The index's {tensor name: file name}; ValueError naming the index unless every file is a plain
    name in the checkpoint's directory (no path: '../x.safetensors' or '/x' would read outside it)."""
    try:
        with open(index) as f:
            weight_map = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{index}: not valid JSON ({e})") from None
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: missing its 'weight_map' object")
    for name, file in weight_map.items():
        if not isinstance(file, str) or os.path.basename(file) != file or file in ("", ".", ".."):
            raise ValueError(f"{index}: weight_map[{name!r}] = {file!r} is not a file name in the checkpoint's "
                             "directory")
    return weight_map


def load_state(abstract: nnx.Module, tensors: dict, source: str, names: Names, what: str):
    """`abstract` (from `nnx.eval_shape`) with every variable read from `tensors` (float32).

    `what` describes the model for messages ("a GPT-2 with n_layer=2"). ValueError for an unexpected,
    missing or wrongly shaped tensor, naming its file and key."""
    unexpected = sorted(n for n in tensors if n not in names)
    if unexpected:
        raise ValueError(f"{tensors[unexpected[0]][1]}: unexpected tensor(s) {unexpected[:8]} for {what} "
                         f"(from {CONFIG_FILE})")
    graphdef, state = nnx.split(abstract)
    by_path = {path: (hf, transposed) for hf, (path, transposed) in names.items()}
    leaves = []
    for var_path, var in nnx.to_flat_state(state):
        hf, transposed = by_path[tuple(var_path)]
        if hf not in tensors:
            raise ValueError(f"{source}: tensor {hf!r} is missing ({what}, from {CONFIG_FILE})")
        array, file = tensors[hf]
        if array.dtype.name not in FLOAT_DTYPES:
            raise ValueError(f"{file}: tensor {hf!r} is {array.dtype.name}, not a float ({FLOAT_DTYPES})")
        with np.errstate(over="ignore"):  # a float64 beyond float32's range becomes inf, refused below
            array = np.asarray(array, dtype=np.float32)
        if not np.isfinite(array).all():
            raise ValueError(f"{file}: tensor {hf!r} holds {int((~np.isfinite(array)).sum())} non-finite values "
                             "(NaN or inf, or beyond float32's range): training from it would spend the privacy "
                             "budget on NaN losses")
        shape = tuple(var.shape[::-1]) if transposed else tuple(var.shape)
        if tuple(array.shape) != shape:
            raise ValueError(f"{file}: tensor {hf!r} has shape {tuple(array.shape)}, expected {shape} "
                             f"from {CONFIG_FILE}")
        leaves.append((var_path, var.replace(jnp.asarray(array.T if transposed else array))))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def save_checkpoint(model: nnx.Module, path, hf_config: dict, names: Names, dtype: str, layout: str) -> None:
    """Writes `model`'s variables as `names` says, and `hf_config`, as an HF checkpoint directory.

    `layout` names the HF layout for the message when the model has variables it has no place for
    (LoRA layers must be merged first, `jaxdp.finetune.methods.merge_lora`; adapters and soft prompts are refused).
    """
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype must be one of {SAVE_DTYPES}, got {dtype!r}")
    values = {tuple(p): var.get_value() for p, var in nnx.to_flat_state(nnx.state(model))}
    extra = sorted("/".join(map(str, p)) for p in set(values) - {p for p, _ in names.values()})
    if extra:
        raise ValueError(f"model has variables {layout} has no place for: {extra[:8]}; merge LoRA "
                         "layers with jaxdp.finetune.methods.merge_lora, and save adapters / soft prompts with nnx state")
    out_dtype = jnp.dtype(dtype)
    tensors = {}
    for hf, (p, transposed) in names.items():
        array = np.asarray(jax.device_get(values[p]))
        tensors[hf] = np.ascontiguousarray(array.T if transposed else array).astype(out_dtype)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(dict(hf_config, torch_dtype=dtype), f, indent=2)
    write_safetensors(os.path.join(path, WEIGHTS_FILE), tensors, {"format": "pt"})
