"""The job's jitted steps: the LM loss, the optimizer, the DP / non-DP / sharded train step, evaluation.

Every step works on any `jaxdp.models` language model `model(tokens_BT) -> logits_BTV`
(GPT-2 and Llama): the losses see only tokens and logits.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdp.clipping.aggregation import FusedClipState, fused_clip
from jaxdp.clipping.settings import ClipSpec, DPSpec, NormPlan
from jaxdp.core import reference
from jaxdp.core.losses import cp_lm_losses, lm_losses
from jaxdp.core.per_example import per_example_grads
from jaxdp.core.terms import group_examples
from jaxdp.data import windows as data_lib
from jaxdp.noise import draws as noise_lib
from jaxdp.noise.mechanisms import DPSGD
from jaxdp.noise.privatizer import NoiseState
from jaxdp.sharding import processes

# ------------------------------------------------------------------ losses


# ------------------------------------------------------------------ optimizer


@dataclasses.dataclass(frozen=True)
class AdamWPlan:
    """The run's adamw: cosine schedule with warmup, MultiSteps over `accumulation_steps` micro-batches."""
    learning_rate: float
    min_lr_ratio: float
    warmup_steps: int
    steps: int
    b1: float
    b2: float
    weight_decay: float
    accumulation_steps: int = 1

    @classmethod
    def of(cls, config, accumulation_steps: int | None = None) -> AdamWPlan:
        return cls(config.learning_rate, config.min_lr_ratio, config.warmup_steps, config.steps, config.b1,
                   config.b2, config.weight_decay, accumulation_steps or config.accumulation_steps)


def dp_settings(config, noise_multiplier: float, expected_batch_size: float,
                mechanism=DPSGD()) -> tuple[DPSpec, NormPlan]:
    """The run's release (`config.dp` with the calibrated sigma and the noise `mechanism`,
    `jaxdp.training.noise_choice`) and norm plan, as the library takes them."""
    dp = config.dp
    return (DPSpec(dp.l2_norm_clip, float(noise_multiplier), float(expected_batch_size),
                   ClipSpec(dp.clipping, dp.clip_fn), dp.secure_noise, mechanism),
            NormPlan("auto" if dp.strategy == "reference" else dp.strategy))


def _tx_of(config, noise_multiplier: float, expected_batch_size: float, accumulation_steps: int | None,
           mechanism=DPSGD()):
    dp, norms = (dp_settings(config, noise_multiplier, expected_batch_size, mechanism) if config.dp.enabled
                 else (None, NormPlan()))
    return _make_tx(AdamWPlan.of(config, accumulation_steps), dp, norms)


def make_optimizer(config, model: nnx.Module, *, noise_multiplier: float, expected_batch_size: float,
                   noise_key: jax.Array | None, accumulation_steps: int | None = None,
                   mechanism=DPSGD()) -> nnx.Optimizer:
    """adamw (wrapped in MultiSteps when accumulating), behind `fused_clip` when DP is on.

    `noise_key`: the run's noise key (required with DP), written into fused_clip's state.
    `accumulation_steps`: micro-batches per logical batch (default config.accumulation_steps).
    `mechanism`: the noise mechanism (`jaxdp.noise.mechanisms`: DP-SGD, or BandMF, whose buffers are
    optimizer state, zero at the start).
    """
    dp = config.dp
    tx = _tx_of(config, noise_multiplier, expected_batch_size, accumulation_steps, mechanism)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    if dp.enabled:
        if noise_key is None:
            raise ValueError("make_optimizer: DP needs the run's noise_key")
        noise_key_variable(optimizer).set_value(noise_key)
    return optimizer


def _noise_state(optimizer: nnx.Optimizer):
    """`fused_clip`'s noise state in `optimizer`, wherever its chain holds it: the key's Variable (DP-SGD), or
    NoiseState(key's Variable, [buffers' Variables]) (a correlated mechanism)."""
    states = jax.tree.leaves(optimizer.opt_state, is_leaf=lambda x: isinstance(x, FusedClipState))
    found = [s.noise_key for s in states if isinstance(s, FusedClipState)]
    if len(found) != 1:
        raise ValueError(f"expected one fused_clip state in the optimizer, found {len(found)}")
    return found[0]


def noise_key_variable(optimizer: nnx.Optimizer) -> nnx.Variable:
    """The noise key of `fused_clip`'s state in `optimizer`, wherever its chain holds it (the run's secret)."""
    state = _noise_state(optimizer)
    return state.key if isinstance(state, NoiseState) else state


def noise_buffer_variables(optimizer: nnx.Optimizer) -> list[nnx.Variable]:
    """A correlated mechanism's buffers in `fused_clip`'s state (one float32 Variable per parameter leaf, the
    past noise: as secret as the key); [] for DP-SGD. Checkpointed with the rest of the optimizer state."""
    state = _noise_state(optimizer)
    return list(state.buffers) if isinstance(state, NoiseState) else []


# Cached: the transformation is stateless, and reusing the same object keeps the
# optimizer's static graph equal, so the jitted step is not recompiled per run. So
# the run's noise key is not in it: `make_optimizer` writes it into the state. fused_clip's own
# key is a fixed placeholder, overwritten there (drawing a secret one would be a collective on
# several processes, and refused under compiled_step_bytes's eval_shape).
@functools.lru_cache(maxsize=64)
def _make_tx(adamw_plan: AdamWPlan, dp: DPSpec | None, norms: NormPlan = NormPlan()) -> optax.GradientTransformation:
    a, k = adamw_plan, adamw_plan.accumulation_steps
    warmup = min(a.warmup_steps, max(a.steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, a.learning_rate, warmup, max(a.steps, warmup + 1), end_value=a.learning_rate * a.min_lr_ratio)
    adamw = optax.adamw(schedule, b1=a.b1, b2=a.b2, weight_decay=a.weight_decay)
    inner = optax.MultiSteps(adamw, k, use_grad_mean=False).gradient_transformation() if k > 1 else adamw
    if dp is None:
        return inner
    return optax.chain(
        fused_clip(dp.l2_norm_clip, dp.noise_multiplier, expected_batch_size=dp.expected_batch_size,
                   key=noise_lib.noise_key_from_seed(0), accumulation_steps=k, secure_noise=dp.secure_noise,
                   clip=dp.clip, norms=norms, mechanism=dp.mechanism),
        inner)


def compiled_step_bytes(config, model: nnx.Module, micro_batch: int, accumulation_steps: int,
                        mechanism=DPSGD()) -> int:
    """Bytes of the job's single-device step compiled for `micro_batch` privacy units (shapes only, nothing
    runs): arguments + outputs + temporaries - aliased, from XLA's `memory_analysis()`; the noise
    `mechanism`'s buffers included."""
    tx = _tx_of(config, 1.0, float(config.batch_size), accumulation_steps, mechanism)
    optimizer = nnx.eval_shape(lambda: nnx.Optimizer(model, tx, wrt=nnx.Param))
    k_unit = config.privacy.windows_per_unit
    windows = micro_batch * k_unit
    batch = {"tokens": jax.ShapeDtypeStruct((windows, config.seq_len + 1), jnp.int32),
             "mask": jax.ShapeDtypeStruct((windows,), jnp.bool_)}
    if not config.dp.enabled:
        batch["divisor"] = jax.ShapeDtypeStruct((), jnp.float32)
    step = make_train_step(config.dp.enabled, per_example="reference" if config.dp.strategy == "reference" else "jaxdp",
                           windows_per_unit=k_unit)
    a = step.lower(model, optimizer, batch).compile().memory_analysis()
    return a.argument_size_in_bytes + a.output_size_in_bytes + a.temp_size_in_bytes - a.alias_size_in_bytes


# ------------------------------------------------------------------ single-device steps


def _reference_grads_fn(loss_fn):
    """Per-example gradients by jax.vmap(jax.grad), as plain (B, ...) arrays in the params' tree."""
    def grads_fn(model, batch):
        losses, dense = reference.per_example_grads(loss_fn, model, batch)
        flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
        return losses, nnx.from_flat_state([(p, var.replace(dense[tuple(p)])) for p, var in flat])
    return grads_fn


@functools.lru_cache(maxsize=None)  # one jitted step per argument set: runs in one process share compiles
def make_train_step(dp: bool, loss_fn=lm_losses, per_example: str = "jaxdp",
                    windows_per_unit: int = 1) -> Callable:
    """`step(model, optimizer, batch) -> sum of the batch's per-example losses` (one micro-batch).

    DP: per-example gradients -> fused_clip (clip, sum, noise once per logical
    batch, divide by the expected batch size) -> adamw. `per_example="reference"`
    computes the per-example gradients by `jax.vmap(jax.grad)` instead (the
    explicit baseline; same clipping, noise and optimizer). With
    `windows_per_unit` k > 1 the batch is units of k consecutive windows and
    fused_clip clips each unit's summed gradient (`jaxdp.core.terms.group_examples`).
    Non-DP: the gradient of `sum(losses) / batch["divisor"]` (the realised size
    of the logical batch, so micro-batch gradients add up to the batch mean).
    """
    if dp:
        grads_fn = per_example_grads(loss_fn) if per_example == "jaxdp" else _reference_grads_fn(loss_fn)

        @nnx.jit
        def dp_step(model, optimizer, batch):
            losses, grads = grads_fn(model, batch)
            optimizer.update(model, group_examples(grads, windows_per_unit))
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


# ------------------------------------------------------------------ the step on a mesh


class ShardedTrainer:
    """The DP step on a (data, seq) mesh (`jaxdp.sharding.ShardedDPStep`) behind the loop's step interface.

    The model and the `nnx.Optimizer` (the chain fused_clip -> adamw) stay the
    host-side record used for evaluation and checkpoints; `sync()` writes the
    sharded state back into them (parameters, adamw state, the noise key of
    fused_clip's state and a correlated mechanism's buffers, the step count),
    `load()` reads it from them (after a restore). The noise key and adamw see
    the same values as in the single-device step, so the run equals it up to
    summation order (and, under ZeRO 2/3, up to the noise: a device draws its
    block of a sharded leaf's noise, and keeps that block of its buffers).
    """

    def __init__(self, config, model, optimizer, noise_multiplier: float, mechanism=DPSGD()):
        from jaxdp import sharding
        self.model, self.optimizer = model, optimizer
        mesh = sharding.make_mesh(config.mesh.data, config.mesh.seq)
        dp, norms = dp_settings(config, noise_multiplier, float(config.batch_size), mechanism)
        inner = _make_tx(AdamWPlan.of(config, 1), None)  # the step clips and noises; adamw after it
        self.step = sharding.ShardedDPStep(  # the run's noise key, from fused_clip's state in `optimizer`
            cp_lm_losses, inner, mesh, dp, key=noise_key_variable(optimizer).get_value(),
            zero_stage=config.mesh.zero_stage, norms=norms, method=config.dp.method)
        self.load()

    def _adam_variables(self):
        """The nnx.Optimizer's state Variables other than fused_clip's (the adamw state the sharded step's
        optimizer holds), in the leaf order of the sharded opt_state."""
        leaves = jax.tree.leaves(self.optimizer.opt_state,
                                 is_leaf=lambda v: isinstance(v, (FusedClipState, nnx.Variable)))
        return [v for v in leaves if not isinstance(v, FusedClipState)]

    def load(self):
        state = self.step.init(self.model)
        values = [v.get_value() for v in self._adam_variables()]
        opt_state = jax.tree.unflatten(jax.tree.structure(state.opt_state), values)
        noise = noise_key = noise_key_variable(self.optimizer).get_value()
        buffers = noise_buffer_variables(self.optimizer)
        if buffers:  # a correlated mechanism: its buffers, laid out by the step like the gradients
            noise = NoiseState(noise_key, [b.get_value() for b in buffers])
        self.state = processes.put(state._replace(opt_state=opt_state, noise_key=noise), self.step.state_shardings)

    def sync(self):
        state = processes.fetch(self.state)  # also the parts sharded over other processes' devices
        self.step.update_model(self.model, state)
        variables, values = self._adam_variables(), jax.tree.leaves(state.opt_state)
        assert len(variables) == len(values)
        for var, value in zip(variables, values):
            var.set_value(jnp.asarray(value))
        noise = state.noise_key
        if isinstance(noise, NoiseState):
            for var, value in zip(noise_buffer_variables(self.optimizer), noise.buffers, strict=True):
                var.set_value(jnp.asarray(value))
            noise = noise.key
        noise_key_variable(self.optimizer).set_value(noise)

    def __call__(self, batch) -> jax.Array:
        """One step; the sum of the batch's losses, left on the device (the loop reads it at log time)."""
        tokens = batch["tokens"]
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": batch["mask"]}
        self.state, out = self.step(self.state, batch)
        self.optimizer.step.set_value(self.optimizer.step.get_value() + 1)
        return out["losses"].sum()


# ------------------------------------------------------------------ evaluation


@functools.partial(nnx.jit, static_argnums=0)
def _eval_sum(loss_fn, model, batch):
    return loss_fn(model, batch).sum()


def evaluate(model: nnx.Module, windows: data_lib.TokenWindows, indices: np.ndarray,
             batch_size: int, loss_fn: Callable = lm_losses) -> float:
    """Mean over `windows[indices]` of `loss_fn` (per-window next-token NLL; fixed-shape, masked batches)."""
    total = 0.0
    for start in range(0, len(indices), batch_size):
        idx = indices[start:start + batch_size]
        mask = np.zeros(batch_size, bool)
        mask[:len(idx)] = True
        padded = np.zeros(batch_size, np.int64)
        padded[:len(idx)] = idx
        total += float(_eval_sum(loss_fn, model, {"tokens": windows.get(padded), "mask": mask}))
    return total / len(indices)
