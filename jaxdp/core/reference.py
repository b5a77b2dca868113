"""Reference DP-SGD: per-example gradients by `jax.vmap(jax.grad)`, clip, sum.

The ground truth the fast paths are tested against, and the "explicit
per-example gradients" baseline (the approach of jax_privacy and Opacus):
it materialises B copies of the gradient. Written to be obviously right,
sharing no code with the fast path but the grouping convention.
"""

from __future__ import annotations

from typing import Callable, Hashable

import jax
import jax.numpy as jnp
from flax import nnx


def per_example_grads(loss_fn: Callable, model: nnx.Module, batch):
    """`{path: (B, *shape)}` per-example gradients of every nnx.Param, and the losses (B,)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    flat = list(nnx.to_flat_state(params))
    values = {tuple(p): var.get_value() for p, var in flat}

    def one_loss(values, rest, example):
        state = nnx.from_flat_state([(p, var.replace(values[tuple(p)])) for p, var in flat])
        example = jax.tree.map(lambda a: a[None], example)
        return loss_fn(nnx.merge(graphdef, state, rest), example)[0]

    losses = jax.vmap(one_loss, in_axes=(None, None, 0))(values, rest, batch)
    grads = jax.vmap(jax.grad(one_loss), in_axes=(None, None, 0))(values, rest, batch)
    return losses, grads


def group_key(path: tuple, clipping) -> Hashable:
    if clipping == "flat":
        return "all"
    if clipping == "per_layer":
        return tuple(path[:-1])
    return clipping(tuple(path))


def clipped_sum(grads: dict, l2_norm_clip: float, *, clipping="flat", clip_fn="abadi", gamma=0.01):
    """Sum of clipped per-example gradients `{path: (B, ...)}` -> `({path: sum}, {group: norms_B})`."""
    groups = {p: group_key(p, clipping) for p in grads}
    names = list(dict.fromkeys(groups.values()))
    threshold = l2_norm_clip / len(names) ** 0.5
    sq = {g: 0.0 for g in names}
    for p, G in grads.items():
        sq[groups[p]] = sq[groups[p]] + jnp.sum(G.reshape(G.shape[0], -1) ** 2, axis=1)
    norms = {g: jnp.sqrt(s) for g, s in sq.items()}
    finite = jnp.all(jnp.stack([jnp.isfinite(n) for n in norms.values()]), axis=0)
    if clip_fn == "abadi":
        factors = {g: jnp.minimum(1.0, threshold / n) for g, n in norms.items()}
    else:
        factors = {g: threshold / (n + gamma) for g, n in norms.items()}
    sums = {}
    for p, G in grads.items():
        c = jnp.where(finite, factors[groups[p]], 0)
        G = jnp.where(finite.reshape((-1,) + (1,) * (G.ndim - 1)), G, 0)
        sums[p] = jnp.tensordot(c, G, axes=1)
    return sums, norms


def dp_sgd_sum(loss_fn, model, batch, l2_norm_clip, **kwargs):
    """Noiseless DP-SGD clipped sum of `model` on `batch`: `({path: sum}, {group: norms_B})`."""
    _, grads = per_example_grads(loss_fn, model, batch)
    return clipped_sum(grads, l2_norm_clip, **kwargs)
