"""Flat-clipped gradient sums in two backward passes, keeping no layer's input and output gradient.

Book-keeping (`per_example_grads` -> `clipped_aggregate`) keeps every DP
layer's input x and output gradient g until all norms are known, since flat
clipping needs every layer's norm before any clipped sum: memory of the order
of every layer's activations, which activation checkpointing cannot reduce.
`two_pass_clipped_sums` trades compute for that memory (ghost clipping as in
Li et al. 2022, arXiv:2110.05679, and Opacus):

1. norms: a forward and backward pass in which every DP layer's tap reduces
   its `(x, g)` to per-example squared norms and their rounding bounds
   (`jaxdp.clipping.norms.rounding_bound`) inside that layer's backward
   (`jaxdp.core._tape` mode "norms") and drops them. Only a parameter with
   several uses (the tied embedding: lookup and head) keeps its terms, for
   its cross terms; parameters without a layer rule get per-example
   gradients by vmap, as in `per_example_grads`.
2. weighted: the ordinary gradient of `sum_b c_b loss_b` with the clip
   factors `c_b` held constant, which is `sum_b c_b G_b`: the clipped sum.

Memory: each pass alone is the non-DP step's (plus B floats per parameter
and the kept terms of multi-use parameters), so with activation
checkpointing DP should need what non-DP needs; XLA:GPU's compile with
remat bears this out (it fits non-DP's longest context, book-keeping a little
less: WORKSPACE.md, "Long context"). XLA:CPU schedules two
backward passes in one program worse than one, so on CPU this function needs
more temporaries than book-keeping, about what two plain non-DP gradients in
sequence need (WORKSPACE.md, "Two methods for flat clipping").
Compute: two forward and two backward passes plus the norms (book-keeping:
one of each, the norms and one clipped GEMM per layer).

Dropped examples (a non-finite norm): `c_b = 0` alone does not remove
example b from pass 2 (0 x inf is NaN inside its GEMMs), so pass 2 runs with
every dropped example replaced by a kept one, weighted 0. The kept example's
per-example gradient is finite (its squared norm is), and pass 2 recomputes
the same forward, so it adds exact zeros.

Flat clipping only: per-group factors would need a different weight per
group inside one backward pass.

Float32 only. Pass 2 scales example b's output gradient by c_b at the top
and runs the backward again; below float32 every layer rounds the scaled
gradients differently from pass 1's unscaled ones, so c_b times pass 2's
gradient is not c_b times the gradient pass 1 measured: in bfloat16 one
example's contribution reached 1.0026 C (tiny GPT-2, 6 seeds), over the
C * SENSITIVITY_FACTOR = 1.000122 C the noise is calibrated to. A model that
records bf16 / f16 values is refused (`allow_low_precision=True` runs it
anyway, for memory and speed measurements that release nothing); the
book-keeping step (`per_example_grads` + `fused_clip`) bounds bf16 exactly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdp.clipping import norms as norms_lib
from jaxdp.clipping import rules as clipping_lib
from jaxdp.clipping.settings import ClipSpec, NormPlan, accepts_old_keywords, check_clip_spec, check_norm_plan
from jaxdp.core import _tape
from jaxdp.core.per_example import (
    LossFn,
    add_fallback_terms,
    discover,
    term_slots,
    use_terms,
)
from jaxdp.core.terms import FactoredGrad, below_float32


@accepts_old_keywords
def two_pass_clipped_sums(loss_fn: LossFn, l2_norm_clip: float, *, clip: ClipSpec = ClipSpec(),
                          norms: NormPlan = NormPlan(), fallback: bool = True,
                          squared_norms_fn: norms_lib.SquaredNormsFn | None = None):
    """Makes `fn(model, batch) -> (losses, sums, norms)`: flat-clipped per-example gradient sums in two passes.

    `sums` has the structure of `nnx.state(model, nnx.Param)` and equals the
    `sums` of `jaxdp.clipped_aggregate(per_example_grads(loss_fn)(model, batch)[1],
    l2_norm_clip, clip=clip, ...)`; `norms` are the per-example norms (B,).
    Noise is not added: see `jaxdp.sharding.ShardedDPStep(method="two_pass")`.

    Args:
      loss_fn: `loss_fn(model, batch) -> losses (B,)`, as for `per_example_grads`.
        Every batch leaf with a leading axis of size B is per-example.
      l2_norm_clip: C > 0.
      clip: a flat `jaxdp.ClipSpec` (its clip_fn and gamma; one group only).
      norms: how each parameter's norm is formed (`jaxdp.NormPlan`: strategy, chunk_size,
        memory_budget_bytes; `jaxdp.clipping.norms.squared_norms_with_bound`), ignored when `squared_norms_fn`
        is given; and `norms.allow_low_precision`: run a model that records values below float32 (bf16,
        f16), whose contributions the clip does not bound (module docstring): memory / speed measurements
        only.
      fallback: as `per_example_grads`.
      squared_norms_fn: `FactoredGrad -> (squared norms (B,), rounding bound (B,))`;
        the context-parallel step passes `jaxdp.sharding.context_parallel.squared_norms`.

    Raises (when `fn` is traced):
      ValueError: a DP layer records a value below float32 and `norms.allow_low_precision` is False.
    """
    if not l2_norm_clip > 0:
        raise ValueError(f"l2_norm_clip must be > 0, got {l2_norm_clip}")
    check_clip_spec(clip)
    check_norm_plan(norms)
    if clip.clipping != "flat" or clip.group_weights is not None:
        raise ValueError(f"two_pass_clipped_sums clips flat (one group), got clip={clip}; per-layer or grouped "
                         "clipping: per_example_grads + jaxdp.clipped_aggregate")
    allow_low_precision = norms.allow_low_precision
    if squared_norms_fn is None:
        squared_norms_fn = functools.partial(norms_lib.squared_norms_with_bound, strategy=norms.strategy,
                                             chunk_size=norms.chunk_size,
                                             memory_budget_bytes=norms.memory_budget_bytes)

    def fn(model: nnx.Module, batch):
        graphdef, params, rest, uses, axes, losses_of = discover(loss_fn, model, batch)
        scanned = sorted({"/".join(map(str, u.scan.path)) for u in uses.values() if u.scan is not None})
        if scanned:
            raise ValueError(f"two_pass_clipped_sums does not support scanned layers ({', '.join(scanned)}; "
                             "scan_layers=True): use per_example_grads + fused_clip (book-keeping), or "
                             "scan_layers=False")
        low = [(k, v.dtype) for k, u in uses.items() for v in (u.y, u.record) if below_float32(v.dtype)]
        if low and not allow_low_precision:
            raise ValueError(
                f"two_pass_clipped_sums: the model records {jnp.dtype(low[0][1]).name} values (at {low[0][0]}); "
                "below float32 the clip-weighted second pass rounds differently from the norms' pass and one "
                "example's contribution can exceed C (seen: 1.0026 C in bfloat16), so the noise would not cover "
                "it. Use the book-keeping step (per_example_grads + fused_clip; ShardedDPStep "
                "method='bookkeeping') or float32; NormPlan(allow_low_precision=True) runs it without a guarantee "
                "(memory / speed measurements only)")
        names = {k: tuple(jax.eval_shape(lambda r, g, u=u: use_terms(u, g, r), u.record, u.y))
                 for k, u in uses.items()}
        uses_of: dict[tuple, int] = {}
        for k, u in uses.items():
            for name in names[k]:
                uses_of[u.path + (name,)] = uses_of.get(u.path + (name,), 0) + 1
        single = {p for p, n in uses_of.items() if n == 1}

        slots, norms_fns = {}, {}
        for k, u in uses.items():
            mine = tuple(n for n in names[k] if u.path + (n,) in single)
            dtype = _norm_dtype(u)
            # per name: (squared norms, rounding bound), shape (2, B)
            slots[k] = {"norms": {n: _tape.varying_like(jnp.zeros((2,) + u.y.shape[:1], dtype), axes)
                                  for n in mine}}
            if len(mine) < len(names[k]):
                slots[k]["g"], slots[k]["record"] = term_slots(u)
            norms_fns[k] = functools.partial(_self_norms, u, mine, dtype, squared_norms_fn)

        def norms_pass(slots, params, rest):
            with _tape.recording("norms", slots, axes, norms_fns):
                return losses_of(jax.lax.stop_gradient(params), jax.lax.stop_gradient(rest))

        losses, vjp_fn, new_rest = jax.vjp(norms_pass, slots, params, rest, has_aux=True)
        slot_cts, _, _ = vjp_fn(jnp.ones_like(losses))
        nnx.update(model, new_rest)

        sq_B, bound_B = sum((v for ct in slot_cts.values() for v in ct["norms"].values()),
                            jnp.zeros((2,) + losses.shape, jnp.float32))
        kept: dict[tuple, list] = {}
        for k, u in uses.items():
            if "g" in slot_cts[k]:
                for name, term in use_terms(u, slot_cts[k]["g"], slot_cts[k]["record"]).items():
                    if u.path + (name,) not in single:
                        kept.setdefault(u.path + (name,), []).append(term)
        covered = {**kept, **{p: [] for p in single}}
        add_fallback_terms(covered, loss_fn, graphdef, params, rest, batch, fallback)
        for terms in covered.values():
            if terms:
                sq, bound = squared_norms_fn(FactoredGrad(tuple(terms)))
                sq_B, bound_B = sq_B + sq, bound_B + bound

        norms_B = clipping_lib.guarded_norms(sq_B, bound_B)
        keep_B = clipping_lib.kept_examples({"all": norms_B})  # the drop rule (jaxdp.clipping.rules)
        factors_B = clipping_lib.clip_factors(norms_B, l2_norm_clip, clip.clip_fn, clip.gamma, keep_B)
        # The barrier starts pass 2 after pass 1 has finished: otherwise the scheduler may run the
        # two forwards side by side and hold both passes' activations at once.
        batch2 = _replace_dropped(batch, keep_B, losses.shape[0])
        params2, rest2, batch2, factors_B = jax.lax.optimization_barrier((params, rest, batch2, factors_B))
        sums, _ = weighted_loss_grad(loss_fn, graphdef, params2, rest2, batch2, axes, factors_B)
        sums = jax.tree.map(lambda s: jnp.where(jnp.any(keep_B), s, 0), sums)
        return losses, sums, norms_B

    return fn


def _norm_dtype(use: _tape.Use):
    """float32, or float64 for float64 layers (the precision `jaxdp.clipping.norms` accumulates in)."""
    return jnp.promote_types(jnp.promote_types(use.y.dtype, use.record.dtype), jnp.float32)


def _self_norms(use, names, dtype, squared_norms_fn, record, g) -> dict:
    """(squared norms, rounding bound), shape (2, B), of this use's single-use parameters (`_norm_tap`'s backward)."""
    terms = use_terms(use, g, record)
    return {n: jnp.stack(squared_norms_fn(FactoredGrad((terms[n],)))).astype(dtype) for n in names}


def _replace_dropped(batch, keep_B, B):
    """The batch with every dropped example replaced by the first kept one (all kept: unchanged)."""
    donor = jnp.argmax(keep_B)

    def replace(a):
        if jnp.ndim(a) == 0 or a.shape[0] != B:
            return a
        return jnp.where(keep_B.reshape((B,) + (1,) * (a.ndim - 1)), a, a[donor])
    return jax.tree.map(replace, batch)


def weighted_loss_grad(loss_fn, graphdef, params, rest, batch, axes, weights_B=None):
    """(gradient of sum_b w_b loss_b with respect to `params`, losses): one ordinary backward pass.

    `weights_B` is held constant; None weighs every example 1. Inside
    shard_map the parameters are first marked varying over `axes` (the mesh
    axes the batch varies over), so the gradient is this device's partial:
    nothing comes back implicitly psum-ed (under check_vma the gradient of a
    replicated parameter would arrive already summed over the axis, and the
    caller's reduction would count it again); the caller reduces it.
    """
    params = jax.tree.map(
        lambda p: _tape.varying_like(p, tuple(a for a in axes if a not in _tape.varying_axes(p))), params)

    def total_loss(params):
        losses = loss_fn(nnx.merge(graphdef, params, rest), batch)
        total = losses.sum() if weights_B is None else jnp.sum(jax.lax.stop_gradient(weights_B) * losses)
        return total, losses

    return jax.grad(total_loss, has_aux=True)(params)
