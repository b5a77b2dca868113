"""One job on several JAX processes (hosts): every process runs the same loop, process 0 writes the run.

Every process prepares the same data, samples the same batches (the root seed is
process 0's, broadcast: `jaxdp.noise.seeds.secret_seed`) and calls the same sharded step,
whose mesh spans every process's devices. The run directory lives on a filesystem
all hosts share (orbax needs one for the checkpoints, which every process saves
together): process 0 alone writes its files, and the others wait at a barrier
wherever they would otherwise read a file while process 0 replaces it.
Placing, fetching and comparing values across processes is `jaxdp.sharding.processes`.
"""

from __future__ import annotations

import os

import jax

from jaxdp.noise.seeds import several_processes
from jaxdp.sharding import processes


def maybe_initialize_distributed() -> bool:
    """`jax.distributed.initialize()` when JAX_COORDINATOR_ADDRESS is set (multi-host runs).

    Every host runs the same command with JAX_COORDINATOR_ADDRESS=<host0>:<port>,
    JAX_NUM_PROCESSES=<hosts> and JAX_PROCESS_ID=<0..hosts-1> set. JAX reads only the
    address itself (outside Slurm, Open MPI and TPU pods), so the other two are read and
    checked here. Returns whether it initialized.
    """
    if not launched_as_one_of_several():
        return False
    address = os.environ["JAX_COORDINATOR_ADDRESS"]
    num_processes = _env_int("JAX_NUM_PROCESSES", 1)
    process_id = _env_int("JAX_PROCESS_ID", 0)
    if process_id >= num_processes:
        raise ValueError(f"JAX_PROCESS_ID must be in [0, JAX_NUM_PROCESSES = {num_processes}), got {process_id}")
    jax.distributed.initialize(address, num_processes=num_processes, process_id=process_id)
    processes.announce_exit()  # a process stopped by an error is named at the others' next agreement
    return True


def launched_as_one_of_several() -> bool:
    """Whether this process was started as one host of several (JAX_COORDINATOR_ADDRESS set): jobs that run on
    one process refuse it rather than run once per host into one directory, each from its own secret root."""
    return bool(os.environ.get("JAX_COORDINATOR_ADDRESS"))


def _env_int(name: str, minimum: int) -> int:
    text = os.environ.get(name, "")
    if not text.strip().isdigit() or int(text) < minimum:
        raise ValueError(f"JAX_COORDINATOR_ADDRESS is set, so {name} must be an integer >= {minimum} "
                         f"(README: several hosts), got {text!r}")
    return int(text)


def writes_run_dir() -> bool:
    """Whether this process writes the run directory's files (process 0 of several; the only one)."""
    return not several_processes() or jax.process_index() == 0
