"""The named settings of the one-run audits (`jaxdp.auditing.runs`), validated once where they are built.

`Claim` is the run under audit: its DP step (C, clipping, clip function, secure noise) and the epsilon its
accountant claims for it; both audits take it. `WhiteBoxSettings` and `BlackBoxSettings` say how each audit
runs: its canaries, its training, the bug it plants and the confidence of its bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxdp.accounting import accountant as accounting
from jaxdp.accounting import calibration
from jaxdp.auditing.bound import DEFAULT_CONFIDENCE
from jaxdp.clipping.settings import ClipSpec

BUGS = ("none", "half_noise", "no_clipping")


def _check_bug(bug: str) -> None:
    if bug not in BUGS:
        raise ValueError(f"bug must be one of {BUGS}, got {bug!r}")


def _as_pairs(ks: Sequence[tuple[int, int]] | None) -> tuple[tuple[int, int], ...] | None:
    """`ks` as a tuple of tuples, so that the settings are hashable values."""
    return None if ks is None else tuple(tuple(k) for k in ks)


@dataclasses.dataclass(frozen=True)
class Claim:
    """The run under audit: its DP step and the (epsilon, delta) its accountant claims for it.

    Attributes:
      target_epsilon: the epsilon the run claims, sigma calibrated to it when `noise_multiplier` is None.
      noise_multiplier: sigma; 0 is no noise (the claim is then infinite).
      delta: of the claim and of the audit.
      l2_norm_clip: C.
      clipping, clip_fn, secure_noise: `jaxdp.fused_clip`'s, as the audited run has them.
      accountant: of the claim ("pld" | "rdp").
    """
    target_epsilon: float = 2.0
    noise_multiplier: float | None = None
    delta: float = 1e-5
    l2_norm_clip: float = 1.0
    clipping: str = "flat"
    clip_fn: str = "abadi"
    secure_noise: bool = False
    accountant: str = "pld"

    def __post_init__(self):
        if self.accountant not in accounting.ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {accounting.ACCOUNTANTS}, got {self.accountant!r}")

    @property
    def clip(self) -> ClipSpec:
        return ClipSpec(self.clipping, self.clip_fn)

    def mechanism(self) -> dict:
        """What the audit ran, as `jaxdp.training.receipt.record_audit` compares it with a run's receipt."""
        return {"clipping": self.clipping, "clip_fn": self.clip_fn, "secure_noise": bool(self.secure_noise),
                "accountant": self.accountant, "l2_norm_clip": float(self.l2_norm_clip)}

    def noise_and_epsilon(self, sampling_probability: float, steps: int) -> tuple[float, float]:
        """(sigma, the claimed epsilon) of `steps` steps at Poisson rate `sampling_probability`."""
        q, delta, accountant = sampling_probability, self.delta, self.accountant
        sigma = (calibration.calibrate_noise_multiplier(self.target_epsilon, q, steps, delta, accountant=accountant)
                 if self.noise_multiplier is None else float(self.noise_multiplier))
        return sigma, accounting.epsilon(sigma, q, steps, delta, accountant=accountant)


@dataclasses.dataclass(frozen=True)
class WhiteBoxSettings:
    """How `white_box_audit` runs.

    Attributes:
      num_canaries: m, gradient canaries (each included with probability 1/2); the kernel has >= m entries.
      num_examples: synthetic data records (Gaussian features, labels of a random teacher).
      steps: DP-SGD steps.
      sampling_probability: q, Poisson rate of every record (data and included canaries) per step.
      canary_norm: norm of each canary's gradient; None: 10 C (> C, so that skipped clipping shows).
      learning_rate: of optax.sgd.
      bug: one of `BUGS`: a planted privacy bug the claim ignores.
      ks: (k_plus, k_minus) guesses tried (union bound); None: `jaxdp.auditing.bound.default_guesses(m)`.
      confidence: of the lower bound.
    """
    num_canaries: int = 2000
    num_examples: int = 32
    steps: int = 4
    sampling_probability: float = 1.0
    canary_norm: float | None = None
    learning_rate: float = 1.0
    bug: str = "none"
    ks: Sequence[tuple[int, int]] | None = None
    confidence: float = DEFAULT_CONFIDENCE

    def __post_init__(self):
        _check_bug(self.bug)
        for name in ("num_canaries", "num_examples", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0 < self.sampling_probability <= 1:
            raise ValueError(f"sampling_probability must be in (0, 1], got {self.sampling_probability!r}")
        if self.canary_norm is not None and not self.canary_norm > 0:
            raise ValueError(f"canary_norm must be > 0, got {self.canary_norm!r}")
        object.__setattr__(self, "ks", _as_pairs(self.ks))


@dataclasses.dataclass(frozen=True)
class BlackBoxSettings:
    """How `black_box_audit` runs.

    Attributes:
      num_canaries: m, random-token canaries (each included with probability 1/2).
      steps: DP-Adam steps.
      batch_size: the expected batch size q (n + m / 2), in (0, n + m / 2].
      learning_rate: of optax.adam.
      overflow: the sampler's (`jaxdp.sampling.poisson.OVERFLOW_MODES`).
      bug, ks, confidence: as `WhiteBoxSettings`.
    """
    num_canaries: int = 256
    steps: int = 100
    batch_size: float = 32
    learning_rate: float = 3e-3
    overflow: str = "truncate"
    bug: str = "none"
    ks: Sequence[tuple[int, int]] | None = None
    confidence: float = DEFAULT_CONFIDENCE

    def __post_init__(self):
        _check_bug(self.bug)
        object.__setattr__(self, "ks", _as_pairs(self.ks))


def field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))
