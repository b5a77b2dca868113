"""Helpers for code traced on one shard of the sequence (context parallelism).

Every helper takes `seq_axis`, the mesh axis sharding the sequence, or None
outside context parallelism, where each is the identity of the
single-device computation. Nothing is ambient: the context-parallel step
(`jaxdp.sharding.ShardedDPStep` with seq > 1) calls its loss as
`loss_fn(model, batch, seq_axis=SEQ)`, the loss passes it to the model's
call (`model(tokens_BT, seq_axis=...)`, see `jaxdp.core.losses.cp_lm_losses`) and
the model to its attention layers. A function traced with one `seq_axis` is
therefore a different function (a different jit cache entry) from one
traced with another.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def num_shards(seq_axis: str | None) -> int:
    return 1 if seq_axis is None else jax.lax.axis_size(seq_axis)


def global_seq_len(local_len: int, seq_axis: str | None) -> int:
    return local_len * num_shards(seq_axis)


def seq_offset(local_len: int, seq_axis: str | None):
    """Global position of this shard's first token (0 without context parallelism)."""
    return 0 if seq_axis is None else jax.lax.axis_index(seq_axis) * local_len


def gather_sequence(x_BT_: jax.Array, seq_axis: str | None) -> jax.Array:
    """All-gathers axis 1 (tokens) over the sequence axis; its transpose is a reduce-scatter."""
    return x_BT_ if seq_axis is None else jax.lax.all_gather(x_BT_, seq_axis, axis=1, tiled=True)


def sequence_count(valid_BT: jax.Array, seq_axis: str | None) -> jax.Array:
    """Per example, the number of True entries of `valid_BT` over the GLOBAL sequence, shape (B,), float32."""
    count_B = valid_BT.astype(jnp.float32).sum(axis=-1)
    return count_B if seq_axis is None else jax.lax.psum(count_B, seq_axis)


def sequence_mean(x_BT: jax.Array, seq_axis: str | None) -> jax.Array:
    """This shard's share of the per-example mean over the GLOBAL sequence, shape (B,).

    Summed over the sequence shards (as the loss of a context-parallel
    example is) it gives the mean over all tokens.
    """
    total_B = x_BT.astype(jnp.promote_types(x_BT.dtype, jnp.float32)).sum(axis=-1)
    return total_B / global_seq_len(x_BT.shape[-1], seq_axis)
