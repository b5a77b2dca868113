"""The noise-mechanism planner: for a run's (units, expected batch, steps, epsilon, delta), the mechanism
whose released prefix sums have the least expected RMS noise, and the table it chose from.

For each candidate the planner builds the strategy (`jaxdp.noise.strategies`), calibrates sigma so that the
run's accounted epsilon (`jaxdp.accounting.mechanisms`) meets the target at the same expected batch, and
computes the expected RMS error of the noise in the prefix sums of the released gradients, in units of the
clipping sensitivity:

    rms_error = noise_std / l2_norm_clip_sensitivity x prefix_sum_rms_error(mechanism, steps)
              = sigma x strategy_sensitivity x sqrt(mean_t Var((A C^{-1} z)_t)),    z unit Gaussian.

  "dpsgd"       Poisson sampling at q = batch / units; strategy sensitivity 1.
  "bandmf", b   cyclic Poisson over b groups at q_b = b q (the same expected batch), amplified BandMF
                accounting over ceil(steps / b) rounds; strategy sensitivity C's max column norm (1).
                Offered for b = 2, 4, 8, ... while b <= steps, q_b <= 1 and b <= `max_bands`.
  "blt", k      k buffers; cyclic sampling over min_sep = `blt_groups(units, batch, steps)` groups (q_b <= 1,
                the same expected batch), so a unit participates at most ceil(steps / min_sep) times, min_sep
                apart; one Gaussian release with that pattern's sensitivity (no amplification). Needs the
                optional extra `jaxdp[mf]` (jax_privacy's BLT optimiser); without it its row says why it is
                skipped.

Memory (`BufferMemory`): each buffer is a float32 copy of the trainable parameters, held as optimizer state;
under ZeRO stage >= 2 each device keeps its shard (`shards` devices), else a whole copy. With a budget, a
candidate whose buffers exceed it per device is skipped (its row says so) before it is planned; DP-SGD has
none and always fits.

Two errors per row, each a proxy for the trained model's loss, not a measurement of it:

  "prefix_sums"  the RMS over steps of the noise in the running sum of the updates, the quantity the
                 strategies are optimised for (jax_privacy's mean loss): what SGD-type optimisers accumulate;
  "steps"        the RMS noise of each step's own release, sigma x strategy sensitivity x
                 `strategies.step_rms_error`: what an optimiser that divides each update by the running RMS of
                 the noisy gradients (Adam, the jobs' AdamW) feeds on. Correlated noise spends more noise per
                 step to cancel it in the sums, so by this error DP-SGD usually wins.

`plan(..., criterion=...)` chooses the least error of one kind, ties going to fewer buffers per parameter
(each costs a float32 copy of the trainable parameters). Strategies are cached per arguments
(`jaxdp.noise.strategies`), sigma per accountant arguments (`jaxdp.accounting.accountant`), so a second
plan with the same inputs is cheap.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence

from jaxdp.accounting import mechanisms as accounting
from jaxdp.noise import mechanisms, strategies

DEFAULT_MAX_BANDS = 64  # BandMF keeps bands - 1 float32 copies of the trainable parameters
DEFAULT_BLT_BUFFERS = (3,)
# The PLD grid of the planner's calibrations: a coarser grid is pessimistic (a valid, slightly larger sigma)
# and several times faster; the planner ranks mechanisms, the run calibrates the chosen one at its own grid.
PLAN_VALUE_DISCRETIZATION_INTERVAL = 1e-3


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A mechanism to consider: kind "dpsgd", "bandmf" (`size` = bands) or "blt" (`size` = buffers)."""
    kind: str
    size: int = 1

    def __post_init__(self):
        if self.kind not in accounting.KINDS:
            raise ValueError(f"Candidate.kind must be one of {accounting.KINDS}, got {self.kind!r}")
        if operator.index(self.size) < 1:
            raise ValueError(f"Candidate.size must be an integer >= 1, got {self.size!r}")

    @property
    def label(self) -> str:
        return {"dpsgd": "dpsgd", "bandmf": f"bandmf b={self.size}", "blt": f"blt {self.size} buffers"}[self.kind]


@dataclasses.dataclass(frozen=True)
class BufferMemory:
    """What a candidate's noise buffers cost per device, and the most they may take.

    Attributes:
      trainable_parameters: the parameters the noise is added to (the buffers' shape), >= 0.
      shards: devices each buffer is split over (the mesh's data axis under ZeRO stage >= 2, else 1), >= 1.
      budget_bytes: the most buffer bytes per device a candidate may need (None: no limit), >= 0.
    """
    trainable_parameters: int
    shards: int = 1
    budget_bytes: int | None = None

    def __post_init__(self):
        if operator.index(self.trainable_parameters) < 0 or operator.index(self.shards) < 1:
            raise ValueError(f"need trainable_parameters >= 0 and shards >= 1, got {self.trainable_parameters!r}, "
                             f"{self.shards!r}")
        if self.budget_bytes is not None and not self.budget_bytes >= 0:
            raise ValueError(f"budget_bytes must be None or >= 0, got {self.budget_bytes!r}")

    def bytes_of(self, num_buffers: int) -> int:
        """Bytes per device of `num_buffers` float32 buffers: ceil(num_buffers x 4 x parameters / shards)."""
        return -(-4 * operator.index(num_buffers) * self.trainable_parameters // self.shards)

    def fits(self, num_buffers: int) -> bool:
        return self.budget_bytes is None or self.bytes_of(num_buffers) <= self.budget_bytes


def num_buffers(candidate: Candidate) -> int:
    """The float32 buffers per trainable parameter a candidate keeps: 0, bands - 1, or its BLT buffers."""
    return {"dpsgd": 0, "bandmf": candidate.size - 1, "blt": candidate.size}[candidate.kind]


def blt_groups(num_units: int, expected_batch_size: float, steps: int) -> int:
    """BLT's cyclic groups (its participations' min separation): units // batch, the most the expected batch
    allows (q_b <= 1; more separation, less sensitivity), at most `steps` (more groups than steps would leave
    units unsampled without lowering the sensitivity: each unit already participates at most once)."""
    return max(1, min(math.floor(num_units / expected_batch_size), steps))


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One candidate's outcome. `skipped` says why a candidate has no numbers (then they are None).

    Attributes:
      mechanism: the noise mechanism (`jaxdp.noise.mechanisms`) to stream.
      run: what the accountant reads (`jaxdp.accounting.mechanisms.MechanismAccounting`): sampling
        probability, cycle length (the cyclic sampler's groups), strategy sensitivity.
      sigma: the calibrated noise multiplier; noise std = run.noise_std(clip sensitivity, sigma).
      unit_rms_error: `prefix_sum_rms_error(mechanism, steps)` (noise std 1).
      rms_error: sigma x strategy sensitivity x unit_rms_error (units of the clipping sensitivity).
      step_error: sigma x strategy sensitivity x `strategies.step_rms_error` (same units).
      num_buffers: float32 buffers per trainable parameter.
      buffer_bytes: the buffers' bytes per device (`BufferMemory.bytes_of`), when the memory was given.
    """
    candidate: Candidate
    mechanism: mechanisms.Mechanism | None = None
    run: accounting.MechanismAccounting | None = None
    sigma: float | None = None
    unit_rms_error: float | None = None
    rms_error: float | None = None
    step_error: float | None = None
    num_buffers: int | None = None
    buffer_bytes: int | None = None
    skipped: str | None = None


def default_candidates(num_units: int, expected_batch_size: float, steps: int, *,
                       max_bands: int = DEFAULT_MAX_BANDS,
                       blt_buffers: Sequence[int] = DEFAULT_BLT_BUFFERS) -> tuple[Candidate, ...]:
    """DP-SGD; BandMF with b = 2, 4, 8, ... (b <= steps, b x batch <= units, b <= max_bands); BLT with each
    of `blt_buffers` buffers."""
    out = [Candidate("dpsgd")]
    b = 2
    while b <= min(steps, max_bands) and b * expected_batch_size <= num_units:
        out.append(Candidate("bandmf", b))
        b *= 2
    out += [Candidate("blt", k) for k in blt_buffers]
    return tuple(out)


def _row(candidate: Candidate, num_units: int, batch: float, steps: int, target_epsilon: float, delta: float,
         options: dict) -> PlanRow:
    q = batch / num_units
    if candidate.kind == "dpsgd":
        mechanism, run = mechanisms.DPSGD(), accounting.MechanismAccounting("dpsgd", steps, q)
    elif candidate.kind == "bandmf":
        b = candidate.size
        if b > steps or b * q > 1:
            return PlanRow(candidate, skipped=f"needs bands <= steps and bands x batch <= units (b={b})")
        mechanism = strategies.bandmf(steps, b)
        column_norm = strategies.sensitivity(mechanism, steps, 1, 1)
        run = accounting.MechanismAccounting("bandmf", steps, b * q, b, column_norm)
    else:
        min_sep = blt_groups(num_units, batch, steps)
        participations = strategies.max_participations(steps, min_sep)
        try:
            mechanism = strategies.blt(steps, candidate.size, min_sep, participations)
            sensitivity = strategies.sensitivity(mechanism, steps, min_sep, participations)
        except ImportError:
            return PlanRow(candidate, skipped=f"needs jax_privacy: pip install '{strategies.MF_EXTRA}'")
        except (RuntimeError, ValueError) as e:  # no strategy, or none whose sensitivity is exact
            return PlanRow(candidate, skipped=f"BLT optimisation failed: {e}")
        run = accounting.MechanismAccounting("blt", steps, batch * min_sep / num_units, min_sep, sensitivity,
                                             participations)
    sigma = accounting.calibrate_for(run, target_epsilon, delta, **options)
    unit, std = strategies.prefix_sum_rms_error(mechanism, steps), run.noise_std(1.0, sigma)
    step = strategies.step_rms_error(mechanism, steps)
    return PlanRow(candidate, mechanism, run, sigma, unit, std * unit, std * step, mechanism.num_buffers)


CRITERIA = ("prefix_sums", "steps")


def best(table: Sequence[PlanRow], criterion: str = "prefix_sums") -> PlanRow:
    """The row with the least error of `criterion` (`CRITERIA`; ties: fewer buffers), skipped rows aside."""
    if criterion not in CRITERIA:
        raise ValueError(f"criterion must be one of {CRITERIA}, got {criterion!r}")
    rows = [r for r in table if r.skipped is None]
    if not rows:
        raise ValueError("no candidate could be planned: " + "; ".join(f"{r.candidate.label}: {r.skipped}"
                                                                       for r in table))
    error = (lambda r: r.rms_error) if criterion == "prefix_sums" else (lambda r: r.step_error)
    return min(rows, key=lambda r: (error(r), r.num_buffers))


def plan(num_units: int, expected_batch_size: float, steps: int, target_epsilon: float, delta: float,
         candidates: Sequence[Candidate] | None = None, *, memory: BufferMemory | None = None,
         criterion: str = "prefix_sums") -> tuple[PlanRow, list[PlanRow]]:
    """(the chosen row, the table): every candidate calibrated to (target_epsilon, delta) at the same
    expected batch, and its two errors (module docstring); the chosen row is the least of `criterion`.

    Args:
      num_units: N, the privacy units in the data set, >= 1.
      expected_batch_size: the expected units per step, in (0, N].
      steps: the run's noisy steps (logical batches), >= 1.
      target_epsilon, delta: the run's budget (delta net of any sampler slack the caller pays).
      candidates: the mechanisms to compare; None: `default_candidates(N, batch, steps)`.
      memory: if given, each row's buffer_bytes per device, and a candidate over its budget is skipped.
      criterion: which error chooses (`CRITERIA`, module docstring).

    Returns:
      (chosen, table): `best(table)` and the rows in the candidates' order.
    """
    num_units, steps = operator.index(num_units), operator.index(steps)
    if num_units < 1 or steps < 1 or not 0 < expected_batch_size <= num_units:
        raise ValueError(f"need num_units >= 1, steps >= 1 and expected_batch_size in (0, num_units]; got "
                         f"{num_units!r}, {steps!r}, {expected_batch_size!r}")
    if candidates is None:
        candidates = default_candidates(num_units, expected_batch_size, steps)
    table, options = [], dict(value_discretization_interval=PLAN_VALUE_DISCRETIZATION_INTERVAL)
    for candidate in candidates:
        if memory is not None and not memory.fits(num_buffers(candidate)):
            nbytes = memory.bytes_of(num_buffers(candidate))
            table.append(PlanRow(candidate, num_buffers=num_buffers(candidate), buffer_bytes=nbytes,
                                 skipped=f"its noise buffers need {nbytes / 2**30:.3g} GiB per device > the budget "
                                         f"{memory.budget_bytes / 2**30:.3g} GiB"))
            continue
        row = _row(candidate, num_units, expected_batch_size, steps, target_epsilon, delta, options)
        if memory is not None and row.num_buffers is not None:
            row = dataclasses.replace(row, buffer_bytes=memory.bytes_of(row.num_buffers))
        table.append(row)
    return best(table, criterion), table


def format_table(table: Sequence[PlanRow], criterion: str = "prefix_sums") -> str:
    """The table as text, one row per candidate, the one `criterion` chooses marked with '*'."""
    chosen = best(table, criterion) if any(r.skipped is None for r in table) else None
    lines = [f"  {'mechanism':<16} {'sigma':>8} {'noise std':>9} {'unit RMS':>9} {'RMS error':>10} {'step RMS':>9} "
             f"{'buffers':>7} {'groups':>6}  note"]
    for r in table:
        mark = "*" if r is chosen else " "
        if r.skipped is not None:
            lines.append(f"{mark} {r.candidate.label:<16} {'-':>8} {'-':>9} {'-':>9} {'-':>10} {'-':>9} {'-':>7} "
                         f"{'-':>6}  "
                         f"skipped: {r.skipped}")
            continue
        memory = "" if r.buffer_bytes is None else f"buffers {r.buffer_bytes / 2**20:.1f} MiB per device"
        lines.append(f"{mark} {r.candidate.label:<16} {r.sigma:8.4f} {r.run.noise_std(1.0, r.sigma):9.4f} "
                     f"{r.unit_rms_error:9.4f} {r.rms_error:10.4f} {r.step_error:9.4f} {r.num_buffers:7d} "
                     f"{r.run.cycle_length:6d}  "
                     f"{memory}")
    return "\n".join(lines)
