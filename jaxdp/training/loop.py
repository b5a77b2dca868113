"""The training loop: `train(config)` runs (or resumes) one pretraining job and returns its summary.

Poisson sampling on the host (`jaxdp.sampling.poisson`; the draw of step s depends
only on (the sampler's seed, s)), one jitted step per micro-batch (`jaxdp.training.steps`),
the privacy accountant (`jaxdp.accounting.budget.BudgetTracker`), which stops
training BEFORE the step that would exceed `dp.target_epsilon`, metrics,
evaluation and checkpoints in the run directory (`jaxdp.training.run_dir`).
With `mesh.data * mesh.seq > 1` the DP step runs on a (data, seq) mesh
(`steps.ShardedTrainer`); several hosts run it together (`jaxdp.training.hosts`).

Resume: rerunning with the same config restores the latest checkpoint and
drops the `metrics.jsonl` lines after it, so an interrupted-and-resumed run
writes exactly the metrics of an uninterrupted one (steps, hence epsilon, are
restored, never counted twice; the root seed of every random choice is read
from the checkpoint, see `jaxdp.training.preparation`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxdp.accounting.budget import BudgetTracker
from jaxdp.data import windows as data_lib
from jaxdp.noise import draws as noise_lib
from jaxdp.noise import seeds
from jaxdp.sampling import poisson as sampling
from jaxdp.sharding import processes
from jaxdp.training import hosts, noise_choice
from jaxdp.training.compilation_cache import CompileTicker
from jaxdp.training.config import build_model, runs_sharded_step
from jaxdp.training.generation import write_samples
from jaxdp.training.preparation import Prepared, mechanism, prepare
from jaxdp.training.receipt import privacy_receipt, write_privacy_receipt
from jaxdp.training.run_dir import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    METRICS_FILE,
    MODEL_DIR,
    SUMMARY_FILE,
    TOKEN_CACHE_FILE,
    TOKENIZER_DIR,
    Checkpointer,
    Progress,
    Ticker,
    log,
    read_json,
    read_metrics,
    record_token_cache,
    write_metrics,
    write_model,
    write_plots,
    write_text_atomic,
)
from jaxdp.training.steps import (
    ShardedTrainer,
    evaluate,
    make_optimizer,
    make_train_step,
)


def train(config, *, prepared: Prepared | None = None, interrupt_after: int | None = None,
          verbose: bool = True) -> dict:
    """Runs (or resumes) the training job of `config`; returns the summary dict.

    Args:
      config: an ml_collections ConfigDict as in `experiments/configs/default.py`.
      prepared: the result of `prepare(config)`, if already computed.
      interrupt_after: for tests: return right after this step, as if the
        process had been killed there (no final checkpoint, no summary).
      verbose: progress bar and messages on stderr.
    """
    verbose = verbose and hosts.writes_run_dir()  # several processes: process 0 reports for all
    p = prepared or prepare(config, progress=data_lib.stderr_progress if verbose else None)
    if config.dp.enabled and p.seed_guessable:
        log("WARNING: config.seed is pinned below 2^64: an attacker can search for it and replay the noise and "
            "the batches, so this run has NO privacy guarantee (privacy.json says so). For a private run leave "
            "config.seed unset, or pin a secret 128-bit value: python -c 'import secrets; "
            "print(secrets.randbits(128))'", verbose)
    elif p.seed_pinned:
        log("config.seed is pinned: the privacy guarantee assumes this seed is secret "
            "(it reproduces the noise and the batches) and is never pinned for another released run "
            "(two runs with one seed share their noise)", verbose)
    finished = _finished_summary(config, p)
    if finished is not None:  # a rerun of a finished run: nothing to do, nothing rewritten
        log(f"{p.workdir} holds this run, finished at step {finished['steps']}: nothing to do (no file rewritten)",
            verbose)
        return finished
    if p.records_noise_mechanism:  # config.dp.mechanism "bandmf" / "auto": what runs (and the planner's table)
        log(noise_choice.startup_text(p), verbose)
    processes.barrier("jaxdp: prepared")  # no process still reads the workdir's config.json when process 0 writes it
    if hosts.writes_run_dir():
        _open_run_dir(p, verbose)  # from here on the workdir is written
    processes.barrier("jaxdp: run dir open")  # made for the owner alone before another process's orbax would create it
    model, optimizer, tracker = _build(config, p)
    run = _Run(config, p, model, optimizer, tracker, Checkpointer(p.workdir / CHECKPOINT_DIR), _Throughput(), verbose)
    start, rows, tracker = _restore_or_evaluate(run)
    run = dataclasses.replace(run, tracker=tracker)
    clock = run.clock
    initial_val_loss = rows[0]["val_loss"]

    sharded = (ShardedTrainer(config, model, optimizer, p.noise_multiplier, p.noise.mechanism)
               if runs_sharded_step(config) else None)
    step_fn = _step_fn(config, p, sharded)
    progress = Progress(config.steps, verbose, accountant=config.accountant if config.dp.enabled else None)
    window_losses, last_row, stop_reason = [], rows[-1], None
    saved, in_flight = (start or None), _InFlight(start)
    metrics_f = open(p.workdir / METRICS_FILE, "a") if hosts.writes_run_dir() else open(os.devnull, "w")
    step = start
    try:
        for step in range(start, config.steps):
            if tracker is not None and not tracker.can_step():
                stop_reason = _budget_stop_reason(run, step)
                break
            window_losses.append(_logical_step(run, step, step_fn))
            n = step + 1
            in_flight.dispatched(n, window_losses[-1][0])
            if sharded is not None and (n % config.log_every == 0 or n == config.steps
                                        or n == interrupt_after):
                sharded.sync()  # the host-side model / optimizer used by eval and checkpoints
            if n % config.log_every == 0 or n == config.steps:
                last_row = _log_row(run, n, window_losses, metrics_f)
                rows.append(last_row)
                window_losses = []
            if n % config.checkpoint_every == 0 and n != config.steps:
                t_save = time.perf_counter()
                run.checkpointer.save(n, model, optimizer, _meta(run, n))
                clock.pause_since(t_save)
                saved = n
            # every step: the last finished step (values as last logged)
            progress.update(in_flight.done(), last_row, clock.tokens_per_s or None, saved=saved)
            if interrupt_after is not None and n >= interrupt_after:
                progress.update(in_flight.finish(), last_row, clock.tokens_per_s or None, saved=saved)
                progress.close()
                return {"interrupted_at": n}
        else:
            step = config.steps
    finally:
        metrics_f.close()
    clock.finish(model)
    if sharded is not None:
        sharded.sync()  # the loop may stop between log boundaries (budget): eval, save and samples see the last step
    progress.update(in_flight.finish(), last_row, clock.tokens_per_s or None, saved=saved)
    progress.close()
    last = step if stop_reason else config.steps
    if stop_reason:
        log(stop_reason, verbose)
    _evaluate_and_save_final(run, rows, last)
    summary = _summary(run, rows, last, stop_reason, initial_val_loss)
    if hosts.writes_run_dir():
        _write_outputs(run, rows, summary, last)
    processes.barrier("jaxdp: outputs written")  # every process returns once the run's files are there
    return summary


class _InFlight:
    """The steps dispatched to the device whose results may not be ready yet. `dispatched` waits for the
    step before the new one, so the host runs at most one step ahead (and the device always has the next
    step queued); `done` is the last step whose losses, outputs of the same programs as its update, are
    ready."""

    def __init__(self, start: int):
        self._done, self._pending = start, []  # [(step, its micro-batches' losses)]

    def dispatched(self, step: int, losses) -> None:
        self._pending.append((step, losses))
        while len(self._pending) > 1:
            self._done, older = self._pending.pop(0)
            jax.block_until_ready(older)

    def finish(self) -> int:
        """Waits for every dispatched step; the last one."""
        for self._done, losses in self._pending:
            jax.block_until_ready(losses)
        self._pending = []
        return self._done

    def done(self) -> int:
        while self._pending and all(x.is_ready() for x in self._pending[0][1]):
            self._done = self._pending.pop(0)[0]
        return self._done


@dataclasses.dataclass
class _Throughput:
    """Training tokens/s: the steps after the first (compiling) one, over their wall time less the pauses
    (accounting, evaluation and checkpoints are not training time)."""
    tokens: int = 0  # tokens of the timed steps of this process
    t_first: float | None = None  # when the first step finished
    t_paused: float = 0.0
    tokens_per_s: float = 0.0  # as last measured, over this process and the runs before a resume
    earlier_tokens: int = 0  # timed tokens and seconds of the processes before a resume (checkpoint meta)
    earlier_seconds: float = 0.0
    _seconds: float = 0.0  # this process's timed seconds, as last measured

    def measure(self, now: float) -> None:
        self._seconds = max(now - self.t_first - self.t_paused, 0.0)
        self._rate()

    def totals(self) -> dict:
        """Timed tokens and seconds of every process of this run so far (kept in the checkpoint meta)."""
        return {"tokens": self.earlier_tokens + self.tokens, "seconds": self.earlier_seconds + self._seconds}

    def resume(self, totals: dict | None) -> None:
        """Continues the totals of the processes before a resume (the rate is theirs until this one measures)."""
        if totals:
            self.earlier_tokens, self.earlier_seconds = int(totals["tokens"]), float(totals["seconds"])
            self._rate()

    def _rate(self) -> None:
        total = self.totals()
        self.tokens_per_s = total["tokens"] / max(total["seconds"], 1e-9) if total["tokens"] else 0.0

    def pause_since(self, t: float) -> None:
        self.t_paused += time.perf_counter() - t

    def finish(self, model) -> None:
        """The final rate, once the steps dispatched since the last logged one are done."""
        if self.tokens:
            jax.block_until_ready(nnx.state(model))
            self.measure(time.perf_counter())


@dataclasses.dataclass(frozen=True)
class _Run:
    """What the loop's steps share: the config, what `prepare` resolved from it, the model and its optimizer,
    the privacy accountant (None: non-DP), the checkpoints, the throughput clock and whether to report."""
    config: Any
    p: Prepared
    model: nnx.Module
    optimizer: nnx.Optimizer
    tracker: BudgetTracker | None
    checkpointer: Checkpointer
    clock: _Throughput
    verbose: bool


def _open_run_dir(p: Prepared, verbose: bool) -> None:
    """The run directory with the run's config, tokenizer and token-cache record, and its checkpoints/
    directory."""
    workdir = p.workdir
    # Created for the owner alone: its metrics, samples and a trained tokenizer are private
    # until the user shares what privacy.json says may be shared. The checkpoints hold the run's root seed
    # (noise, sampling): the owner's alone even in a workdir that existed before.
    workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (workdir / CHECKPOINT_DIR).mkdir(mode=0o700, exist_ok=True)
    (workdir / CHECKPOINT_DIR).chmod(0o700)
    (workdir / CONFIG_FILE).write_text(json.dumps(p.config_json, indent=2, sort_keys=True) + "\n")
    if not (workdir / TOKENIZER_DIR / "tokenizer.json").is_file():
        p.tokenizer.save(workdir / TOKENIZER_DIR)
    files = record_token_cache(workdir, (p.train, p.valid))
    used = [f for f in files if pathlib.Path(f["path"]).is_file()]
    log(f"token cache: {len(used)} files, {sum(f['bytes'] for f in used) / 1e6:.1f} MB in "
        f"{os.path.commonpath([f['path'] for f in used])}, named in {workdir / TOKEN_CACHE_FILE}: they hold the private "
        f"text's tokens (python -m experiments.delete_token_cache --workdir={workdir} deletes them)", verbose)


def _build(config, p: Prepared):
    """(model, optimizer, privacy accountant or None for non-DP), each from its own seed."""
    init_seed = p.derive_seed(seeds.INIT)
    model = p.build_model(init_seed) if p.build_model is not None else build_model(p.model_config, init_seed)
    optimizer = make_optimizer(config, model, noise_multiplier=p.noise_multiplier,
                               expected_batch_size=config.batch_size,
                               noise_key=noise_lib.noise_key_from_seed(p.derive_seed(seeds.NOISE)),
                               accumulation_steps=p.accumulation_steps, mechanism=p.noise.mechanism)
    tracker = None
    if config.dp.enabled:  # DP-SGD: q over the steps; BandMF: q_b over ceil(steps / b) rounds; BLT: its prefix
        tracker = BudgetTracker.of(p.accounting(), p.noise_multiplier, p.delta_mechanism,
                                   target_epsilon=config.dp.target_epsilon,
                                   accountant=config.accountant,
                                   value_discretization_interval=p.pld_interval, prefix=p.accounting)
    return model, optimizer, tracker


def _restore_or_evaluate(run: _Run):
    """(first step, metrics rows up to it, accountant): the latest checkpoint restored into the model and
    optimizer, or the untrained model evaluated as step 0; `metrics.jsonl` rewritten to those rows."""
    config, p, tracker = run.config, run.p, run.tracker
    start = run.checkpointer.latest_step() or 0
    rows = read_metrics(p.workdir)
    if start:
        meta = run.checkpointer.restore(start, run.model, run.optimizer)
        run.clock.resume(meta.get("throughput"))
        if tracker is not None:
            tracker = tracker.restored(meta["accountant"])
        log(f"resuming {p.workdir} from the checkpoint at step {start}", run.verbose)
    rows = [r for r in rows if r["step"] <= start]
    if start == 0:
        with Ticker(f"step 0: evaluating the untrained model on {len(p.eval_indices)} validation windows",
                    run.verbose) as t:
            val_loss = evaluate(run.model, p.valid, p.eval_indices, config.eval_batch_size, p.loss_fn)
            t.set(f": validation loss {val_loss:.4f}")
        rows = [{"step": 0, "train_loss": None, "epsilon": 0.0 if config.dp.enabled else None,
                 "val_loss": val_loss}]
    processes.barrier("jaxdp: metrics read")  # every process read metrics.jsonl before process 0 replaces it
    if hosts.writes_run_dir():
        write_metrics(p.workdir, rows)
    return start, rows, tracker


def _step_fn(config, p: Prepared, sharded):
    """(model, optimizer, micro-batch) -> loss sum: the jitted single-device step, or the sharded trainer's."""
    if sharded is None:
        return make_train_step(config.dp.enabled, p.loss_fn,
                               per_example="reference" if config.dp.strategy == "reference" else "jaxdp",
                               windows_per_unit=config.privacy.windows_per_unit)
    return lambda model, optimizer, batch: sharded(batch)


def _budget_stop_reason(run: _Run, step: int) -> str:
    p = run.p
    return (f"privacy budget: stopping before step {step + 1}, which would spend "
            f"epsilon > target_epsilon = {run.config.dp.target_epsilon:g} at delta = "
            f"{p.delta:.3g} ({p.delta_mechanism:.3g} for the mechanism + the sampling "
            f"slack; the budget allows {run.tracker.max_steps} steps)")


def _logical_step(run: _Run, step: int, step_fn):
    """One logical step: the Poisson sample of `step`, its micro-batches, the accountant's step.

    Returns (the micro-batches' losses as device scalars, the windows sampled). The first
    step of the process compiles: it is timed alone and starts the throughput clock.
    """
    config, p, clock = run.config, run.p, run.clock
    dp, k = config.dp.enabled, p.accumulation_steps
    k_unit = config.privacy.windows_per_unit  # windows per sampled unit (1: the unit is a window)
    indices, mask = p.sample(step)
    if config.privacy.unit != "window":  # units -> k_unit window slots each, a unit per block
        stream = sampling.KeyStream(p.derive_seed(seeds.UNIT_WINDOWS, step))
        indices, mask = p.train.units_to_windows(indices, mask, k_unit, stream)
    tokens = p.train.get(indices)
    count = int(mask.sum())  # windows
    mb = p.sampler.max_batch_size // k * k_unit  # windows per micro-batch: whole units
    first = clock.t_first is None
    compiling = CompileTicker(f"compiling and running the first {'DP' if dp else 'non-DP'} step (micro-batch {mb} "
                       f"windows, {k} per step)", run.verbose) if first else contextlib.nullcontext()
    with compiling:
        micro_losses = []  # device scalars: no host sync per micro-batch
        for j in range(k):
            batch = {"tokens": tokens[j * mb:(j + 1) * mb], "mask": mask[j * mb:(j + 1) * mb]}
            if not dp:
                batch["divisor"] = np.float32(max(count, 1))
            micro_losses.append(step_fn(run.model, run.optimizer, batch))
        if first:
            jax.block_until_ready(micro_losses)
    if run.tracker is not None:
        run.tracker.step()
    if first:
        clock.t_first = time.perf_counter()  # after the first (compiling) step
    else:
        clock.tokens += count * config.seq_len
    return micro_losses, count


def _log_row(run: _Run, n: int, window_losses, metrics_f) -> dict:
    """The metrics row of step `n` (train loss over the steps since the last row; validation loss every
    eval_every steps), appended to `metrics_f`; its time counted as a pause."""
    config, p, tracker, clock = run.config, run.p, run.tracker, run.clock
    train_loss = float(np.mean([sum(float(x) for x in losses) / max(c, 1)
                                for losses, c in window_losses]))  # syncs
    t_log = time.perf_counter()
    clock.measure(t_log)
    eps = tracker.epsilon() if tracker is not None else None
    row = {"step": n, "train_loss": train_loss, "epsilon": eps}
    if n % config.eval_every == 0 or n == config.steps:
        row["val_loss"] = evaluate(run.model, p.valid, p.eval_indices, config.eval_batch_size, p.loss_fn)
    metrics_f.write(json.dumps(row) + "\n")
    metrics_f.flush()
    clock.pause_since(t_log)
    return row


def _evaluate_and_save_final(run: _Run, rows, last: int):
    """The final state evaluated (budget stop, or a run that was already complete) and checkpointed at
    step `last`, unless it already is."""
    p, tracker, checkpointer = run.p, run.tracker, run.checkpointer
    if not rows or rows[-1]["step"] != last or "val_loss" not in rows[-1]:
        row = rows[-1] if rows and rows[-1]["step"] == last else {
            "step": last, "train_loss": None,
            "epsilon": tracker.epsilon() if tracker is not None else None}
        row["val_loss"] = evaluate(run.model, p.valid, p.eval_indices, run.config.eval_batch_size, p.loss_fn)
        if not rows or rows[-1] is not row:
            rows.append(row)
        if hosts.writes_run_dir():
            write_metrics(p.workdir, rows)
    if checkpointer.latest_step() != last:
        checkpointer.save(last, run.model, run.optimizer, _meta(run, last))
    checkpointer.close()


def _summary(run: _Run, rows, last: int, stop_reason, initial_val_loss) -> dict:
    """The run's summary.json: losses, the privacy guarantee and how it was sampled, model and throughput."""
    config, p, tracker = run.config, run.p, run.tracker
    dp, k, sampler = config.dp.enabled, p.accumulation_steps, p.sampler
    final = rows[-1]
    train_losses = [r["train_loss"] for r in rows if r.get("train_loss") is not None]
    final_train = train_losses[-1] if train_losses else None
    previous = read_json(p.workdir / SUMMARY_FILE)
    return {
        "steps": last,
        "stop_reason": stop_reason,
        "train_loss": final_train,
        "train_perplexity": math.exp(final_train) if final_train is not None else None,
        "val_loss": final["val_loss"],
        "val_perplexity": math.exp(final["val_loss"]),
        "initial_val_loss": initial_val_loss,
        "dp": dp,
        "epsilon": tracker.epsilon() if tracker is not None else math.inf,
        # a DP run pinned to a seed below 2^64 has no guarantee (privacy.json's "NONE as run")
        "seed_guessable": bool(dp and p.seed_guessable),
        "accountant": config.accountant if dp else None,
        "pld_interval": p.pld_interval if dp and config.accountant == "pld" else None,
        "delta": p.delta,  # the guarantee: (epsilon, delta), delta = delta_mechanism + sampling_slack
        "delta_from": p.delta_from,
        "delta_mechanism": p.delta_mechanism,
        "sampling_slack": p.sampling_slack,
        "overflow_probability": sampler.overflow_probability,
        "noise_multiplier": p.noise_multiplier if dp else None,
        "sampling_probability": sampler.sampling_probability,
        "expected_batch_size": config.batch_size,
        "max_batch_size": sampler.max_batch_size,
        "accumulation_steps": k,
        "micro_batch_size": sampler.max_batch_size // k,  # units; windows: x windows_per_unit
        "max_batch_size_from": p.max_batch_size_from,
        "num_train_windows": p.train.num_windows,
        "privacy_unit": config.privacy.unit,
        "num_train_units": p.num_units,  # N: windows, documents or users
        "num_units_bound": config.privacy.num_units_bound,  # None: q, sigma, max batch and delta follow from N
        "windows_per_unit": config.privacy.windows_per_unit,
        "model": config.model.family,
        "num_params": sum(x.size for x in jax.tree.leaves(nnx.state(run.model, nnx.Param))),
        "tokenizer": p.tokenizer.name,
        "vocab_size": p.tokenizer.vocab_size,
        "tokens_per_s": run.clock.tokens_per_s or (previous or {}).get("tokens_per_s"),  # every process of the run
        "overflowed_steps_this_process": sampler.overflow_count,
    }


def _write_outputs(run: _Run, rows, summary: dict, last: int) -> None:
    """The privacy receipt, the plots, the model, the samples and, last (it marks a finished run: a rerun
    then rewrites nothing), the summary, in the run directory."""
    config, p, model = run.config, run.p, run.model
    dp, workdir = config.dp.enabled, p.workdir
    write_privacy_receipt(workdir, privacy_receipt(config, p, steps=last, epsilon=summary["epsilon"] if dp else None,
                                                   overflowed_steps=p.sampler.overflow_count))
    write_plots(workdir, rows, target_epsilon=config.dp.target_epsilon if dp else None,
                accountant=config.accountant if dp else None)
    write_model(workdir / MODEL_DIR, model)
    if config.sample.num > 0:
        write_samples(model, p, config)
    write_text_atomic(workdir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")


def _meta(run: _Run, step: int) -> dict:
    """The checkpoint's JSON: the private part of the run directory, the only place of the root seed."""
    p, tracker = run.p, run.tracker
    return {"step": step, "accountant": tracker.state_dict() if tracker is not None else None,
            "root_seed": p.root_seed, "seed_pinned": p.seed_pinned, "mechanism": mechanism(p),
            "throughput": run.clock.totals()}


def _finished_summary(config, p: Prepared) -> dict | None:
    """The summary of the run in the workdir if it has finished (summary.json, written last, is at the latest
    checkpoint's step and that step is config.steps or a budget stop), else None. Reads only."""
    summary = read_json(p.workdir / SUMMARY_FILE)
    if summary is None or not (p.workdir / CHECKPOINT_DIR).is_dir():
        return None
    checkpointer = Checkpointer(p.workdir / CHECKPOINT_DIR)
    try:
        latest = checkpointer.latest_step()
    finally:
        checkpointer.close()
    if latest is None or summary.get("steps") != latest:
        return None
    return summary if latest == config.steps or summary.get("stop_reason") else None
