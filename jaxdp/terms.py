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


def is_factored(x) -> bool:
    return isinstance(x, FactoredGrad)


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
        return jax.vmap(one)(term.ids_BT, term.g_BTD)
    raise TypeError(f"unknown term type {type(term).__name__}")
