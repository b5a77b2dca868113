"""The privatizer: the one place where DP noise is added to a sum of clipped gradients.

`jaxdp.fused_clip` (one device) and `jaxdp.sharding.ShardedDPStep` (a mesh)
both release their clipped sums through a `GaussianPrivatizer`, and nothing
else in the library draws DP noise. Its `update` is the Gaussian mechanism on
the sum of a logical batch,

    (sum_b clip(G_b) + x_t) / expected_batch_size,

divided by the EXPECTED batch size (the realised count would depend on who is
in the batch). The noise x_t is row t of C^{-1} Z for the `mechanism`'s
strategy matrix C and Z of i.i.d. N(0, std^2) rows: independent for DP-SGD
(C = I, x_t = z_t), a fixed combination of the draws of steps <= t for the
correlated mechanisms of `jaxdp.noise.mechanisms` (BandMF, BLT), generated in
streaming form from a bounded state. `std` is sigma times the sensitivity the
caller guarantees (`jaxdp.clipping.rules.noise_std` for DP-SGD's clipping;
times the strategy's sensitivity for a correlated mechanism: the caller's).

The state goes in and comes out of every step, and a step is split in two so
that a mesh can run the second half inside `shard_map`:

    state, step_keys = privatizer.begin_step(state, num_leaves)    # replicated: the state's randomness
    released, buffers = privatizer.privatize(sums, step_keys, shards, buffers)   # per device, its shards

`update(sums, state)` is the two halves on one device. The state is the noise
key for DP-SGD (`jaxdp.noise.draws`: split once per logical batch, secret
unless pinned) and `NoiseState(key, buffers)` for a correlated mechanism: one
float32 array (num_buffers, *leaf.shape) per leaf, the mechanism's memory of
earlier draws, kept like the gradient (a device holds its shard under ZeRO
2/3). A leaf that ZeRO 2/3 reduce-scatters over devices (`shards[i]`, the
device's index) draws its block of the noise from `fold_in(leaf_key, shard)`,
so no device generates the whole noise tensor, while a replicated leaf gets
exactly the noise it gets on one device. `secure=True`: ChaCha20 bits, four
draws per value and snapping (`jaxdp.noise.draws`, "Floating-point noise").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxdp.noise import draws as noise_lib
from jaxdp.noise.mechanisms import DPSGD


class NoiseState(NamedTuple):
    """A correlated mechanism's state: the noise key and, per leaf, its float32 buffers."""
    key: jax.Array
    buffers: list


@dataclasses.dataclass(frozen=True)
class GaussianPrivatizer:
    """The Gaussian mechanism on a clipped sum, divided by the expected batch size.

    Attributes:
      std: the standard deviation of the draws Z: sigma times the sensitivity the caller's clipping and
        strategy guarantee. 0 adds no noise (no privacy).
      expected_batch_size: q * N, the divisor of the noisy sum (> 0).
      secure: the floating-point mitigation (ChaCha20 bits, four draws per value, snapping).
      mechanism: how the noise of a step combines the draws of earlier ones (`jaxdp.noise.mechanisms`:
        `DPSGD()`, independent, the default; `BandMF`, `BLT`).
    """
    std: float
    expected_batch_size: float
    secure: bool = False
    mechanism: Any = DPSGD()

    def __post_init__(self):
        if not self.std >= 0:  # NaN too: a NaN std would skip the noise
            raise ValueError(f"the noise std must be >= 0, got {self.std}")
        if not self.expected_batch_size > 0:
            raise ValueError(f"expected_batch_size must be > 0, got {self.expected_batch_size}")
        object.__setattr__(self, "secure", noise_lib.check_secure(self.secure, "GaussianPrivatizer"))
        if not hasattr(self.mechanism, "num_buffers") or not hasattr(self.mechanism, "next"):
            raise TypeError(f"mechanism must be one of jaxdp.noise.mechanisms' (DPSGD, BandMF, BLT), "
                            f"got {self.mechanism!r}")

    @property
    def correlated(self) -> bool:
        return self.mechanism.num_buffers > 0

    def init(self, params: Any, key: jax.Array | None = None):
        """The state before the first step: the pinned noise `key` (`jaxdp.noise.draws.check_key`), else a fresh
        secret one for every call (`jaxdp.noise.draws.init_key`, which `params` tells whether it runs traced);
        with a correlated mechanism, `NoiseState(key, zero buffers per leaf of params)`."""
        key = noise_lib.init_key(key, params)
        if not self.correlated:
            return key
        return NoiseState(key, [self.mechanism.init_buffers(p) for p in jax.tree.leaves(params)])

    def key_of(self, state) -> jax.Array:
        return state.key if self.correlated else state

    def buffers_of(self, state) -> list | None:
        return state.buffers if self.correlated else None

    def with_key(self, state, key: jax.Array):
        return NoiseState(key, state.buffers) if self.correlated else key

    def begin_step(self, state, num_leaves: int):
        """(the state with its key split, this step's keys: one per leaf, or under `secure` the step's one key
        for all). The buffers are untouched: `privatize` advances them."""
        key, step_keys = noise_lib.split_step_key(self.key_of(state), num_leaves, self.secure)
        return self.with_key(state, key), step_keys

    def privatize(self, sums: Sequence[jax.Array], step_keys: Sequence[jax.Array],
                  shards: Sequence[Any] | None = None, buffers: Sequence[jax.Array] | None = None):
        """(`sums` with this step's noise added and divided by the expected batch size, the advanced buffers).

        `shards[i]` (None, or a traced device index): `sums[i]` is this device's block of a reduce-scattered
        gradient and draws its noise block from `fold_in(step_keys[i], shards[i])`; `buffers[i]` is then
        that block's buffers. DP-SGD takes and returns `buffers=None`."""
        sums = list(sums)
        if self.correlated and buffers is None:
            raise ValueError(f"{type(self.mechanism).__name__} noise needs the state's buffers")
        if self.std > 0:
            keys = list(step_keys) * len(sums) if len(step_keys) == 1 else list(step_keys)
            if self.correlated:  # draws in float32 whatever the sums' dtype: the buffers' precision
                wide = [jax.ShapeDtypeStruct(s.shape, jnp.promote_types(s.dtype, jnp.float32)) for s in sums]
                draws = noise_lib.gaussians(keys, wide, self.std, shards, secure=self.secure)
                noise, buffers = [], list(buffers)
                for i, z in enumerate(draws):
                    x, buffers[i] = self.mechanism.next(z, buffers[i])
                    noise.append(x)
            else:
                noise = noise_lib.gaussians(keys, sums, self.std, shards, secure=self.secure)
            sums = [noise_lib.release(s, n, self.std, self.secure).astype(s.dtype) for s, n in zip(sums, noise)]
        return [s / self.expected_batch_size for s in sums], (list(buffers) if buffers is not None else None)

    def update(self, sums: Any, state) -> tuple[Any, Any]:
        """(the released tree of `sums`, the next state): one logical batch on one device."""
        leaves, treedef = jax.tree.flatten(sums)
        state, step_keys = self.begin_step(state, len(leaves))
        released, buffers = self.privatize(leaves, step_keys, None, self.buffers_of(state))
        if self.correlated:
            state = NoiseState(state.key, buffers)
        return jax.tree.unflatten(treedef, released), state

    def transform(self, key: jax.Array | None = None) -> optax.GradientTransformation:
        """This privatizer as an optax transform of summed clipped gradients (its state: `init`'s).
        Chain it after a transform that clips and sums per-example gradients."""
        pinned = noise_lib.check_key(key, "GaussianPrivatizer")

        def update_fn(sums, state, params=None):
            del params
            return self.update(sums, state)

        return optax.GradientTransformation(lambda params: self.init(params, pinned), update_fn)
