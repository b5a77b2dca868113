"""The named settings of the one-run audits (`jaxdp.auditing.runs`), validated once where they are built.

`Claim` is the run under audit: its DP step (C, clipping, clip function, secure noise, noise mechanism) and the
epsilon its accountant claims for it; both audits take it. `WhiteBoxSettings` and `BlackBoxSettings` say how each audit
runs: its canaries, its training, the bug it plants and the confidence of its bound.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

from jaxdp.accounting import accountant as accounting
from jaxdp.accounting import calibration
from jaxdp.accounting import mechanisms as mechanism_accounting
from jaxdp.auditing.bound import DEFAULT_CONFIDENCE
from jaxdp.clipping import rules as clipping_rules
from jaxdp.clipping.settings import ClipSpec
from jaxdp.noise import strategies
from jaxdp.noise.mechanisms import BLT, DPSGD, BandMF

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
      noise_mechanism: the noise's correlation over steps (`jaxdp.noise.mechanisms`): `DPSGD()` (the default),
        `BandMF(coefs)` or `BLT(buf_decay, output_scale)`; the claim is then the epsilon
        `jaxdp.accounting.mechanisms` gives that mechanism, its noise std that record's.
      cycle_length: the groups of the cyclic sampling the audit draws records with: BandMF's bands (None: the
        bands; another value is refused: the amplified analysis needs as many groups as bands), BLT's min
        separation (None: 1), DP-SGD's 1 (None: 1).
    """
    target_epsilon: float = 2.0
    noise_multiplier: float | None = None
    delta: float = 1e-5
    l2_norm_clip: float = 1.0
    clipping: str = "flat"
    clip_fn: str = "abadi"
    secure_noise: bool = False
    accountant: str = "pld"
    noise_mechanism: Any = DPSGD()
    cycle_length: int | None = None

    def __post_init__(self):
        if self.accountant not in accounting.ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {accounting.ACCOUNTANTS}, got {self.accountant!r}")
        noise = self.noise_mechanism
        if not isinstance(noise, (DPSGD, BandMF, BLT)):
            raise ValueError(f"noise_mechanism must be jaxdp.noise.mechanisms.DPSGD(), BandMF(...) or BLT(...), "
                             f"got {noise!r}")
        natural = noise.bands if isinstance(noise, BandMF) else 1
        cycle = natural if self.cycle_length is None else self.cycle_length
        if isinstance(cycle, bool) or operator.index(cycle) < 1 or (not isinstance(noise, BLT) and cycle != natural):
            raise ValueError(f"cycle_length must be {natural} for {type(noise).__name__} (None: {natural})"
                             + (", any integer >= 1 for BLT" if natural == 1 else "") + f", got {self.cycle_length!r}")
        object.__setattr__(self, "cycle_length", operator.index(cycle))

    @property
    def noise_kind(self) -> str:
        """"dpsgd", "bandmf" or "blt": the kind `jaxdp.accounting.mechanisms` accounts the noise as."""
        return {DPSGD: "dpsgd", BandMF: "bandmf", BLT: "blt"}[type(self.noise_mechanism)]

    def accounting(self, sampling_probability: float, steps: int) -> mechanism_accounting.MechanismAccounting:
        """The accountant's record of `steps` steps at rate `sampling_probability` (BandMF, BLT: within the
        step's group) with this claim's noise mechanism: BLT's sensitivity is its min-separation one over the
        `steps` steps at `cycle_length` apart, as many participations as they allow."""
        noise, kind, q = self.noise_mechanism, self.noise_kind, sampling_probability
        if kind == "dpsgd":
            return mechanism_accounting.MechanismAccounting("dpsgd", steps, q)
        if kind == "bandmf":
            return mechanism_accounting.MechanismAccounting("bandmf", steps, q, self.cycle_length, noise.column_norm)
        sensitivity = strategies.sensitivity(noise, steps, self.cycle_length)
        return mechanism_accounting.MechanismAccounting("blt", steps, q, self.cycle_length, sensitivity)

    def noise_std(self, sigma: float, sampling_probability: float, steps: int) -> float:
        """The std of the draws the audited step adds at noise multiplier `sigma` (the record's convention:
        sigma x C' x the strategy's sensitivity)."""
        clip_sensitivity = clipping_rules.noise_std(self.l2_norm_clip, 1.0)
        return self.accounting(sampling_probability, steps).noise_std(clip_sensitivity, sigma)

    @property
    def clip(self) -> ClipSpec:
        return ClipSpec(self.clipping, self.clip_fn)

    def mechanism(self) -> dict:
        """What the audit ran, as `jaxdp.training.receipt.record_audit` compares it with a run's receipt."""
        mechanism = {"clipping": self.clipping, "clip_fn": self.clip_fn, "secure_noise": bool(self.secure_noise),
                     "accountant": self.accountant, "l2_norm_clip": float(self.l2_norm_clip)}
        if self.noise_kind != "dpsgd":  # the receipt's name of a correlated-noise run's mechanism
            mechanism.update(noise_mechanism=self.noise_kind, cycle_length=self.cycle_length,
                             noise_parameters=dataclasses.asdict(self.noise_mechanism))
        return mechanism

    def noise_and_epsilon(self, sampling_probability: float, steps: int) -> tuple[float, float]:
        """(sigma, the claimed epsilon) of `steps` steps at Poisson rate `sampling_probability` (within the
        step's group for BandMF and BLT); sigma calibrated to `target_epsilon` when `noise_multiplier` is None."""
        q, delta, accountant = sampling_probability, self.delta, self.accountant
        if self.noise_kind == "dpsgd":
            sigma = (calibration.calibrate_noise_multiplier(self.target_epsilon, q, steps, delta,
                                                            accountant=accountant)
                     if self.noise_multiplier is None else float(self.noise_multiplier))
            return sigma, accounting.epsilon(sigma, q, steps, delta, accountant=accountant)
        record = self.accounting(q, steps)
        sigma = (mechanism_accounting.calibrate_for(record, self.target_epsilon, delta, accountant=accountant)
                 if self.noise_multiplier is None else float(self.noise_multiplier))
        return sigma, mechanism_accounting.epsilon_for(record, sigma, delta, accountant=accountant)


@dataclasses.dataclass(frozen=True)
class WhiteBoxSettings:
    """How `white_box_audit` runs.

    Attributes:
      num_canaries: m, gradient canaries (each included with probability 1/2); the kernel has >= m entries.
      num_examples: synthetic data records (Gaussian features, labels of a random teacher).
      steps: DP-SGD steps.
      sampling_probability: q, Poisson rate of every record (data and included canaries) per step (per step of
        its group under a cyclic claim: `Claim.cycle_length`).
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
