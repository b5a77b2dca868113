"""Data- and context-parallel DP training step with ZeRO stages 0-3 (DP-ZeRO, LongShield).

One jitted step over a (data, seq) mesh:

1. `jax.shard_map` over both axes: each device runs `per_example_grads` on
   its examples (and, with seq > 1, its slice of their tokens), computes the
   per-example norms of ITS examples (no communication over `data`; over
   `seq` see `context_parallel`) and their clipped sums.
2. The clipped sums are summed over the mesh: `psum` (ZeRO 0/1), or a
   `psum_scatter` over `data` along each tensor's ZeRO dimension (ZeRO 2/3),
   after a `psum` over `seq`.
3. The privatizer (`jaxdp.noise.privatizer.GaussianPrivatizer`, the one `jaxdp.fused_clip`
   releases through): its state's keys split outside the shard_map (`begin_step`), the
   noise added and the sums divided by the expected batch size inside (`privatize`): a
   replicated gradient gets the SAME noise as on one device; a reduce-scattered one draws
   its shard from `fold_in(leaf_key, shard)`, so no device generates (or holds) the full
   noise tensor.
4. The optax optimizer under `jax.jit` with `NamedSharding`s: ZeRO >= 1
   shards its state over `data`; ZeRO 3 keeps parameters sharded and
   all-gathers them inside the shard_map for use.

Equivalence: with sigma = 0 the step equals the single-device step of
`optax.chain(jaxdp.fused_clip(..., key=k), tx)` up to float summation order;
with sigma > 0 and ZeRO 0/1 (and replicated leaves under 2/3) it adds the
same noise. The shard_map runs with `check_vma=True`: `per_example_grads`
creates its zero slots varying over the same manual axes as the activations
they stand for, and takes no gradient with respect to the replicated
parameters, so no cotangent comes back implicitly psum-ed over the mesh (the
pitfall: an extra psum would multiply it by the axis size); every collective here is explicit.

`method="two_pass"` forms the clipped sums of step 1 with
`jaxdp.clipping.two_pass.two_pass_clipped_sums` instead of book-keeping: norms inside
each layer's backward (under context parallelism the per-example
reduce-scatter and norm psum run there, next to the layer's own backward),
then an ordinary backward of the clip-weighted loss. No layer's activations
and output gradients are kept past its backward, so with `remat` it keeps
no more activations than the non-DP step (XLA:GPU's compile for an H100 fits
non-DP's longest context; see WORKSPACE.md); the price is a second forward
and backward. Flat clipping only.

`NonPrivate(expected_batch_size)` in place of the `DPSpec` is the non-DP baseline on the same layout: step 1 becomes
the ordinary gradient of `sum(losses)` (one backward pass, no per-example
gradients, no norms, no clipping) with respect to the parameters marked
varying over the mesh (so autodiff inserts no implicit psum), and step 3
draws no noise; the mesh, the shardings, the ZeRO gathers and the
reductions of step 2 are the same code. The collectives of the two programs
therefore differ only by what DP itself adds (`jaxdp.analysis.collectives`
measures it).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdp.clipping.aggregation import clipped_aggregate
from jaxdp.clipping.settings import (CLIP_KEYWORDS, NORM_KEYWORDS, ClipSpec, DPSpec, NormPlan, check_norm_plan,
                                     check_positive)
from jaxdp.clipping.two_pass import two_pass_clipped_sums, weighted_loss_grad
from jaxdp.core.per_example import per_example_grads
from jaxdp.noise import draws as noise_lib
from jaxdp.noise import seeds
from jaxdp.noise.privatizer import GaussianPrivatizer, NoiseState
from jaxdp.sharding import context_parallel
from jaxdp.sharding.mesh import DATA, SEQ, param_dims, spec_for
from jaxdp.sharding.processes import agree, put

ZERO_STAGES = (0, 1, 2, 3)
METHODS = ("bookkeeping", "two_pass")


def check_mesh_strategy(strategy: str) -> None:
    """Raises ValueError if `strategy` cannot run inside the step's shard_map here."""
    if strategy != "pallas":
        return
    from jaxdp.pallas import _common  # imports jax.experimental.pallas only when asked for
    if _common.resolve_interpret(None):
        raise ValueError('strategy="pallas" in ShardedDPStep needs a GPU: without one the Pallas kernels '
                         "run in JAX's interpreter, which cannot run under shard_map; use "
                         'strategy="auto", "ghost" or "instantiate"')


@dataclasses.dataclass(frozen=True)
class NonPrivate:
    """The non-DP baseline of `ShardedDPStep` on the same layout: the gradient of
    `sum(losses) / expected_batch_size` by ordinary autodiff. Not differentially private."""
    expected_batch_size: float

    def __post_init__(self):
        check_positive("expected_batch_size", self.expected_batch_size)


_OLD_DP_KEYWORDS = ("l2_norm_clip", "noise_multiplier", "expected_batch_size", "secure_noise", "private")


def _accepts_old_keywords(init):
    """One release: `ShardedDPStep(..., l2_norm_clip=, noise_multiplier=, expected_batch_size=, clipping=, ...,
    strategy=, chunk_size=, private=)` (the keywords before `DPSpec` / `NormPlan`), with a DeprecationWarning."""
    @functools.wraps(init)
    def wrapper(self, loss_fn, tx, mesh, dp=None, **kw):
        old = {k: kw.pop(k) for k in (*_OLD_DP_KEYWORDS, *CLIP_KEYWORDS) if k in kw}
        old_norms = {k: kw.pop(k) for k in NORM_KEYWORDS if k in kw}
        if old or old_norms:
            warnings.warn(f"ShardedDPStep({', '.join(f'{k}=' for k in {**old, **old_norms})}) is now "
                          "ShardedDPStep(loss_fn, tx, mesh, jaxdp.DPSpec(...), norms=jaxdp.NormPlan(...)); the old "
                          "keywords go in the next release", DeprecationWarning, stacklevel=2)
        if old:
            if dp is not None:
                raise TypeError("ShardedDPStep: dp and the old keywords given together")
            clip = ClipSpec(**{k: old.pop(k) for k in CLIP_KEYWORDS if k in old})
            dp = (DPSpec(old["l2_norm_clip"], old["noise_multiplier"], old["expected_batch_size"], clip,
                         old.get("secure_noise", False))
                  if old.get("private", True) else NonPrivate(old["expected_batch_size"]))
        if old_norms:
            kw["norms"] = NormPlan(**old_norms)
        return init(self, loss_fn, tx, mesh, dp, **kw)

    return wrapper


class ShardedDPState(NamedTuple):
    params: Any        # nnx.State of Params; sharded over `data` under ZeRO-3
    rest: Any          # the model's other state (replicated)
    opt_state: Any     # sharded over `data` under ZeRO >= 1
    noise_key: Any     # the privatizer's state: its key (DP-SGD), or NoiseState(key, buffers) (correlated)


class Layout(NamedTuple):
    """Where a model's state lives on the mesh under a ZeRO stage (`layout_for`)."""
    graphdef: Any            # the model's structure (nnx.GraphDef)
    dims: Any                # per parameter: the dimension ZeRO shards over `data` (-1: replicated)
    grad_dims: Any           # the same for the gradients (sharded from ZeRO-2 on)
    param_specs: Any         # PartitionSpecs of the parameters (sharded under ZeRO-3)
    grad_specs: Any
    state_shardings: ShardedDPState


def _named(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def layout_for(model, tx: optax.GradientTransformation, mesh, zero_stage: int) -> Layout:
    """The layout of `model`'s parameters, gradients and `tx`'s state on `mesh` under `zero_stage`."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    zero_shards = mesh.shape[DATA] if zero_stage >= 1 else 1
    dims = param_dims(params, zero_shards)
    replicated = jax.tree.map(lambda _: -1, dims)
    opt_shapes = jax.eval_shape(tx.init, params)
    opt_dims = optax.tree_map_params(tx, lambda _, d: d, opt_shapes, dims, transform_non_params=lambda _: -1)
    spec = lambda d, a: spec_for(d, np.ndim(a))
    grad_dims = dims if zero_stage >= 2 else replicated
    param_specs = jax.tree.map(spec, dims if zero_stage >= 3 else replicated, params)
    grad_specs = jax.tree.map(spec, grad_dims, params)
    opt_specs = jax.tree.map(spec, opt_dims, opt_shapes)
    state_shardings = ShardedDPState(
        _named(mesh, param_specs), jax.tree.map(lambda _: NamedSharding(mesh, P()), rest),
        _named(mesh, opt_specs), NamedSharding(mesh, P()))
    return Layout(graphdef, dims, grad_dims, param_specs, grad_specs, state_shardings)


def _buffer_specs(layout: Layout) -> list:
    """A correlated mechanism's buffers (num_buffers, *leaf shape) per leaf: sharded as the leaf's gradient."""
    return [P(None, *spec) for spec in jax.tree.leaves(layout.grad_specs, is_leaf=lambda x: isinstance(x, P))]


def _check_takes_seq_axis(loss_fn: Callable) -> None:
    """Context parallelism calls `loss_fn(model, batch, seq_axis=...)`: refuse a loss that cannot take it."""
    try:
        inspect.signature(loss_fn).bind(None, None, seq_axis=None)
    except TypeError:
        raise ValueError("on a mesh with seq > 1 (context parallelism) loss_fn must accept a `seq_axis` keyword "
                         "and pass it to the model's call, as jaxdp.core.losses.cp_lm_losses does; got "
                         f"{getattr(loss_fn, '__name__', loss_fn)!r}") from None
    except ValueError:  # no signature to inspect (a builtin): let the call decide
        pass


class ShardedDPStep:
    """`step = ShardedDPStep(...)`; `state = step.init(model)`; `state, out = step(state, batch)`.

    `out` holds the per-example `losses` (B,) and the privatised mean gradient
    `grads` handed to the optimizer. `step.update_model(model, state)` writes
    the parameters back into an NNX model.

    `dp`: the release (`jaxdp.DPSpec`: C, sigma, the expected batch size, the `ClipSpec`, secure
    noise), or `NonPrivate(expected_batch_size)`: the non-DP baseline with the same layout and
    reductions, `grads` the gradient of `sum(losses) / expected_batch_size` (the mean loss when the
    batch holds `expected_batch_size` real examples) by ordinary autodiff. `norms`: how the norms and
    sums are formed (`jaxdp.NormPlan`; "pallas" needs a GPU here). `method`: "bookkeeping" or
    "two_pass" (flat clipping only; module docstring).

    `key`: the noise PRNG key of `init`'s state; None (the default): each `init` draws a fresh
    one from the operating system's entropy (`jaxdp.noise.draws.secret_key`).

    `loss_fn(model, batch) -> losses (B,)`. On a mesh with seq > 1 (context
    parallelism) the step calls `loss_fn(model, batch, seq_axis=SEQ)` on each
    device's slice of the tokens: the loss passes `seq_axis` to the model's
    call and returns this shard's share of each example's loss
    (`jaxdp.core.losses.cp_lm_losses` does both).

    `init(model)` fixes the layout (`self.layout`: which dimension of each
    parameter ZeRO shards, and the shardings of the state); a step built for
    one model structure refuses another's.

    Several processes (a mesh over several hosts): every process calls `init` with the same
    model and `step` with the same WHOLE batch as host arrays (each places its own devices'
    slices: `jaxdp.sharding.processes.put`); both are compared across processes by digest and
    a difference raises `processes.Disagreement` (hosts sampling their own batches could put
    one example in two places: sensitivity 2C). Fetch the state with `processes.fetch`.
    """

    @_accepts_old_keywords
    def __init__(self, loss_fn: Callable, tx: optax.GradientTransformation, mesh, dp: DPSpec | NonPrivate, *,
                 key: jax.Array | None = None, zero_stage: int = 0, norms: NormPlan = NormPlan(),
                 method: str = "bookkeeping"):
        if not isinstance(dp, (DPSpec, NonPrivate)):
            raise TypeError(f"dp must be a jaxdp.DPSpec (or jaxdp.sharding.NonPrivate for the non-DP baseline), "
                            f"got {type(dp).__name__}: {dp!r}")
        if zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage!r}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        self.private = isinstance(dp, DPSpec)
        if self.private and method == "two_pass" and (dp.clip.clipping != "flat" or dp.clip.group_weights):
            raise ValueError(f'method="two_pass" needs flat clipping, got clipping={dp.clip.clipping!r}; '
                             'use method="bookkeeping" for per-layer or grouped clipping')
        check_norm_plan(norms)
        check_mesh_strategy(norms.strategy)
        self.loss_fn, self.tx, self.mesh = loss_fn, tx, mesh
        self.dp, self.norms, self.zero_stage, self.method = dp, norms, zero_stage, method
        self.pinned_key = noise_lib.check_key(key, "ShardedDPStep")
        self.privatizer = (dp.privatizer() if self.private
                           else GaussianPrivatizer(0.0, dp.expected_batch_size))  # no noise: the mean gradient
        self.num_data, self.num_seq = mesh.shape[DATA], mesh.shape[SEQ]
        if self.num_seq > 1:
            _check_takes_seq_axis(loss_fn)
        self.cp_axis = SEQ if self.num_seq > 1 else None
        self.layout: Layout | None = None
        self._compiled = {}  # batch structure -> jitted step

    # Layout.

    def init(self, model) -> ShardedDPState:
        """The step's state for `model` (parameters, optimizer state and noise key, placed on the mesh)."""
        layout = layout_for(model, self.tx, self.mesh, self.zero_stage)
        if self.layout is not None and layout.graphdef != self.layout.graphdef:
            raise ValueError("ShardedDPStep.init: this step was built for another model structure; "
                             "build one ShardedDPStep per model")
        if self.privatizer.correlated:  # the buffers are laid out like the gradients
            buffers = [NamedSharding(self.mesh, spec) for spec in _buffer_specs(layout)]
            layout = layout._replace(state_shardings=layout.state_shardings._replace(
                noise_key=NoiseState(NamedSharding(self.mesh, P()), buffers)))
        self.layout = layout
        _, params, rest = nnx.split(model, nnx.Param, ...)
        key = self.privatizer.init(params, self.pinned_key)
        # several processes: each places its own copy; equal only if every host built the same model and key
        agree("ShardedDPStep.init", params=params, rest=rest, noise_key=key)
        shardings = layout.state_shardings
        params, rest, key = put((params, rest, key), (shardings.params, shardings.rest, shardings.noise_key))
        opt_state = jax.jit(self.tx.init, out_shardings=shardings.opt_state)(params)
        return ShardedDPState(params, rest, opt_state, key)

    @property
    def state_shardings(self) -> ShardedDPState:
        return self._layout().state_shardings

    def _layout(self) -> Layout:
        if self.layout is None:
            raise ValueError("call ShardedDPStep.init(model) before stepping: the layout follows the model")
        return self.layout

    def update_model(self, model, state: ShardedDPState) -> None:
        nnx.update(model, jax.device_get(state.params))

    # The step.

    def batch_spec(self, leaf) -> P:
        if np.ndim(leaf) >= 2 and self.num_seq > 1:
            return P(DATA, SEQ)
        return P(DATA)

    def _local(self, layout: Layout, params, rest, batch, leaf_keys, buffers):
        """Per device: gradient sums, then sums over the mesh and noise (inside shard_map); a correlated
        mechanism's `buffers` are this device's blocks, laid out like the gradients."""
        if self.zero_stage >= 3:
            params = jax.tree.map(
                lambda p, d: p if d < 0 else jax.lax.all_gather(p, DATA, axis=d, tiled=True),
                params, layout.dims)
        cp_axis = self.cp_axis
        loss_fn = self.loss_fn if cp_axis is None else functools.partial(self.loss_fn, seq_axis=cp_axis)
        if self.private:
            losses, sums = self._clipped_sums(loss_fn, layout.graphdef, params, rest, batch)
        else:
            losses, sums = self._loss_grad(loss_fn, layout.graphdef, params, rest, batch)
        if cp_axis is not None:
            losses = jax.lax.psum(losses, SEQ)
        leaves, treedef = jax.tree.flatten(sums)
        dims = jax.tree.leaves(layout.grad_dims)
        reduced, shards = [], []
        shard = jax.lax.axis_index(DATA)  # one object: secure noise draws all sharded leaves from one stream
        for s, d in zip(leaves, dims):
            if d < 0:  # one all-reduce over the whole mesh
                reduced.append(jax.lax.psum(s, (DATA, SEQ) if cp_axis is not None else DATA))
                shards.append(None)
            else:      # seq partials summed, then reduce-scattered over data
                s = jax.lax.psum(s, SEQ) if cp_axis is not None else s
                reduced.append(jax.lax.psum_scatter(s, DATA, scatter_dimension=d, tiled=True))
                shards.append(shard)
        out, buffers = self.privatizer.privatize(reduced, leaf_keys, shards, buffers)  # noise, / expected batch
        return losses, jax.tree.unflatten(treedef, out), buffers

    def _clipped_sums(self, loss_fn, graphdef, params, rest, batch):
        """DP: per-example losses and this device's share of the clipped per-example gradient sums."""
        model = nnx.merge(graphdef, params, rest)
        dp, plan = self.dp, self.norms
        norms_fn = None if self.cp_axis is None else functools.partial(
            context_parallel.squared_norms, axis=SEQ, strategy=plan.strategy, chunk_size=plan.chunk_size)
        if self.method == "two_pass":
            losses, sums, _ = two_pass_clipped_sums(loss_fn, dp.l2_norm_clip, clip=dp.clip, norms=plan,
                                                    squared_norms_fn=norms_fn)(model, batch)
            return losses, sums
        losses, grads = per_example_grads(loss_fn)(model, batch)
        sums, _ = clipped_aggregate(grads, dp.l2_norm_clip, clip=dp.clip, norms=plan, squared_norms_fn=norms_fn)
        return losses, sums

    def _loss_grad(self, loss_fn, graphdef, params, rest, batch):
        """Non-DP: per-example losses and this device's partial gradient of their sum (one backward)."""
        axes = (DATA, SEQ) if self.cp_axis is not None else (DATA,)
        grads, losses = weighted_loss_grad(loss_fn, graphdef, params, rest, batch, axes)
        return losses, grads

    def _step(self, layout: Layout, state: ShardedDPState, batch):
        num_leaves = len(jax.tree.leaves(state.params))
        noise, leaf_keys = self.privatizer.begin_step(state.noise_key, num_leaves)
        if self.privatizer.secure:
            leaf_keys = leaf_keys[:1]  # every leaf's is the step's key: passed once, one stream inside
        batch_specs = jax.tree.map(self.batch_spec, batch)
        buffers = self.privatizer.buffers_of(noise)
        buffer_specs = None if buffers is None else _buffer_specs(layout)
        local = jax.shard_map(
            functools.partial(self._local, layout), mesh=self.mesh,
            in_specs=(layout.param_specs, jax.tree.map(lambda _: P(), state.rest), batch_specs,
                      [P()] * len(leaf_keys), buffer_specs),
            out_specs=(P(DATA), layout.grad_specs, buffer_specs), check_vma=True)
        losses, grads, buffers = local(state.params, state.rest, batch, leaf_keys, buffers)
        if buffers is not None:
            noise = NoiseState(self.privatizer.key_of(noise), buffers)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return ShardedDPState(params, state.rest, opt_state, noise), {"losses": losses, "grads": grads}

    def _jit(self, batch):
        """The jitted step for batches of `batch`'s structure (each leaf's sharding follows its rank)."""
        layout = self._layout()
        batch_shardings = jax.tree.map(lambda a: NamedSharding(self.mesh, self.batch_spec(a)), batch)
        cache_key = jax.tree.structure(batch_shardings), tuple(jax.tree.leaves(batch_shardings))
        if cache_key not in self._compiled:
            out = {"losses": NamedSharding(self.mesh, P(DATA)), "grads": _named(self.mesh, layout.grad_specs)}
            self._compiled[cache_key] = jax.jit(
                functools.partial(self._step, layout), in_shardings=(layout.state_shardings, batch_shardings),
                out_shardings=(layout.state_shardings, out))
        return self._compiled[cache_key]

    def __call__(self, state: ShardedDPState, batch):
        step = self._jit(batch)
        if seeds.several_processes():  # host batches: each process places its own devices' slices
            # of the SAME batch: hosts sampling their own would put a unit in two places (sensitivity 2C)
            local = [a for a in jax.tree.leaves(batch) if not (isinstance(a, jax.Array) and not a.is_fully_addressable)]
            agree("ShardedDPStep batch", batch=local)  # NumPy or process-local jax arrays; global ones are one value
            batch = put(batch, jax.tree.map(lambda a: NamedSharding(self.mesh, self.batch_spec(a)), batch))
        return step(state, batch)

    def lower(self, state: ShardedDPState, batch, **lower_kwargs):
        """The lowered step (for `.compile().memory_analysis()` and HLO inspection); `lower_kwargs` go to
        `jax.stages.Traced.lower` (e.g. `lowering_platforms=("cuda",)`)."""
        return self._jit(batch).trace(state, batch).lower(**lower_kwargs)
