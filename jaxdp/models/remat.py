"""Per-block activation checkpointing policies shared by the models.

`remat` in a model config is "none" | "dots" | "full" (True / False are
accepted as "full" / "none"):

- "none": no checkpointing; every block's activations are kept for the backward.
- "dots": `nnx.remat` with `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`:
  outputs of matmuls without batch dimensions (the projections) are saved,
  everything else in the block (norms, GELU / SiLU, attention) is recomputed.
- "full": `nnx.remat` with no policy: only the block input is saved.

All three are exact under `jaxdp.per_example_grads`: the tape's records and
output gradients come out of the ordinary backward pass, so a recomputed
block recomputes them (see `jaxdp.core._tape`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

REMAT_POLICIES = ("none", "dots", "full")


def remat_policy(remat: bool | str) -> str:
    """Normalises a config's `remat` (bool or policy name) to a policy name."""
    if remat is True:
        return "full"
    if remat is False or remat is None:
        return "none"
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {REMAT_POLICIES} (or True / False), got {remat!r}")
    return remat


def remat_block(apply_block: Callable, remat: bool | str) -> Callable:
    """`apply_block` wrapped in `nnx.remat` according to the policy name."""
    policy = remat_policy(remat)
    if policy == "none":
        return apply_block
    if policy == "dots":
        return nnx.remat(apply_block, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    return nnx.remat(apply_block)


def block_apply(remat: bool | str, seq_axis: str | None = None) -> Callable:
    """`apply(block, *arrays) = block(*arrays, seq_axis)` wrapped by `remat_block`: each model runs its blocks
    (unrolled, or by `jaxdp.core.layer_scan.scan_layers`) through it. `seq_axis` (a mesh axis name or None) is
    closed over because `nnx.remat` takes array arguments only."""
    def apply(block, *arrays):
        return block(*arrays, seq_axis)
    return remat_block(apply, remat)
