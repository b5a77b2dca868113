"""The secret seeds of a run: drawn from the operating system, derived per use, never guessable.

The (epsilon, delta) guarantee assumes the noise and the batches are secret. So every random choice of a
run derives from one root seed through `derive_seed(root, DOMAIN, ...)`, a SHA-256 of the root and the
domain path: the noise, the sampler's draw of step s, the model's initialisation and the samples a run
writes are independent streams, and no two can share a state (unlike `np.random.default_rng([seed, 0, 0])`,
which NumPy seeds exactly like `default_rng(seed)`: trailing zeros are dropped). The root is 128 bits of
the operating system's entropy (`secret_seed`; on several processes, process 0's, broadcast) unless the
user pins one; a pinned seed below 2^64 can be searched for (`guessable_seed`).

NumPy and the standard library only: the sampler and the accountant import this without JAX (a
multi-host broadcast imports JAX's multihost utilities when it runs).
"""

from __future__ import annotations

import hashlib
import secrets
import sys

import numpy as np

# Domains of the job's randomness (`derive_seed(root, DOMAIN, ...)`).
NOISE = "noise"
SAMPLER = "sampler"
INIT = "init"
SAMPLES = "samples"
UNIT_WINDOWS = "unit_windows"  # which windows of each sampled document / user a step trains on

_SEED_BITS = 128

GUESSABLE_SEED = 2**64  # a pinned seed below it can be found by search (a small seed is found in a few replays)


def guessable_seed(seed: int) -> bool:
    """Whether a pinned `seed` is small enough to search for: with it anyone replays the noise and batches.
    A seed drawn as `secret_seed()` (128 bits) is below 2^64 with probability 2^-64."""
    return seed < GUESSABLE_SEED


def secret_seed(bits: int = _SEED_BITS) -> int:
    """A `bits`-bit seed from the operating system's entropy source. On several processes (multi-host),
    process 0's, broadcast, so every process samples the same batches and adds the same noise (each
    drew its own before): every process must call it, as SPMD code does."""
    seed = secrets.randbits(bits)
    if not several_processes():
        return seed
    from jax.experimental import multihost_utils
    words = np.asarray(multihost_utils.broadcast_one_to_all(seed_words(seed, -(-bits // 32))))
    return sum(int(w) << (32 * i) for i, w in enumerate(words)) & ((1 << bits) - 1)


def seed_words(value: int, count: int) -> np.ndarray:
    """The low `count` 32-bit words of `value`, least significant first."""
    return np.array([(int(value) >> (32 * i)) & 0xFFFFFFFF for i in range(count)], np.uint32)


def several_processes() -> bool:
    """Whether this is one of several JAX processes; asks nothing of JAX's backends unless
    `jax.distributed` is initialized (asking would start them, and a later `jax.distributed.initialize`
    would then fail)."""
    jax = sys.modules.get("jax")  # not imported: no distributed runtime either (and none is imported here)
    return jax is not None and jax.distributed.is_initialized() and jax.process_count() > 1


def derive_seed(root: int, *path: str | int) -> int:
    """A 256-bit seed for the stream `path` of `root` (SHA-256; distinct paths give independent seeds)."""
    h = hashlib.sha256(b"jaxdp.noise.derive_seed/v1")  # its first home's name: the salt fixes every derived seed
    for part in (int(root),) + path:
        if isinstance(part, (bool, np.bool_)) or not isinstance(part, (str, int, np.integer)):
            raise TypeError(f"derive_seed path parts must be str or int, got {part!r}")
        tagged = f"{'s' if isinstance(part, str) else 'i'}:{part}".encode()
        h.update(len(tagged).to_bytes(8, "little") + tagged)
    return int.from_bytes(h.digest(), "little")
