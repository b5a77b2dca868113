"""Per-example squared norms of factored gradients, without vmap over the model.

The squared norm of a parameter's per-example gradient G_b = sum_i T_i[b]
(one term per use) is sum_{i,j} <T_i[b], T_j[b]>. Each pair has an exact rule:

  Linear . Linear   ghost:        sum_{t,s} (x x'^T)[t,s] (g g'^T)[t,s]   2T^2(P+D) FLOPs
                    instantiate:  <x^T g, x'^T g'>                        2TPD FLOPs (x2 if i != j)
  Embed  . Embed    ghost:        sum_{t,s} [id_t = id'_s] <g_t, g'_s>   2T^2 D
                    instantiate:  rows of G summed by id (sort + segment_sum), |.|^2; self pairs only
  Linear . Embed    ghost:        sum_{t,s} x[t, id_s] <g_t, g'_s>       2T^2 D (tied head x embedding)
                    instantiate:  <(x^T g)[ids], g'>                      2TPD
  Dense  . any      <V, other>:   contract V with the other's factors    no instantiation

Work runs over chunks of `chunk_size` examples at a time (`jax.lax.map`), so
an instantiated gradient never exceeds `chunk_size` x parameter size and a
Gram matrix never exceeds `chunk_size` x T^2.

`strategy="auto"` picks ghost or instantiate per pair from `jaxdp.clipping.norm_costs`: the
least time (FLOPs at the device's matmul rate plus bytes at its bandwidth,
`jaxdp.clipping.device_rates`) among the choices whose scratch memory fits
`memory_budget_bytes` (per layer). For a parameter with one linear term (and possibly
embedding lookups: the tied GPT-2 embedding, `storable`) it may also keep the
per-example gradients G_b until the clip factors are known (`store`, what
makes vmap fast at small B x params): the norm squares them and the clipped
sum is sum_b c_b G_b, so the clipped-sum GEMM x^T diag(c) g is never run. `norm_costs.plan_stored` picks the
layers where that saves the most time per byte held, within a budget for
the bytes held in total (`jaxdp.clipping.aggregation.clipped_aggregate` applies it,
by default with 1/4 of the device's memory; `strategy="store"` stores every
such layer).
`strategy="pallas"` computes Linear self pairs with the Pallas kernels of
`jaxdp.pallas` (ghost or instantiate by FLOPs alone: neither kernel writes
scratch to memory; interpreted on CPU) and every other pair as "auto"
(`jaxdp.fused_clip` moves single-linear-term groups to the single-pass
kernel, which computes that self pair itself: `skip_self`).

Rounding. A squared norm is a sum of products that can cancel: one example
with tokens x_2 = x_1 and g_2 = -g_1 + small has a tiny true norm, and its
ghost norm (a sum of Gram products of size |x|^2 |g|^2) can come out 0 or
negative. The error of every rule here is at most a multiple of the
example's magnitude A_b^2, A_b = sum over terms of sum_t |x_bt| |g_bt|
(`term_stats`): `rounding_bound` returns kappa A_b^2 with
kappa = 2 u sqrt(K), u the unit roundoff of the accumulation dtype and K the
longest reduction over tokens, inputs or outputs (T + P + D for a linear
term), plus kappa(N) (sum_i |T_i|)^2 for the final sums over the N
entries of the gradient (`final_sums_bound`: relative to the terms' norms,
not to their total, which cancellation between terms can make tiny). The ghost rule's final sum over
T^2 Gram products is not a sum of N squares, but its row sums are
<x_t g_t^T, G> (at most |x_t| |g_t| |G|), so its partial sums stay within A
|G| when it is accumulated by rows or columns (measured at T = 2048 on
tokens built to cancel: errors <= 0.03 u A^2, against the bound's 2 u
sqrt(T + P + D) A^2 > 100 u A^2).
The sqrt(K) growth is the probabilistic rounding-error model of Higham & Mary
(2019, SIAM J. Sci. Comput. 41(5)); measured errors of the cancelling
construction were at most 0.52 u sqrt(K) A^2 (ghost, bfloat16 inputs, P = 768,
D = 3072) and far less for instantiate. The model assumes no underflow:
`underflow_bound` (also in `rounding_bound`) covers products and sums that
fall below the smallest normal number (x ~ 1e-20 with g ~ 1e18 gave a ghost
norm of 0). `jaxdp.clipping.rules.guarded_norms` turns (squared norm, bound) into
the norm the clip factor uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxdp.clipping import device_rates
from jaxdp.clipping.norm_costs import DEFAULT_CHUNK_SIZE, DEFAULT_MEMORY_BUDGET_BYTES, LayerShape, choose_method
from jaxdp.core.terms import DenseTerm, EmbedTerm, FactoredGrad, LinearTerm, Term, lookup

STRATEGIES = ("ghost", "instantiate", "store", "auto", "pallas")
# A parameter's per-example squared norms (B,) and a bound on their rounding error (B,), from its
# factored gradient: `squared_norms_with_bound` with fixed options, or
# `jaxdp.sharding.context_parallel.squared_norms` on sequence shards.
SquaredNormsFn = Callable[[FactoredGrad], tuple[jax.Array, jax.Array]]


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def _acc(*arrays):
    return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)


def _arrays(term: Term) -> tuple[jax.Array, ...]:
    if isinstance(term, LinearTerm):
        return term.x_BTP, term.g_BTD
    if isinstance(term, EmbedTerm):
        return (term.g_BTD,)
    return (term.value_B,)


def _f(a, dtype):
    return a.astype(dtype)


def _dot(spec: str, *arrays) -> jax.Array:
    """einsum accumulating in float32 (float64 for float64) with exactly rounded products.

    bf16 / f16 operands stay in their dtype (their products are exact in
    float32: tensor-core speed, nothing rounded before the sum); wider ones
    run at HIGHEST precision, never TF32, whose 10-bit inputs would void
    `rounding_bound`.
    """
    acc = _acc(*arrays)
    if jnp.result_type(*arrays) in (jnp.bfloat16, jnp.float16):
        return jnp.einsum(spec, *arrays, preferred_element_type=acc)
    return jnp.einsum(spec, *[a.astype(acc) for a in arrays], precision=jax.lax.Precision.HIGHEST)


# Per-example pair rules: arguments have no batch axis.

def _linear_ghost(x, g, x2, g2):
    return jnp.sum(_dot("tp,sp->ts", x, x2) * _dot("td,sd->ts", g, g2))


def _linear_instantiate(x, g, x2, g2):
    G = _dot("tp,td->pd", x, g)
    if x2 is x and g2 is g:
        return jnp.sum(G * G)
    return jnp.sum(G * _dot("tp,td->pd", x2, g2))


def _embed_ghost(ids, g, ids2, g2):
    return jnp.sum(jnp.where(ids[:, None] == ids2[None, :], _dot("td,sd->ts", g, g2), 0))


def _row_sums(ids_T, g_TD, dt):
    """One example's lookups summed by id, in `dt`: (sorted ids, each one's segment, segment sums (T, D)).
    The per-example embedding gradient has at most T non-zero rows: these."""
    order = jnp.argsort(ids_T)
    ids = ids_T[order]
    segment = jnp.cumsum(jnp.concatenate([jnp.zeros((1,), jnp.int32), (ids[1:] != ids[:-1]).astype(jnp.int32)]))
    return ids, segment, jax.ops.segment_sum(_f(g_TD, dt)[order], segment, num_segments=ids_T.shape[0])


def _embed_instantiate(ids, g):
    rows = _row_sums(ids, g, _acc(g))[2]
    return jnp.sum(rows * rows)


def _linear_embed_ghost(x, g, ids, g2):
    dt = _acc(x, g, g2)
    x_at_ids = jnp.take(_f(x, dt), ids, axis=1)                # (T, S): x[t, id_s]
    return jnp.sum(x_at_ids * _dot("td,sd->ts", g, g2))


def _linear_embed_instantiate(x, g, ids, g2):
    G = _dot("tp,td->pd", x, g)
    return jnp.sum(G[ids] * _f(g2, G.dtype))


def _dense_with(value, term_arrays, kind, num_embeddings=None):
    dt = _acc(value, *term_arrays)
    value = _f(value, dt)
    if kind == "dense":
        (other,) = term_arrays
        return jnp.sum(value * _f(other, dt))
    if kind == "linear":
        x, g = term_arrays
        return jnp.einsum("tp,pd,td->", _f(x, dt), value, _f(g, dt), precision=jax.lax.Precision.HIGHEST)
    ids, g = term_arrays
    return jnp.sum(value[ids] * _f(g, dt))


# Dispatch.

def _per_example(fn, arrays, chunk_size):
    """fn over examples, `chunk_size` examples at a time."""
    if chunk_size >= arrays[0].shape[0]:
        return jax.vmap(fn)(*arrays)
    return jax.lax.map(lambda a: fn(*a), arrays, batch_size=chunk_size)


def _method(strategy, kind, a, b, chunk_size, memory_budget_bytes):
    if strategy != "auto":
        return strategy
    if kind == "linear":
        B, T, P = a.x_BTP.shape
        shape = LayerShape(B, T, P, a.g_BTD.shape[-1], a.x_BTP.dtype.itemsize, S=b.x_BTP.shape[1])
        return choose_method(kind, shape, chunk_size=chunk_size, memory_budget_bytes=memory_budget_bytes,
                             rates=device_rates.current())
    if kind == "embed":
        B, T, D = a.g_BTD.shape
        shape = LayerShape(B, T, a.num_embeddings, D, S=b.g_BTD.shape[1])
        return choose_method(kind, shape, chunk_size=chunk_size, memory_budget_bytes=memory_budget_bytes)
    B, T, P = a.x_BTP.shape
    shape = LayerShape(B, T, P, a.g_BTD.shape[-1], a.x_BTP.dtype.itemsize, S=b.g_BTD.shape[1])
    return choose_method(kind, shape, chunk_size=chunk_size, memory_budget_bytes=memory_budget_bytes)


def storable(grad: FactoredGrad) -> LinearTerm | None:
    """The linear term of a parameter whose per-example gradients `store` can keep: one linear term,
    plus any embedding lookups (the tied GPT-2 embedding), no dense term. None otherwise."""
    linear = [t for t in grad.terms if isinstance(t, LinearTerm)]
    ok = len(linear) == 1 and all(isinstance(t, (LinearTerm, EmbedTerm)) for t in grad.terms)
    return linear[0] if ok else None


def instantiated(term: Term) -> jax.Array:
    """A linear or dense term's per-example gradients (B, *shape) at float32 or wider, the products exact
    (`_dot`: bf16 stays bf16 into a float32 accumulation, float32 never runs as TF32) -- what a norm may
    square. `jaxdp.core.terms.instantiate` is the plain-einsum version for tests."""
    if isinstance(term, LinearTerm):
        return _dot("btp,btd->bpd", term.x_BTP, term.g_BTD)
    if isinstance(term, DenseTerm):
        return term.value_B.astype(_acc(term.value_B))
    raise TypeError(f"instantiated takes linear or dense terms, got {type(term).__name__}")


def per_example_gradients(grad: FactoredGrad) -> jax.Array:
    """G_b of every example, (B, *shape), of a `storable` parameter: x_b^T g_b (float32 accumulation,
    float64 for float64), plus each lookup's rows g_bt added at its ids.

    Kept in the inputs' dtype (bf16 inputs: bf16 G_b, half the bytes to write, norm and sum). Rounding
    G_b cannot break the bound: the norm that clips is taken of this array, and the clipped sum is c_b
    times this same array (`materialized_clipped_sum`). The lookups of one id are summed in float32
    before they meet G_b (`_add_lookups`): a bf16 running sum would stall (1000 lookups of 1.0 gave 256).
    """
    linear = storable(grad)
    total = instantiated(linear).astype(jnp.result_type(linear.x_BTP, linear.g_BTD))
    for term in grad.terms:
        if isinstance(term, EmbedTerm):
            total = jax.vmap(_add_lookups)(total, *lookup(term))
    return total


def _add_lookups(G_VD: jax.Array, ids_T: jax.Array, g_TD: jax.Array) -> jax.Array:
    """G_VD with sum_{t: ids_t = v} g_t added to each row v, each row's lookups summed at float32 or wider
    and rounded into G_VD's dtype once (only the <= T rows looked up are read and written)."""
    T, V = ids_T.shape[0], G_VD.shape[0]
    acc = jnp.promote_types(_acc(g_TD), G_VD.dtype)
    ids, segment, sums = _row_sums(ids_T.astype(jnp.int32), g_TD, acc)
    rows = jnp.full((T,), V, ids.dtype).at[segment].set(ids)  # each segment's id; unused segments: V
    updated = G_VD.at[rows].get(mode="fill", fill_value=0).astype(acc) + sums
    return G_VD.at[rows].set(updated.astype(G_VD.dtype), mode="drop")  # row V (unused) is dropped


def _linear_self_pallas(term: LinearTerm, chunk_size: int) -> jax.Array:
    """||x_b^T g_b||^2 by a Pallas kernel: ghost (Gram tiles) or instantiate (G tiles), by the cost model."""
    from jaxdp import pallas as pallas_lib  # imports jax.experimental.pallas only when used
    method = _method("auto", "linear", term, term, chunk_size, math.inf)
    if method == "ghost":
        return pallas_lib.linear_ghost_sq_norms(term.x_BTP, term.g_BTD)
    return pallas_lib.linear_sq_norms(term.x_BTP, term.g_BTD)


def pair_inner(a: Term, b: Term, strategy: str = "auto", *, chunk_size: int = DEFAULT_CHUNK_SIZE,
               memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> jax.Array:
    """Per-example inner products <a[b], b[b]> of two terms of one parameter, shape (B,)."""
    if strategy == "pallas":
        if isinstance(a, LinearTerm) and a is b:
            return _linear_self_pallas(a, chunk_size)
        strategy = "auto"
    if strategy == "store":  # stored gradients are `jaxdp.clipping.aggregation.clipped_aggregate`'s; any other pair: auto
        strategy = "auto"
    if isinstance(b, DenseTerm) and not isinstance(a, DenseTerm):
        a, b = b, a
    if isinstance(a, DenseTerm):
        if isinstance(b, DenseTerm):
            return _per_example(lambda v, o: _dense_with(v, (o,), "dense"), (a.value_B, b.value_B), chunk_size)
        if isinstance(b, LinearTerm):
            return _per_example(lambda v, x, g: _dense_with(v, (x, g), "linear"),
                                (a.value_B, b.x_BTP, b.g_BTD), chunk_size)
        return _per_example(lambda v, i, g: _dense_with(v, (i, g), "embed"),
                            (a.value_B, *lookup(b)), chunk_size)
    if isinstance(a, EmbedTerm) and isinstance(b, LinearTerm):
        a, b = b, a
    if isinstance(a, LinearTerm) and isinstance(b, LinearTerm):
        method = _method(strategy, "linear", a, b, chunk_size, memory_budget_bytes)
        fn = _linear_ghost if method == "ghost" else _linear_instantiate
        if a is b:
            return _per_example(lambda x, g: fn(x, g, x, g), (a.x_BTP, a.g_BTD), chunk_size)
        return _per_example(fn, (a.x_BTP, a.g_BTD, b.x_BTP, b.g_BTD), chunk_size)
    if isinstance(a, EmbedTerm) and isinstance(b, EmbedTerm):
        method = _method(strategy, "embed", a, b, chunk_size, memory_budget_bytes)
        if a is b and method == "instantiate":
            return _per_example(_embed_instantiate, lookup(a), chunk_size)
        return _per_example(_embed_ghost, (*lookup(a), *lookup(b)), chunk_size)
    method = _method(strategy, "linear_embed", a, b, chunk_size, memory_budget_bytes)
    fn = _linear_embed_ghost if method == "ghost" else _linear_embed_instantiate
    return _per_example(fn, (a.x_BTP, a.g_BTD, *lookup(b)), chunk_size)


# Rounding-error bound.

ROUNDING_SAFETY = 2.0  # lambda in kappa = lambda u sqrt(K)


def _sum_and_max(p, q):
    # One function, not a lambda per call: lax.reduce caches its traced reducer by function, so an
    # eager row_stats reuses its compiled reduction instead of lowering a new one every call.
    return p[0] + q[0], jnp.maximum(p[1], q[1])


def row_stats(a: jax.Array, dt) -> tuple[jax.Array, jax.Array]:
    """(sum a^2, max |a|) over the last axis, in `dt`, from ONE variadic reduction (one kernel, one
    read of `a`: the step reads every layer's x and g, and every kept G_b, for these)."""
    a = a.astype(dt)
    return jax.lax.reduce((jnp.square(a), jnp.abs(a)), (jnp.zeros((), dt), jnp.zeros((), dt)),
                          _sum_and_max, (a.ndim - 1,))


def term_stats(term: Term) -> tuple[jax.Array, jax.Array]:
    """(A_b, U_b), each (B,), in the accumulation dtype.

    A_b (the magnitude): sum_t |x_bt| |g_bt| (linear), sum_t |g_bt| (lookup), |V_b| (dense). Every
    entry of the term's per-example gradient, and every product of two of them, is bounded through A_b:
    |G_b|_F <= A_b, |<G_b, G'_b>| <= A_b A'_b (`rounding_bound`).

    U_b (the underflow scale): sum over tokens of max_p |x_tp| + max_d |g_td| (lookups: 1 + max_d
    |g_td|; dense: 1 + max |V_b|) over the tokens whose x_t and g_t are not zero (the others add exact
    zeros to every rule, so an all-zero example, e.g. a padded one, has U_b = 0 and keeps norm 0). No
    square is taken, so it neither underflows nor overflows where a norm would (`underflow_bound`).
    """
    dt = _acc(*_arrays(term))
    live = lambda peak, u: jnp.where(peak > 0, u, 0)
    if isinstance(term, LinearTerm):
        (x_sq, x_peak), (g_sq, g_peak) = row_stats(term.x_BTP, dt), row_stats(term.g_BTD, dt)
        return (jnp.sum(jnp.sqrt(x_sq) * jnp.sqrt(g_sq), axis=1),
                jnp.sum(live(jnp.minimum(x_peak, g_peak), x_peak + g_peak), axis=1))
    if isinstance(term, EmbedTerm):
        g_sq, g_peak = row_stats(term.g_BTD, dt)
        return jnp.sum(jnp.sqrt(g_sq), axis=1), jnp.sum(live(g_peak, 1 + g_peak), axis=1)
    v_sq, v_peak = row_stats(term.value_B.reshape(term.value_B.shape[0], -1), dt)
    return jnp.sqrt(v_sq), live(v_peak, 1 + v_peak)


def squares_underflow(N: int, dtype) -> float:
    """4 mu N: what underflow can take from a sum of N squares (each square or partial sum below the
    smallest normal number mu is flushed to zero or kept subnormal, an absolute error below mu)."""
    return 4 * float(jnp.finfo(dtype).tiny) * N


def underflow_bound(grad: FactoredGrad, scale_B: jax.Array | None = None, *, seq_shards: int = 1) -> jax.Array:
    """A bound (B,) on what underflow can change in the squared norms of `grad` under any strategy:
    4 mu N (T + 1) U_b^2 + squares_underflow((T^2 + N) n^2), U_b the terms' `term_stats` scales
    summed, N the parameter's entries, T the tokens, n the terms, mu the accumulation dtype's smallest
    normal number.

    Why: every product or partial sum below mu loses at most mu. A ghost Gram entry (a sum over P)
    then errs by at most 2 P mu and meets the other Gram's entries, at most D max|g_t| max|g_s|
    (ghost: 2 P D mu (sum_t max|g_t|)^2 + the same with x); an instantiated entry (a sum over T) errs
    by at most 2 T mu and is squared with entries at most sum_t max|x_t| max|g_t| (instantiate:
    4 N T mu (sum_t max|x_t|) (sum_t max|g_t|)); the T^2 or N final products may each lose mu. Without
    it an example with x ~ 1e-20, g ~ 1e18 (|G| ~ 1.5) had a ghost norm of 0 and went through
    unclipped (100 C); for ordinary data it is ~1e-20 of the norm. `scale_B` defaults to the terms'
    scales summed (the context-parallel step passes the sum over sequence shards).
    """
    if scale_B is None:
        scale_B = sum(term_stats(t)[1] for t in grad.terms)
    dtype = _acc(*[a for t in grad.terms for a in _arrays(t)])
    N = math.prod(grad.shape)
    T = max((t.g_BTD.shape[1] if not isinstance(t, DenseTerm) else 1) for t in grad.terms) * seq_shards
    scale_B = scale_B.astype(dtype)
    scaled = math.sqrt(squares_underflow(N * (T + 1), dtype)) * scale_B  # no overflow of U^2
    return scaled * scaled + jnp.where(scale_B > 0, squares_underflow((T * T + N) * len(grad.terms) ** 2, dtype), 0)


def _reduction_length(term: Term, seq_shards: int) -> int:
    if isinstance(term, LinearTerm):
        return term.x_BTP.shape[1] * seq_shards + term.x_BTP.shape[2] + term.g_BTD.shape[2]
    if isinstance(term, EmbedTerm):
        return term.ids_BT.shape[1] * seq_shards + term.g_BTD.shape[2]
    return math.prod(term.shape)


def rounding_coefficient(grad: FactoredGrad, *, seq_shards: int = 1) -> float:
    """kappa = ROUNDING_SAFETY u sqrt(K): the squared norm's rounding error is at most kappa A_b^2.

    `seq_shards`: the terms hold one of that many sequence shards (context
    parallel), so reductions over tokens are that many times longer.
    """
    K = max(_reduction_length(t, seq_shards) for t in grad.terms)
    return _coefficient(_acc(*[a for t in grad.terms for a in _arrays(t)]), K)


def _coefficient(dtype, K: int) -> float:
    return ROUNDING_SAFETY * float(jnp.finfo(dtype).eps) / 2 * math.sqrt(K)


def final_sums_bound(roots_B: jax.Array, N: int) -> jax.Array:
    """kappa(N) roots_B^2 (B,): a bound on the rounding error of final sums over N entries whose terms
    have norms adding up to roots_B (a materialised gradient's sum of squares: roots_B = its norm). No
    cancellation inside such a sum can shrink the bound: it scales with the parts, in the same rounding
    model as `rounding_bound`; above `jaxdp.clipping.rules.ROUNDING_DELTA` from N ~ 4e6 float32 entries
    (GPT-2's tied head: 3.9e7)."""
    scaled = math.sqrt(_coefficient(roots_B.dtype, N)) * roots_B  # no overflow of roots^2
    return scaled * scaled


def rounding_bound(grad: FactoredGrad, roots_B: jax.Array, magnitude_B: jax.Array | None = None, *,
                   seq_shards: int = 1, underflow_scale_B: jax.Array | None = None) -> jax.Array:
    """A bound (B,) on |computed - true| of the squared norms of `grad` under any strategy: kappa A_b^2
    for the products, Gram entries and cancelling sums (module docstring), plus `final_sums_bound(roots_B,
    N)` for the final sums over the gradient's N entries (instantiate, the kernels), plus
    `underflow_bound(grad, underflow_scale_B)`.

    `roots_B`: the sum over terms of |T_i| as computed (`squared_norms_and_roots`), or sqrt(s) where
    the squared norm s is one sum of squares of the combined gradient. `magnitude_B` defaults to the
    sum of the terms' `term_stats` magnitudes (the context-parallel step passes the sum over sequence
    shards, and so `underflow_scale_B`).
    """
    if magnitude_B is None or underflow_scale_B is None:
        stats = [term_stats(t) for t in grad.terms]  # one reduction of each x and g for both
        magnitude_B = sum(a for a, _ in stats) if magnitude_B is None else magnitude_B
        underflow_scale_B = sum(u for _, u in stats) if underflow_scale_B is None else underflow_scale_B
    scaled = math.sqrt(rounding_coefficient(grad, seq_shards=seq_shards)) * magnitude_B  # no overflow of A^2
    return (scaled * scaled + final_sums_bound(roots_B.astype(scaled.dtype), math.prod(grad.shape))
            + underflow_bound(grad, underflow_scale_B, seq_shards=seq_shards))


def squared_norms_with_bound(grad: FactoredGrad, strategy: str = "auto", **kwargs) -> tuple[jax.Array, jax.Array]:
    """(`squared_norms(grad, strategy, **kwargs)`, their `rounding_bound`): the default `SquaredNormsFn`."""
    sq, roots = squared_norms_and_roots(grad, strategy=strategy, **kwargs)
    return sq, rounding_bound(grad, roots)


def squared_norms(grad: FactoredGrad, strategy: str = "auto", *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                  memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
                  skip_self: int | None = None) -> jax.Array:
    """Per-example squared L2 norms (B,) of a parameter's factored gradient, cross terms included.

    `skip_self=i` leaves out the self pair <T_i, T_i> (computed elsewhere, e.g.
    by the single-pass kernel); the result is then zeros if nothing is left.
    """
    return squared_norms_and_roots(grad, strategy, chunk_size=chunk_size, memory_budget_bytes=memory_budget_bytes,
                                   skip_self=skip_self)[0]


def squared_norms_and_roots(grad: FactoredGrad, strategy: str = "auto", *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                            memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
                            skip_self: int | None = None) -> tuple[jax.Array, jax.Array]:
    """(`squared_norms(...)`, the sum over the self pairs it computed of sqrt(<T_i, T_i>)), (B,) each.

    The second scales the rounding of the final sums (`rounding_bound`): a pair's final sum errs
    relative to |T_i| |T_j|, not to the total, which cancellation between terms can make tiny.
    """
    check_strategy(strategy)
    kw = dict(chunk_size=chunk_size, memory_budget_bytes=memory_budget_bytes)
    terms = grad.terms
    total = jnp.zeros((grad.batch_size,), jnp.float32)
    roots = jnp.zeros((grad.batch_size,), jnp.float32)
    for i, a in enumerate(terms):
        for j in range(i, len(terms)):
            if i == j == skip_self:
                continue
            inner = pair_inner(a, terms[j], strategy, **kw)
            if i == j:
                roots = roots + jnp.sqrt(jnp.maximum(inner, 0))
            total = total + (inner if i == j else 2 * inner)
    return total, roots
