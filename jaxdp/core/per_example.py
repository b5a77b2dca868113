"""Per-example gradients in one backward pass, without vmap over the model.

`per_example_grads(loss_fn)(model, batch)` returns the per-example losses and,
for every `nnx.Param` of the model, a `FactoredGrad`: the per-example gradient
in factored form (activations and output gradients for a linear weight,
small per-example gradients for norm scales and biases). See `jaxdp.core.terms`.

The loss must be per-example: `losses[b]` a function of example b's data only.
A loss that couples examples (batch statistics, logits normalised over the
batch, in-batch negatives) makes example b's gradient depend on the others, so
clipping each example's gradient to C no longer bounds any example's
contribution to the clipped sum by C, and the DP guarantee is void.
`jaxdp.check_per_example_loss` checks this on a batch, once, before training.

How: a shape-only pass (`jax.eval_shape`) finds every DP-layer call; a second
pass runs the forward under `jax.vjp` with respect to one zero "slot" per
call, whose cotangents are that call's output gradient and recorded input
(`jaxdp.core._tape`). The weight-gradient GEMMs of the ordinary backward are never
formed. Parameters that no layer rule covers get exact per-example gradients
of those parameters alone (`jax.vmap(jax.grad)` with respect to them only), or
a ValueError naming them when `fallback=False`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdp.core import _tape
from jaxdp.core.nn import DP_LAYERS
from jaxdp.core.terms import DenseTerm, FactoredGrad, StackedGrad

LossFn = Callable[[nnx.Module, Any], jax.Array]


def _label_layers(model: nnx.Module) -> None:
    """Gives every DP layer of `model` its state path (a static attribute, so that it survives the
    split / merge of `nnx.remat`).

    Only ever applied to the model `discover` merges inside the traced
    function, never to the caller's model: labelling the caller's model inside
    a jitted step changed its graphdef after the first call, and the step
    compiled a second time (issue "5/6", item 4).
    """
    for path, node in nnx.iter_graph(model):  # DP layers and stacked modules (`jaxdp.core.layer_scan.stack`)
        if (isinstance(node, DP_LAYERS) or isinstance(node, nnx.Module) and hasattr(node, "dp_path")) \
                and node.dp_path != tuple(path):
            node.dp_path = tuple(path)


def _check_losses(losses) -> None:
    if losses.ndim != 1:
        raise ValueError(
            "loss_fn must return per-example losses of shape (B,); got shape "
            f"{tuple(losses.shape)}. Return the unreduced losses (e.g. the mean over "
            "tokens of each example), not their mean or sum.")


def per_example_grads(loss_fn: LossFn, *, fallback: bool = True):
    """Makes a function returning per-example losses and factored per-example gradients.

    Args:
      loss_fn: `loss_fn(model, batch) -> losses` with `losses` of shape (B,):
        one loss per example, so that the gradient of `sum(losses)` is the sum
        of per-example gradients. `losses[b]` must depend on example b's data
        only: no batch statistics, normalisation over the batch or in-batch
        negatives. With those an example also moves the other examples'
        gradients, its contribution to the clipped sum is no longer bounded
        by C and the DP guarantee is void; this function cannot detect it, so
        run `jaxdp.check_per_example_loss` once before training. Padding
        examples should have loss 0 (e.g. `jnp.where(mask, loss, 0.0)`).
      fallback: if True, parameters not covered by a `jaxdp.core.nn` layer rule get
        exact per-example gradients by `jax.vmap(jax.grad)` with respect to
        those parameters only (this runs the model once more, per example);
        if False, such parameters raise a ValueError naming them.

    Returns:
      `grads_fn(model, batch) -> (losses, grads)`, where `grads` has the tree
      structure of `nnx.state(model, nnx.Param)` and every leaf value is a
      `jaxdp.core.terms.FactoredGrad`. Works under `jax.jit` / `nnx.jit` and with
      `nnx.remat` blocks. Pass `grads` to `jaxdp.fused_clip`.

    Example:
      >>> def loss_fn(model, batch):
      ...   logits = model(batch["inputs"])
      ...   nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
      ...   return nll.mean(axis=-1) * batch["mask"]
      >>> losses, grads = jaxdp.per_example_grads(loss_fn)(model, batch)
    """

    def grads_fn(model: nnx.Module, batch):
        graphdef, params, rest, uses, axes, losses_of = discover(loss_fn, model, batch)
        slots = use_slots(uses)

        # Parameters and the rest of the state (Frozen parameters among it) enter under stop_gradient:
        # the backward forms no weight gradient, only the slots' cotangents.
        def record_pass(slots, params, rest):
            with _tape.recording("record", slots, axes):
                return losses_of(jax.lax.stop_gradient(params), jax.lax.stop_gradient(rest))

        losses, vjp_fn, new_rest = jax.vjp(record_pass, slots, params, rest, has_aux=True)
        slot_cts, _, _ = vjp_fn(jnp.ones_like(losses))
        nnx.update(model, new_rest)

        terms_by_path: dict[tuple, list] = {}
        for key, use in uses.items():
            if use.scan is None:
                terms = use_terms(use, *slot_cts[key])
            else:  # the scan's slots came back stacked: (L, B, ...)
                terms = jax.vmap(lambda g, r, use=use: use_terms(use, g, r))(*slot_cts[use.scan.key][key])
            for name, term in terms.items():
                terms_by_path.setdefault(use.path + (name,), []).append(term)
        stacked = stacked_paths(params, uses)
        add_fallback_terms(terms_by_path, loss_fn, graphdef, params, rest, batch, fallback, stacked=stacked)
        flat = list(nnx.to_flat_state(params))
        grads = nnx.from_flat_state(
            [(path, var.replace(_grad_of(tuple(path), terms_by_path[tuple(path)], stacked)))
             for path, var in flat])
        return losses, grads

    return grads_fn


def discover(loss_fn: LossFn, model: nnx.Module, batch):
    """Splits the model and finds every DP-layer call (shapes only).

    Returns `(graphdef, params, rest, uses, axes, losses_of)`: `uses` maps each
    tap key to its `_tape.Use`, `axes` are the shard_map axes the batch varies
    over, and `losses_of(params, rest) -> (losses, new rest)` runs the model.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def losses_of(params, rest):
        model = nnx.merge(graphdef, params, rest)
        _label_layers(model)
        losses = loss_fn(model, batch)
        return losses, nnx.state(model, nnx.Not(nnx.Param))

    axes = _batch_axes(batch)
    with _tape.recording("discover", axes=axes) as tape:
        losses_struct, _ = jax.eval_shape(losses_of, params, rest)
    _check_losses(losses_struct)
    _check_batch_first(tape.uses, losses_struct.shape[0])
    return graphdef, params, rest, tape.uses, axes, losses_of


def _check_batch_first(uses: dict, batch_size: int) -> None:
    """Every tapped input and output must lead with the losses' batch axis: a layer run inside a loss that
    vmaps over examples, or on a table shared by the batch, records no per-example factors (its 'per-example'
    gradient would be a sum over examples, so one example could move the clipped sum by 2 C or more)."""
    for use in uses.values():
        if use.y.shape[:1] != (batch_size,) or use.record.shape[:1] != (batch_size,):
            raise ValueError(
                f"per_example_grads: layer {'/'.join(map(str, use.path))} ran on an input of shape "
                f"{tuple(use.record.shape)} with output {tuple(use.y.shape)}: every jaxdp layer must see the "
                f"batch axis of the losses ({batch_size},) first. Apply layers to the whole batch (not inside "
                "jax.vmap over examples, not to a table shared by all examples)")


def term_slots(use: _tape.Use):
    """Zero slots for one use, varying over the manual axes of what they stand for: (g, record); a use
    inside a layer scan has them with a leading layer axis (L, ...)."""
    lead = (use.scan.layers,) if use.scan is not None else ()
    return (_tape.varying_like(jnp.zeros(lead + use.y.shape, use.y.dtype), use.y_axes),
            _tape.varying_like(jnp.zeros(lead + use.record.shape, use.record.dtype), use.record_axes))


def use_slots(uses: dict) -> dict:
    """{use key: slots} of the uses outside layer scans, and {scan key: {use key: slots}} of those inside
    one (the scan's xs, `jaxdp.core._tape.Scan`)."""
    slots: dict = {}
    for key, use in uses.items():
        (slots if use.scan is None else slots.setdefault(use.scan.key, {}))[key] = term_slots(use)
    return slots


def stacked_paths(params, uses: dict) -> dict:
    """{parameter path: layer_axis_at} of the parameters under a layer scan's stacked module."""
    prefixes = {use.scan.path for use in uses.values() if use.scan is not None}
    return {tuple(p): len(prefix) for p, _ in nnx.to_flat_state(params)
            for prefix in prefixes if tuple(p)[:len(prefix)] == prefix}


def _grad_of(path: tuple, terms: list, stacked: dict):
    """A FactoredGrad, or a StackedGrad for a stacked parameter."""
    if path in stacked:
        return StackedGrad(FactoredGrad(tuple(terms)), stacked[path])
    return FactoredGrad(tuple(terms))


def use_terms(use: _tape.Use, g, record) -> dict:
    """{parameter name: term} of one use from its output gradient and recorded input (integer records
    back in their dtype). Below float32, `jaxdp.clipping.aggregation.clipped_aggregate` pins the terms that the
    norm and the clipped sum read separately (`jaxdp.core.terms.pinned`: one rounding for both)."""
    if jnp.issubdtype(use.record_dtype, jnp.integer):
        record = record.astype(use.record_dtype)
    return use.terms_fn(record, g)


def add_fallback_terms(terms_by_path: dict, loss_fn, graphdef, params, rest, batch, fallback: bool, *,
                       stacked: dict | None = None) -> None:
    """Adds a DenseTerm for every parameter no layer rule covered (or raises when `fallback` is False); a
    stacked parameter's (`stacked_paths`) with its layer axis first, (L, B, ...)."""
    missing = [path for path, _ in nnx.to_flat_state(params) if tuple(path) not in terms_by_path]
    if missing:
        for path, value in _fallback_grads(loss_fn, graphdef, params, rest, batch,
                                           missing, fallback).items():
            terms_by_path[path] = [DenseTerm(jnp.moveaxis(value, 1, 0) if path in (stacked or {}) else value)]


def _batch_axes(batch) -> tuple[str, ...]:
    """The shard_map axes any batch leaf varies over (empty outside shard_map)."""
    return tuple(sorted({a for leaf in jax.tree.leaves(batch) for a in _tape.varying_axes(leaf)}))


def _fallback_grads(loss_fn, graphdef, params, rest, batch, missing, enabled):
    """Exact per-example gradients of the parameters in `missing` only."""
    names = ", ".join("/".join(map(str, p)) for p in missing)
    if not enabled:
        raise ValueError(
            f"no per-example gradient rule covers parameter(s) {names}; build the model "
            "from jaxdp.core.nn layers, or pass fallback=True to per_example_grads to get "
            "their per-example gradients by vmap over examples.")
    missing = {tuple(p) for p in missing}
    flat = list(nnx.to_flat_state(params))
    values = {tuple(p): var.get_value() for p, var in flat if tuple(p) in missing}
    others = {tuple(p): var.get_value() for p, var in flat if tuple(p) not in missing}

    # Everything the model is built from is an argument (not a closure), so
    # that nnx transforms inside the model (nnx.remat) see one trace level.
    def one_example_loss(values, others, rest, example):
        others = jax.lax.stop_gradient(others)
        merged = nnx.from_flat_state([
            (p, var.replace(values[tuple(p)] if tuple(p) in values else others[tuple(p)]))
            for p, var in flat])
        model = nnx.merge(graphdef, merged, rest)
        example = jax.tree.map(lambda a: a[None], example)
        return loss_fn(model, example)[0]

    # Inside shard_map (check_vma=True) the gradient with respect to a value
    # replicated over an axis comes back summed over that axis; marking the
    # values varying like the batch keeps each device's per-example gradients its own.
    axes = _batch_axes(batch)
    values = jax.tree.map(lambda v: _tape.varying_like(v, axes), values)
    grad_fn = jax.vmap(jax.grad(one_example_loss), in_axes=(None, None, None, 0))
    return grad_fn(values, others, rest, batch)
