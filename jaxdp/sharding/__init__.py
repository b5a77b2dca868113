"""Data and sequence parallel DP on jax.sharding meshes: DP-ZeRO stages 0-3, context parallelism, and the
collective bytes of the compiled step (`collectives`), the longest context that fits (`longest_context`), and
SPMD over several processes (`processes`: placing, fetching and agreeing on host values)."""

from jaxdp.sharding import collectives, context, context_parallel, longest_context, processes
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
    "collectives",
    "context",
    "context_parallel",
    "longest_context",
    "processes",
    "make_mesh",
    "param_specs",
    "shard_dim",
]
