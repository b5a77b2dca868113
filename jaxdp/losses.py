"""Per-example language-model losses: the `loss_fn` of the DP step.

Both return one loss per window (B,): the mean next-token NLL over the
window's targets, exactly 0 where `batch["mask"]` is False (padding slots),
so a masked window contributes nothing to any gradient. Windows may end in
`jaxdp.data.PAD` (a document's padded last window): PAD targets are not
counted and PAD inputs are read as token 0; they follow every real token,
so causal attention keeps them out of the real positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxdp.sharding import context


def lm_losses(model: nnx.Module, batch) -> jax.Array:
    """Per-window mean next-token NLL (B,) of {"tokens" (B, T + 1), "mask" (B,)}."""
    tokens_BT1 = batch["tokens"]
    targets_BT = tokens_BT1[:, 1:]
    logits_BTV = model(jnp.maximum(tokens_BT1[:, :-1], 0))
    nll_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, jnp.maximum(targets_BT, 0))
    valid_BT = targets_BT >= 0
    per_example = (jnp.where(valid_BT, nll_BT, 0.0).astype(jnp.float32).sum(axis=-1)
                   / jnp.maximum(valid_BT.sum(axis=-1), 1))
    return jnp.where(batch["mask"], per_example, 0.0)


def cp_lm_losses(model: nnx.Module, batch, seq_axis: str | None = None) -> jax.Array:
    """`lm_losses` on {"inputs", "targets", "mask"}; with `seq_axis` (the mesh axis sharding the sequence,
    context parallelism) this shard's share, passing `seq_axis` to the model's call."""
    inputs_BT = jnp.maximum(batch["inputs"], 0)
    logits_BTV = model(inputs_BT) if seq_axis is None else model(inputs_BT, seq_axis=seq_axis)
    targets_BT = batch["targets"]
    nll_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, jnp.maximum(targets_BT, 0))
    valid_BT = targets_BT >= 0
    # This shard's share: its valid targets' NLL over the example's valid targets on all shards.
    per_example = (jnp.where(valid_BT, nll_BT, 0.0).astype(jnp.float32).sum(axis=-1)
                   / jnp.maximum(context.sequence_count(valid_BT, seq_axis), 1.0))
    return jnp.where(batch["mask"], per_example, 0.0)
