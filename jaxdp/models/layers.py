"""Between the two layouts of a model's blocks: unrolled (`nnx.List` of L blocks) and scanned (one block
whose variables lead with the layer axis, `config.scan_layers=True`, run by `jaxdp.core.layer_scan`).

`scanned(model)` / `unrolled(model)` return the model in the other layout with the same values (the
variables of block l are slice l of the stacked ones); the model passed in is not changed. They work on
any model with `.blocks` and a `.config` that has `scan_layers` (GPT-2, Llama and its families), also
after fine-tuning methods changed the blocks alike (LoRA, adapters, frozen parameters). HF import /
export and the run directory's shareable model go through them, so files keep the unrolled layout.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from jaxdp.core import layer_scan


def is_scanned(model: nnx.Module) -> bool:
    """Whether `model`'s blocks are stacked (its config says `scan_layers=True`)."""
    return bool(getattr(getattr(model, "config", None), "scan_layers", False))


def _copy(model: nnx.Module) -> nnx.Module:
    """A new module graph holding the same arrays (nothing copied)."""
    return nnx.merge(*nnx.split(model))


def scanned(model: nnx.Module) -> nnx.Module:
    """`model` with its blocks stacked (`config.scan_layers=True`); the same model if already scanned."""
    if is_scanned(model):
        return model
    new = _copy(model)
    new.blocks = layer_scan.stack(list(new.blocks))
    new.config = dataclasses.replace(new.config, scan_layers=True)
    return new


def unrolled(model: nnx.Module) -> nnx.Module:
    """`model` with its blocks as a list of L blocks (`config.scan_layers=False`); the same if unrolled."""
    if not is_scanned(model):
        return model
    new = _copy(model)
    new.blocks = nnx.List(layer_scan.unstack(new.blocks))
    new.config = dataclasses.replace(new.config, scan_layers=False)
    return new


def with_layout(model: nnx.Module, scan_layers: bool) -> nnx.Module:
    """`scanned(model)` or `unrolled(model)`."""
    return scanned(model) if scan_layers else unrolled(model)
