"""Per-example norms and clipped sums when the sequence is sharded (context parallelism).

Under context parallelism a device holds a slice of every example's tokens,
so each linear layer's factored gradient `(x_s, g_s)` gives a PARTIAL
per-example gradient `G_b^s = x_{b,s}^T g_{b,s}`; the true one is
`G_b = sum_s G_b^s`. Norms of partials do not add
(`|G_b|^2 != sum_s |G_b^s|^2`), so:

- Linear / dense terms (input-stationary, as LongShield): every shard forms
  its partial `G_b^s` for a chunk of examples, `psum_scatter`s it over `seq`
  (each shard then owns 1/S of the exact `G_b`), squares its slice, and the
  (B,) partial squared norms are `psum`-ed, together with the (B,) partial
  magnitudes sum_t |x_t| |g_t| of `jaxdp.clipping.norms.rounding_bound`. No device holds a full per-example
  gradient; the traffic is B * params / S per device per layer, independent
  of T. (The ghost alternative needs the cross-shard T x T Gram matrices:
  an all-gather of x and g, T-proportional, and S-fold redundant FLOPs.)
- Embedding lookups (a (V, D) partial per example would be huge): the ids
  and output gradients are all-gathered over `seq` (B T (D + 1) floats, the
  size of one activation) and the exact single-device rule runs on them.
  A parameter with both (the tied embedding: lookup + output head) splits as
  |P + E|^2 = |P|^2 + 2 <P, E> + |E|^2 with P the sum of its partial terms
  (the head, reduce-scattered as above) and E the gathered lookup: the cross
  term is linear in the partials, so each shard pairs its LOCAL head term
  with the gathered lookup and the results are psum-ed. The head's output
  gradients (B T V: the logits' size) are never gathered.

Clipped sums are linear in the partials once the clip factors are known:
`sum_b c_b G_b = sum_s sum_b c_b G_b^s`, so each shard clips its partial
terms with the (global, identical) factors and the caller sums over `seq`
together with the data-parallel reduction: `jaxdp.clipped_aggregate(grads,
..., squared_norms_fn=functools.partial(squared_norms, axis="seq"))`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdp.clipping import norm_costs
from jaxdp.clipping import norms as norms_lib
from jaxdp.core.terms import EmbedTerm, FactoredGrad


def _gathered_lookup(term: EmbedTerm, axis: str) -> EmbedTerm:
    """The whole sequence's ids and output gradients of an embedding lookup (B T (D + 1) floats)."""
    gather = lambda a: jax.lax.all_gather(a, axis, axis=1, tiled=True)
    return EmbedTerm(gather(term.ids_BT), gather(term.g_BTD), term.num_embeddings)


def _slice_term(term, start, stop):
    return jax.tree.map(lambda a: a[start:stop], term)


def _partial_sq_norms(terms, axis: str, chunk_size: int) -> jax.Array:
    """This shard's part of |sum of partial terms|^2 per example (psum over `axis` to complete it):
    partials instantiated per chunk, reduce-scattered, squared."""
    S = jax.lax.axis_size(axis)
    B = terms[0].batch_size
    parts = []
    for start in range(0, B, chunk_size):
        stop = min(B, start + chunk_size)
        partial = sum(norms_lib.instantiated(_slice_term(t, start, stop)).astype(jnp.float32) for t in terms)
        flat = partial.reshape(stop - start, -1)
        pad = (-flat.shape[1]) % S
        if pad:
            flat = jnp.pad(flat, ((0, 0), (0, pad)))
        mine = jax.lax.psum_scatter(flat, axis, scatter_dimension=1, tiled=True)
        parts.append(jnp.sum(mine * mine, axis=1))
    return jnp.concatenate(parts)


def squared_norms(grad: FactoredGrad, axis: str, strategy: str = "auto", *,
                  chunk_size: int = norm_costs.DEFAULT_CHUNK_SIZE) -> tuple[jax.Array, jax.Array]:
    """Exact per-example squared norms (B,) of a gradient whose terms are sequence-shard partials,
    and their rounding bound (B,) (`jaxdp.clipping.norms.rounding_bound` of the whole sequence)."""
    partials = [t for t in grad.terms if not isinstance(t, EmbedTerm)]
    lookups = [_gathered_lookup(t, axis) for t in grad.terms if isinstance(t, EmbedTerm)]
    kw = dict(chunk_size=chunk_size)
    # A_b (the rounding bound's magnitude) is a sum over tokens: the partial terms' shares add over
    # the shards, in the same psum as the squared-norm parts.
    lookup_stats = [norms_lib.term_stats(t) for t in lookups]
    magnitude, underflow_scale = sum(a for a, _ in lookup_stats), sum(u for _, u in lookup_stats)
    total = 0.0
    if partials:
        partial_stats = [norms_lib.term_stats(t) for t in partials]
        local = jnp.stack([_partial_sq_norms(partials, axis, chunk_size),
                           sum(a for a, _ in partial_stats), sum(u for _, u in partial_stats)])
        total, partial_magnitude, partial_scale = jax.lax.psum(local, axis)
        magnitude, underflow_scale = magnitude + partial_magnitude, underflow_scale + partial_scale
    # The final sums err relative to |P| + |E| (`norms.rounding_bound`), not to the total they may cancel to.
    roots = jnp.sqrt(jnp.maximum(total, 0)) if partials else 0.0
    if lookups:
        lookup_sq, lookup_roots = norms_lib.squared_norms_and_roots(FactoredGrad(tuple(lookups)), strategy, **kw)
        total, roots = total + lookup_sq, roots + lookup_roots
    cross = [norms_lib.pair_inner(p, e, strategy, **kw) for p in partials for e in lookups]
    if cross:
        total = total + 2 * jax.lax.psum(sum(cross), axis)
    bound = norms_lib.rounding_bound(grad, roots, magnitude, seq_shards=jax.lax.axis_size(axis),
                                     underflow_scale_B=underflow_scale)
    return total, bound

