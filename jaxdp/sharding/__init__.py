"""Data and sequence parallel DP on jax.sharding meshes: DP-ZeRO stages 0-3 and context parallelism."""

from jaxdp.sharding import context, context_parallel
from jaxdp.sharding.dp_step import ShardedDPState, ShardedDPStep
from jaxdp.sharding.mesh import (
    DATA,
    PARTITION_RULES,
    SEQ,
    make_mesh,
    param_specs,
    shard_dim,
)

__all__ = [
    "DATA",
    "PARTITION_RULES",
    "SEQ",
    "ShardedDPState",
    "ShardedDPStep",
    "context",
    "context_parallel",
    "make_mesh",
    "param_specs",
    "shard_dim",
]
