"""One job on several JAX processes (hosts): every process runs the same loop, process 0 writes the run.

Every process prepares the same data, samples the same batches (the root seed is
process 0's, broadcast: `jaxdp.noise.secret_seed`) and calls the same sharded step,
whose mesh spans every process's devices. The run directory lives on a filesystem
all hosts share (orbax needs one for the checkpoints, which every process saves
together): process 0 alone writes its files, and the others wait at a barrier
wherever they would otherwise read a file while process 0 replaces it.
On one process every function here is a no-op or a plain device_get.
"""

from __future__ import annotations

import hashlib
import json
import os

import jax
import numpy as np

from jaxdp.noise import several_processes


def maybe_initialize_distributed() -> bool:
    """`jax.distributed.initialize()` when JAX_COORDINATOR_ADDRESS is set (multi-host runs).

    Every host runs the same command with JAX_COORDINATOR_ADDRESS=<host0>:<port>,
    JAX_NUM_PROCESSES=<hosts> and JAX_PROCESS_ID=<0..hosts-1> set. JAX reads only the
    address itself (outside Slurm, Open MPI and TPU pods), so the other two are read and
    checked here. Returns whether it initialized.
    """
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not address:
        return False
    num_processes = _env_int("JAX_NUM_PROCESSES", 1)
    process_id = _env_int("JAX_PROCESS_ID", 0)
    if process_id >= num_processes:
        raise ValueError(f"JAX_PROCESS_ID must be in [0, JAX_NUM_PROCESSES = {num_processes}), got {process_id}")
    jax.distributed.initialize(address, num_processes=num_processes, process_id=process_id)
    return True


def _env_int(name: str, minimum: int) -> int:
    text = os.environ.get(name, "")
    if not text.strip().isdigit() or int(text) < minimum:
        raise ValueError(f"JAX_COORDINATOR_ADDRESS is set, so {name} must be an integer >= {minimum} "
                         f"(README: several hosts), got {text!r}")
    return int(text)


def writes_run_dir() -> bool:
    """Whether this process writes the run directory's files (process 0 of several; the only one)."""
    return not several_processes() or jax.process_index() == 0


def barrier(name: str) -> None:
    """Every process waits here until all have reached `name` (nothing on one process)."""
    if several_processes():
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def fetch(tree):
    """Host copies of `tree`'s arrays, also of those sharded over other processes' devices (PRNG keys stay
    keys, their data on the host)."""
    if not several_processes():
        return jax.device_get(tree)
    from jax.experimental import multihost_utils
    is_key = lambda x: isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    leaves, treedef = jax.tree.flatten(tree)
    data = [jax.random.key_data(x) if is_key(x) else x for x in leaves]
    gathered = multihost_utils.process_allgather(data, tiled=True)
    out = [jax.random.wrap_key_data(np.asarray(g), impl=jax.random.key_impl(x)) if is_key(x) else np.asarray(g)
           for x, g in zip(leaves, gathered)]
    return jax.tree.unflatten(treedef, out)


def check_agreement(**values) -> None:
    """Raises unless every process holds the same `values` (compared by SHA-256, so secrets stay put).

    SPMD code silently mixes two runs when processes disagree: each would place its own slices of
    its own batches and noise key (`jaxdp.sharding.mesh.put` does not compare them)."""
    if not several_processes():
        return
    from jax.experimental import multihost_utils
    names = sorted(values)
    digests = np.stack([np.frombuffer(hashlib.sha256(json.dumps(values[n], sort_keys=True, default=str).encode())
                                      .digest(), np.uint8) for n in names])
    every = np.asarray(multihost_utils.process_allgather(digests))  # (processes, values, 32)
    differ = [n for i, n in enumerate(names) if not (every[:, i] == every[0, i]).all()]
    if differ:
        raise RuntimeError(f"the {jax.process_count()} processes of this run disagree on {', '.join(differ)}: "
                           "run the same command and config on every host, over the same data")
