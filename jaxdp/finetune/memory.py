"""Peak training memory of each fine-tuning method, from the compiled step (MemDPT's memory table).

`step_memory(config, method, step=StepSpec(batch_size, seq_len, dp=...), options=...)` builds the
method's model from abstract shapes (`nnx.eval_shape`: nothing is allocated,
so GPT-2 large costs no 3 GB of weights), compiles one training step for the
given devices and returns XLA's `memory_analysis()`:

  peak = arguments + outputs + temporaries - aliased

The step is what a fine-tuning loop runs. DP, `StepSpec(dp_method="bookkeeping")`:
per-example gradients (`jaxdp.per_example_grads`: every DP layer's input and
output gradient kept until all norms are known) -> `jaxdp.fused_clip` (flat
clipping, Gaussian noise) -> adamw; `dp_method="two_pass"`:
`jaxdp.two_pass_clipped_sums` (norms inside each layer's backward, then a
clip-weighted backward: nothing kept per layer) -> Gaussian noise -> adamw.
Non-DP: the mean-loss gradient -> adamw. The trainable parameters and the optimizer state are donated
(updated in place, as a loop that donates does); the frozen weights are
arguments only. Frozen weights are held in the compute dtype when
`frozen_dtype` is given (a bf16 backbone: nothing reads them in float32),
trainable parameters and Adam's moments stay float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxdp._keywords import fold, warn_moved
from jaxdp.clipping.aggregation import fused_clip
from jaxdp.clipping.settings import NormPlan
from jaxdp.clipping.two_pass import two_pass_clipped_sums
from jaxdp.core import losses, nn
from jaxdp.core.per_example import per_example_grads
from jaxdp.finetune import methods as finetune
from jaxdp.finetune.settings import accepts_flat_keywords, fold_flat
from jaxdp.models import registry
from jaxdp.models.gpt2 import GPT2Config
from jaxdp.models.llama import LlamaConfig
from jaxdp.noise.privatizer import GaussianPrivatizer

DP_METHODS = ("bookkeeping", "two_pass")


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """The training step whose memory is measured.

    Attributes:
      batch_size, seq_len: the batch's examples and tokens per example.
      dp: a DP step (per-example clipping and noise) or the non-DP mean-loss gradient.
      dp_method: how DP forms its clipped sums (`DP_METHODS`; see the module doc).
    """
    batch_size: int
    seq_len: int
    dp: bool = True
    dp_method: str = "bookkeeping"

    def __post_init__(self):
        for name in ("batch_size", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.dp_method not in DP_METHODS:
            raise ValueError(f"dp_method must be one of {DP_METHODS}, got {self.dp_method!r}")


@dataclasses.dataclass(frozen=True)
class StepMemory:
    arguments: int
    outputs: int
    temporaries: int
    aliased: int
    trainable_params: int

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs + self.temporaries - self.aliased


def lm_losses(model, batch) -> jax.Array:
    """Per-example mean next-token NLL (B,), zero for masked examples."""
    nll_BT = losses.token_nll(model, batch["tokens"][:, :-1], batch["tokens"][:, 1:])
    return jnp.where(batch["mask"], nll_BT.mean(axis=-1), 0.0)


@accepts_flat_keywords
def abstract_model(config, method: str, *, options=None, frozen_dtype=None) -> nnx.Module:
    """The method's model (`jaxdp.finetune.methods.prepare` with `options`) as shapes only; frozen weights cast
    to `frozen_dtype`. `config`: any model config `jaxdp.models.registry` knows (GPT-2, Llama and its families)."""
    model = nnx.eval_shape(lambda: finetune.prepare(registry.build(config, nnx.Rngs(0)), method,
                                                    rngs=nnx.Rngs(1), options=options))
    if frozen_dtype is not None:
        graphdef, state = nnx.split(model)
        state = nnx.from_flat_state([
            (p, v.replace(jax.ShapeDtypeStruct(v.shape, frozen_dtype)) if isinstance(v, nn.Frozen) else v)
            for p, v in nnx.to_flat_state(state)])
        model = nnx.merge(graphdef, state)
    return model


def _num_params(state) -> int:
    return sum(math.prod(jnp.shape(v)) for v in jax.tree.leaves(state))


_STEP_KEYWORDS = ("batch_size", "seq_len", "dp", "dp_method")


def _accepts_old_step_keywords(fn):
    """`step_memory(config, method, dp=..., batch_size=..., seq_len=..., dp_method=..., rank=...)` (the keywords
    before `StepSpec` and the methods' settings) as `step=StepSpec(...)`, `options=...`, with a
    DeprecationWarning; for one release."""
    @functools.wraps(fn)
    def wrapper(config, method, **kwargs):
        moved = [m for m in (fold("step", kwargs, StepSpec, _STEP_KEYWORDS, fn.__name__),
                             fold_flat(method, kwargs, fn.__name__)) if m is not None]
        warn_moved(fn.__name__, moved)
        return fn(config, method, **kwargs)

    return wrapper


@_accepts_old_step_keywords
def step_memory(config: GPT2Config | LlamaConfig, method: str, *, step: StepSpec, options=None, frozen_dtype=None,
                device=None, compiler_options=None) -> StepMemory:
    """Compiles one training `step` (`StepSpec`) of `method` with `options` (its `jaxdp.finetune.settings`
    value; None: the defaults) on `config` and returns its memory analysis.

    `device`: the device to compile for (default: this machine's first); a deviceless
    GPU target from `jaxdp.analysis.hlo_cost.target_devices` gives XLA:GPU's buffer assignment.
    """
    if not isinstance(step, StepSpec):
        raise TypeError(f"step must be a StepSpec, got {type(step).__name__}: {step!r}")
    model = abstract_model(config, method, options=options, frozen_dtype=frozen_dtype)
    dp, batch_size, seq_len = step.dp, step.batch_size, step.seq_len
    tx = optax.adamw(1e-3, weight_decay=0.0)
    bookkeeping = dp and step.dp_method == "bookkeeping"
    if bookkeeping:
        tx = optax.chain(fused_clip(1.0, 1.0, expected_batch_size=float(batch_size), key=jax.random.key(0)), tx)
    optimizer = nnx.eval_shape(lambda: nnx.Optimizer(model, tx, wrt=nnx.Param))
    graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
    opt_graphdef, opt_state = nnx.split(optimizer)
    grads_fn = per_example_grads(lm_losses, fallback=False)
    sums_fn = two_pass_clipped_sums(lm_losses, 1.0, fallback=False,
                                    norms=NormPlan(allow_low_precision=True))  # memory only

    def train_step(params, opt_state, frozen, batch):
        model = nnx.merge(graphdef, params, frozen)
        optimizer = nnx.merge(opt_graphdef, opt_state)
        if bookkeeping:
            losses, grads = grads_fn(model, batch)
        elif dp:
            losses, sums, _ = sums_fn(model, batch)
            grads, _ = GaussianPrivatizer(1.0, batch_size).update(sums, jax.random.key(0))
        else:
            losses, grads = nnx.value_and_grad(lambda m: lm_losses(m, batch).sum() / batch_size)(model)
        optimizer.update(model, grads)
        return nnx.state(model, nnx.Param), nnx.state(optimizer), losses.sum()

    tokens = jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32)
    batch = {"tokens": tokens, "mask": jax.ShapeDtypeStruct((batch_size,), jnp.bool_)}
    shardings = None
    if device is not None:
        sharding = jax.sharding.SingleDeviceSharding(device)
        shardings = jax.tree.map(lambda _: sharding, (params, opt_state, frozen, batch))
    jitted = jax.jit(train_step, donate_argnums=(0, 1), in_shardings=shardings, compiler_options=compiler_options)
    analysis = jitted.lower(params, opt_state, frozen, batch).compile().memory_analysis()
    return StepMemory(analysis.argument_size_in_bytes, analysis.output_size_in_bytes, analysis.temp_size_in_bytes,
                      analysis.alias_size_in_bytes, _num_params(params))


# MemDPT (arXiv:2406.11087), GPT-2 large on E2E, B = 32, T = 128: training memory in GB (DP at eps 8, non-DP).
SEED_GB = {"full": (62.23, 20.45), "lora": (21.75, 13.68), "adapter": (23.68, None), "bitfit": (9.59, None),
           "prompt": (22.12, None), "side": (11.44, 10.17), "reversible": (9.88, 8.39)}


def target_checks(rows: dict) -> list[str]:
    """The memory targets (DP within 5% of non-DP; side-tuning DP <= 0.55 of LoRA DP; reversible DP <= 1.10 of
    BiTFiT DP) on {method: {"dp": GB, "nondp": GB}}, each as 'name: ratio (target) ok|MISSED'."""
    out = []
    for m, r in rows.items():
        out.append(f"{m} DP / non-DP: {r['dp'] / r['nondp']:.3f} (<= 1.05) "
                   f"{'ok' if r['dp'] <= 1.05 * r['nondp'] else 'MISSED'}")
    if "side" in rows and "lora" in rows:
        ratio = rows["side"]["dp"] / rows["lora"]["dp"]
        out.append(f"side DP / LoRA DP: {ratio:.3f} (<= 0.55) {'ok' if ratio <= 0.55 else 'MISSED'}")
    if "reversible" in rows and "bitfit" in rows:
        ratio = rows["reversible"]["dp"] / rows["bitfit"]["dp"]
        out.append(f"reversible DP / BiTFiT DP: {ratio:.3f} (<= 1.10) {'ok' if ratio <= 1.10 else 'MISSED'}")
    return out
