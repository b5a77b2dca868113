"""Layers stacked on a leading axis, run by `lax.scan`, with exact per-example gradients.

A model of L identical blocks may hold them as one module whose every variable has a leading layer
axis (`stack` of L built blocks) and run them with `scan_layers`: the body is traced and compiled
once, not L times. Model-agnostic: any module whose call is `apply(block, carry, *args) -> carry`.

Under `jaxdp.per_example_grads` the body's taps register one use each (`jaxdp.core._tape`, "Scanned
layers"); their slots carry the layer axis and enter the scan as xs, so the backward hands out every
layer's `(g, record)` stacked, and `per_example_grads` returns a `jaxdp.core.terms.StackedGrad` for each
stacked parameter, which `jaxdp.fused_clip` clips exactly as it clips the unrolled model's L layers
(same norms, same groups: layer l's parameters are the unrolled paths `(*stack path, l, ...)`).

For that the stacked module must carry the attribute `dp_path` (`stack` sets it; `per_example_grads`
labels it with the module's path). The stacked layers must not update their own state in the forward
(batch statistics, counters): the scan drops such updates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from flax import nnx

from jaxdp.core import _tape


def stack(blocks: Sequence[nnx.Module]) -> nnx.Module:
    """One module holding `blocks`' variables stacked on a leading layer axis (the blocks' values copied).

    The blocks must share one structure (the same graph and variable types: a block LoRA'd or frozen
    apart from the others cannot be stacked); ValueError otherwise.
    """
    if not blocks:
        raise ValueError("stack needs at least one block")
    graphdef, first = nnx.split(blocks[0])
    states = [first]
    for i, block in enumerate(blocks[1:], 1):
        other, state = nnx.split(block)
        if other != graphdef or jax.tree.structure(state) != jax.tree.structure(first):
            raise ValueError(f"stack: block {i} differs in structure from block 0 (modules, variable types "
                             "or frozen parameters); stacked layers must be alike")
        states.append(state)
    stacked = nnx.merge(graphdef, jax.tree.map(lambda *a: jax.numpy.stack(a), *states))
    stacked.dp_path = None  # labelled by per_example_grads: where the layer index goes in the unrolled paths
    return stacked


def num_layers(stacked: nnx.Module) -> int:
    """L, the leading axis of `stacked`'s variables."""
    leaves = jax.tree.leaves(nnx.state(stacked))
    if not leaves:
        raise ValueError("a stacked module must hold at least one variable")
    return leaves[0].shape[0]


def unstack(stacked: nnx.Module) -> list[nnx.Module]:
    """The L blocks of `stacked` (inverse of `stack`; values copied)."""
    graphdef, state = nnx.split(stacked)
    blocks = [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(num_layers(stacked))]
    for block in blocks:
        if hasattr(block, "dp_path"):
            del block.dp_path
    return blocks


def scan_layers(apply: Callable, stacked: nnx.Module, carry, *args):
    """`carry = apply(block_l, carry, *args)` for l = 0 .. L-1, block_l the l-th layer of `stacked`, as a
    `lax.scan`; returns the final carry. `args` are the same for every layer; `apply` may be wrapped in
    `nnx.remat` (remat inside the body). Exact under `per_example_grads` (module doc)."""
    graphdef, state = nnx.split(stacked)
    tape = _tape.current()
    if tape is None:
        def plain(c, layer_state):
            return apply(nnx.merge(graphdef, layer_state), c, *args), None
        return jax.lax.scan(plain, carry, state)[0]
    path = getattr(stacked, "dp_path", None)
    if path is None:
        raise ValueError(f"{type(stacked).__name__}: a stacked module run inside per_example_grads must come from "
                         "jaxdp.core.layer_scan.stack and be part of the model passed to per_example_grads")
    scan = tape.open_scan(path, num_layers(stacked))
    counts = dict(tape._counts)

    def body(c, layer):
        layer_state, layer_slots = layer
        with tape.inside(scan, layer_slots, counts):
            return apply(nnx.merge(graphdef, layer_state), c, *args), None
    return jax.lax.scan(body, carry, (state, tape.scan_slots(scan)))[0]
