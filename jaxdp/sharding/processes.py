"""SPMD over several JAX processes (hosts): placing host values, fetching global ones, checking agreement.

Every process runs the same program on its own copy of the host values (batches,
parameters, keys) and places only its own devices' slices of them (`put`). Nothing
in JAX compares those copies: processes that disagree (another batch, another sigma
from another library version, another token cache, another default PRNG) would each
place their own slices of one "replicated" array and silently train a mix, whose
noise and clipping no longer match the receipt. `agree` compares
SHA-256 digests of what must be equal through the coordination service's key-value
store (host-side: it does not wait for the devices), naming what differs.
On one process every function is a plain device_put / device_get / no-op.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import json
import time
from typing import Any

import jax
import numpy as np

from jaxdp.noise.seeds import several_processes

AGREE_TIMEOUT_S = 1800  # how long a process waits for the others at `agree` (another host may still compile)
_calls: collections.Counter = collections.Counter()  # per `what`: the same count on every process (SPMD)


class Disagreement(RuntimeError):
    """The processes of one SPMD program hold different values where they must agree (`agree`), or one of
    them left before agreeing."""


def put(tree: Any, shardings: Any) -> Any:
    """`jax.device_put(tree, shardings)`, also where a sharding spans other processes' devices (several
    hosts): each process then places its own devices' slices of its host copy, so every process must
    hold the same values (`agree` checks it where it matters). PRNG keys keep their type."""
    def one(x, s):
        if s.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
            return jax.device_put(x, s)  # a local placement, or a global array resharded
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = one(jax.random.key_data(x), s)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda index: host[index])
    return jax.tree.map(one, tree, shardings)


def fetch(tree: Any) -> Any:
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


def barrier(name: str) -> None:
    """Every process waits here until all have reached `name` (nothing on one process)."""
    if several_processes():
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def digest(value: Any) -> str:
    """SHA-256 (hex) of a pytree: its structure, each array's shape, dtype and bytes (PRNG keys as their
    data), each other leaf as JSON."""
    h = hashlib.sha256(b"jaxdp.processes.digest/v1")
    leaves, treedef = jax.tree.flatten(value)
    for part in [str(treedef).encode()] + [_leaf_bytes(x) for x in leaves]:
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


def _leaf_bytes(x) -> bytes:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
        a = np.ascontiguousarray(np.asarray(x))
        return f"array{a.shape}{a.dtype}:".encode() + a.tobytes()
    return b"json:" + json.dumps(x, sort_keys=True, default=str).encode()


def agree(what: str, **values: Any) -> None:
    """Raises (on every process) unless every process holds the same `values`, each compared by `digest`, so
    secrets never leave the process; the error names the values that differ. Every process must call it
    with the same `what` in the same order (SPMD). A process that exits first (an error of its own) is
    named instead of waited for."""
    if not several_processes():
        return
    client = _client()
    announce_exit()
    n, me, call = jax.process_count(), jax.process_index(), _calls[what]
    _calls[what] += 1
    mine = {name: digest(v) for name, v in values.items()}
    client.key_value_set(f"jaxdp/agree/{what}/{call}/{me}", json.dumps(mine))
    every = [json.loads(_wait_for(client, f"jaxdp/agree/{what}/{call}/{i}", i, what)) for i in range(n)]
    if call >= 2:  # every process has read call - 2's keys before any reached call (each read call - 1's)
        client.key_value_delete(f"jaxdp/agree/{what}/{call - 2}/{me}")
    differ = sorted(name for name in mine if any(other.get(name) != mine[name] for other in every))
    if differ:
        raise Disagreement(f"{what}: the {n} processes disagree on {', '.join(differ)}; run the same command, "
                           "config and library versions on every host, over the same data")


def announce_exit() -> None:
    """Once per process: at exit, tell the others (`agree` stops waiting for a process that has left)."""
    global _announced
    if _announced or not several_processes():
        return
    _announced = True
    me = jax.process_index()

    def announce():  # runs before JAX's own atexit shutdown (registered at `import jax`, so later in LIFO order)
        try:
            _client().key_value_set(f"jaxdp/exited/{me}", "1")
        except Exception:  # noqa: BLE001 -- the service may be gone already; nothing to tell then
            pass
    atexit.register(announce)


_announced = False


def _client():
    from jax._src import distributed  # the coordination service's client (orbax and multihost_utils use it)
    return distributed.global_state.client


def _wait_for(client, key: str, process: int, what: str) -> str:
    deadline = time.monotonic() + AGREE_TIMEOUT_S
    while True:
        try:
            return client.blocking_key_value_get(key, 1000)
        except Exception:  # noqa: BLE001 -- the client raises XlaRuntimeError(DEADLINE_EXCEEDED) each second
            pass
        try:
            exited = client.key_value_try_get(f"jaxdp/exited/{process}") is not None
        except Exception:  # noqa: BLE001 -- NOT_FOUND: still running
            exited = False
        if exited:
            raise Disagreement(f"{what}: process {process} of {jax.process_count()} exited before agreeing: "
                               "see its log for its error")
        if time.monotonic() > deadline:
            raise Disagreement(f"{what}: process {process} did not arrive within {AGREE_TIMEOUT_S} s (see its log)")
