"""Meshes over `data` and `seq`, and the ZeRO partition rules of GPT-2 and Llama.

ZeRO shards a tensor over the `data` axis along one of its dimensions. Which
dimension is a table (`PARTITION_RULES`): the first rule whose pattern
matches the parameter's path lists dimensions in order of preference; the
first one divisible by the number of `data` shards is used, and a tensor with
none (a tiny bias, a vocabulary of 97) stays replicated. Small tensors
(norm scales, biases) are replicated on purpose: their bytes are negligible
and their gradients then need no reduce-scatter.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, SEQ = "data", "seq"

# (regex on the "/"-joined parameter path, dimensions to shard over `data` in order of preference)
PARTITION_RULES: tuple[tuple[str, tuple[int, ...]], ...] = (
    # GPT-2
    (r"^wte/embedding$", (0, 1)),                   # (V, D) tied embedding / head
    (r"^wpe/embedding$", (0, 1)),                   # (T, D) positions
    (r"/c_attn/kernel$", (1, 0)),                   # (D, 3D)
    (r"/c_fc/kernel$", (1, 0)),                     # (D, 4D)
    (r"/c_proj/kernel$", (0, 1)),                   # (4D | D, D)
    # Llama
    (r"^embed_tokens/embedding$", (0, 1)),          # (V, D)
    (r"^lm_head/kernel$", (1, 0)),                  # (D, V)
    (r"/(q_proj|k_proj|v_proj)/kernel$", (1, 0)),   # (D, N*H | K*H)
    (r"/o_proj/kernel$", (0, 1)),                   # (N*H, D)
    (r"/(gate_proj|up_proj)/kernel$", (1, 0)),      # (D, F)
    (r"/down_proj/kernel$", (0, 1)),                # (F, D)
    # Anything else: norm scales, biases: replicated.
    (r".*", ()),
)


def make_mesh(data: int, seq: int = 1, *, devices=None) -> Mesh:
    """A (data, seq) mesh with Auto axis types (so shard_map and jit compose without explicit-sharding types)."""
    if data < 1 or seq < 1:
        raise ValueError(f"mesh sizes must be >= 1, got data={data}, seq={seq}")
    devices = jax.devices() if devices is None else devices
    if data * seq > len(devices):
        raise ValueError(f"mesh data*seq = {data * seq} exceeds the {len(devices)} devices available")
    return jax.make_mesh((data, seq), (DATA, SEQ), axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[: data * seq])


def path_str(path) -> str:
    return "/".join(map(str, path))


def shard_dim(path, shape, num_shards: int) -> int | None:
    """The dimension ZeRO shards this parameter along, or None (replicated)."""
    if num_shards == 1:
        return None
    name = path_str(path)
    for pattern, dims in PARTITION_RULES:
        if re.search(pattern, name):
            for d in dims:
                if d < len(shape) and shape[d] % num_shards == 0:
                    return d
            return None
    return None


def spec_for(dim: int | None, ndim: int) -> P:
    if dim is None or dim < 0:
        return P()
    return P(*([None] * dim + [DATA] + [None] * (ndim - dim - 1)))


def param_dims(params, num_shards: int):
    """Tree (like `params`) of the ZeRO shard dimension of every leaf (-1: replicated)."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    dims = []
    for kp, leaf in with_path:
        keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in kp]
        keys = [k for k in keys if k != "value"]
        d = shard_dim(keys, np.shape(leaf), num_shards)
        dims.append(-1 if d is None else d)
    return jax.tree.unflatten(treedef, dims)


def param_specs(params, num_shards: int):
    """Tree of PartitionSpecs: each leaf sharded over `data` along its ZeRO dimension."""
    dims = param_dims(params, num_shards)
    return jax.tree.map(lambda d, p: spec_for(d, np.ndim(p)), dims, params)


def named(mesh: Mesh, specs: Any):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))

