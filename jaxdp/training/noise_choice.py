"""The job's noise mechanism (`config.dp.mechanism`, `config.dp.bands`): what the step streams, how the
batches are sampled and what the accountant counts, decided once in `prepare`.

  "dpsgd"   independent noise and Poisson sampling at q = batch_size / N: the run as before these fields.
  "bandmf"  DP-BandMF (Choquette-Choo et al., arXiv:2306.08153) with b = `config.dp.bands` bands: the
            coefficients of `jaxdp.noise.strategies.bandmf(config.steps, b)` (L2 norm 1), cyclic Poisson
            sampling over b groups (`jaxdp.sampling.cyclic.CyclicPoissonSampler`) at q_b = b x batch_size / N,
            so the expected batch stays `config.batch_size`, and amplified BandMF accounting
            (`jaxdp.accounting.mechanisms`, kind "bandmf": the Poisson-subsampled Gaussian at q_b over
            ceil(steps / b) rounds). `config.dp.bands` None (or 0): the planner's best b.
  "auto"    the planner's choice (`jaxdp.training.planner.plan`: least expected RMS noise of the prefix sums)
            among DP-SGD and BandMF b = 2, 4, 8, ... (only b = `config.dp.bands` when it is set), at the run's
            (N, batch_size, steps, target epsilon, delta net of the sampling slack).

BLT is refused by `jaxdp.training.config.validate_config`: it is accounted as one un-amplified release of the
whole run, which the budget stop and a resume cannot count per step, and it needs jaxdp[mf].

The choice is public (the bands, the coefficients, the planner's table: functions of N, the batch, the steps
and the budget); the partition of the units into groups is as secret as the root seed it derives from and is
never written.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from jaxdp.accounting import mechanisms as accounting
from jaxdp.noise import mechanisms, strategies
from jaxdp.sampling.cyclic import CyclicPoissonSampler
from jaxdp.sampling.poisson import PoissonSampler
from jaxdp.training import planner
from jaxdp.training.config import ConfigError


@dataclasses.dataclass(frozen=True)
class NoiseChoice:
    """The run's noise mechanism.

    Attributes:
      kind: "dpsgd" or "bandmf".
      coefs: BandMF's strategy coefficients c_0..c_{b-1} ((1.0,) for DP-SGD).
      chosen_by: how it was chosen, in words (the config fields, or the planner).
      table: the planner's rows when it chose ("auto", or "bandmf" without bands), else ().
    """
    kind: str = "dpsgd"
    coefs: tuple[float, ...] = (1.0,)
    chosen_by: str = "config.dp.mechanism='dpsgd' (the default)"
    table: tuple = dataclasses.field(default=(), compare=False, repr=False)

    @property
    def bands(self) -> int:
        return len(self.coefs)

    @property
    def mechanism(self) -> mechanisms.DPSGD | mechanisms.BandMF:
        """What `fused_clip` / `DPSpec` stream (`jaxdp.noise.mechanisms`)."""
        return mechanisms.DPSGD() if self.kind == "dpsgd" else mechanisms.BandMF(self.coefs)

    @property
    def column_norm(self) -> float:
        """C's max column norm, the strategy sensitivity of one participation (1 for `strategies.bandmf`)."""
        return self.mechanism.column_norm

    @property
    def coefs_sha256(self) -> str:
        """SHA-256 of the coefficients as little-endian float64 (what the receipt names them by)."""
        return hashlib.sha256(np.asarray(self.coefs, "<f8").tobytes()).hexdigest()

    def accounting(self, steps: int, sampler: PoissonSampler) -> accounting.MechanismAccounting:
        """What the accountant counts for `steps` steps of batches from `sampler`."""
        if self.kind == "dpsgd":
            return accounting.MechanismAccounting("dpsgd", steps, sampler.sampling_probability)
        return accounting.MechanismAccounting("bandmf", steps, sampler.group_sampling_probability, self.bands,
                                              self.column_norm)

    def sampler(self, poisson: PoissonSampler) -> PoissonSampler:
        """The run's sampler: `poisson` itself for DP-SGD; for BandMF the cyclic Poisson sampler over b groups
        with the same population, expected batch, padded size, seed and overflow mode (its overflow
        probability, hence the sampling slack, is the Poisson sampler's: `jaxdp.sampling.cyclic`)."""
        if self.kind == "dpsgd":
            return poisson
        return CyclicPoissonSampler(poisson.num_examples, poisson.expected_batch_size, self.bands,
                                    max_batch_size=poisson.max_batch_size, seed=poisson.seed,
                                    overflow=poisson.overflow)

    def parameters(self, steps: int) -> dict:
        """The mechanism's parameters for the receipt: bands, coefficients, their hash and where they come from."""
        if self.kind == "dpsgd":
            return {"bands": 1, "note": "C = I: independent noise each step"}
        return {"bands": self.bands, "coefficients": list(self.coefs), "coefficients_sha256": self.coefs_sha256,
                "coefficients_from": f"jaxdp.noise.strategies.bandmf(steps={steps}, bands={self.bands}): the "
                                     "banded Toeplitz strategy minimising the mean squared prefix-sum error, "
                                     "coefficients scaled to L2 norm 1 (float64; sha256 of their little-endian "
                                     "float64 bytes)",
                "buffers_per_parameter": self.bands - 1,
                "chosen_by": self.chosen_by}


def bandmf_choice(steps: int, bands: int, chosen_by: str, table: tuple = ()) -> NoiseChoice:
    if bands == 1:
        return NoiseChoice(chosen_by=chosen_by, table=table)  # BandMF b = 1 is DP-SGD: run it as DP-SGD
    return NoiseChoice("bandmf", strategies.bandmf(steps, bands).coefs, chosen_by, table)


def planned_mechanism(config) -> mechanisms.DPSGD | mechanisms.BandMF:
    """The mechanism whose buffers the memory plan (`config.memory_budget_gb`) counts, known from the config
    alone: BandMF with config.dp.bands, else DP-SGD (`validate_config` refuses a memory budget when the
    planner would choose the bands)."""
    dp = config.dp
    if dp.enabled and dp.get("mechanism", "dpsgd") != "dpsgd" and dp.get("bands"):
        return bandmf_choice(config.steps, dp.bands, "").mechanism
    return mechanisms.DPSGD()


def choose(config, population: int, delta_mechanism: float | None) -> NoiseChoice:
    """The run's `NoiseChoice` from config.dp.mechanism / bands (DP-SGD when DP is off), given the population
    the sampler draws from (N, or config.privacy.num_units_bound) and the accountant's delta. Raises
    ConfigError naming config.dp.bands when b x batch_size exceeds the population (q_b > 1)."""
    dp, steps, batch = config.dp, config.steps, config.batch_size
    kind = dp.get("mechanism", "dpsgd") if dp.enabled else "dpsgd"
    bands = dp.get("bands") or None
    if kind == "dpsgd":
        return NoiseChoice()
    if bands is not None and bands * batch > population:
        raise ConfigError(
            f"config.dp.bands = {bands} x config.batch_size = {batch} exceeds the {population} training units the "
            f"sampler draws from: cyclic Poisson sampling of {bands} groups cannot keep the expected batch (the "
            f"group's sampling probability would be {bands * batch / population:.3g} > 1); use at most "
            f"{population // batch} bands, or a smaller batch")
    if kind == "bandmf" and bands is not None:
        return bandmf_choice(steps, bands, f"config.dp.mechanism='bandmf', config.dp.bands={bands}")
    everything = planner.default_candidates(population, batch, steps, blt_buffers=())
    if kind == "bandmf":
        candidates = [c for c in everything if c.kind == "bandmf"]
        if not candidates:
            raise ConfigError(
                f"config.dp.mechanism='bandmf' with config.dp.bands None: no bands b >= 2 fit (b <= config.steps = "
                f"{steps} and b x config.batch_size <= the {population} training units); use "
                "config.dp.mechanism='dpsgd'")
    else:
        candidates = everything if bands is None else [planner.Candidate("dpsgd"), planner.Candidate("bandmf", bands)]
    chosen, table = planner.plan(population, batch, steps, dp.target_epsilon, delta_mechanism, candidates)
    how = (f"the planner (config.dp.mechanism={kind!r}"
           + (f", config.dp.bands={bands}" if bands else "") + "): the least expected RMS prefix-sum noise")
    if chosen.candidate.kind == "dpsgd":
        return NoiseChoice(chosen_by=how, table=tuple(table))
    return NoiseChoice("bandmf", chosen.mechanism.coefs, how, tuple(table))


def startup_text(p) -> str:
    """What the job prints at the start about the noise mechanism of `p` (a `Prepared`): the mechanism, its
    sampling and sigma, and the planner's table when the planner chose."""
    choice, run = p.noise, p.accounting()
    if choice.kind == "dpsgd":
        what = f"noise mechanism: dpsgd (Poisson sampling at q = {run.sampling_probability:.4g})"
    else:
        what = (f"noise mechanism: bandmf b={choice.bands} (cyclic Poisson sampling over {choice.bands} groups at "
                f"q_b = {run.sampling_probability:.4g}; accounted over {run.rounds} rounds)")
    what += f", sigma {p.noise_multiplier:.4g}, chosen by {choice.chosen_by}"
    if not choice.table:
        return what
    return (what + "; the planner's table (RMS noise of the prefix sums in units of the clip norm; its sigma at "
            "a coarse PLD grid, the run calibrates the chosen one at its own):\n" + planner.format_table(choice.table))


def table_record(choice: NoiseChoice) -> list[dict] | None:
    """The planner's table for the receipt: one JSON row per candidate (None when it did not choose)."""
    if not choice.table:
        return None
    chosen = planner.best(choice.table)
    rows = []
    for r in choice.table:
        row = {"mechanism": r.candidate.label, "chosen": r is chosen}
        if r.skipped is not None:
            row["skipped"] = r.skipped
        else:
            row.update(sigma=r.sigma, noise_std_per_clip_sensitivity=r.run.noise_std(1.0, r.sigma),
                       unit_rms_error=r.unit_rms_error, rms_error=r.rms_error, buffers_per_parameter=r.num_buffers,
                       groups=r.run.cycle_length)
        rows.append(row)
    return rows
