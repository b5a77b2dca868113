"""The checks a fine-tuning run ends with: silent failures caught before the model is shared.

A fine-tuning method trains a subset of the parameters; a bug (an update or a weight decay reaching a frozen
leaf, a LoRA factor never updated, a merge that drops or rescales the LoRA product) leaves a run that looks
normal and ships a wrong model (Opacus #820: LoRA weights silently corrupted, runs looked normal). Three
cheap checks, on the host, on the run's final state:

  frozen      every frozen parameter (`jaxdp.core.nn.Frozen`) is bit for bit the loaded one: SHA-256 of each
              leaf's dtype, shape and bytes (`digests`), compared by path (`check_frozen`).
  trained     at least one trainable parameter (`nnx.Param`) differs from its value before training
              (`check_trained`; only for a run that took a step).
  lora merge  the model with LoRA merged into its base kernels (`jaxdp.finetune.methods.merge_lora`, what
              `save_hf` writes) gives the logits of the unmerged model on a fixed probe batch of token ids
              (`probe_tokens`: public, no record), within `merge_tolerance` (`check_lora_merge`).

Each failure raises `TripwireError` naming the parameter (or the logits' difference and its bound); the
fine-tuning job (`jaxdp.training.finetune_job.run_tripwires`) records the result in summary.json, keeps every
output of the run, and exits nonzero.

The merge check computes both models in float32 (`in_float32`: a bfloat16 run's compute dtype set to float32
on a copy; the parameters are float32 already), because bfloat16 compute rounds the merged and the unmerged
paths apart by more than a small trained LoRA product moves the logits. Its tolerance is
`16 eps sqrt(width * merged) max(1, max |logits|)` (eps of the least precise of the logits' and the kernels'
dtypes, width the widest merged input, merged the number of merged projections): the rounding of a merged
product grows like the square root of the terms it sums.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdp.core import nn


class TripwireError(RuntimeError):
    """A fine-tuning run's final state failed a check; the message names the parameter."""


def _name(path) -> str:
    return "/".join(map(str, path))


def digests(model: nnx.Module, kind) -> dict[str, str]:
    """{parameter path: SHA-256 of its dtype, shape and bytes} of the `kind` (`nnx.Param`, `nn.Frozen`) leaves
    of `model`, read on the host."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, kind)):
        value = np.asarray(jax.device_get(var.get_value()))
        h = hashlib.sha256(f"{value.dtype.str}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).view(np.uint8).tobytes())
        out[_name(path)] = h.hexdigest()
    return out


def check_frozen(loaded: dict[str, str], model: nnx.Module) -> int:
    """The number of frozen leaves of `model`, each bit for bit its `loaded` digest; else TripwireError naming
    the first that differs (or is missing, or appeared)."""
    now = digests(model, nn.Frozen)
    for name in sorted(set(loaded) | set(now)):
        if name not in now:
            raise TripwireError(f"frozen parameter {name} is no longer frozen (or gone) after training")
        if name not in loaded:
            raise TripwireError(f"parameter {name} is frozen after training but was not among the loaded frozen ones")
        if now[name] != loaded[name]:
            changed = sum(now[k] != loaded.get(k) for k in now)
            raise TripwireError(f"frozen parameter {name} changed during training ({changed} of {len(now)} frozen "
                                "leaves differ from the loaded weights, bit for bit)")
    return len(now)


def check_trained(initial: dict[str, str], model: nnx.Module) -> int:
    """The number of trainable leaves of `model` that differ from `initial` (digests before training); none:
    TripwireError naming them."""
    now = digests(model, nnx.Param)
    changed = sum(now.get(k) != v for k, v in initial.items())
    if not changed:
        names = ", ".join(sorted(initial)[:4]) + (", ..." if len(initial) > 4 else "")
        raise TripwireError(f"no trainable parameter changed during training ({len(initial)} leaves: {names}); "
                            "a learning rate of 0, or updates that never reach the parameters")
    return changed


def probe_tokens(vocab_size: int, seq_len: int, batch: int = 2) -> np.ndarray:
    """A fixed (batch, min(seq_len, 32)) int32 batch of token ids spread over the vocabulary (public)."""
    n = min(seq_len, 32)
    return ((np.arange(batch * n, dtype=np.int64) * 7919 + 17) % vocab_size).astype(np.int32).reshape(batch, n)


def merge_tolerance(logits: np.ndarray, dtypes, width: int, merged: int) -> float:
    """The bound on |merged - unmerged| logits (see the module doc)."""
    eps = max(float(jnp.finfo(d).eps) for d in dtypes)
    return 16 * eps * math.sqrt(max(width, 1) * max(merged, 1)) * max(1.0, float(np.abs(logits).max()))


def in_float32(model: nnx.Module) -> nnx.Module:
    """A copy of `model` that computes in float32: every module's `dtype` attribute, and the `dtype` of every
    module's dataclass `config`, set to float32 (the parameters are not cast: a bfloat16 parameter stays one,
    and its eps enters the tolerance)."""
    copy = nnx.clone(model)
    for _, node in nnx.iter_graph(copy):
        if not isinstance(node, nnx.Module):
            continue
        if getattr(node, "dtype", None) is not None:
            node.dtype = jnp.float32
        config = getattr(node, "config", None)
        if dataclasses.is_dataclass(config) and getattr(config, "dtype", None) not in (None, "float32", "float64"):
            node.config = dataclasses.replace(config, dtype="float32")
    return copy


def check_lora_merge(model: nnx.Module, tokens: np.ndarray,
                     merge: Callable[[nnx.Module], nnx.Module] | None = None) -> dict:
    """{"max_abs_diff", "tolerance", "merged"}: the logits of `merge(clone of model)` (default
    `jaxdp.finetune.methods.merge_lora`) against `model`'s on `tokens`; TripwireError past the tolerance.
    `model` is left as it was."""
    from jaxdp.finetune.methods import LoRALinear, merge_lora
    loras = [node for _, node in nnx.iter_graph(model) if isinstance(node, LoRALinear)]
    if not loras:
        raise TripwireError("the LoRA merge check found no LoRA projection in the trained model")
    model = in_float32(model)  # a copy: bfloat16 compute rounds the two paths apart by far more than a merge
    logits = model(jnp.asarray(tokens))
    unmerged = np.asarray(jax.device_get(logits), np.float64)
    merged_model = (merge or merge_lora)(nnx.clone(model))
    merged = np.asarray(jax.device_get(merged_model(jnp.asarray(tokens))), np.float64)
    dtypes = {lora.base.kernel.get_value().dtype for lora in loras} | {logits.dtype}
    tolerance = merge_tolerance(unmerged, dtypes, max(lora.base.in_features for lora in loras), len(loras))
    diff = float(np.abs(merged - unmerged).max()) if np.isfinite(merged).all() else math.inf
    if not diff <= tolerance:
        raise TripwireError(f"the LoRA-merged model's logits differ from the unmerged model's by {diff:.3g} on the "
                            f"probe batch, above the tolerance {tolerance:.3g} ({len(loras)} merged projections): "
                            "a merged model saved now would not be the model trained")
    return {"max_abs_diff": diff, "tolerance": tolerance, "merged": len(loras)}
