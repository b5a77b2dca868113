"""What each noise mechanism is accounted as, the noise std it must add, its epsilon and its sigma (NumPy).

One convention for every mechanism: `sigma` is the noise multiplier of the Gaussian in the DpEvent the
mechanism is accounted as, and the independent draws z_t that the mechanism correlates
(`jaxdp.noise.mechanisms`: x = C^{-1} z) have the standard deviation

    noise_std = sigma * l2_norm_clip_sensitivity * strategy_sensitivity,

where `l2_norm_clip_sensitivity` is what the clipping guarantees for one unit's contribution to one step
(`jaxdp.clipping.rules.noise_std(C, 1)`: C times its rounding factor) and `strategy_sensitivity` is the
strategy's, as below. `noise_std` computes it from the same record the accountant reads, so the step and the
accountant cannot disagree.

  kind      sampling (jaxdp.sampling)            strategy_sensitivity               DpEvent (add/remove one)
  "dpsgd"   Poisson, q over all units            1 (C = I)                          SelfComposed(PoissonSampled(q,
                                                                                    Gaussian(sigma)), steps)
  "bandmf"  cyclic Poisson, b groups, q_b        C's max column norm (1 for         SelfComposed(PoissonSampled(q_b,
            within the group of step t mod b     `strategies.bandmf`)               Gaussian(sigma)), ceil(steps / b))
  "blt"     b-min-separated participation        `strategies.sensitivity(C, steps,  Gaussian(sigma), once
            (cyclic, cycle_length = min_sep)     min_sep, participations)`

"bandmf" is amplified BandMF (Choquette-Choo et al., arXiv:2306.08153, Thm. 4; jax_privacy's
`amplified_bandmf_event`): with b bands and cyclic Poisson sampling over b groups, a unit's participations
touch disjoint b-row blocks of C, so the run is DP-SGD over ceil(steps / b) rounds at the group's sampling
probability q_b, each round a Gaussian of sensitivity C's max column norm. It needs the groups to be a secret
partition in which each unit's group is drawn independently (`jaxdp.sampling.cyclic`) and `cycle_length`
equal to the number of bands.
"blt" is the un-amplified analysis of any factorization (Choquette-Choo et al., arXiv:2211.06530): the
whole run is one Gaussian release C G + Z of sensitivity `strategy_sensitivity`, the largest norm of a sum
of C's columns over the participation patterns the sampler allows (at most `participations`, at least
`min_sep` = `cycle_length` steps apart). It claims no amplification: the sampling probability is recorded
only. A prefix of the run (its first `steps` of `total` steps, as the budget stop and a resume count it) is
the release of the leading steps x steps block of C, whose sensitivity `prefix_sensitivity` (the same
patterns within `steps`) is at most the run's: with the run's noise std it is one Gaussian at noise
multiplier sigma x strategy_sensitivity / prefix_sensitivity, nondecreasing in `steps` to sigma at the end.

The epsilon is `jaxdp.accounting.accountant.epsilon`'s (PLD by default) on the event's rounds; a single
Gaussian is its q = 1, one-step case. `calibrate_for` reuses `jaxdp.accounting.calibration`'s bracketing.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import dp_accounting

from jaxdp.accounting import accountant as accountant_lib
from jaxdp.accounting import calibration

KINDS = ("dpsgd", "bandmf", "blt")
ACCOUNTED_AS = {
    "dpsgd": "Poisson-subsampled Gaussian, composed over the steps",
    "bandmf": "amplified BandMF: Poisson-subsampled Gaussian at the group's probability over ceil(steps / bands) "
              "rounds (arXiv:2306.08153)",
    "blt": "one Gaussian release with the strategy's min-separation sensitivity, no amplification "
           "(arXiv:2211.06530)",
}


def _positive_finite(name: str, value: float) -> float:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class MechanismAccounting:
    """What the accountant needs to know of a run with a noise mechanism (module docstring's table).

    Attributes:
      kind: "dpsgd", "bandmf" or "blt".
      steps: the run's noisy steps (logical batches), >= 0.
      sampling_probability: "dpsgd": q = expected batch / units; "bandmf": q_b, the probability within the
        step's group (expected batch = q_b x units / bands); "blt": recorded, not used (no amplification).
      cycle_length: "dpsgd": 1; "bandmf": the bands b, which are also the cyclic sampler's groups; "blt":
        the min separation of a unit's participations (the cyclic sampler's groups).
      strategy_sensitivity: "dpsgd": 1; "bandmf": C's max column norm; "blt": the min-separation
        sensitivity of C over the run (`jaxdp.noise.strategies.sensitivity`).
      participations: "blt": the cap on a unit's participations the sensitivity assumed (None: as many as
        `steps` allow at `cycle_length` apart); recorded for the others.
      prefix_sensitivity: "blt" only: the sensitivity of the first `steps` steps (`strategies.sensitivity`
        of C over `steps`), when `steps` is a prefix of a run whose noise std is scaled by
        `strategy_sensitivity`; None: `steps` is the whole run (the same as strategy_sensitivity).
    """

    kind: str
    steps: int
    sampling_probability: float
    cycle_length: int = 1
    strategy_sensitivity: float = 1.0
    participations: int | None = None
    prefix_sensitivity: float | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        accountant_lib._check_count("steps", self.steps)
        accountant_lib._check_sampling_probability(self.sampling_probability)
        if operator.index(self.cycle_length) < 1:
            raise ValueError(f"cycle_length must be an integer >= 1, got {self.cycle_length!r}")
        _positive_finite("strategy_sensitivity", self.strategy_sensitivity)
        if self.participations is not None and operator.index(self.participations) < 1:
            raise ValueError(f"participations must be None or an integer >= 1, got {self.participations!r}")
        if self.prefix_sensitivity is not None:
            _positive_finite("prefix_sensitivity", self.prefix_sensitivity)
            if self.kind != "blt" or self.prefix_sensitivity > self.strategy_sensitivity * (1 + 1e-12):
                raise ValueError(f"prefix_sensitivity applies to kind 'blt' and is at most strategy_sensitivity "
                                 f"{self.strategy_sensitivity!r}, got {self.prefix_sensitivity!r} (kind "
                                 f"{self.kind!r})")
        if self.kind == "dpsgd" and (self.cycle_length != 1 or self.strategy_sensitivity != 1):
            raise ValueError("dpsgd: cycle_length and strategy_sensitivity must be 1 "
                             f"(got {self.cycle_length!r}, {self.strategy_sensitivity!r})")

    @property
    def rounds(self) -> int:
        """The compositions in the DpEvent: steps (dpsgd), ceil(steps / bands) (bandmf), 1 (blt; 0 if no step)."""
        if self.kind == "blt":
            return min(self.steps, 1)
        return -(-self.steps // self.cycle_length)

    def noise_std(self, l2_norm_clip_sensitivity: float, sigma: float) -> float:
        return noise_std(self.kind, l2_norm_clip_sensitivity, sigma, self.strategy_sensitivity)

    def event_noise_multiplier(self, sigma: float) -> float:
        """The noise multiplier of the event's Gaussian: `sigma`, except for a "blt" prefix, whose release
        has the prefix's sensitivity under the run's noise: sigma x strategy_sensitivity / prefix_sensitivity."""
        sigma = accountant_lib._check_noise_multiplier(sigma)
        if self.prefix_sensitivity is None:
            return sigma
        return sigma * (self.strategy_sensitivity / self.prefix_sensitivity)

    def dp_event(self, sigma: float) -> dp_accounting.DpEvent:
        """The DpEvent this run is accounted as, at noise multiplier `sigma`."""
        gaussian = dp_accounting.GaussianDpEvent(self.event_noise_multiplier(sigma))
        if self.kind == "blt":
            return gaussian if self.steps else dp_accounting.NoOpDpEvent()
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(self.sampling_probability, gaussian), self.rounds)

    def rounds_and_probability(self) -> tuple[int, float]:
        """(compositions, sampling probability) of the Poisson-subsampled Gaussian the event is: a single
        Gaussian release ("blt") is the one at q = 1, once."""
        return self.rounds, (1.0 if self.kind == "blt" else self.sampling_probability)


def noise_std(kind: str, l2_norm_clip_sensitivity: float, sigma: float, strategy_sensitivity: float) -> float:
    """The standard deviation of the independent draws z_t the mechanism correlates:
    sigma x l2_norm_clip_sensitivity x strategy_sensitivity (module docstring); for "dpsgd" the strategy
    sensitivity must be 1."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "dpsgd" and strategy_sensitivity != 1:
        raise ValueError(f"dpsgd: strategy_sensitivity must be 1, got {strategy_sensitivity!r}")
    _positive_finite("strategy_sensitivity", strategy_sensitivity)
    if not (l2_norm_clip_sensitivity >= 0 and math.isfinite(l2_norm_clip_sensitivity)):
        raise ValueError(f"l2_norm_clip_sensitivity must be a finite number >= 0, got {l2_norm_clip_sensitivity!r}")
    return accountant_lib._check_noise_multiplier(sigma) * float(l2_norm_clip_sensitivity) * float(strategy_sensitivity)


def epsilon_for(run: MechanismAccounting, sigma: float, delta: float, *, accountant: str = "pld",
                value_discretization_interval: float = accountant_lib.DEFAULT_VALUE_DISCRETIZATION_INTERVAL) -> float:
    """Epsilon of `run` at noise multiplier `sigma` (an upper bound: the run is (epsilon, delta)-DP under
    add-or-remove-one adjacency, given the sampling and noise std of the module docstring). 0 steps cost 0;
    sigma = 0 costs inf."""
    rounds, q = run.rounds_and_probability()
    return accountant_lib.epsilon(run.event_noise_multiplier(sigma), q, rounds, delta, accountant=accountant,
                                  value_discretization_interval=value_discretization_interval)


def calibrate_for(run: MechanismAccounting, target_epsilon: float, delta: float, *, accountant: str = "pld",
                  rtol: float = 1e-3,
                  value_discretization_interval: float = accountant_lib.DEFAULT_VALUE_DISCRETIZATION_INTERVAL) -> float:
    """The smallest sigma with (1 - rtol) target_epsilon <= epsilon_for(run, sigma, delta) <= target_epsilon
    (`jaxdp.accounting.calibration.calibrate_noise_multiplier` on the run's rounds; 0.0 for 0 steps)."""
    rounds, q = run.rounds_and_probability()
    sigma = calibration.calibrate_noise_multiplier(
        target_epsilon, q, rounds, delta, accountant=accountant, rtol=rtol,
        value_discretization_interval=value_discretization_interval)
    return sigma if run.prefix_sensitivity is None else sigma * run.prefix_sensitivity / run.strategy_sensitivity


def describe(run: MechanismAccounting, sigma: float, delta: float, *, parameters: dict[str, Any] | None = None,
             accountant: str = "pld",
             value_discretization_interval: float = accountant_lib.DEFAULT_VALUE_DISCRETIZATION_INTERVAL) -> dict:
    """The receipt's record of the mechanism (JSON-ready): kind, its `parameters` as given (e.g. the
    strategy's coefficients), the strategy sensitivity, the sampling, what it is accounted as, the DpEvent
    as text, sigma, the noise std per unit of clipping sensitivity, and the epsilon at `delta`."""
    sampling = {"dpsgd": "poisson", "bandmf": "cyclic_poisson", "blt": "cyclic (min-separated), not amplified"}
    return {
        "mechanism": run.kind,
        "parameters": dict(parameters or {}),
        "strategy_sensitivity": run.strategy_sensitivity,
        "sampling": {
            "kind": sampling[run.kind],
            "sampling_probability": run.sampling_probability,
            "cycle_length": run.cycle_length,
            "partition": None if run.kind == "dpsgd" else "secret; each unit's group uniform and independent",
            "participations": run.participations,
        },
        **({} if run.prefix_sensitivity is None else {"prefix_sensitivity": run.prefix_sensitivity}),
        "steps": run.steps,
        "accounted_as": ACCOUNTED_AS[run.kind],
        "dp_event": repr(run.dp_event(sigma)),
        "noise_multiplier": float(sigma),
        "noise_std_per_clip_sensitivity": noise_std(run.kind, 1.0, sigma, run.strategy_sensitivity),
        "accountant": accountant,
        "delta": float(delta),
        "epsilon": epsilon_for(run, sigma, delta, accountant=accountant,
                               value_discretization_interval=value_discretization_interval),
    }
