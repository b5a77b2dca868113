"""Data and sequence parallel DP on jax.sharding meshes: DP-ZeRO stages 0-3, context parallelism, the
longest context that fits (`longest_context`), and SPMD over several processes (`processes`: placing,
fetching and agreeing on host values). The compiled step's collectives are read by
`jaxdp.analysis.collectives`.

Names load on first use (PEP 562). `context` (the sequence-shard helpers, now
`jaxdp.core.sequence_shards`: the models use them and import nothing of the mesh) and `collectives` (now
`jaxdp.analysis.collectives`) keep their old names for one release.
"""

from jaxdp._lazy import lazy_names

# name -> the module that defines it (a submodule: the name itself).
_PUBLIC = {
    "DATA": "jaxdp.sharding.mesh",
    "NonPrivate": "jaxdp.sharding.dp_step",
    "PARTITION_RULES": "jaxdp.sharding.mesh",
    "SEQ": "jaxdp.sharding.mesh",
    "ShardedDPState": "jaxdp.sharding.dp_step",
    "ShardedDPStep": "jaxdp.sharding.dp_step",
    "context_parallel": None,
    "longest_context": None,
    "make_mesh": "jaxdp.sharding.mesh",
    "param_specs": "jaxdp.sharding.mesh",
    "processes": None,
    "shard_dim": "jaxdp.sharding.mesh",
}


__getattr__, __dir__ = lazy_names(__name__, _PUBLIC, {"collectives": "jaxdp.sharding.collectives",
                                                         "context": "jaxdp.sharding.context"})  # old names: they warn

__all__ = sorted(_PUBLIC)  # the moved names (`collectives`, `context`) answer, with a warning, one release
