"""DP (and non-DP) language-model pretraining: the tested logic behind `experiments/pretrain_gpt2.py`.

`train(config)` runs one training job described by an ml_collections config
(see `experiments/configs/default.py` for every field):

  1. `prepare(config)` validates every value, loads the corpus, builds the
     tokenizer and the token windows (the DP records), calibrates sigma and
     checks any existing run directory, all BEFORE anything is written to the
     workdir; a bad value raises `ConfigError` with a one-line message.
  2. The loop: Poisson sampling on the host (`jaxdp.sampling`; the draw of step
     s depends only on (seed, s)), one jitted step per micro-batch
     (`per_example_grads` -> `fused_clip` -> adamw inside `nnx.Optimizer`, or
     the plain mean-loss gradient when `dp.enabled=False`), the privacy
     accountant (`jaxdp.accounting.BudgetTracker`), which stops training
     BEFORE the step that would exceed `dp.target_epsilon`.
     With `mesh.data * mesh.seq > 1` the DP step is `jaxdp.sharding.ShardedDPStep`
     on a (data, seq) mesh (ZeRO stage `mesh.zero_stage`, context parallel
     when `mesh.seq > 1`), equal to the single-device step up to summation
     order; `maybe_initialize_distributed()` joins several hosts.
  3. The run directory: `config.json`, `metrics.jsonl`, `tokenizer/`, orbax
     checkpoints under `checkpoints/` (parameters, optimizer state with the
     noise PRNG key, accountant state, step; the latest is kept),
     `summary.json`, plots and `samples.txt`.

Resume: rerunning with the same config restores the latest checkpoint and
drops the `metrics.jsonl` lines after it, so an interrupted-and-resumed run
writes exactly the metrics of an uninterrupted one (steps, hence epsilon, are
restored, never counted twice). A different config in the same workdir is an
error, not a silent mix.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdp import accounting
from jaxdp import data as data_lib
from jaxdp import norms as norms_lib
from jaxdp import reference
from jaxdp.fused_clip import fused_clip
from jaxdp.models.gpt2 import GPT2, GPT2Config
from jaxdp.per_example import per_example_grads
from jaxdp.models.remat import REMAT_POLICIES
from jaxdp.sampling import OVERFLOW_MODES, PoissonSampler

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
SAMPLES_FILE = "samples.txt"
TOKENIZER_DIR = "tokenizer"
CHECKPOINT_DIR = "checkpoints"


class ConfigError(ValueError):
    """A bad config value or input; the message is one line naming the problem."""


# ------------------------------------------------------------------ model and loss


def lm_losses(model: nnx.Module, batch) -> jax.Array:
    """Per-example mean next-token NLL (B,), exactly 0 for masked (padding) examples."""
    tokens_BT1 = batch["tokens"]
    logits_BTV = model(tokens_BT1[:, :-1])
    nll_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, tokens_BT1[:, 1:])
    return jnp.where(batch["mask"], nll_BT.mean(axis=-1), 0.0)


def cp_lm_losses(model: nnx.Module, batch) -> jax.Array:
    """`lm_losses` on {"inputs", "targets", "mask"}; also correct on a sequence shard (context parallel)."""
    from jaxdp.sharding import context
    logits_BTV = model(batch["inputs"])
    nll_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, batch["targets"])
    return jnp.where(batch["mask"], context.sequence_mean(nll_BT), 0.0)


def maybe_initialize_distributed() -> bool:
    """`jax.distributed.initialize()` when JAX_COORDINATOR_ADDRESS is set (multi-host runs).

    Every host runs the same command with JAX_COORDINATOR_ADDRESS=<host0>:<port>,
    JAX_NUM_PROCESSES=<hosts> and JAX_PROCESS_ID=<0..hosts-1> (read by JAX
    itself). Returns whether it initialized.
    """
    if not os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return False
    jax.distributed.initialize()
    return True


def mesh_size(config) -> int:
    return config.mesh.data * config.mesh.seq


class _ShardedTrainer:
    """The DP step on a (data, seq) mesh (`jaxdp.sharding.ShardedDPStep`) behind the loop's step interface.

    The model and the `nnx.Optimizer` (the chain fused_clip -> adamw) stay the
    host-side record used for evaluation and checkpoints; `sync()` writes the
    sharded state back into them (parameters, adamw state, the noise key of
    fused_clip's state, the step count), `load()` reads it from them (after a
    restore). The noise key and adamw see the same values as in the
    single-device step, so the run equals it up to summation order.
    """

    def __init__(self, config, model, optimizer, noise_multiplier: float):
        from jaxdp import sharding
        self.model, self.optimizer = model, optimizer
        mesh = sharding.make_mesh(config.mesh.data, config.mesh.seq)
        dp = config.dp
        inner = _make_tx(1, config.learning_rate, config.min_lr_ratio, config.warmup_steps, config.steps,
                         config.b1, config.b2, config.weight_decay, False, dp.l2_norm_clip,
                         float(noise_multiplier), float(config.batch_size), config.seed + 1,
                         dp.clipping, dp.clip_fn, dp.strategy)
        self.step = sharding.ShardedDPStep(
            cp_lm_losses, inner, mesh, l2_norm_clip=dp.l2_norm_clip, noise_multiplier=float(noise_multiplier),
            expected_batch_size=float(config.batch_size), seed=config.seed + 1,
            zero_stage=config.mesh.zero_stage, clipping=dp.clipping, clip_fn=dp.clip_fn, strategy=dp.strategy)
        self.load()

    def _adam_variables(self):
        """The adamw state's Variables in the nnx.Optimizer, in the leaf order of the sharded opt_state."""
        return jax.tree.leaves(self.optimizer.opt_state[1], is_leaf=lambda v: isinstance(v, nnx.Variable))

    def load(self):
        state = self.step.init(self.model)
        values = [v.get_value() for v in self._adam_variables()]
        opt_state = jax.tree.unflatten(jax.tree.structure(state.opt_state), values)
        noise_key = self.optimizer.opt_state[0].noise_key.get_value()
        self.state = jax.device_put(state._replace(opt_state=opt_state, noise_key=noise_key),
                                    self.step.state_shardings)

    def sync(self):
        state = jax.device_get(self.state)
        self.step.update_model(self.model, state)
        variables, values = self._adam_variables(), jax.tree.leaves(state.opt_state)
        assert len(variables) == len(values)
        for var, value in zip(variables, values):
            var.set_value(jnp.asarray(value))
        self.optimizer.opt_state[0].noise_key.set_value(state.noise_key)

    def __call__(self, batch) -> float:
        tokens = batch["tokens"]
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": batch["mask"]}
        self.state, out = self.step(self.state, batch)
        self.optimizer.step.set_value(self.optimizer.step.get_value() + 1)
        return float(out["losses"].sum())


def model_config(config, vocab_size: int) -> GPT2Config:
    m = config.model
    return GPT2Config(vocab_size=vocab_size, seq_len=m.max_seq_len, n_layer=m.n_layer,
                      n_head=m.n_head, d_model=m.d_model, mlp_ratio=m.mlp_ratio,
                      dtype=config.dtype, remat=config.remat)


def make_optimizer(config, model: nnx.Module, *, noise_multiplier: float,
                   expected_batch_size: float) -> nnx.Optimizer:
    """adamw (wrapped in MultiSteps when accumulating), behind `fused_clip` when DP is on."""
    dp = config.dp
    tx = _make_tx(config.accumulation_steps, config.learning_rate, config.min_lr_ratio,
                  config.warmup_steps, config.steps, config.b1, config.b2, config.weight_decay,
                  dp.enabled, dp.l2_norm_clip, float(noise_multiplier), float(expected_batch_size),
                  config.seed + 1, dp.clipping, dp.clip_fn,
                  "auto" if dp.strategy == "reference" else dp.strategy)
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


# Cached: the transformation is stateless, and reusing the same object keeps the
# optimizer's static graph equal, so the jitted step is not recompiled per run.
@functools.lru_cache(maxsize=64)
def _make_tx(k, learning_rate, min_lr_ratio, warmup_steps, steps, b1, b2, weight_decay,
             dp_enabled, l2_norm_clip, noise_multiplier, expected_batch_size, seed, clipping,
             clip_fn, strategy) -> optax.GradientTransformation:
    warmup = min(warmup_steps, max(steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, warmup, max(steps, warmup + 1), end_value=learning_rate * min_lr_ratio)
    adamw = optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay)
    inner = optax.MultiSteps(adamw, k, use_grad_mean=False).gradient_transformation() if k > 1 else adamw
    if not dp_enabled:
        return inner
    return optax.chain(
        fused_clip(l2_norm_clip, noise_multiplier, expected_batch_size=expected_batch_size,
                   seed=seed, clipping=clipping, clip_fn=clip_fn, strategy=strategy,
                   accumulation_steps=k),
        inner)


def _reference_grads_fn(loss_fn):
    """Per-example gradients by jax.vmap(jax.grad), as plain (B, ...) arrays in the params' tree."""
    def grads_fn(model, batch):
        losses, dense = reference.per_example_grads(loss_fn, model, batch)
        flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
        return losses, nnx.from_flat_state([(p, var.replace(dense[tuple(p)])) for p, var in flat])
    return grads_fn


@functools.lru_cache(maxsize=None)  # one jitted step per (dp, loss_fn): runs in one process share compiles
def make_train_step(dp: bool, loss_fn=lm_losses, per_example: str = "jaxdp") -> Callable:
    """`step(model, optimizer, batch) -> sum of the batch's per-example losses` (one micro-batch).

    DP: per-example gradients -> fused_clip (clip, sum, noise once per logical
    batch, divide by the expected batch size) -> adamw. `per_example="reference"`
    computes the per-example gradients by `jax.vmap(jax.grad)` instead (the
    explicit baseline; same clipping, noise and optimizer). Non-DP: the gradient
    of `sum(losses) / batch["divisor"]` (the realised size of the logical
    batch, so micro-batch gradients add up to the batch mean).
    """
    if dp:
        grads_fn = per_example_grads(loss_fn) if per_example == "jaxdp" else _reference_grads_fn(loss_fn)

        @nnx.jit
        def dp_step(model, optimizer, batch):
            losses, grads = grads_fn(model, batch)
            optimizer.update(model, grads)
            return losses.sum()
        return dp_step

    @nnx.jit
    def step(model, optimizer, batch):
        def mean_loss(model):
            total = loss_fn(model, batch).sum()
            return total / batch["divisor"], total
        grads, total = nnx.grad(mean_loss, has_aux=True)(model)
        optimizer.update(model, grads)
        return total
    return step


@nnx.jit
def _eval_sum(model, batch):
    return lm_losses(model, batch).sum()


def evaluate(model: nnx.Module, windows: data_lib.TokenWindows, indices: np.ndarray,
             batch_size: int) -> float:
    """Mean next-token NLL over `windows[indices]` (fixed-shape, masked batches)."""
    total = 0.0
    for start in range(0, len(indices), batch_size):
        idx = indices[start:start + batch_size]
        mask = np.zeros(batch_size, bool)
        mask[:len(idx)] = True
        padded = np.zeros(batch_size, np.int64)
        padded[:len(idx)] = idx
        total += float(_eval_sum(model, {"tokens": windows.get(padded), "mask": mask}))
    return total / len(indices)


def generate(model: nnx.Module, prompt: list[int], num_tokens: int, *, seed: int = 0,
             temperature: float = 1.0, top_k: int | None = 40) -> list[int]:
    """Samples `num_tokens` continuation ids of `prompt` (a fixed-shape window of the model's length)."""
    T = model.config.seq_len
    ids = list(prompt)[-(T - 1):] if len(prompt) >= T else list(prompt)
    key = jax.random.key(seed)
    out = []
    for _ in range(num_tokens):
        window = ids[-T:]
        buf = np.zeros((1, T), np.int32)
        buf[0, :len(window)] = window
        key, sub = jax.random.split(key)
        nxt = int(_next_token(model, buf, len(window) - 1, sub, temperature, top_k))
        ids.append(nxt)
        out.append(nxt)
    return out


@nnx.jit(static_argnums=(4, 5))
def _next_token(model, buf_1T, pos, key, temperature, top_k):
    logits_V = model(buf_1T)[0, pos]
    if temperature <= 0:
        return jnp.argmax(logits_V)
    logits_V = logits_V / temperature
    if top_k is not None and top_k < logits_V.shape[0]:
        kth = jax.lax.top_k(logits_V, top_k)[0][-1]
        logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
    return jax.random.categorical(key, logits_V)


# ------------------------------------------------------------------ config validation


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate_config(config) -> None:
    """Range checks of every numeric / enum field; raises ConfigError naming the first bad one."""
    def positive_int(name, value):
        _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                 f"config.{name} must be an integer >= 1, got {value!r}")

    for name in ("steps", "checkpoint_every", "log_every", "eval_every", "eval_windows",
                 "eval_batch_size", "batch_size", "accumulation_steps", "seq_len",
                 "model.n_layer", "model.n_head", "model.d_model", "model.max_seq_len",
                 "model.mlp_ratio"):
        positive_int(name, _get(config, name))
    _require(isinstance(config.seed, int) and 0 <= config.seed < 2**31,
             f"config.seed must be an integer in [0, 2**31), got {config.seed!r}")
    _require(config.checkpoint_every % config.log_every == 0,
             f"config.checkpoint_every ({config.checkpoint_every}) must be a multiple of "
             f"config.log_every ({config.log_every})")
    _require(config.seq_len <= config.model.max_seq_len,
             f"config.seq_len ({config.seq_len}) is longer than the model's maximum sequence "
             f"length config.model.max_seq_len ({config.model.max_seq_len})")
    _require(config.model.d_model % config.model.n_head == 0,
             f"config.model.d_model ({config.model.d_model}) must be divisible by "
             f"config.model.n_head ({config.model.n_head})")
    _require(config.learning_rate > 0 and math.isfinite(config.learning_rate),
             f"config.learning_rate must be > 0, got {config.learning_rate!r}")
    _require(0 <= config.min_lr_ratio <= 1, f"config.min_lr_ratio must be in [0, 1], got {config.min_lr_ratio!r}")
    _require(isinstance(config.warmup_steps, int) and config.warmup_steps >= 0,
             f"config.warmup_steps must be an integer >= 0, got {config.warmup_steps!r}")
    _require(config.weight_decay >= 0, f"config.weight_decay must be >= 0, got {config.weight_decay!r}")
    for name in ("b1", "b2"):
        _require(0 <= _get(config, name) < 1, f"config.{name} must be in [0, 1), got {_get(config, name)!r}")
    _require(config.remat in REMAT_POLICIES or isinstance(config.remat, bool),
             f"config.remat must be one of {REMAT_POLICIES}, got {config.remat!r}")
    for name in ("mesh.data", "mesh.seq"):
        positive_int(name, _get(config, name))
    _require(config.mesh.zero_stage in (0, 1, 2, 3),
             f"config.mesh.zero_stage must be 0, 1, 2 or 3, got {config.mesh.zero_stage!r}")
    if mesh_size(config) > 1:
        _require(mesh_size(config) <= jax.device_count(),
                 f"config.mesh.data * config.mesh.seq = {mesh_size(config)} exceeds the "
                 f"{jax.device_count()} devices available")
        _require(config.dp.enabled and config.dp.strategy != "reference",
                 "a mesh of more than one device runs the DP step (dp.enabled=True, dp.strategy != 'reference')")
        _require(config.accumulation_steps == 1,
                 "a mesh of more than one device needs config.accumulation_steps == 1")
        _require(config.seq_len % config.mesh.seq == 0,
                 f"config.seq_len ({config.seq_len}) must be divisible by config.mesh.seq ({config.mesh.seq})")
    _require(config.dtype in ("float32", "bfloat16"),
             f"config.dtype must be 'float32' or 'bfloat16', got {config.dtype!r}")
    _require(config.accountant in accounting.ACCOUNTANTS,
             f"config.accountant must be one of {accounting.ACCOUNTANTS}, got {config.accountant!r}")
    _require(0 < config.data.validation_fraction < 1,
             f"config.data.validation_fraction must be in (0, 1), got {config.data.validation_fraction!r}")
    _require(isinstance(config.workdir, str) and config.workdir.strip() != "",
             "config.workdir must be a non-empty path")
    mb = config.max_batch_size
    _require(mb is None or (isinstance(mb, int) and mb >= config.accumulation_steps),
             f"config.max_batch_size must be None or an integer >= accumulation_steps, got {mb!r}")
    dp = config.dp
    _require(dp.l2_norm_clip > 0 and math.isfinite(dp.l2_norm_clip),
             f"config.dp.l2_norm_clip must be > 0, got {dp.l2_norm_clip!r}")
    _require(dp.clipping in ("flat", "per_layer"),
             f"config.dp.clipping must be 'flat' or 'per_layer', got {dp.clipping!r}")
    _require(dp.clip_fn in ("abadi", "automatic"),
             f"config.dp.clip_fn must be 'abadi' or 'automatic', got {dp.clip_fn!r}")
    strategies = norms_lib.STRATEGIES + ("reference",)
    _require(dp.strategy in strategies,
             f"config.dp.strategy must be one of {strategies}, got {dp.strategy!r}")
    _require(dp.overflow in OVERFLOW_MODES,
             f"config.dp.overflow must be one of {OVERFLOW_MODES}, got {dp.overflow!r}")
    if dp.enabled:
        _require(dp.target_epsilon is not None and dp.target_epsilon > 0 and math.isfinite(dp.target_epsilon),
                 f"config.dp.target_epsilon must be a finite number > 0, got {dp.target_epsilon!r}")
        _require(dp.noise_multiplier is None or (dp.noise_multiplier > 0 and math.isfinite(dp.noise_multiplier)),
                 f"config.dp.noise_multiplier must be None (calibrate) or > 0, got {dp.noise_multiplier!r}")
        _require(dp.delta is None or 0 < dp.delta < 1,
                 f"config.dp.delta must be None (1/N) or in (0, 1), got {dp.delta!r}")


def _get(config, dotted: str):
    for part in dotted.split("."):
        config = config[part]
    return config


# ------------------------------------------------------------------ preparation (no writes)


@dataclasses.dataclass
class Prepared:
    config: Any
    config_json: dict
    workdir: pathlib.Path
    tokenizer: data_lib.Tokenizer
    train: data_lib.TokenWindows
    valid: data_lib.TokenWindows
    model_config: GPT2Config
    sampler: PoissonSampler
    noise_multiplier: float
    delta: float | None
    eval_indices: np.ndarray


def _config_json(config) -> dict:
    return json.loads(config.to_json_best_effort(sort_keys=True))


def prepare(config, *, progress: Callable | None = None) -> Prepared:
    """Validates the config and builds data, tokenizer, sampler and sigma; writes nothing to the workdir."""
    validate_config(config)
    workdir = pathlib.Path(config.workdir)
    cfg_json = _config_json(config)
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"config.workdir {workdir} exists and is not a directory")
    try:
        docs = data_lib.load_documents(config.data.path)
    except ValueError as e:
        raise ConfigError(f"config.data.path: {e}") from None
    saved = workdir / CONFIG_FILE
    if saved.is_file():
        old = json.loads(saved.read_text())
        diff = sorted(k for k in set(_flat(old)) | set(_flat(cfg_json))
                      if _flat(old).get(k) != _flat(cfg_json).get(k))
        if diff:
            raise ConfigError(
                f"workdir {workdir} holds a run with a different config (differs in: "
                f"{', '.join(diff[:5])}); pass a new --config.workdir to start another run")
    tok_dir = workdir / TOKENIZER_DIR
    try:
        if (tok_dir / "tokenizer.json").is_file():
            tokenizer = data_lib.Tokenizer.load(tok_dir)
        else:
            tokenizer = data_lib.make_tokenizer(config.data.tokenizer, docs)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"config.data.tokenizer: {e}") from None
    kw = dict(validation_fraction=config.data.validation_fraction, seed=config.seed,
              cache_dir=config.data.cache_dir, progress=progress)
    try:
        train = data_lib.TokenWindows(docs, tokenizer, config.seq_len, split="train", **kw)
        valid = data_lib.TokenWindows(docs, tokenizer, config.seq_len, split="validation", **kw)
    except ValueError as e:
        raise ConfigError(f"config.data: {e}") from None
    n = train.num_windows
    _require(config.batch_size <= n,
             f"config.batch_size ({config.batch_size}) exceeds the {n} training windows of the corpus")
    k = config.accumulation_steps
    try:
        sampler = PoissonSampler(n, config.batch_size, max_batch_size=config.max_batch_size,
                                 seed=config.seed, overflow=config.dp.overflow)
    except ValueError as e:
        raise ConfigError(f"sampler: {e}") from None
    if sampler.max_batch_size % k:  # room for k equal micro-batches
        sampler.max_batch_size += k - sampler.max_batch_size % k
    data = config.mesh.data if mesh_size(config) > 1 else 1
    if sampler.max_batch_size % data:  # equal shards over the `data` axis
        sampler.max_batch_size += data - sampler.max_batch_size % data
    delta, sigma = None, 0.0
    if config.dp.enabled:
        delta = config.dp.delta if config.dp.delta is not None else 1.0 / n
        if config.dp.noise_multiplier is not None:
            sigma = float(config.dp.noise_multiplier)
        else:
            sigma = accounting.calibrate_noise_multiplier(
                config.dp.target_epsilon, sampler.sampling_probability, config.steps, delta,
                accountant=config.accountant)
    m = valid.num_windows
    eval_indices = np.unique(np.linspace(0, m - 1, min(m, config.eval_windows)).astype(np.int64))
    return Prepared(config, cfg_json, workdir, tokenizer, train, valid,
                    model_config(config, tokenizer.vocab_size), sampler, sigma, delta, eval_indices)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ------------------------------------------------------------------ checkpoints


def _to_saveable(leaf):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(leaf))
    return np.asarray(leaf)


class Checkpointer:
    """Orbax checkpoints of (model, optimizer) state plus a JSON of host state; the latest is kept."""

    def __init__(self, directory: pathlib.Path):
        import orbax.checkpoint as ocp
        self._ocp = ocp
        self._manager = ocp.CheckpointManager(
            directory.absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True,
                                                 enable_async_checkpointing=False),
            item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, model, optimizer, meta: dict) -> None:
        ocp = self._ocp
        leaves = [_to_saveable(x) for x in jax.tree.leaves(nnx.state((model, optimizer)))]
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"leaves": leaves}), meta=ocp.args.JsonSave(meta)), force=True)
        self._manager.wait_until_finished()

    def restore(self, step: int, model, optimizer) -> dict:
        ocp = self._ocp
        state = nnx.state((model, optimizer))
        leaves, treedef = jax.tree.flatten(state)
        target = {"leaves": [_to_saveable(x) for x in leaves]}
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        new = []
        for old, value in zip(leaves, restored["state"]["leaves"]):
            if jax.dtypes.issubdtype(old.dtype, jax.dtypes.prng_key):
                new.append(jax.random.wrap_key_data(jnp.asarray(value), impl=jax.random.key_impl(old)))
            else:
                new.append(jnp.asarray(value, dtype=old.dtype))
        nnx.update((model, optimizer), jax.tree.unflatten(treedef, new))
        return dict(restored["meta"])

    def close(self):
        self._manager.close()


# ------------------------------------------------------------------ metrics


def read_metrics(workdir) -> list[dict]:
    path = pathlib.Path(workdir) / METRICS_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by a kill: everything after it is dropped too
    return rows


def _write_metrics(workdir: pathlib.Path, rows: list[dict]) -> None:
    tmp = workdir / (METRICS_FILE + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, workdir / METRICS_FILE)


def write_plots(workdir, rows: list[dict]) -> list[str]:
    """loss.png (train / validation loss) and epsilon.png against step; [] without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    workdir = pathlib.Path(workdir)
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    tr = [(r["step"], r["train_loss"]) for r in rows if r.get("train_loss") is not None]
    va = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if tr:
        ax.plot(*zip(*tr), label="train")
    if va:
        ax.plot(*zip(*va), marker="o", label="validation")
    ax.set_xlabel("step"); ax.set_ylabel("loss (nats / token)"); ax.legend(); ax.grid(alpha=0.3)
    fig.tight_layout(); fig.savefig(workdir / "loss.png", dpi=100); plt.close(fig)
    written.append("loss.png")
    eps = [(r["step"], r["epsilon"]) for r in rows if r.get("epsilon") is not None]
    if eps:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(*zip(*eps))
        ax.set_xlabel("step"); ax.set_ylabel("epsilon spent"); ax.grid(alpha=0.3)
        fig.tight_layout(); fig.savefig(workdir / "epsilon.png", dpi=100); plt.close(fig)
        written.append("epsilon.png")
    return written


# ------------------------------------------------------------------ training


class _Progress:
    """One stderr line updated in place."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled

    def update(self, step, loss, tokens_per_s, eps):
        if not self.enabled:
            return
        width = 24
        done = int(width * step / max(self.total, 1))
        eps_s = "inf" if eps is None else f"{eps:.3f}"
        print(f"\r[{'#' * done}{'.' * (width - done)}] step {step}/{self.total} "
              f"loss {loss:.4f} tok/s {tokens_per_s:,.0f} eps {eps_s}   ",
              end="", file=sys.stderr, flush=True)

    def close(self):
        if self.enabled:
            print(file=sys.stderr, flush=True)


def _log(msg: str, enabled: bool = True) -> None:
    if enabled:
        print(msg, file=sys.stderr, flush=True)


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
    p = prepared or prepare(config, progress=data_lib.stderr_progress if verbose else None)
    workdir = p.workdir
    # ---- from here on the workdir is written
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / CONFIG_FILE).write_text(json.dumps(p.config_json, indent=2, sort_keys=True) + "\n")
    if not (workdir / TOKENIZER_DIR / "tokenizer.json").is_file():
        p.tokenizer.save(workdir / TOKENIZER_DIR)

    dp = config.dp.enabled
    k = config.accumulation_steps
    sampler = p.sampler
    q = sampler.sampling_probability
    model = GPT2(p.model_config, rngs=nnx.Rngs(config.seed))
    optimizer = make_optimizer(config, model, noise_multiplier=p.noise_multiplier,
                               expected_batch_size=config.batch_size)
    tracker = None
    if dp:
        tracker = accounting.BudgetTracker(p.noise_multiplier, q, p.delta,
                                           target_epsilon=config.dp.target_epsilon,
                                           accountant=config.accountant)
    checkpointer = Checkpointer(workdir / CHECKPOINT_DIR)
    start = checkpointer.latest_step() or 0
    rows = read_metrics(workdir)
    if start:
        meta = checkpointer.restore(start, model, optimizer)
        if tracker is not None:
            tracker = accounting.BudgetTracker.from_state_dict(meta["accountant"])
        _log(f"resuming {workdir} from the checkpoint at step {start}", verbose)
    rows = [r for r in rows if r["step"] <= start]
    if start == 0:
        rows = [{"step": 0, "train_loss": None, "epsilon": 0.0 if dp else None,
                 "val_loss": evaluate(model, p.valid, p.eval_indices, config.eval_batch_size)}]
    _write_metrics(workdir, rows)
    initial_val_loss = rows[0]["val_loss"]

    sharded = _ShardedTrainer(config, model, optimizer, p.noise_multiplier) if mesh_size(config) > 1 else None
    if sharded is None:
        step_fn = make_train_step(dp, per_example="reference" if config.dp.strategy == "reference" else "jaxdp")
    else:
        step_fn = lambda model, optimizer, batch: sharded(batch)
    progress = _Progress(config.steps, verbose)
    tokens_done, t_first, window_losses = 0, None, []
    stop_reason = None
    metrics_f = open(workdir / METRICS_FILE, "a")
    step = start
    try:
        for step in range(start, config.steps):
            if tracker is not None and not tracker.can_step():
                stop_reason = (f"privacy budget: stopping before step {step + 1}, which would spend "
                               f"epsilon > target_epsilon = {config.dp.target_epsilon:g} at delta = "
                               f"{p.delta:.3g} (the budget allows {tracker.max_steps} steps)")
                break
            indices, mask = sampler.sample(step)
            tokens = p.train.get(indices)
            count = int(mask.sum())
            loss_sum = 0.0
            mb = sampler.max_batch_size // k
            for j in range(k):
                batch = {"tokens": tokens[j * mb:(j + 1) * mb], "mask": mask[j * mb:(j + 1) * mb]}
                if not dp:
                    batch["divisor"] = np.float32(max(count, 1))
                loss_sum += float(step_fn(model, optimizer, batch))
            if tracker is not None:
                tracker.step()
            n = step + 1
            window_losses.append(loss_sum / max(count, 1))
            if t_first is None:
                t_first = time.perf_counter()  # after the first (compiling) step
            else:
                tokens_done += count * config.seq_len
            tps = tokens_done / max(time.perf_counter() - t_first, 1e-9)
            if sharded is not None and (n % config.log_every == 0 or n == config.steps
                                        or n == interrupt_after):
                sharded.sync()  # the host-side model / optimizer used by eval and checkpoints
            if n % config.log_every == 0 or n == config.steps:
                eps = tracker.epsilon() if tracker is not None else None
                row = {"step": n, "train_loss": float(np.mean(window_losses)), "epsilon": eps}
                window_losses = []
                if n % config.eval_every == 0 or n == config.steps:
                    row["val_loss"] = evaluate(model, p.valid, p.eval_indices, config.eval_batch_size)
                rows.append(row)
                metrics_f.write(json.dumps(row) + "\n")
                metrics_f.flush()
                progress.update(n, row["train_loss"], tps, eps)
            if n % config.checkpoint_every == 0 and n != config.steps:
                checkpointer.save(n, model, optimizer, _meta(n, tracker))
            if interrupt_after is not None and n >= interrupt_after:
                progress.close()
                return {"interrupted_at": n}
        else:
            step = config.steps
    finally:
        metrics_f.close()
    progress.close()
    last = step if stop_reason else config.steps
    if stop_reason:
        _log(stop_reason, verbose)
        window_losses = []
    if not rows or rows[-1]["step"] != last or "val_loss" not in rows[-1]:
        # the final state, evaluated (budget stop, or a run that was already complete)
        row = rows[-1] if rows and rows[-1]["step"] == last else {
            "step": last, "train_loss": None,
            "epsilon": tracker.epsilon() if tracker is not None else None}
        row["val_loss"] = evaluate(model, p.valid, p.eval_indices, config.eval_batch_size)
        if not rows or rows[-1] is not row:
            rows.append(row)
        _write_metrics(workdir, rows)
    if checkpointer.latest_step() != last:
        checkpointer.save(last, model, optimizer, _meta(last, tracker))
    checkpointer.close()

    final = rows[-1]
    train_losses = [r["train_loss"] for r in rows if r.get("train_loss") is not None]
    final_train = train_losses[-1] if train_losses else None
    previous = _read_json(workdir / SUMMARY_FILE)
    summary = {
        "steps": last,
        "stop_reason": stop_reason,
        "train_loss": final_train,
        "train_perplexity": math.exp(final_train) if final_train is not None else None,
        "val_loss": final["val_loss"],
        "val_perplexity": math.exp(final["val_loss"]),
        "initial_val_loss": initial_val_loss,
        "dp": dp,
        "epsilon": tracker.epsilon() if tracker is not None else math.inf,
        "delta": p.delta,
        "noise_multiplier": p.noise_multiplier if dp else None,
        "sampling_probability": q,
        "expected_batch_size": config.batch_size,
        "max_batch_size": sampler.max_batch_size,
        "num_train_windows": p.train.num_windows,
        "num_params": sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
        "tokenizer": p.tokenizer.name,
        "vocab_size": p.tokenizer.vocab_size,
        "tokens_per_s": tps if tokens_done else (previous or {}).get("tokens_per_s"),
        "overflowed_steps_this_process": sampler.overflow_count,
    }
    (workdir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    write_plots(workdir, rows)
    if config.num_samples > 0:
        write_samples(model, p, config)
    return summary


def _read_json(path):
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return None


def _meta(step: int, tracker) -> dict:
    return {"step": step, "accountant": tracker.state_dict() if tracker is not None else None}


def write_samples(model, p: Prepared, config) -> None:
    """`samples.txt`: continuations of prompts cut from validation windows."""
    prompt_len = max(1, min(config.seq_len // 2, 32))
    parts = []
    picks = np.linspace(0, p.valid.num_windows - 1, config.num_samples).astype(np.int64)
    for i, w in enumerate(picks):
        prompt = p.valid.get(np.array([w]))[0, :prompt_len].tolist()
        cont = generate(model, prompt, config.sample_tokens, seed=config.seed + i)
        parts.append(f"=== sample {i + 1} (validation window {int(w)}) ===\n"
                     f"[prompt] {p.tokenizer.decode(prompt)}\n"
                     f"[continuation] {p.tokenizer.decode(cont)}\n")
    (p.workdir / SAMPLES_FILE).write_text("\n".join(parts))


def load_for_generation(workdir) -> tuple[GPT2, data_lib.Tokenizer, dict]:
    """(model with the latest checkpoint's parameters, tokenizer, config json) of a run directory."""
    workdir = pathlib.Path(workdir)
    if not (workdir / CONFIG_FILE).is_file():
        raise ConfigError(f"{workdir} is not a run directory (no {CONFIG_FILE})")
    cfg = json.loads((workdir / CONFIG_FILE).read_text())
    tokenizer = data_lib.Tokenizer.load(workdir / TOKENIZER_DIR)
    m = cfg["model"]
    mc = GPT2Config(vocab_size=tokenizer.vocab_size, seq_len=m["max_seq_len"], n_layer=m["n_layer"],
                    n_head=m["n_head"], d_model=m["d_model"], mlp_ratio=m["mlp_ratio"],
                    dtype=cfg["dtype"], remat=False)
    model = GPT2(mc, rngs=nnx.Rngs(0))
    checkpointer = Checkpointer(workdir / CHECKPOINT_DIR)
    step = checkpointer.latest_step()
    if step is None:
        raise ConfigError(f"{workdir} has no checkpoint yet")
    import orbax.checkpoint as ocp
    # Restore only the parameters: the first leaves of (model, optimizer) state are the model's.
    model_leaves, treedef = jax.tree.flatten(nnx.state(model))
    meta_args = ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore())
    restored = checkpointer._manager.restore(step, args=meta_args)
    saved = restored["state"]["leaves"]
    new = [jnp.asarray(v, dtype=o.dtype) for o, v in zip(model_leaves, saved[:len(model_leaves)])]
    nnx.update(model, jax.tree.unflatten(treedef, new))
    checkpointer.close()
    return model, tokenizer, cfg
