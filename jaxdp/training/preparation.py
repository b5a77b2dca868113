"""Preparing a run: `prepare(config)` builds what the loop needs (`Prepared`: data, tokenizer, sampler, sigma, seed).

Nothing here writes to the run directory: `prepare(config)` checks every value
(`jaxdp.training.config.validate_config`) and every input (corpus, tokenizer,
an existing run's config) first, so a bad value raises `ConfigError` with a
one-line message and leaves the workdir as it was. It also sizes the Poisson
sampler's padded batch, calibrates sigma and, with `config.memory_budget_gb`,
plans the micro-batches (`plan_accumulation`).

Secret randomness (`jaxdp.noise.draws`). Every random choice of a run derives from
one root seed through its own domain: the sampler's seed is
`derive_seed(root, SAMPLER)`, the noise key `key_from_seed(derive_seed(root,
NOISE))`, the model's initialisation `derive_seed(root, INIT)`, sample i of
samples.txt `derive_seed(root, SAMPLES, i)` (`Prepared.derive_seed`). The
root is `config.seed` when set (it then reproduces the run bit for bit, and
the guarantee assumes it is secret), else 128 bits of OS entropy. It is kept
only in the checkpoints' meta (the private part of the run directory), and a
resume reads it from there: `config.json` records only whether it was pinned.
A run killed before its first checkpoint starts again with a fresh root
(nothing covered by the guarantee was released).

What a resume continues (`mechanism`). Every checkpoint's meta also keeps the
mechanism the run's accountant counts: the run-defining config, the training
data's key (SHA-256 of the corpus, ids, tokenizer and split), N, q, the padded
batch, sigma, delta and its split. A resume must reproduce it from the config
and the data on disk now, or `prepare` refuses (`ConfigError` naming each field
that changed), and then runs on the kept floats, so the steps after a resume are
the mechanism the restored accountant counts. With `config.dp.mechanism` other than "dpsgd" the kept
mechanism also names the noise mechanism (`jaxdp.training.noise_choice`), its bands, the group's sampling
probability and the strategy's coefficients, which a resume runs on as kept. A directory whose run finished
(`model/`, `summary.json`, `privacy.json` or `samples.txt`) but lost its checkpoints is refused: a new run
there would spend the data's budget again under the same receipt.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxdp.accounting import accountant as accounting
from jaxdp.accounting import calibration
from jaxdp.accounting import mechanisms as mech_accounting
from jaxdp.core.losses import lm_losses
from jaxdp.data import windows as data_lib
from jaxdp.models.gpt2 import GPT2Config
from jaxdp.models.llama import LlamaConfig
from jaxdp.noise import seeds
from jaxdp.noise.mechanisms import BLT
from jaxdp.sampling.poisson import (
    DEFAULT_MAX_OVERFLOW_PROBABILITY,
    DEFAULT_SLACK_FRACTION,
    PoissonSampler,
    max_batch_size_for_delta,
    overflow_slack,
)
from jaxdp.sharding import processes
from jaxdp.training import init_weights, noise_choice, steps
from jaxdp.training.config import (
    ConfigError,
    _require,
    build_model,
    model_config,
    runs_sharded_step,
    validate_config,
)
from jaxdp.training.receipt import PRIVACY_FILE
from jaxdp.training.run_dir import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    MODEL_DIR,
    SAMPLES_FILE,
    SUMMARY_FILE,
    TOKENIZER_DIR,
    Ticker,
    latest_checkpoint_meta,
)

# ------------------------------------------------------------------ preparation (no writes)


@dataclasses.dataclass
class Prepared:
    config: Any
    config_json: dict
    workdir: pathlib.Path
    tokenizer: data_lib.Tokenizer
    train: data_lib.TokenWindows
    valid: data_lib.TokenWindows
    model_config: GPT2Config | LlamaConfig
    sampler: PoissonSampler            # over N units, or over config.privacy.num_units_bound (`sample`)
    accumulation_steps: int            # micro-batches per logical batch (config's, or planned for memory_budget_gb)
    noise_multiplier: float
    eval_indices: np.ndarray
    root_seed: int = dataclasses.field(repr=False)  # secret: kept only in checkpoints
    seed_pinned: bool
    # The guarantee (DP only; None without): (epsilon, delta) with delta = delta_mechanism + sampling_slack.
    delta: float | None                # the run's total delta (config.dp.delta, or default_delta(N))
    delta_mechanism: float | None      # the accountant's delta (sigma calibration, budget stop)
    pld_interval: float                # the PLD accountant's grid spacing (`accounting.pld_interval`)
    sampling_slack: float | None       # (1 + e^target_epsilon) * steps * sampler.overflow_probability
    delta_from: str | None             # how delta was chosen
    max_batch_size_from: str           # how sampler.max_batch_size was chosen
    # The model the loop trains, `build_model(seed)`; None: `build_model(model_config, seed)`, a fresh
    # one. Fine-tuning (`jaxdp.training.finetune_job`) sets it: pretrained weights, then `jaxdp.finetune.methods.prepare`.
    build_model: Callable[[int], nnx.Module] | None = dataclasses.field(default=None, repr=False)
    # The per-window loss the step and the validation loss use (`jaxdp.core.losses`); fine-tuning may count the
    # label only (`completion_losses`). Single-device step only: the sharded step uses `cp_lm_losses`.
    loss_fn: Callable = dataclasses.field(default=lm_losses, repr=False)
    # Fine-tuning: SHA-256 of the init weights (`jaxdp.training.init_weights.init_sha256`), so that a resume on other
    # init weights under the same path is refused; None when pretraining.
    init_key: str | None = None
    num_units: int = 0                 # N: the training units (windows, documents or users)
    # The noise mechanism (config.dp.mechanism / bands): DP-SGD, or BandMF with its coefficients; the sampler
    # is then cyclic Poisson over its bands (`jaxdp.training.noise_choice`).
    noise: noise_choice.NoiseChoice = noise_choice.NoiseChoice()

    def sample(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The Poisson sample of `step` (indices, mask), with `config.privacy.num_units_bound` B: drawn over B
        units, of which those >= N do not exist (masked, index 0), so each of the N units is in it with the
        public q = batch_size / B and nothing the run releases (q, sigma, max batch, delta) depends on N."""
        indices, mask = self.sampler.sample(step)
        if self.sampler.num_examples > self.num_units:
            mask = mask & (indices < self.num_units)
            indices = np.where(mask, indices, 0)
        return indices, mask

    @property
    def seed_guessable(self) -> bool:
        """A pinned root seed below 2^64 (`jaxdp.noise.seeds.guessable_seed`): searchable, so a DP run has no guarantee."""
        return self.seed_pinned and seeds.guessable_seed(self.root_seed)

    def accounting(self, steps: int | None = None):
        """What the accountant counts after `steps` steps (default config.steps):
        `jaxdp.accounting.mechanisms.MechanismAccounting` of the run's mechanism and sampler."""
        return self.noise.accounting(self.config.steps if steps is None else steps, self.sampler)

    @property
    def records_noise_mechanism(self) -> bool:
        """Whether the run's files name its noise mechanism: config.dp.mechanism is not the default "dpsgd"
        (a default run's config.json, checkpoints and receipt are those of before the field existed)."""
        return self.config.dp.enabled and self.config.dp.get("mechanism", "dpsgd") != "dpsgd"

    def derive_seed(self, domain: str, *path: str | int) -> int:
        """The seed of one use of randomness (`jaxdp.noise.seeds.derive_seed` of the root)."""
        return seeds.derive_seed(self.root_seed, domain, *path)


def prepare(config, *, progress: Callable | None = None,
            trainable_parameters: Callable[[Any], int] | None = None, windows: Callable | None = None) -> Prepared:
    """Validates the config and builds data, tokenizer, sampler and sigma; writes nothing to the workdir.
    `windows(tokenizer) -> (train, validation)`: the run's windows instead of the corpus of config.data.path
    in `TokenWindows` (the fine-tuning job's instruction data, `jaxdp.data.instructions`); its ValueError is a
    ConfigError on config.data.
    `trainable_parameters(model_config)`: how many parameters the run trains (the noise buffers' size, which
    the planner's memory counts); None: every parameter of the model (pretraining)."""
    validate_config(config)
    workdir = pathlib.Path(config.workdir)
    cfg_json = _without_default_mechanism(json.loads(config.to_json_best_effort(sort_keys=True)))
    cfg_json.pop("compilation_cache_dir", None)  # where this machine keeps compiled programs: not the run's
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"config.workdir {workdir} exists and is not a directory")
    docs = ids = None
    try:
        if windows is None:
            docs, ids = data_lib.load_corpus(config.data.path, id_field=config.data.id_field)
    except ValueError as e:
        raise ConfigError(f"config.data.path: {e}") from None
    meta = latest_checkpoint_meta(workdir / CHECKPOINT_DIR)
    finished = (MODEL_DIR, SUMMARY_FILE, PRIVACY_FILE, SAMPLES_FILE)  # written only when a run ends
    _require(meta is not None or not any((workdir / f).exists() for f in finished),
             f"workdir {workdir} holds a finished run's outputs ({', '.join(finished)}) but no checkpoint: "
             "a new run there would spend the data's privacy budget again under the same receipt; pass a new "
             "--config.workdir")
    # Several hosts: what each read decides whether it draws a fresh secret root (a collective) or resumes
    processes.agree("prepare: config", checkpoint_step=None if meta is None else meta.get("step"),
                    **{f"config.{k}": v for k, v in _flat(cfg_json).items()})
    root_seed, seed_pinned = _root_seed(config, workdir, meta)
    cfg_json["seed"] = PINNED_SEED if seed_pinned else None  # never the seed itself
    init_key = None
    if "finetune" in config:  # where and which init weights, so that generation finds these
        init = pathlib.Path(str(config.finetune.init)).expanduser()
        try:  # the weights, config and tokenizer read from it (stable across copies of the directory)
            init_key = init_weights.init_sha256(init)
        except (OSError, ValueError) as e:
            raise ConfigError(f"config.finetune.init: {e}") from None
        cfg_json["finetune"].update(init=os.path.realpath(init), init_sha256=init_key)
    saved = workdir / CONFIG_FILE
    if saved.is_file():
        old, new = _run_defining(json.loads(saved.read_text())), _run_defining(cfg_json)
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        if diff:
            raise ConfigError(
                f"workdir {workdir} holds a run with a different config (differs in: "
                f"{', '.join(diff[:5])}); pass a new --config.workdir to start another run")
    tok_dir = workdir / TOKENIZER_DIR
    try:
        if (tok_dir / "tokenizer.json").is_file():
            tokenizer = data_lib.Tokenizer.load(tok_dir)
        else:
            spec = config.data.tokenizer
            trains = spec.startswith("bpe") and spec[3:].isdigit()
            shown = progress is not None and trains  # a bpe<N> trains on the corpus: seconds to minutes
            with Ticker(f"training the {spec} tokenizer on {len(docs or ())} documents", shown):
                tokenizer = data_lib.make_tokenizer(spec, docs)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"config.data.tokenizer: {e}") from None
    kw = dict(validation_fraction=config.data.validation_fraction, cache_dir=config.data.cache_dir,
              progress=progress, ids=ids)
    try:
        if windows is not None:
            train, valid = windows(tokenizer)
        else:
            train = data_lib.TokenWindows(docs, tokenizer, config.seq_len, split="train", **kw)
            valid = data_lib.TokenWindows(docs, tokenizer, config.seq_len, split="validation", **kw)
    except ValueError as e:
        raise ConfigError(f"config.data: {e}") from None
    unit = config.privacy.unit
    n = train.num_windows if unit == "window" else train.num_units  # N: the privacy units sampled
    bound = config.privacy.num_units_bound
    _require(bound is None or n <= bound,
             f"config.privacy.num_units_bound ({bound}) must be at least the N = {n} training {unit}s")
    _require(bound is None or (bound < 2**62 and config.batch_size / bound >= accounting.MIN_SAMPLING_PROBABILITY),
             f"config.privacy.num_units_bound ({bound}) is too large: q = batch_size / bound must be >= "
             f"{accounting.MIN_SAMPLING_PROBABILITY:g} (the accountants' float64 precision) and the bound < 2^62")
    population = n if bound is None else bound  # what q, delta and the max batch are computed from
    _require(config.batch_size <= population,
             f"config.batch_size ({config.batch_size}) exceeds the {population} training {unit}s" +
             (" of the corpus" if bound is None else " of config.privacy.num_units_bound"))
    dp = config.dp
    max_batch_size = config.max_batch_size
    max_batch_size_from = "config.max_batch_size"
    delta = delta_from = None
    if dp.enabled:
        delta, delta_from = ((dp.delta, "config.dp.delta") if dp.delta is not None else
                             (accounting.default_delta(population),
                              "default: min(10^-(number of digits of N + 1), 1e-5)" if bound is None else
                              "default: min(10^-(number of digits of num_units_bound + 1), 1e-5)"))
        _require(delta < 1 / population,
                 f"config.dp.delta ({delta:g}) must be below 1/N = {1 / population:.3g} (N = {population} training "
                 f"{unit}s{'' if bound is None else ', num_units_bound'}): a mechanism that publishes one random "
                 f"{unit} in the clear meets a delta of 1/N; leave it unset for min(10^-(digits of N + 1), 1e-5)")
        # The accountant runs at delta - slack: the slack may take at most delta / 10.
        smallest = _round_batch(config, max_batch_size_for_delta(
            population, config.batch_size, config.steps, dp.target_epsilon, delta))
        if max_batch_size is None:
            max_batch_size = smallest
            max_batch_size_from = f"sized: sampling slack <= {_SLACK_BOUND}"
    elif max_batch_size is None:
        max_batch_size_from = f"overflow probability < {DEFAULT_MAX_OVERFLOW_PROBABILITY:g} per step"
    try:
        sampler = PoissonSampler(population, config.batch_size, max_batch_size=max_batch_size,
                                 seed=seeds.derive_seed(root_seed, seeds.SAMPLER), overflow=dp.overflow)
    except ValueError as e:
        raise ConfigError(f"sampler: {e}") from None
    k = config.accumulation_steps
    if config.memory_budget_gb is not None:
        k = plan_accumulation(config, sampler.max_batch_size, tokenizer.vocab_size, progress=progress)
    sampler.max_batch_size = _round_batch(config, sampler.max_batch_size, k)
    delta_mechanism = slack = None
    noise = noise_choice.NoiseChoice()
    sigma, pld_interval = 0.0, accounting.DEFAULT_VALUE_DISCRETIZATION_INTERVAL
    if dp.enabled:
        slack = overflow_slack(dp.target_epsilon, config.steps, sampler.overflow_probability)
        if sampler.max_batch_size < smallest:
            accepted = smallest  # the smallest value that _round_batch takes to `smallest` or above
            while accepted > 1 and _round_batch(config, accepted - 1) >= smallest:
                accepted -= 1
            raise ConfigError(
                f"config.max_batch_size = {config.max_batch_size} overflows with probability "
                f"{sampler.overflow_probability:.2g} per step: the sampling slack (1 + e^{dp.target_epsilon:g}) * "
                f"{config.steps} * {sampler.overflow_probability:.2g} = {slack:.2g} exceeds {_SLACK_BOUND} "
                f"= {delta * DEFAULT_SLACK_FRACTION:.2g}; the smallest max_batch_size accepted is {accepted} "
                "(None sizes it)")
        delta_mechanism = delta - slack
        noise = noise_choice.choose(config, population, delta_mechanism,
                                    functools.partial(_trainable_parameters, config, tokenizer.vocab_size,
                                                      trainable_parameters))
        try:
            sampler = noise.sampler(sampler)  # BandMF, BLT: cyclic Poisson over its groups, same overflow probability
        except ValueError as e:
            raise ConfigError(f"sampler: {e}") from None
        rounds, q = noise.accounting(config.steps, sampler).rounds_and_probability()  # BLT: one release, q = 1
        sigma, pld_interval = _noise_multiplier(config, q, rounds, delta_mechanism)
        if dp.noise_multiplier is not None and dp.target_epsilon is not None:  # else a run that cannot take one step
            first = mech_accounting.epsilon_for(noise.accounting(1, sampler), sigma, delta_mechanism,
                                                accountant=config.accountant, value_discretization_interval=pld_interval)
            _require(first <= dp.target_epsilon,
                     f"config.dp.noise_multiplier = {sigma:g} spends epsilon {first:.4g} in the first step, above "
                     f"config.dp.target_epsilon = {dp.target_epsilon:g}: the run could not take one step; raise "
                     "noise_multiplier, or leave it None to calibrate it to the target")
    m = valid.num_windows
    eval_indices = np.unique(np.linspace(0, m - 1, min(m, config.eval_windows)).astype(np.int64))
    mc = model_config(config.model, tokenizer.vocab_size, dtype=config.dtype, remat=config.remat)
    p = Prepared(config=config, config_json=cfg_json, workdir=workdir, tokenizer=tokenizer, train=train,
                 valid=valid, model_config=mc, sampler=sampler, accumulation_steps=k, noise_multiplier=sigma,
                 pld_interval=pld_interval,
                 eval_indices=eval_indices, root_seed=root_seed, seed_pinned=seed_pinned, delta=delta,
                 delta_mechanism=delta_mechanism, sampling_slack=slack, delta_from=delta_from,
                 max_batch_size_from=max_batch_size_from, init_key=init_key, num_units=n, noise=noise)
    # ... and what each computed from it: sigma, q, the batches (library versions, JAX flags, token caches)
    processes.agree("prepare: run", root_seed=p.derive_seed("hosts agree"), mechanism=mechanism(p),
                    train_windows=train.content_arrays(), validation_windows=valid.content_arrays(),
                    libraries=_library_versions(), jax_flags={k: str(jax.config.values.get(k)) for k in _JAX_FLAGS})
    return p if meta is None else _continued(p, meta)


# JAX flags that change what a program computes: several processes must agree on them
_JAX_FLAGS = ("jax_default_prng_impl", "jax_enable_x64", "jax_default_matmul_precision", "jax_threefry_partitionable",
              "jax_enable_custom_prng")


def _library_versions() -> dict:
    """The installed versions of what computes sigma, the batches and the step (several processes agree on them)."""
    from importlib import metadata
    versions = {}
    for name in ("jaxdp", "jax", "jaxlib", "numpy", "scipy", "dp-accounting", "optax", "flax", "orbax-checkpoint"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


# The floats computed from the inputs (calibration, tail sums): a resume runs on the checkpoint's.
_DERIVED = ("noise_multiplier", "delta_mechanism", "sampling_slack", "pld_interval")


def mechanism(p: Prepared) -> dict:
    """What the run's guarantee rests on, as JSON: kept in every checkpoint's meta and checked on resume."""
    return {**{f"config.{k}": v for k, v in _run_defining(p.config_json).items()},
            "train_data": p.train.data_key, "num_units": p.num_units,
            "sampling_probability": p.sampler.sampling_probability, "max_batch_size": p.sampler.max_batch_size,
            "delta": p.delta, **{k: getattr(p, k) for k in _DERIVED},
            **({} if p.init_key is None else {"init_weights": p.init_key}),
            **(_noise_mechanism(p) if p.records_noise_mechanism else {})}


def _trainable_parameters(config, vocab_size: int, count: Callable[[Any], int] | None) -> int:
    """The parameters the run trains, counted on shapes (`count(model_config)`, default all of the model's)."""
    mc = model_config(config.model, vocab_size, dtype=config.dtype, remat=config.remat)
    if count is not None:
        return count(mc)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: build_model(mc, 0)),
                                                                        nnx.Param)))


def _noise_mechanism(p: Prepared) -> dict:
    """The noise mechanism's part of `mechanism(p)` (a run with config.dp.mechanism other than "dpsgd")."""
    run, noise = p.accounting(), p.noise
    kept = {"noise_mechanism": noise.kind, "bands": noise.bands,
            "group_sampling_probability": run.sampling_probability if noise.kind == "bandmf" else None,
            "strategy_coefs": list(noise.coefs)}
    if noise.kind == "blt":  # its strategy (the optimiser's output, kept as it ran) and the run's sensitivity
        kept.update(groups=noise.groups, group_sampling_probability=run.sampling_probability,
                    blt_buf_decay=list(noise.blt.buf_decay), blt_output_scale=list(noise.blt.output_scale),
                    strategy_sensitivity=noise.blt.sensitivity)
    return kept


def _without_default_mechanism(cfg_json: dict) -> dict:
    """`cfg_json` without config.dp.mechanism = "dpsgd" and config.dp.bands = None, the defaults: a DP-SGD run's
    config.json and checkpoints are those it wrote before the fields existed, and such runs still resume."""
    dp = cfg_json.get("dp") or {}
    if dp.get("mechanism", "dpsgd") == "dpsgd" and not dp.get("bands"):
        dp.pop("mechanism", None)
        dp.pop("bands", None)
    if dp.get("mechanism", "dpsgd") in ("dpsgd", "bandmf"):  # BLT's buffers: read by "blt" and "auto" only
        dp.pop("blt_buffers", None)
    if dp.get("noise_buffer_gb", 0) is None:  # the default: no limit
        dp.pop("noise_buffer_gb", None)
    return cfg_json


def _continued(p: Prepared, meta: dict) -> Prepared:
    """`p` resuming the run of checkpoint `meta`: refused unless it reproduces the kept mechanism, then
    with the kept floats (within 1e-9 of the fresh ones), which the restored accountant counts."""
    kept = meta.get("mechanism")
    _require(kept is not None, f"the checkpoint in {p.workdir} keeps no mechanism (written before resumes were "
                               "checked); pass a new --config.workdir to start another run")
    now = mechanism(p)
    diff = [k for k in sorted(set(kept) | set(now)) if not _same(kept.get(k), now.get(k))]
    if kept.get("noise_mechanism") == now.get("noise_mechanism") == "blt":
        # jax_privacy's BLT optimiser can differ in its last digits between machines and XLA flags; sigma does
        # not depend on the strategy (one Gaussian release), so the run continues on the kept strategy and
        # sensitivity, which its buffers, its noise and its accountant then all use.
        diff = [k for k in diff if k not in _BLT_STRATEGY]
    if "init_weights" in diff and kept.get("init_weights") and now.get("init_weights") and init_weights.matches(
            kept["init_weights"], p.config.finetune.init, exclude=p.workdir):  # a run recorded the whole directory
        diff.remove("init_weights")
    if "init_weights" in diff:
        raise ConfigError(
            f"workdir {p.workdir} holds a run that trained from other init weights: the files under "
            f"config.finetune.init ({p.config.finetune.init}) are not those of its checkpoint (a file added, "
            "removed or changed; or a checkpoint written before init weights were checked); restore them, or "
            "pass a new --config.workdir")
    if diff:
        changes = "; ".join(f"{k}: {_short(kept.get(k))} -> {_short(now.get(k))}" for k in diff[:6])
        raise ConfigError(
            f"workdir {p.workdir} holds a run whose accountant counted another mechanism than this config and "
            f"data give now ({changes}{'; ...' if len(diff) > 6 else ''}): resuming would account the new "
            "steps as the old mechanism; restore the config and the data, or pass a new --config.workdir")
    p = dataclasses.replace(p, **{k: kept[k] for k in _DERIVED})
    if "strategy_coefs" in kept:  # the coefficients the buffers were built with
        p = dataclasses.replace(p, noise=dataclasses.replace(p.noise, coefs=tuple(kept["strategy_coefs"])))
    if "blt_buf_decay" in kept:  # BLT's strategy and sensitivity as the run began (within 1e-9 of the fresh ones)
        blt = BLT(tuple(kept["blt_buf_decay"]), tuple(kept["blt_output_scale"]), kept["strategy_sensitivity"])
        p = dataclasses.replace(p, noise=dataclasses.replace(p.noise, blt=blt))
    return p


_BLT_STRATEGY = ("blt_buf_decay", "blt_output_scale", "strategy_sensitivity")


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-9 * max(abs(a), abs(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _noise_multiplier(config, q: float, rounds: int, delta: float) -> tuple[float, float]:
    """(sigma: config.dp.noise_multiplier, else calibrated to dp.target_epsilon; the PLD grid spacing
    the run accounts with: `accounting.pld_interval` at that sigma, unused by RDP), for the Poisson-subsampled
    Gaussian at `q` over `rounds` compositions (DP-SGD: q and config.steps; BandMF: q_b and ceil(steps / b),
    as `jaxdp.accounting.mechanisms.calibrate_for`)."""
    fixed = config.dp.noise_multiplier

    def calibrate(interval):
        return calibration.calibrate_noise_multiplier(config.dp.target_epsilon, q, rounds, delta,
                                                     accountant=config.accountant,
                                                     value_discretization_interval=interval)
    if config.accountant == "rdp":
        interval = accounting.DEFAULT_VALUE_DISCRETIZATION_INTERVAL
        return float(fixed) if fixed is not None else calibrate(interval), interval
    sigma = float(fixed) if fixed is not None else calibrate(1e-2)  # cheap; then at the spacing it needs
    interval = accounting.pld_interval(sigma, q, rounds, delta)
    return (sigma if fixed is not None else calibrate(interval)), interval


_SLACK_BOUND = f"delta / {1 / DEFAULT_SLACK_FRACTION:g}"  # the share of delta overflow may take, in words


def _round_batch(config, max_batch_size: int, k: int | None = None) -> int:
    """`max_batch_size` rounded up to k (default config.accumulation_steps) equal micro-batches, then to
    equal shards over the `data` axis."""
    max_batch_size += -max_batch_size % (k or config.accumulation_steps)
    return max_batch_size + -max_batch_size % (config.mesh.data if runs_sharded_step(config) else 1)


def plan_accumulation(config, max_batch_size: int, vocab_size: int, *, progress: Callable | None = None) -> int:
    """The fewest micro-batches per logical batch whose compiled step fits config.memory_budget_gb.

    Tries config.accumulation_steps; if that does not fit, micro-batch 1 (one compile, so that a budget
    nothing fits fails at once), then twice as many micro-batches, ... (micro-batch
    ceil(max_batch_size / k)) until the single-device step's compiled bytes (`memory_analysis()`:
    arguments + outputs + temporaries - aliased) fit the budget. The logical batch, hence the
    guarantee, is unchanged: noise is still added once per logical batch. Compiles on shapes only; a BandMF
    run's compiled step holds its buffers (`noise_choice.planned_mechanism`).
    """
    budget = config.memory_budget_gb * 2**30
    mc = model_config(config.model, vocab_size, dtype=config.dtype, remat=config.remat)
    model = nnx.eval_shape(lambda: build_model(mc, 0))

    def fits(k):
        micro = -(-max_batch_size // k)
        nbytes = steps.compiled_step_bytes(config, model, micro, k, noise_choice.planned_mechanism(config))
        ok = nbytes <= budget
        if progress is not None or not ok:
            print(f"micro-batch {micro} (accumulation {k}): compiled step {nbytes / 2**30:.2f} GiB "
                  f"{'<=' if ok else '>'} config.memory_budget_gb = {config.memory_budget_gb:g}",
                  file=sys.stderr, flush=True)
        _require(ok or micro > 1, f"even micro-batch 1 needs {nbytes / 2**30:.2f} GiB > config.memory_budget_gb"
                                  f" = {config.memory_budget_gb:g}: raise it, or use remat / a mesh")
        return ok

    k = config.accumulation_steps
    if fits(k):
        return k
    fits(max_batch_size)  # micro-batch 1: one compile to fail fast where nothing fits
    while not fits(2 * k):
        k *= 2
    return 2 * k


PINNED_SEED = "pinned (kept in the checkpoint)"  # config.json's `seed` when config.seed was set


def _root_seed(config, workdir: pathlib.Path, meta: dict | None) -> tuple[int, bool]:
    """(the run's root seed, whether it was pinned): the latest checkpoint's (`meta`), else config.seed, else
    fresh."""
    if meta is not None:
        _require("root_seed" in meta, f"the checkpoint in {workdir} has no root seed (written before seeds were "
                                      "secret); pass a new --config.workdir to start another run")
        _require(config.seed is None or config.seed == meta["root_seed"],
                 f"config.seed differs from the root seed kept in the checkpoint of {workdir}; leave "
                 "config.seed unset to resume that run, or pass a new --config.workdir")
        return int(meta["root_seed"]), bool(meta["seed_pinned"])
    if config.seed is not None:
        return int(config.seed), True
    return seeds.secret_seed(), False  # process 0's on every host


_PATH_FIELDS = ("data.path", "data.cache_dir", "finetune.init")  # compared as resolved paths, not as spelled


def _run_defining(cfg_json: dict) -> dict:
    """The flattened config fields that define a run, for comparing a saved run with a resumed one.

    Not `workdir` (the run directory is the one being resumed however it is spelled: relative,
    absolute, trailing slash), `seed` (checked against the checkpoint by `_root_seed`) nor
    `finetune.init_sha256` (the checkpoint's `init_weights`, with its own message); paths
    resolved, so `corpus.txt` and `./corpus.txt` are the same corpus.
    """
    flat = _flat(cfg_json)
    flat.pop("workdir", None)
    flat.pop("seed", None)
    flat.pop("finetune.init_sha256", None)  # the checkpoint's mechanism checks the init weights (init_weights)
    if not flat.get("model.scan_layers"):  # False is the layout of runs from before the field: the same run
        flat.pop("model.scan_layers", None)
    for key in _PATH_FIELDS:
        path = flat.get(key)
        if isinstance(path, str) and path and os.path.exists(os.path.expanduser(path)):
            flat[key] = os.path.realpath(os.path.expanduser(path))  # a corpus name stays a name
    return flat


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
