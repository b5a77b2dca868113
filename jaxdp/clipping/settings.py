"""The named settings of DP aggregation, validated once where they are built.

What travels together travels as one frozen value: `ClipSpec` (how an example's gradient is bounded, beside
the bound C), `NormPlan` (how per-example norms and clipped sums are computed: no privacy meaning, every plan
bounds each example by the same C') and `DPSpec` (the whole release: C, sigma, the expected batch size, the
clip spec, secure noise). `jaxdp.fused_clip`, `jaxdp.clipped_aggregate`, `jaxdp.two_pass_clipped_sums`,
`jaxdp.sharding.ShardedDPStep` and the training job all take them, so a setting is checked in one place and
cannot be dropped on its way through. They are hashable (a cached optimizer keys on them).

The keyword arguments these replaced (`clipping=`, `clip_fn=`, `gamma=`, `group_weights=`, `strategy=`,
`chunk_size=`, `memory_budget_bytes=`, `store_budget_bytes=`, `allow_low_precision=`) are still accepted for
one release (`accepts_old_keywords`), with a DeprecationWarning.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from jaxdp._keywords import old_keywords
from jaxdp.clipping import norm_costs
from jaxdp.clipping import norms as norms_lib
from jaxdp.clipping import rules as clipping_lib
from jaxdp.noise import draws as noise_lib
from jaxdp.noise.mechanisms import BLT, DPSGD, BandMF


def check_positive(name: str, value, allow_zero: bool = False) -> None:
    """ValueError naming `name` unless value > 0 (>= 0 with `allow_zero`); NaN fails both."""
    ok = value >= 0 if allow_zero else value > 0
    if not ok:
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclasses.dataclass(frozen=True)
class ClipSpec:
    """How each example's gradient is bounded by C.

    Attributes:
      clipping: "flat" (one group), "per_layer" (a group per module: a parameter's path without its own
        name), or a callable path -> group key.
      clip_fn: "abadi" (min(1, C_g / n)) or "automatic" (C_g / (n + gamma)).
      gamma: automatic clipping's stability constant (> 0).
      group_weights: relative weights w_g, C_g = C sqrt(w_g / sum w); None: equal. Stored as a tuple of
        (group, weight) pairs so that the spec is hashable; `weights` gives the mapping.
    """
    clipping: str | Callable = "flat"
    clip_fn: str = "abadi"
    gamma: float = 0.01
    group_weights: tuple[tuple[Hashable, float], ...] | Mapping[Hashable, float] | None = None

    def __post_init__(self):
        clipping_lib.check_clipping(self.clipping)
        clipping_lib.check_clip_fn(self.clip_fn)
        check_positive("gamma", self.gamma)
        clipping_lib.check_gamma(self.clip_fn, self.gamma)
        if isinstance(self.group_weights, Mapping):
            object.__setattr__(self, "group_weights", tuple(self.group_weights.items()))

    @property
    def weights(self) -> dict[Hashable, float] | None:
        return None if self.group_weights is None else dict(self.group_weights)


@dataclasses.dataclass(frozen=True)
class NormPlan:
    """How per-example norms and clipped sums are computed. Every plan gives the same guarantee.

    Attributes:
      strategy: "ghost", "instantiate", "store" (a linear layer keeps its per-example gradients for its
        norm and its clipped sum), "auto" (per layer the fastest of these within `memory_budget_bytes`, by
        the cost model `jaxdp.clipping.norm_costs` and the device's rates) or "pallas" (the kernels of
        `jaxdp.pallas`; the single-pass kernel where a clipping group holds one linear term).
      chunk_size: examples whose norms are computed at once.
      memory_budget_bytes: `auto`'s scratch budget per layer.
      store_budget_bytes: what `auto` may hold in kept per-example gradients in total; None: 1/4 of the
        device's memory where `jaxdp.clipping.device_rates` knows it, else `memory_budget_bytes`.
      allow_low_precision: the two-pass sums (`jaxdp.clipping.two_pass`) below float32, whose norms are
        not guarded: for memory measurements only.
    """
    strategy: str = "auto"
    chunk_size: int = norm_costs.DEFAULT_CHUNK_SIZE
    memory_budget_bytes: int = norm_costs.DEFAULT_MEMORY_BUDGET_BYTES
    store_budget_bytes: int | None = None
    allow_low_precision: bool = False

    def __post_init__(self):
        norms_lib.check_strategy(self.strategy)
        check_positive("chunk_size", self.chunk_size)
        check_positive("memory_budget_bytes", self.memory_budget_bytes)
        if self.store_budget_bytes is not None:
            check_positive("store_budget_bytes", self.store_budget_bytes, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class DPSpec:
    """One DP release: each example's contribution bounded by C' = C * SENSITIVITY_FACTOR, Gaussian noise
    of std sigma C', the sum divided by the expected batch size.

    Attributes:
      l2_norm_clip: C (> 0).
      noise_multiplier: sigma (>= 0; 0 adds no noise: no privacy).
      expected_batch_size: q N, the divisor of the noisy sum (> 0); never the realised count.
      clip: the `ClipSpec`.
      secure_noise: four draws per value from ChaCha20 bits and a snapped release (`jaxdp.noise.draws`,
        "Floating-point noise").
      mechanism: how each step's noise combines the draws of earlier steps (`jaxdp.noise.mechanisms`):
        `DPSGD()` (independent, the default), `BandMF(coefs)` or `BLT(..., sensitivity=s)`. The draws' std
        is sigma C' times the strategy sensitivity: BandMF's column norm ||c|| (1 for
        `jaxdp.noise.strategies.bandmf`'s coefficients), BLT's `sensitivity` (its min-separation
        sensitivity for the run's participation, which only the caller knows: a BLT without it is
        refused), the convention of `jaxdp.accounting.mechanisms`. BandMF's epsilon is the amplified
        analysis, valid only with cyclic Poisson sampling of b groups (`jaxdp.sampling.cyclic`); BLT's is
        one Gaussian release, valid for any sampling whose participations the sensitivity covers.
    """
    l2_norm_clip: float
    noise_multiplier: float
    expected_batch_size: float
    clip: ClipSpec = ClipSpec()
    secure_noise: bool = False
    mechanism: Any = DPSGD()

    def __post_init__(self):  # NaN passes a `<= 0` check, and a NaN std would skip the noise: checked as `> 0`
        check_positive("l2_norm_clip", self.l2_norm_clip)
        check_positive("noise_multiplier", self.noise_multiplier, allow_zero=True)
        check_positive("expected_batch_size", self.expected_batch_size)
        check_clip_spec(self.clip)
        object.__setattr__(self, "secure_noise", noise_lib.check_secure(self.secure_noise, "DPSpec"))
        if not (isinstance(self.mechanism, (DPSGD, BandMF))
                or (isinstance(self.mechanism, BLT) and self.mechanism.sensitivity is not None)):
            raise TypeError(f"mechanism must be jaxdp.noise.mechanisms.DPSGD(), BandMF(coefs) or BLT(..., "
                            f"sensitivity=s), got {self.mechanism!r} (a BLT's sensitivity depends on the run: "
                            "jaxdp.noise.strategies.sensitivity)")
        if not math.isfinite(self.l2_norm_clip):
            raise ValueError(f"l2_norm_clip must be finite, got {self.l2_norm_clip}")

    @property
    def noise_std(self) -> float:
        """The std of the draws: sigma times the clip's sensitivity C' times the strategy's column norm."""
        scale = self.mechanism.sensitivity if isinstance(self.mechanism, BLT) else self.mechanism.column_norm
        return clipping_lib.noise_std(self.l2_norm_clip, self.noise_multiplier) * scale

    def privatizer(self):
        """The `jaxdp.noise.privatizer.GaussianPrivatizer` of this release."""
        from jaxdp.noise.privatizer import GaussianPrivatizer
        return GaussianPrivatizer(self.noise_std, self.expected_batch_size, self.secure_noise, self.mechanism)


def check_clip_spec(clip) -> None:
    if not isinstance(clip, ClipSpec):
        raise TypeError(f"clip must be a jaxdp.ClipSpec, got {type(clip).__name__}: {clip!r}")


def check_norm_plan(norms) -> None:
    if not isinstance(norms, NormPlan):
        raise TypeError(f"norms must be a jaxdp.NormPlan, got {type(norms).__name__}: {norms!r}")


CLIP_KEYWORDS = tuple(f.name for f in dataclasses.fields(ClipSpec))
NORM_KEYWORDS = tuple(f.name for f in dataclasses.fields(NormPlan))


def accepts_old_keywords(fn: Callable) -> Callable:
    """`fn(..., clipping=..., strategy=...)` (the keywords before `ClipSpec` / `NormPlan`) as
    `fn(..., clip=ClipSpec(clipping=...), norms=NormPlan(strategy=...))`, with a DeprecationWarning; for one
    release. A keyword given both ways is an error."""
    return old_keywords(clip=(ClipSpec, CLIP_KEYWORDS), norms=(NormPlan, NORM_KEYWORDS))(fn)
