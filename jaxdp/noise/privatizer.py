"""The privatizer: the one place where DP noise is added to a sum of clipped gradients.

`jaxdp.fused_clip` (one device) and `jaxdp.sharding.ShardedDPStep` (a mesh)
both release their clipped sums through a `GaussianPrivatizer`, and nothing
else in the library draws DP noise. Its `update` is the Gaussian mechanism of
DP-SGD on the sum of a logical batch,

    (sum_b clip(G_b) + N(0, std^2 I)) / expected_batch_size,   std = sigma * sensitivity,

divided by the EXPECTED batch size (the realised count would depend on who is
in the batch). The privatizer is stateful in the way correlated-noise
mechanisms need (a mechanism whose noise at step t combines the draws of
earlier steps keeps them in its state): its state goes in and comes out of
every step, and a step is split in two so that a mesh can run the second half
inside `shard_map`:

    state, step_keys = privatizer.begin_step(state, num_leaves)   # replicated: the state's randomness
    released = privatizer.privatize(sums, step_keys, shards)      # per device, on its shards of the sums

`update(sums, state)` is the two halves on one device. For the Gaussian
mechanism the state is the noise key (`jaxdp.noise.draws`: split once per logical
batch, secret unless pinned), and a leaf that ZeRO 2/3 reduce-scatters over
devices (`shards[i]`, the device's index) draws its block of the noise from
`fold_in(leaf_key, shard)`, so no device generates the whole noise tensor,
while a replicated leaf gets exactly the noise it gets on one device.
`secure=True`: ChaCha20 bits, four draws per value and snapping (`jaxdp.noise.draws`,
"Floating-point noise").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import optax

from jaxdp.noise import draws as noise_lib


@dataclasses.dataclass(frozen=True)
class GaussianPrivatizer:
    """The Gaussian mechanism on a clipped sum, divided by the expected batch size.

    Attributes:
      std: the noise standard deviation: sigma times the sensitivity the caller's clipping guarantees
        (`jaxdp.clipping.rules.noise_std(l2_norm_clip, noise_multiplier)` for DP-SGD's clipping). 0 adds no noise (no privacy).
      expected_batch_size: q * N, the divisor of the noisy sum (> 0).
      secure: the floating-point mitigation (ChaCha20 bits, four draws per value, snapping).
    """
    std: float
    expected_batch_size: float
    secure: bool = False

    def __post_init__(self):
        if not self.std >= 0:  # NaN too: a NaN std would skip the noise
            raise ValueError(f"the noise std must be >= 0, got {self.std}")
        if not self.expected_batch_size > 0:
            raise ValueError(f"expected_batch_size must be > 0, got {self.expected_batch_size}")
        object.__setattr__(self, "secure", noise_lib.check_secure(self.secure, "GaussianPrivatizer"))

    def init(self, params: Any, key: jax.Array | None = None) -> jax.Array:
        """The state before the first step: the pinned noise `key` (`jaxdp.noise.draws.check_key`), else a fresh secret
        one for every call (`jaxdp.noise.draws.init_key`, which `params` tells whether it runs traced)."""
        return noise_lib.init_key(key, params)

    def begin_step(self, state: jax.Array, num_leaves: int) -> tuple[jax.Array, list[jax.Array]]:
        """(the next state, this step's keys: one per leaf, or under `secure` the step's one key for all)."""
        return noise_lib.split_step_key(state, num_leaves, self.secure)

    def privatize(self, sums: Sequence[jax.Array], step_keys: Sequence[jax.Array],
                  shards: Sequence[Any] | None = None) -> list[jax.Array]:
        """`sums` with this step's noise added and divided by the expected batch size.

        `shards[i]` (None, or a traced device index): `sums[i]` is this device's block of a reduce-scattered
        gradient and draws its noise block from `fold_in(step_keys[i], shards[i])`."""
        sums = list(sums)
        if self.std > 0:
            keys = list(step_keys) * len(sums) if len(step_keys) == 1 else list(step_keys)
            noise = noise_lib.gaussians(keys, sums, self.std, shards, secure=self.secure)
            sums = [noise_lib.release(s, n, self.std, self.secure) for s, n in zip(sums, noise)]
        return [s / self.expected_batch_size for s in sums]

    def update(self, sums: Any, state: jax.Array) -> tuple[Any, jax.Array]:
        """(the released tree of `sums`, the next state): one logical batch on one device."""
        leaves, treedef = jax.tree.flatten(sums)
        state, step_keys = self.begin_step(state, len(leaves))
        return jax.tree.unflatten(treedef, self.privatize(leaves, step_keys)), state

    def transform(self, key: jax.Array | None = None) -> optax.GradientTransformation:
        """This privatizer as an optax transform of summed clipped gradients (its state: `init`'s).
        Chain it after a transform that clips and sums per-example gradients."""
        pinned = noise_lib.check_key(key, "GaussianPrivatizer")

        def update_fn(sums, state, params=None):
            del params
            return self.update(sums, state)

        return optax.GradientTransformation(lambda params: self.init(params, pinned), update_fn)
