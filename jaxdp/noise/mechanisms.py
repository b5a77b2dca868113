"""Correlated noise in streaming form: the noise each mechanism adds at step t, from the Gaussian draws of
steps <= t and a bounded state of buffers.

A matrix-factorization mechanism (Choquette-Choo et al., arXiv:2306.08153) factors the prefix-sum workload
A = B C with a lower-triangular strategy C and releases the clipped gradients g_t with the correlated noise

    x = C^{-1} z,    z_t ~ N(0, std^2 I) independent,    released_t = g_t + x_t,

so the noise of the prefix sums is A C^{-1} z, smaller than DP-SGD's A z when C is chosen well. Every
strategy here is lower-triangular Toeplitz (the same coefficients down every diagonal) with a streaming
inverse, so x_t is computed from z_t and a state of a few buffers of the parameter's shape:

  `DPSGD`   C = I: x_t = z_t, no buffers. The default and the special case b = 1 of `BandMF`.
  `BandMF`  C banded with coefficients c_0..c_{b-1}: x_t = (z_t - sum_{j=1}^{b-1} c_j x_{t-j}) / c_0, the
            last b - 1 outputs kept as buffers (newest first). Column-normalised coefficients (L2 norm 1,
            `jaxdp.noise.strategies.bandmf`) give C a max column norm of 1.
  `BLT`     buffered linear Toeplitz (Dvijotham et al., arXiv:2404.16706): C has the Toeplitz coefficients
            c_0 = 1, c_k = sum_i w_i theta_i^(k-1) (theta = `buf_decay`, w = `output_scale`); its inverse
            streams with one buffer per theta (McMahan et al., arXiv:2408.08868, Alg. 3):
            x_t = z_t - sum_i w_i s_i, then s_i <- theta_i s_i + x_t.

Contract of every mechanism (a hashable frozen dataclass of Python floats, so it can be a static argument):

  buffers = mechanism.init_buffers(leaf)          # zeros (num_buffers, *leaf.shape), float32 (float64 leaf: float64)
  x, buffers = mechanism.next(z, buffers)         # once per logical batch, per parameter leaf

Step t's x equals row t of C^{-1} Z (tested against a dense C built from the coefficients). The arithmetic,
the buffers and x are float32 for float32 and narrower draws (bf16 training keeps float32 buffers), float64 for
float64 draws and leaves (JAX's x64 mode, where the exact covariance is tested); the recursions are elementwise
over the leaf, so a device holding a shard of a leaf and the same shard of its buffers computes its shard
of x. The buffers are optimizer state: they must be checkpointed and restored with it, and they hold past
noise, so they are as secret as the noise key. The privacy of the released sequence is not this module's:
it is the strategy's sensitivity (`jaxdp.noise.strategies.sensitivity`) and the accountant
(`jaxdp.accounting.mechanisms`), with the noise std that accountant prescribes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp


def _float_tuple(name: str, values: Any) -> tuple[float, ...]:
    """`values` as a non-empty tuple of finite Python floats, or a ValueError naming the field."""
    try:
        out = tuple(float(v) for v in values)
    except TypeError as e:
        raise ValueError(f"{name} must be a sequence of numbers, got {values!r}") from e
    if not out:
        raise ValueError(f"{name} must not be empty")
    if not all(math.isfinite(v) for v in out):
        raise ValueError(f"{name} must be finite, got {out}")
    return out


def _wide(dtype: Any) -> Any:
    """The noise arithmetic's dtype for `dtype`: float32, or float64 for float64 (x64 mode)."""
    return jnp.promote_types(dtype, jnp.float32)


def _zeros(count: int, leaf: Any) -> jax.Array:
    return jnp.zeros((count, *jnp.shape(leaf)), _wide(getattr(leaf, "dtype", jnp.float32)))


def _check_buffers(buffers: jax.Array, count: int, z: jax.Array, mechanism: str) -> jax.Array:
    if buffers.shape != (count, *z.shape):
        raise ValueError(f"{mechanism}: buffers of shape {buffers.shape} for noise of shape {z.shape}; "
                         f"expected {(count, *z.shape)} (init_buffers(leaf))")
    return buffers.astype(z.dtype)


@dataclasses.dataclass(frozen=True)
class DPSGD:
    """Independent noise, C = I: x_t = z_t (in float32, or float64). No buffers: a (0, *shape) array."""

    num_buffers: ClassVar[int] = 0
    column_norm: ClassVar[float] = 1.0  # C = I

    def init_buffers(self, leaf: Any) -> jax.Array:
        return _zeros(0, leaf)

    def next(self, z: jax.Array, buffers: Any) -> tuple[jax.Array, Any]:
        z = jnp.asarray(z)
        return z.astype(_wide(z.dtype)), buffers


@dataclasses.dataclass(frozen=True)
class BandMF:
    """Banded lower-triangular Toeplitz strategy C with coefficients `coefs` = (c_0, ..., c_{b-1}).

    Attributes:
      coefs: c_0..c_{b-1}, finite, c_0 > 0 (C is invertible). C's max column norm is the coefficients' L2
        norm; the amplified accounting of `jaxdp.accounting.mechanisms` takes it as the sensitivity of one
        participation, so `jaxdp.noise.strategies.bandmf` returns coefficients of norm 1. `BandMF((1.0,))`
        is DP-SGD.
    """

    coefs: tuple[float, ...]

    def __post_init__(self):
        coefs = _float_tuple("BandMF.coefs", self.coefs)
        if not coefs[0] > 0:
            raise ValueError(f"BandMF.coefs[0] must be > 0 (C must be invertible), got {coefs[0]}")
        object.__setattr__(self, "coefs", coefs)

    @property
    def bands(self) -> int:
        return len(self.coefs)

    @property
    def column_norm(self) -> float:
        """C's max column norm, ||coefs||: the strategy sensitivity of one participation."""
        return math.sqrt(sum(c * c for c in self.coefs))

    @property
    def num_buffers(self) -> int:
        return self.bands - 1

    def init_buffers(self, leaf: Any) -> jax.Array:
        return _zeros(self.num_buffers, leaf)

    def next(self, z: jax.Array, buffers: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(x_t, buffers): x_t = (z_t - sum_{j>=1} c_j x_{t-j}) / c_0; buffers hold x_{t-1}, x_{t-2}, ...
        (newest first; zeros before the first step)."""
        z = jnp.asarray(z)
        z = z.astype(_wide(z.dtype))
        c0 = jnp.asarray(self.coefs[0], z.dtype)
        if self.num_buffers == 0:
            return z / c0, buffers
        buffers = _check_buffers(jnp.asarray(buffers), self.num_buffers, z, "BandMF")
        past = jnp.tensordot(jnp.asarray(self.coefs[1:], z.dtype), buffers, axes=(0, 0))
        x = (z - past) / c0
        return x, jnp.concatenate([x[None], buffers[:-1]], axis=0)


@dataclasses.dataclass(frozen=True)
class BLT:
    """Buffered linear Toeplitz strategy C: c_0 = 1, c_k = sum_i output_scale_i buf_decay_i^(k-1).

    Attributes:
      buf_decay: theta_i, each in (0, 1): the geometric decay of buffer i.
      output_scale: w_i, finite, one per buffer.
      sensitivity: the strategy sensitivity the run's noise is scaled by (finite, > 0): C's min-separation
        sensitivity for the run's participation pattern (`jaxdp.noise.strategies.sensitivity(C, steps,
        min_sep, participations)`), or None (a bare strategy). Unlike BandMF's, it depends on the run, so
        `jaxdp.clipping.settings.DPSpec` takes a BLT only with it set.
    The parameters are those of C (as jax_privacy's `BufferedToeplitz`), not of its inverse.
    """

    buf_decay: tuple[float, ...]
    output_scale: tuple[float, ...]
    sensitivity: float | None = None

    def __post_init__(self):
        decay = _float_tuple("BLT.buf_decay", self.buf_decay)
        scale = _float_tuple("BLT.output_scale", self.output_scale)
        if not all(0 < d < 1 for d in decay):
            raise ValueError(f"BLT.buf_decay must be in (0, 1), got {decay}")
        if len(scale) != len(decay):
            raise ValueError(f"BLT.output_scale has {len(scale)} values for {len(decay)} buf_decay values")
        if self.sensitivity is not None and not (float(self.sensitivity) > 0 and math.isfinite(self.sensitivity)):
            raise ValueError(f"BLT.sensitivity must be None or a finite number > 0, got {self.sensitivity!r}")
        object.__setattr__(self, "buf_decay", decay)
        object.__setattr__(self, "output_scale", scale)
        if self.sensitivity is not None:
            object.__setattr__(self, "sensitivity", float(self.sensitivity))

    @property
    def num_buffers(self) -> int:
        return len(self.buf_decay)

    def init_buffers(self, leaf: Any) -> jax.Array:
        return _zeros(self.num_buffers, leaf)

    def next(self, z: jax.Array, buffers: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(x_t, buffers): x_t = z_t - sum_i w_i s_i; then s_i <- theta_i s_i + x_t."""
        z = jnp.asarray(z)
        z = z.astype(_wide(z.dtype))
        buffers = _check_buffers(jnp.asarray(buffers), self.num_buffers, z, "BLT")
        scale = jnp.asarray(self.output_scale, z.dtype)
        decay = jnp.asarray(self.buf_decay, z.dtype).reshape((-1,) + (1,) * z.ndim)
        x = z - jnp.tensordot(scale, buffers, axes=(0, 0))
        return x, decay * buffers + x[None]


Mechanism = DPSGD | BandMF | BLT
