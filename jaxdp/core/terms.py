"""Factored per-example gradients.

`per_example_grads` returns, for every parameter, the per-example gradient in
factored form: a `FactoredGrad` holding one term per use of the parameter in
the forward pass (a tied embedding has two). The per-example gradient of
example b is the sum of its terms' gradients; nothing of size B x params is
ever materialised unless a norm strategy instantiates a chunk of it.

Terms:
    `LinearTerm(x_BTP, g_BTD)`   G_b = x_b^T g_b              shape (P, D)
    `EmbedTerm(ids_BT, g_BTD)`   G_b = sum_t onehot(ids_bt) g_bt  shape (V, D)
    `DenseTerm(value_B)`         G_b = value_B[b]             any shape

A parameter stacked over layers (a scanned model) has a `StackedGrad`: a FactoredGrad whose arrays lead
with the layer axis.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearTerm:
    """Per-example gradient `x_b^T g_b` of a (P, D) matrix used as `x @ W`."""

    x_BTP: jax.Array
    g_BTD: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.x_BTP.shape[-1], self.g_BTD.shape[-1])

    @property
    def batch_size(self) -> int:
        return self.x_BTP.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EmbedTerm:
    """Per-example gradient of a (V, D) table looked up as `table[ids]`."""

    ids_BT: jax.Array
    g_BTD: jax.Array
    num_embeddings: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_embeddings, self.g_BTD.shape[-1])

    @property
    def batch_size(self) -> int:
        return self.ids_BT.shape[0]


def lookup(term: EmbedTerm) -> tuple[jax.Array, jax.Array]:
    """(ids, g) of the rows `term` adds to, in the one convention every norm rule and the clipped sum
    read (so the norm that clips counts exactly the rows the sum adds): an id in [-V, 0) is row id + V,
    as `jnp.take` wraps it in the forward; a token whose id lies outside [-V, V) adds nothing (its g is
    zeroed and its id set to 0). Without this, ids -1 and V - 1 (a -1 padding id reaching the table)
    were two rows to the norm and one to the forward and the sum: 1.41 C got through."""
    V = term.num_embeddings
    ids = term.ids_BT.astype(jnp.int32)
    ids = jnp.where(ids < 0, ids + V, ids)
    valid = (ids >= 0) & (ids < V)
    return jnp.where(valid, ids, 0), jnp.where(valid[..., None], term.g_BTD, jnp.zeros((), term.g_BTD.dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseTerm:
    """A materialised per-example gradient with a leading batch axis."""

    value_B: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value_B.shape[1:])

    @property
    def batch_size(self) -> int:
        return self.value_B.shape[0]


Term = Union[LinearTerm, EmbedTerm, DenseTerm]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FactoredGrad:
    """The per-example gradient of one parameter: the sum of `terms`."""

    terms: tuple[Term, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.terms[0].shape

    @property
    def batch_size(self) -> int:
        return self.terms[0].batch_size


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedGrad:
    """The per-example gradient of a parameter stacked over L layers (`jaxdp.core.layer_scan`).

    `grad`'s terms carry a leading layer axis before the batch axis: slice l (`layer(l)`) is layer l's
    FactoredGrad, what the unrolled model's layer l has. `layer_axis_at` is where the layer index goes in
    the parameter's path to give the unrolled path (the stacked module's path length): clipping groups
    and thresholds are those of the unrolled model.
    """

    grad: FactoredGrad
    layer_axis_at: int = dataclasses.field(metadata=dict(static=True))

    @property
    def num_layers(self) -> int:
        return jax.tree.leaves(self.grad)[0].shape[0]

    @property
    def shape(self) -> tuple[int, ...]:
        one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), self.grad)
        return (self.num_layers,) + tuple(one.shape)

    @property
    def batch_size(self) -> int:
        return jax.tree.leaves(self.grad)[0].shape[1]

    def layer(self, index: int) -> FactoredGrad:
        return jax.tree.map(lambda a: a[index], self.grad)

    def layer_path(self, path: tuple, index: int) -> tuple:
        """The unrolled model's path of layer `index`'s slice of the parameter at `path`."""
        return tuple(path[:self.layer_axis_at]) + (index,) + tuple(path[self.layer_axis_at:])


def is_stacked(x) -> bool:
    return isinstance(x, StackedGrad)


def below_float32(dtype) -> bool:
    """A floating dtype of fewer than 32 bits (bf16, f16): one whose rounding the DP paths must pin."""
    return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def pinned(grad: FactoredGrad) -> FactoredGrad:
    """`grad` with its arrays below float32 through one optimization barrier, so that the norm and the
    clipped sum, which read them separately, read one rounding.

    Under jit, XLA's excess precision (on by default) may fold convert(convert(v, bf16), float32) into
    v, handing one consumer of a bf16 array the unrounded float32 value it was rounded from while
    another reads the rounded one: a norm of one rounding and a sum of the other (one example's
    contribution reached 1.0005 C through the output gradients, 1.00002 C through the recorded inputs;
    tests/test_norm_rounding.py). For the parameters whose per-example gradients are not kept
    (`jaxdp.clipping.aggregation.clipped_aggregate`): a kept G_b has one consumer of (x, g), the GEMM that makes
    it, and pinning its recorded inputs would keep them alive as bf16 buffers next to what the
    backward already holds (XLA would otherwise recompute them inside the GEMM's fusion)."""
    leaves, treedef = jax.tree.flatten(grad)
    low = [i for i, leaf in enumerate(leaves) if below_float32(leaf.dtype)]
    if low:
        for i, leaf in zip(low, jax.lax.optimization_barrier([leaves[i] for i in low])):
            leaves[i] = leaf
    return jax.tree.unflatten(treedef, leaves)


def is_factored(x) -> bool:
    """A per-example gradient leaf: a FactoredGrad or a StackedGrad."""
    return isinstance(x, (FactoredGrad, StackedGrad))


def as_factored(leaf) -> FactoredGrad:
    """A FactoredGrad as is; a plain array of per-example gradients (B, ...) as a DenseTerm."""
    if isinstance(leaf, FactoredGrad):
        return leaf
    return FactoredGrad((DenseTerm(jnp.asarray(leaf)),))


def instantiate(term: Term) -> jax.Array:
    """Materialises a term's per-example gradients, shape (B, *param_shape).

    For tests, small parameters and chunks of examples only: the memory is
    B x parameter size.
    """
    if isinstance(term, DenseTerm):
        return term.value_B
    if isinstance(term, LinearTerm):
        return jnp.einsum("btp,btd->bpd", term.x_BTP, term.g_BTD)
    if isinstance(term, EmbedTerm):
        def one(ids_T, g_TD):
            return jnp.zeros(term.shape, g_TD.dtype).at[ids_T].add(g_TD)
        return jax.vmap(one)(*lookup(term))
    raise TypeError(f"unknown term type {type(term).__name__}")


def group_examples(grads, size: int):
    """Per-unit gradients from per-example ones: examples `[u*size, (u+1)*size)` are unit u.

    A unit's gradient is the sum of its examples' gradients, still factored:
    a linear or embedding term of B examples of T tokens becomes one of
    B / size units of size * T tokens (a reshape, no copy), a dense term is
    summed over each unit's examples. Clipping the result bounds each unit's
    whole contribution (user- or document-level DP; `config.privacy.unit`).

    Args:
      grads: a tree whose leaves are `FactoredGrad`s or plain (B, ...) arrays
        of per-example gradients (as `fused_clip` takes them).
      size: examples per unit, >= 1, dividing B.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be an integer >= 1, got {size!r}")
    if size == 1:
        return grads

    def units(a):
        if a.shape[0] % size:
            raise ValueError(f"a batch of {a.shape[0]} examples does not split into units of {size}")
        return a.shape[0] // size

    def tokens(a):  # (B, T, ...) -> (U, size * T, ...)
        return a.reshape((units(a), size * a.shape[1]) + a.shape[2:])

    def dense(a):
        return a.reshape((units(a), size) + a.shape[1:]).sum(axis=1, dtype=jnp.promote_types(a.dtype, jnp.float32))

    def term(t):
        if isinstance(t, LinearTerm):
            return LinearTerm(tokens(t.x_BTP), tokens(t.g_BTD))
        if isinstance(t, EmbedTerm):
            return EmbedTerm(tokens(t.ids_BT), tokens(t.g_BTD), t.num_embeddings)
        return DenseTerm(dense(t.value_B))

    def leaf(g):
        if isinstance(g, StackedGrad):
            return StackedGrad(jax.vmap(leaf)(g.grad), g.layer_axis_at)
        if isinstance(g, FactoredGrad):
            return FactoredGrad(tuple(term(t) for t in g.terms))
        return dense(jnp.asarray(g))

    return jax.tree.map(leaf, grads, is_leaf=is_factored)
