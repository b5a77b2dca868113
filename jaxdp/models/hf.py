"""One loader for local Hugging Face checkpoints: `load_hf` / `save_hf` dispatch on `config.json`.

The family is `model_type`, or the class `architectures` names when there is
no `model_type` (`jaxdp.models.hf_checkpoint.model_type`):

  gpt2                          -> `jaxdp.models.gpt2.GPT2`    (`hf_gpt2`)
  llama, mistral, qwen2, qwen3  -> `jaxdp.models.llama.Llama`  (`hf_llama`; the
                                   family is kept in `LlamaConfig.family`)
  gemma2, gemma3_text           -> `jaxdp.models.gemma.Gemma`  (`hf_gemma`; `GemmaConfig.family`)
  gemma3                        -> its text model, a gemma3_text `Gemma` (the vision tower is not loaded)

Anything else (qwen2_moe, mixtral, ...), a config value the model
does not implement, or a missing, extra or misshapen tensor is one ValueError
naming the file and the key, raised before any tensor is copied or any
compute runs. Nothing here reaches a network.

    model = jaxdp.load_hf("Qwen2.5-0.5B/", dtype="bfloat16", remat="full")
    jaxdp.save_hf(model, "out/")      # the same family, names and layout
"""

from __future__ import annotations

import os

from flax import nnx

from jaxdp.models import hf_checkpoint, hf_gemma, hf_gpt2, hf_llama
from jaxdp.models.gemma import Gemma
from jaxdp.models.gpt2 import GPT2
from jaxdp.models.llama import Llama

MODEL_TYPES = hf_checkpoint.MODEL_TYPES


def model_type(path: str | os.PathLike) -> str:
    """The family of the checkpoint directory `path` (one of `MODEL_TYPES`); ValueError naming its
    config.json for anything else, FileNotFoundError without one."""
    path = os.fspath(path)
    return hf_checkpoint.model_type(hf_checkpoint.read_config(path), os.path.join(path, hf_checkpoint.CONFIG_FILE))


def load_hf(path: str | os.PathLike, *, dtype: str = "float32", **compute) -> GPT2 | Llama | Gemma:
    """Loads a local HF checkpoint directory of any family jaxdp implements (float32 parameters).

    Args:
      path: directory with `config.json` and `model.safetensors` (or
        `model.safetensors.index.json` and the files it names).
      dtype: the compute dtype, "float32" or "bfloat16" (parameters stay float32).
      **compute: the other compute settings of the model's config: `remat`, `attention`.

    Returns:
      a `GPT2` (model_type gpt2), a `Llama` (llama, mistral, qwen2, qwen3) or a `Gemma` (gemma2, gemma3_text,
      and gemma3's text model).

    Raises:
      FileNotFoundError: a file is missing (the message names it).
      ValueError: an unsupported model_type or config value, or a missing,
        unexpected or wrongly shaped tensor (the message names the file and key).
    """
    kind = model_type(path)
    load = (hf_gpt2.load_hf_gpt2 if kind == "gpt2" else hf_gemma.load_hf_gemma if kind in hf_gemma.MODEL_TYPES
            else hf_llama.load_hf_llama)
    return load(path, dtype=dtype, **compute)


def save_hf(model: nnx.Module, path: str | os.PathLike, *, dtype: str = "float32") -> None:
    """Writes `model` (a `GPT2`, `Llama` or `Gemma`) as an HF checkpoint directory of its family, as `load_hf` reads it.

    LoRA layers must be merged first (`jaxdp.finetune.methods.merge_lora`); adapters and soft prompts have
    no place in HF's layouts and are refused. `dtype`: "float32", "bfloat16" or "float16".
    """
    if isinstance(model, GPT2):
        hf_gpt2.save_hf_gpt2(model, path, dtype=dtype)
    elif isinstance(model, Llama):
        hf_llama.save_hf_llama(model, path, dtype=dtype)
    elif isinstance(model, Gemma):
        hf_gemma.save_hf_gemma(model, path, dtype=dtype)
    else:
        raise ValueError(f"model must be a jaxdp.models.gpt2.GPT2, jaxdp.models.llama.Llama or "
                         f"jaxdp.models.gemma.Gemma, got {type(model).__name__}")
