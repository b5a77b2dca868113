"""The job's noise mechanism (`config.dp.mechanism`, `config.dp.bands`, `config.dp.blt_buffers`): what the step
streams, how the batches are sampled and what the accountant counts, decided once in `prepare`.

  "dpsgd"   independent noise and Poisson sampling at q = batch_size / N: the run as before these fields.
  "bandmf"  DP-BandMF (Choquette-Choo et al., arXiv:2306.08153) with b = `config.dp.bands` bands: the
            coefficients of `jaxdp.noise.strategies.bandmf(config.steps, b)` (L2 norm 1), cyclic Poisson
            sampling over b groups (`jaxdp.sampling.cyclic.CyclicPoissonSampler`) at q_b = b x batch_size / N,
            so the expected batch stays `config.batch_size`, and amplified BandMF accounting
            (`jaxdp.accounting.mechanisms`, kind "bandmf": the Poisson-subsampled Gaussian at q_b over
            ceil(steps / b) rounds). `config.dp.bands` None (or 0): the planner's best b.
  "blt"     BLT (Dvijotham et al., arXiv:2404.16706) with `config.dp.blt_buffers` buffers, from jax_privacy's
            optimiser (`jaxdp.noise.strategies.blt`, the extra jaxdp[mf]) for b-min-separated participation:
            the same cyclic sampler over b = `config.dp.bands` groups (None: `planner.blt_groups`, units //
            batch_size, at most the steps), so a unit joins only steps of its group's residue class mod b, at
            most ceil(steps / b) of them, b apart. No amplification is claimed (the within-group Poisson draw
            and the random partition are not used by the analysis): the run is one Gaussian release of
            sensitivity `strategies.sensitivity(C, steps, b, ceil(steps / b))`, the noise std sigma C' times
            it, sigma calibrated to the target for that one release; after k steps the accountant counts the
            release of the first k (`MechanismAccounting.prefix_sensitivity`), which the budget stop and a
            resume use.
  "auto"    the planner's choice (`jaxdp.training.planner.plan`) among DP-SGD, BandMF b = 2, 4, 8, ... (only
            b = `config.dp.bands` when it is set) and, where jax_privacy is installed, BLT with
            `config.dp.blt_buffers` buffers, at the run's (N, batch_size, steps, target epsilon, delta net of the
            sampling slack), by the least RMS noise of each step's release (criterion "steps"): the jobs train
            with AdamW, which divides each update by the running RMS of the noisy gradients, and at the job's
            learning rate correlated noise lost to DP-SGD in every regime measured, by about what its larger
            per-step noise predicts (notebook/2026-11-28-correlated-noise-utility.md); by this criterion DP-SGD
            wins, and the table shows what each mechanism would give. `bandmf` without bands picks b by the
            prefix sums' noise (criterion "prefix_sums"), the quantity BandMF is optimised for.

`config.dp.noise_buffer_gb` (None: no limit) is the planner's memory budget: a candidate whose float32
buffers (`planner.BufferMemory`: buffers x trainable parameters x 4 bytes, split over the data axis under
ZeRO stage >= 2) exceed it per device is skipped; a named mechanism over it is refused. None is the default
because the choice must be a function of the run's public inputs, the same on any machine a resume runs on
(a fraction of the device's memory would make it depend on the device), and `config.memory_budget_gb`
already counts the buffers in the whole step when set.

The choice is public (the bands, the coefficients, the planner's table: functions of N, the batch, the steps
and the budget); the partition of the units into groups is as secret as the root seed it derives from and is
never written.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable

import numpy as np

from jaxdp.accounting import mechanisms as accounting
from jaxdp.noise import mechanisms, strategies
from jaxdp.sampling.cyclic import CyclicPoissonSampler
from jaxdp.sampling.poisson import PoissonSampler
from jaxdp.training import planner
from jaxdp.training.config import MF_INSTALL, ConfigError, has_jax_privacy


@dataclasses.dataclass(frozen=True)
class NoiseChoice:
    """The run's noise mechanism.

    Attributes:
      kind: "dpsgd", "bandmf" or "blt".
      coefs: BandMF's strategy coefficients c_0..c_{b-1} ((1.0,) for DP-SGD and BLT).
      chosen_by: how it was chosen, in words (the config fields, or the planner).
      table: the planner's rows when it chose ("auto", or "bandmf" without bands), else ().
      blt: "blt": the strategy, its `sensitivity` the whole run's (module docstring); else None.
      groups: "blt": the cyclic groups b (the participations' min separation); else 0.
      participations: "blt": the most participations its sensitivity assumes, ceil(steps / groups); else None.
      buffer_bytes: the buffers' bytes per device (`planner.BufferMemory`), when they were counted.
      criterion: the planner's criterion when it chose (`planner.CRITERIA`).
    """
    kind: str = "dpsgd"
    coefs: tuple[float, ...] = (1.0,)
    chosen_by: str = "config.dp.mechanism='dpsgd' (the default)"
    table: tuple = dataclasses.field(default=(), compare=False, repr=False)
    blt: mechanisms.BLT | None = None
    groups: int = 0
    participations: int | None = None
    buffer_bytes: int | None = dataclasses.field(default=None, compare=False)
    criterion: str = dataclasses.field(default="prefix_sums", compare=False)

    @property
    def bands(self) -> int:
        return len(self.coefs)

    @property
    def cycle_length(self) -> int:
        """The cyclic sampler's groups: BandMF's bands, BLT's min separation (1 for DP-SGD)."""
        return self.groups if self.kind == "blt" else self.bands

    @property
    def mechanism(self) -> mechanisms.Mechanism:
        """What `fused_clip` / `DPSpec` stream (`jaxdp.noise.mechanisms`)."""
        if self.kind == "blt":
            return self.blt
        return mechanisms.DPSGD() if self.kind == "dpsgd" else mechanisms.BandMF(self.coefs)

    @property
    def column_norm(self) -> float:
        """The strategy sensitivity the noise std is scaled by: C's max column norm (BandMF, 1 for
        `strategies.bandmf`; DP-SGD 1), or BLT's min-separation sensitivity over the run."""
        return self.blt.sensitivity if self.kind == "blt" else self.mechanism.column_norm

    @property
    def coefs_sha256(self) -> str:
        """SHA-256 of the coefficients as little-endian float64 (what the receipt names them by)."""
        return hashlib.sha256(np.asarray(self.coefs, "<f8").tobytes()).hexdigest()

    def accounting(self, steps: int, sampler: PoissonSampler) -> accounting.MechanismAccounting:
        """What the accountant counts for `steps` steps of batches from `sampler` ("blt": the first `steps`
        steps of the run, with their prefix sensitivity)."""
        if self.kind == "dpsgd":
            return accounting.MechanismAccounting("dpsgd", steps, sampler.sampling_probability)
        if self.kind == "blt":
            prefix = (None if steps == 0 else
                      min(strategies.sensitivity(self.blt, steps, self.groups, self.participations),
                          self.blt.sensitivity))
            return accounting.MechanismAccounting("blt", steps, sampler.group_sampling_probability, self.groups,
                                                  self.blt.sensitivity, self.participations, prefix)
        return accounting.MechanismAccounting("bandmf", steps, sampler.group_sampling_probability, self.bands,
                                              self.column_norm)

    def sampler(self, poisson: PoissonSampler) -> PoissonSampler:
        """The run's sampler: `poisson` itself for DP-SGD; for BandMF (BLT) the cyclic Poisson sampler over b
        groups (its min separation) with the same population, expected batch, padded size, seed and overflow
        mode (its overflow probability, hence the sampling slack, is the Poisson sampler's:
        `jaxdp.sampling.cyclic`)."""
        if self.kind == "dpsgd":
            return poisson
        return CyclicPoissonSampler(poisson.num_examples, poisson.expected_batch_size, self.cycle_length,
                                    max_batch_size=poisson.max_batch_size, seed=poisson.seed,
                                    overflow=poisson.overflow)

    def parameters(self, steps: int) -> dict:
        """The mechanism's parameters for the receipt: bands or BLT's buffers, where they come from, and the
        buffers' memory."""
        memory = {} if self.buffer_bytes is None else {"buffer_bytes_per_device": self.buffer_bytes}
        if self.kind == "dpsgd":
            chosen = {"chosen_by": self.chosen_by} if self.table else {}  # the planner chose it ("auto")
            return {"bands": 1, "note": "C = I: independent noise each step", "buffers_per_parameter": 0, **memory,
                    **chosen}
        if self.kind == "blt":
            return {"buffers": self.blt.num_buffers, "buf_decay": list(self.blt.buf_decay),
                    "output_scale": list(self.blt.output_scale), "groups": self.groups,
                    "min_separation": self.groups, "max_participations": self.participations,
                    "parameters_from": f"jaxdp.noise.strategies.blt(steps={steps}, buffers={self.blt.num_buffers}, "
                                       f"min_sep={self.groups}, participations={self.participations}): jax_privacy "
                                       "2.0.0's buffered_toeplitz.optimize (mean squared prefix-sum error x squared "
                                       "sensitivity); C's Toeplitz coefficients c_0 = 1, c_k = sum_i output_scale_i "
                                       "buf_decay_i^(k-1)",
                    "sensitivity_from": f"jaxdp.noise.strategies.sensitivity(C, {steps}, min_sep={self.groups}, "
                                        f"participations={self.participations})",
                    "buffers_per_parameter": self.blt.num_buffers, **memory, "chosen_by": self.chosen_by}
        return {"bands": self.bands, "coefficients": list(self.coefs), "coefficients_sha256": self.coefs_sha256,
                "coefficients_from": f"jaxdp.noise.strategies.bandmf(steps={steps}, bands={self.bands}): the "
                                     "banded Toeplitz strategy minimising the mean squared prefix-sum error, "
                                     "coefficients scaled to L2 norm 1 (float64; sha256 of their little-endian "
                                     "float64 bytes)",
                "buffers_per_parameter": self.bands - 1, **memory,
                "chosen_by": self.chosen_by}


def bandmf_choice(steps: int, bands: int, chosen_by: str, table: tuple = ()) -> NoiseChoice:
    if bands == 1:
        return NoiseChoice(chosen_by=chosen_by, table=table)  # BandMF b = 1 is DP-SGD: run it as DP-SGD
    return NoiseChoice("bandmf", strategies.bandmf(steps, bands).coefs, chosen_by, table)


def blt_choice(steps: int, strategy: mechanisms.BLT, groups: int, chosen_by: str, table: tuple = ()) -> NoiseChoice:
    """The BLT run of `strategy` over `steps` steps and `groups` cyclic groups: its sensitivity set to the
    whole run's (at most ceil(steps / groups) participations, groups apart)."""
    participations = strategies.max_participations(steps, groups)
    sensitivity = strategies.sensitivity(strategy, steps, groups, participations)
    blt = mechanisms.BLT(strategy.buf_decay, strategy.output_scale, sensitivity)
    return NoiseChoice("blt", (1.0,), chosen_by, table, blt, groups, participations)


def planned_mechanism(config) -> mechanisms.Mechanism:
    """The mechanism whose buffers the memory plan (`config.memory_budget_gb`) counts, known from the config
    alone: BandMF with config.dp.bands, BLT with config.dp.blt_buffers (placeholder values: the compiled
    step's memory does not depend on them), else DP-SGD (`validate_config` refuses a memory budget when the
    planner would choose the bands)."""
    dp = config.dp
    kind = dp.get("mechanism", "dpsgd") if dp.enabled else "dpsgd"
    if kind == "blt":
        k = dp.get("blt_buffers", 3)
        return mechanisms.BLT((0.5,) * k, (0.1,) * k, 1.0)
    if kind != "dpsgd" and dp.get("bands"):
        return bandmf_choice(config.steps, dp.bands, "").mechanism
    return mechanisms.DPSGD()


def buffer_memory(config, trainable_parameters: int) -> planner.BufferMemory:
    """The planner's `BufferMemory` of the run: the trainable parameters, split over config.mesh.data under
    ZeRO stage >= 2 (the buffers are laid out like the gradients), the budget config.dp.noise_buffer_gb."""
    shards = config.mesh.data if config.mesh.get("zero_stage", 0) >= 2 else 1
    budget = config.dp.get("noise_buffer_gb")
    return planner.BufferMemory(trainable_parameters, shards, None if budget is None else int(budget * 2**30))


def choose(config, population: int, delta_mechanism: float | None,
           trainable_parameters: Callable[[], int] | None = None) -> NoiseChoice:
    """The run's `NoiseChoice` from config.dp.mechanism / bands / blt_buffers / noise_buffer_gb (DP-SGD when DP
    is off), given the population the sampler draws from (N, or config.privacy.num_units_bound), the
    accountant's delta and `trainable_parameters()` (the buffers' size; None: not counted, no budget).
    Raises ConfigError naming the field when b x batch_size exceeds the population (q_b > 1), or a named
    mechanism's buffers exceed config.dp.noise_buffer_gb."""
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
    memory = None if trainable_parameters is None else buffer_memory(config, trainable_parameters())
    if kind in ("bandmf", "blt") and (bands is not None or kind == "blt"):
        size = bands if kind == "bandmf" else dp.get("blt_buffers", 3)
        candidate = planner.Candidate(kind, size)
        if memory is not None and not memory.fits(planner.num_buffers(candidate)):
            raise ConfigError(
                f"config.dp.mechanism={kind!r} keeps {planner.num_buffers(candidate)} noise buffers of the "
                f"{memory.trainable_parameters} trainable parameters: "
                f"{memory.bytes_of(planner.num_buffers(candidate)) / 2**30:.3g} GiB per device > "
                f"config.dp.noise_buffer_gb = {dp.noise_buffer_gb:g}; raise it, or use fewer "
                + ("bands" if kind == "bandmf" else "config.dp.blt_buffers"))
        nbytes = None if memory is None else memory.bytes_of(planner.num_buffers(candidate))
        if kind == "bandmf":
            return dataclasses.replace(
                bandmf_choice(steps, bands, f"config.dp.mechanism='bandmf', config.dp.bands={bands}"),
                buffer_bytes=nbytes)
        groups = bands or planner.blt_groups(population, batch, steps)
        how = (f"config.dp.mechanism='blt', config.dp.blt_buffers={size}, "
               + (f"config.dp.bands={bands}" if bands else f"groups = min(units // batch_size, steps) = {groups}"))
        try:
            strategy = strategies.blt(steps, size, groups, strategies.max_participations(steps, groups))
            choice = blt_choice(steps, strategy, groups, how)
        except ImportError:
            raise ConfigError(f"config.dp.mechanism='blt' needs jax_privacy for its strategy: {MF_INSTALL}") from None
        except (RuntimeError, ValueError) as e:  # no strategy, or none whose sensitivity is exact
            raise ConfigError(f"config.dp.mechanism='blt': the BLT optimisation failed: {e}") from None
        return dataclasses.replace(choice, buffer_bytes=nbytes)
    blt_buffers = (dp.get("blt_buffers", 3),) if kind == "auto" and has_jax_privacy() else ()
    everything = planner.default_candidates(population, batch, steps, blt_buffers=blt_buffers)
    if kind == "bandmf":
        candidates = [c for c in everything if c.kind == "bandmf"]
        if not candidates:
            raise ConfigError(
                f"config.dp.mechanism='bandmf' with config.dp.bands None: no bands b >= 2 fit (b <= config.steps = "
                f"{steps} and b x config.batch_size <= the {population} training units); use "
                "config.dp.mechanism='dpsgd'")
    else:
        candidates = everything if bands is None else [
            planner.Candidate("dpsgd"), planner.Candidate("bandmf", bands),
            *(c for c in everything if c.kind == "blt")]
    criterion = "steps" if kind == "auto" else "prefix_sums"
    try:
        chosen, table = planner.plan(population, batch, steps, dp.target_epsilon, delta_mechanism, candidates,
                                     memory=memory, criterion=criterion)
    except ValueError as e:  # every candidate skipped (the noise-buffer budget)
        raise ConfigError(f"config.dp.mechanism={kind!r}: {e}") from None
    how = (f"the planner (config.dp.mechanism={kind!r}" + (f", config.dp.bands={bands}" if bands else "") + "): "
           + ("the least RMS noise per step, what AdamW sees" if criterion == "steps"
              else "the least expected RMS prefix-sum noise"))
    nbytes = chosen.buffer_bytes
    if chosen.candidate.kind == "dpsgd":
        choice = NoiseChoice(chosen_by=how, table=tuple(table), buffer_bytes=nbytes)
    elif chosen.candidate.kind == "blt":
        choice = dataclasses.replace(blt_choice(steps, chosen.mechanism, chosen.run.cycle_length, how, tuple(table)),
                                     buffer_bytes=nbytes)
    else:
        choice = NoiseChoice("bandmf", chosen.mechanism.coefs, how, tuple(table), buffer_bytes=nbytes)
    return dataclasses.replace(choice, criterion=criterion)


def startup_text(p) -> str:
    """What the job prints at the start about the noise mechanism of `p` (a `Prepared`): the mechanism, its
    sampling and sigma, and the planner's table when the planner chose."""
    choice, run = p.noise, p.accounting()
    if choice.kind == "dpsgd":
        what = f"noise mechanism: dpsgd (Poisson sampling at q = {run.sampling_probability:.4g})"
    elif choice.kind == "blt":
        what = (f"noise mechanism: blt {choice.blt.num_buffers} buffers (cyclic sampling over {choice.groups} groups: "
                f"each unit at most {choice.participations} times, {choice.groups} steps apart; one Gaussian release "
                f"of sensitivity {choice.column_norm:.4g}, no amplification)")
    else:
        what = (f"noise mechanism: bandmf b={choice.bands} (cyclic Poisson sampling over {choice.bands} groups at "
                f"q_b = {run.sampling_probability:.4g}; accounted over {run.rounds} rounds)")
    what += f", sigma {p.noise_multiplier:.4g}, chosen by {choice.chosen_by}"
    if choice.buffer_bytes is not None:
        what += f"; noise buffers {choice.buffer_bytes / 2**20:.1f} MiB per device"
    if not choice.table:
        return what
    return (what + "; the planner's table (RMS noise of the prefix sums in units of the clip norm; its sigma at "
            "a coarse PLD grid, the run calibrates the chosen one at its own; step RMS: each step's own noise):\n"
            + planner.format_table(choice.table, choice.criterion))


def table_record(choice: NoiseChoice) -> list[dict] | None:
    """The planner's table for the receipt: one JSON row per candidate (None when it did not choose)."""
    if not choice.table:
        return None
    chosen = planner.best(choice.table, choice.criterion)
    rows = []
    for r in choice.table:
        row = {"mechanism": r.candidate.label, "chosen": r is chosen}
        if r.buffer_bytes is not None:
            row["buffer_bytes_per_device"] = r.buffer_bytes
        if r.skipped is not None:
            row["skipped"] = r.skipped
        else:
            row.update(sigma=r.sigma, noise_std_per_clip_sensitivity=r.run.noise_std(1.0, r.sigma),
                       unit_rms_error=r.unit_rms_error, rms_error=r.rms_error, step_rms_error=r.step_error,
                       buffers_per_parameter=r.num_buffers,
                       groups=r.run.cycle_length)
        rows.append(row)
    return rows
