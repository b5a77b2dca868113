"""DP aggregation: `clipped_aggregate` (clip each example, sum) and `fused_clip`, the optax transform that
composes it with the privatizer (`jaxdp.noise.privatizer`: Gaussian noise once per logical batch, / expected batch).

`fused_clip` is exported as `jaxdp.fused_clip`; this module has another name so that the package attribute
is always the transform, never the module."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxdp.clipping import device_rates, norm_costs
from jaxdp.clipping import norms as norms_lib
from jaxdp.clipping import rules as clipping_lib
from jaxdp.clipping import stacked as stacked_lib
from jaxdp.core import rows as rows_lib
from jaxdp.core.terms import DenseTerm, FactoredGrad, as_factored, is_factored, is_stacked, pinned
from jaxdp.noise import draws as noise_lib
from jaxdp.noise.mechanisms import DPSGD
from jaxdp.clipping.settings import (ClipSpec, DPSpec, NormPlan, accepts_old_keywords, check_clip_spec,
                                     check_norm_plan)


class FusedClipState(NamedTuple):
    """State of `fused_clip`."""
    noise_key: Any         # the privatizer's state (`jaxdp.noise.privatizer`): its key, split once per logical batch
                           # (DP-SGD), or NoiseState(key, buffers) for a correlated mechanism (the name kept:
                           # checkpoints keep their layout)
    micro_step: jax.Array  # int32 in [0, accumulation_steps)
    accumulated: Any       # clipped sums of this logical batch so far (None without accumulation)


def _path_keys(keypath) -> tuple:
    keys = []
    for k in keypath:
        if isinstance(k, jax.tree_util.DictKey):
            keys.append(k.key)
        elif isinstance(k, jax.tree_util.SequenceKey):
            keys.append(k.idx)
        elif isinstance(k, jax.tree_util.GetAttrKey):
            if k.name != "value":  # an nnx.Variable's own value slot
                keys.append(k.name)
        else:
            keys.append(getattr(k, "key", k))
    return tuple(keys)


def flatten_grads(grads):
    """(paths, FactoredGrads, treedef) of a tree of FactoredGrads, StackedGrads or per-example arrays."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(grads, is_leaf=is_factored)
    paths = [_path_keys(kp) for kp, _ in with_path]
    return paths, [leaf if is_stacked(leaf) else as_factored(leaf) for _, leaf in with_path], treedef


def _check_parameter_shapes(grads, params) -> None:
    """Each gradient's parameter shape must be its parameter's: a summed gradient (no batch axis; with a
    square kernel its rows would pass as examples, each clipped to C, and the sum would exceed C) is refused."""
    paths, factored, _ = flatten_grads(grads)
    if params is None:  # a FactoredGrad is per-example by construction; a plain array may be a sum (16 C)
        if not all(is_factored(g) for g in jax.tree.leaves(grads, is_leaf=is_factored)):
            raise ValueError("fused_clip: update got plain-array gradients without params: pass "
                             "params=(the parameters) so that their per-example shapes can be checked "
                             "(nnx.Optimizer does), or the FactoredGrads of jaxdp.per_example_grads")
        return
    shapes = [jnp.shape(p) for p in jax.tree.leaves(params)]
    if len(shapes) != len(factored):
        raise ValueError(f"fused_clip: update got {len(factored)} gradients for {len(shapes)} parameters")
    for path, grad, shape in zip(paths, factored, shapes):
        if tuple(grad.shape) != tuple(shape):
            raise ValueError(
                f"fused_clip: the gradient of {'/'.join(map(str, path))} has per-example shape "
                f"{tuple(grad.shape)} for a parameter of shape {tuple(shape)}: update takes per-example "
                "gradients (jaxdp.per_example_grads, or arrays with a leading batch axis), not their sum")


@accepts_old_keywords
def clipped_aggregate(grads, l2_norm_clip: float, *, clip: ClipSpec = ClipSpec(), norms: NormPlan = NormPlan(),
                      squared_norms_fn: norms_lib.SquaredNormsFn | None = None):
    """Sum over examples of clipped per-example gradients, and per-group norms.

    Returns `(sums, group_norms)`: `sums` has the tree structure of `grads`
    with parameter-shaped leaves; `group_norms` maps each group to its
    per-example norms (B,).

    `clip` says how each example is bounded by `l2_norm_clip` (`jaxdp.ClipSpec`), `norms` how the norms and
    sums are computed (`jaxdp.NormPlan`). With `norms.strategy="pallas"`, a group with exactly one linear term (per-layer
    clipping: a Linear's kernel, or the tied embedding's head use) takes the
    single-pass kernel for that term: see `_single_pass_sums`.

    Every clip factor comes from `jaxdp.clipping.rules.guarded_norms` of the
    group's squared norms and their rounding bound (`jaxdp.clipping.norms.rounding_bound`),
    so cancellation inside a per-example gradient cannot shrink its norm;
    `group_norms` are those guarded norms.

    `squared_norms_fn` (`FactoredGrad -> (squared norms (B,), rounding bound (B,))`)
    replaces `jaxdp.clipping.norms.squared_norms_with_bound` (and the single-pass
    kernel) for every parameter. The context-parallel step passes
    `jaxdp.sharding.context_parallel.squared_norms`: its gradients are
    sequence-shard partials, its norms exact, and the sums this returns the
    shard's share (summed over the sequence axis by the caller).
    """
    check_clip_spec(clip)
    check_norm_plan(norms)
    strategy, chunk_size = norms.strategy, norms.chunk_size
    leaf_paths, leaves, treedef = flatten_grads(grads)
    # A scanned model's stacked parameters: one vmapped copy of the rules for all layers (`stacked`), or,
    # where the kernel's single pass or a caller's norms need them apart, layer by layer (`stacked.per_layer`).
    vmapped = squared_norms_fn is None and strategy != "pallas"
    stacked = {i: stacked_lib.pinned_layers(g) for i, g in enumerate(leaves) if vmapped and is_stacked(g)}
    apart = [i for i in range(len(leaves)) if i not in stacked]  # the leaves not vmapped over layers
    paths, factored, counts = stacked_lib.per_layer([leaf_paths[i] for i in apart], [leaves[i] for i in apart])
    groups = [clipping_lib.group_of(p, clip.clipping) for p in paths]
    stacked_groups = {i: [clipping_lib.group_of(g.layer_path(leaf_paths[i], l), clip.clipping)
                          for l in range(g.num_layers)] for i, g in stacked.items()}
    thresholds = clipping_lib.group_thresholds(groups + [g for gs in stacked_groups.values() for g in gs],
                                               l2_norm_clip, clip.weights)
    single, single_roots = {}, {}  # single_roots: the single-pass parameter's other terms' |T_i| summed
    if strategy == "pallas" and squared_norms_fn is None:
        from jaxdp.clipping import single_pass as single_pass_lib  # imports jax.experimental.pallas only when used
        single = single_pass_lib.single_linear_terms(factored, groups)
    dense = {} if squared_norms_fn is not None else _materialized(factored, norms)
    sq_by_group, bound_by_group = _materialized_sq_norms(dense, groups, thresholds)
    factored = [grad if i in dense else pinned(grad) for i, grad in enumerate(factored)]
    for i, (grad, group) in enumerate(zip(factored, groups)):
        if i in dense:
            continue
        if squared_norms_fn is not None:
            sq, bound = squared_norms_fn(grad)
        else:
            skip = single[group][1] if single.get(group, (None,))[0] == i else None
            sq, roots = norms_lib.squared_norms_and_roots(grad, strategy, chunk_size=chunk_size,
                                                          memory_budget_bytes=norms.memory_budget_bytes,
                                                          skip_self=skip)
            bound = norms_lib.rounding_bound(grad, roots)  # the single-pass kernel adds its own term's share
            if skip is not None:
                single_roots[group] = roots
        sq_by_group[group] = sq if group not in sq_by_group else sq_by_group[group] + sq
        bound_by_group[group] = bound if group not in bound_by_group else bound_by_group[group] + bound

    families = stacked_lib.families(stacked_groups, groups)
    for i, grad in stacked.items():
        sq_LB, bound_LB = stacked_lib.squared_norms(grad, norms)
        if i in families:  # one (L, B) entry for the L groups
            stacked_lib.add(sq_by_group, bound_by_group, families[i], sq_LB, bound_LB)
            thresholds[families[i]] = jnp.stack([jnp.asarray(thresholds[g]) for g in families[i].groups])[:, None]
        else:
            stacked_lib.add_layers(sq_by_group, bound_by_group, stacked_groups[i], sq_LB, bound_LB)

    def factors_of(norms_B, group, keep_B):
        return clipping_lib.clip_factors(norms_B, thresholds[group], clip.clip_fn, clip.gamma, keep_B)

    if single:
        linear_sums, sq_by_group, bound_by_group, keep_pre_B, applied = single_pass_lib.single_pass_sums(
            factored, single, sq_by_group, bound_by_group, single_roots, factors_of, chunk_size)
    guarded = {g: clipping_lib.guarded_norms(sq, bound_by_group[g]) for g, sq in sq_by_group.items()}
    keep_B = clipping_lib.kept_examples({g: stacked_lib.all_finite(n) if isinstance(g, stacked_lib.Family)
                                         else n for g, n in guarded.items()})
    factors = {g: factors_of(n, g, keep_B) for g, n in guarded.items()}
    if single:  # a single-pass group's other parameters take the factors its kernel applied (zero if dropped)
        factors.update({g: jnp.where(keep_B, c, 0).astype(factors[g].dtype) for g, c in applied.items()})
        linear_sums = single_pass_lib.redo_if_dropped_late(linear_sums, factored, single, guarded, keep_pre_B,
                                                           keep_B, factors)
    pallas = strategy == "pallas"
    sums = []
    dense_sums = _materialized_sums(dense, groups, factors)
    for i, (grad, group) in enumerate(zip(factored, groups)):
        if i in dense:
            sums.append(dense_sums[i])
            continue
        if single.get(group, (None,))[0] != i:
            sums.append(clipping_lib.clipped_sum(grad, factors[group], pallas=pallas))
            continue
        j = single[group][1]
        term, rest = grad.terms[j], grad.terms[:j] + grad.terms[j + 1:]
        part = linear_sums[group].astype(
            jnp.promote_types(jnp.result_type(term.x_BTP, term.g_BTD), factors[group].dtype))
        if rest:  # the tied embedding: its lookup term, clipped with the same factors
            part = part + clipping_lib.clipped_sum(FactoredGrad(rest), factors[group], pallas=True)
        sums.append(part)
    split = iter(stacked_lib.restacked(sums, counts, [leaves[i] for i in apart]))
    out = [stacked_lib.clipped_sums(stacked[i], factors[families[i]] if i in families else
                                    jnp.stack([factors[g] for g in stacked_groups[i]]))
           if i in stacked else next(split) for i in range(len(leaves))]
    for family in set(families.values()):  # the norms by group, as the contract says
        guarded.update(zip(family.groups, guarded.pop(family)))
    return jax.tree.unflatten(treedef, out), guarded


# Materialised per-example gradients: small dense ones (biases, norm scales) and the G_b that strategy
# "store" / "auto" keeps. Their squared norms are sums of squares: no cancellation, but a relative
# rounding error that grows with the size (`jaxdp.clipping.norms.final_sums_bound`); the clipped contribution
# IS c_b times the array whose norm was taken. The small ones of every group
# sit side by side in one block (B, G, W), each group's row zero-padded to the widest, so that their
# norms and clipped sums are one reduction each for all groups, not one per group or parameter (fewer
# kernels and less compile time; counts in WORKSPACE.md).
_SMALL = 1 << 16  # elements per example below which a materialised gradient joins the block


def _materialized(factored, plan: NormPlan) -> dict:
    """{parameter index: per-example gradients (B, *shape)}: every single-DenseTerm parameter, and the
    kept G_b of `_stored_gradients`."""
    dense = {i: grad.terms[0].value_B for i, grad in enumerate(factored)
             if len(grad.terms) == 1 and isinstance(grad.terms[0], DenseTerm)}
    return {**dense, **_stored_gradients(factored, plan)}


def _flat_f32(v):
    return v.reshape(v.shape[0], -1).astype(jnp.promote_types(v.dtype, jnp.float32))


class _SmallBlock(NamedTuple):
    keys: list             # the groups with small gradients, in block order
    layout: dict           # {parameter index: (group row, first column, size)}
    block_BGW: jax.Array   # their flattened gradients, a group per row, zero-padded to width W


def _small_blocks(dense: dict, groups) -> tuple[list[_SmallBlock], list]:
    """(blocks of the small materialised gradients, indices of the large ones): one block of all groups,
    or one per group where padding to the widest group would more than double the block."""
    small, large = {}, []
    for i, v in dense.items():
        (small.setdefault(groups[i], []) if math.prod(v.shape[1:]) < _SMALL else large).append(i)
    sizes = {g: sum(math.prod(dense[i].shape[1:]) for i in members) for g, members in small.items()}
    together = len(small) * max(sizes.values(), default=0) <= 2 * sum(sizes.values())
    return [_block(dense, {g: small[g] for g in keys})
            for keys in ([list(small)] if together else [[g] for g in small]) if keys], large


def _block(dense: dict, small: dict) -> _SmallBlock:
    width = max(sum(math.prod(dense[i].shape[1:]) for i in members) for members in small.values())
    rows, layout = [], {}
    for row, members in enumerate(small.values()):
        parts, column = [_flat_f32(dense[i]) for i in members], 0
        for i, part in zip(members, parts):
            layout[i] = (row, column, part.shape[1])
            column += part.shape[1]
        rows.append(jnp.concatenate(parts + [jnp.zeros((parts[0].shape[0], width - column), parts[0].dtype)], axis=1))
    return _SmallBlock(list(small), layout, jnp.stack(rows, axis=1))


def _materialized_sq_norms(dense: dict, groups, thresholds: dict) -> tuple[dict, dict]:
    """({group: squared norms (B,)}, {group: their rounding bounds (B,)}) of the materialised gradients.

    Underflow (squares below the smallest normal mu, flushed) can take at most N mu from a sum of N
    squares, which only matters for norms under ~sqrt(N mu) (5e-16 for GPT-2's tied head in float32).
    For a clip norm known at trace time, `_check_clip_above_underflow` refuses one small enough for that
    to reach the sensitivity, rather than every step reading each kept G_b a second time to tell zero
    from underflow; for a traced one, N mu joins the bound (an all-zero example's norm is then ~sqrt(N
    mu), not 0: harmless)."""
    blocks, large = _small_blocks(dense, groups)
    traced = _check_clip_above_underflow(dense, groups, thresholds)
    sq, bound = {}, {}

    def add(group, part_B, K):
        part_bound = norms_lib.final_sums_bound(jnp.sqrt(part_B), K)
        if group in traced:
            part_bound = part_bound + norms_lib.squares_underflow(K, part_B.dtype)
        sq[group] = part_B if group not in sq else sq[group] + part_B
        bound[group] = part_bound if group not in bound else bound[group] + part_bound

    for block in blocks:
        sq_BG = _sum_of_squares(block.block_BGW)
        for row, g in enumerate(block.keys):
            add(g, sq_BG[:, row], block.block_BGW.shape[2])
    for i in large:
        add(groups[i], _sum_of_squares(_flat_f32(dense[i])), math.prod(dense[i].shape[1:]))
    return sq, bound


def _sum_of_squares(v):
    """Sums of squares over the last axis (the one reduction every materialised norm takes)."""
    return jnp.sum(jnp.square(v), axis=-1)


def _check_clip_above_underflow(dense: dict, groups, thresholds: dict) -> set:
    """ValueError unless each group's threshold C_g is large enough that the squares underflow can take
    from its materialised gradients (at most N mu in all) add under 1e-6 to C_g^2 (contribution <=
    C_g sqrt(1 + 2**-12 + N mu / C_g^2)): C_g >= sqrt(1e6 N mu), 3e-11 for all of GPT-2 small.
    Returns the groups whose threshold is traced (not checkable here)."""
    entries: dict = {}
    for i, v in dense.items():
        mu = float(jnp.finfo(jnp.promote_types(v.dtype, jnp.float32)).tiny)
        entries[groups[i]] = entries.get(groups[i], 0.0) + mu * math.prod(v.shape[1:])
    traced = {g for g in entries if isinstance(thresholds[g], jax.core.Tracer)}
    for g, n_mu in entries.items():
        if g not in traced and thresholds[g] < math.sqrt(1e6 * n_mu):
            raise ValueError(f"l2_norm_clip gives clipping group {g!r} the threshold {thresholds[g]:.3g}, below "
                             f"{math.sqrt(1e6 * n_mu):.3g}: per-example norms that small are lost to floating-point "
                             "underflow in its per-example gradients; use a larger l2_norm_clip (scale the loss)")
    return traced


def _materialized_sums(dense: dict, groups, factors: dict) -> dict:
    """{parameter index: sum_b c_b G_b} of the materialised gradients (dropped examples: exact zeros)."""
    blocks, large = _small_blocks(dense, groups)
    own_factors = rows_lib.rows_apart(jnp.stack([factors[groups[i]] for i in large])) if large else []
    sums = {i: clipping_lib.materialized_clipped_sum(dense[i], c_B.astype(factors[groups[i]].dtype))  # stack may promote
            for i, c_B in zip(large, own_factors)}
    for block in blocks:
        c_BG = jnp.stack([factors[g] for g in block.keys], axis=1)
        total_GW = clipping_lib.materialized_clipped_sum(block.block_BGW, c_BG)
        for i, (row, column, size) in block.layout.items():
            sums[i] = total_GW[row, column:column + size].reshape(dense[i].shape[1:])
    return sums


def _stored_gradients(factored, plan: NormPlan) -> dict:
    """{parameter index: per-example gradients (B, *shape)} of the linear layers (with the tied
    embedding's lookups) whose G_b are kept (`jaxdp.clipping.norm_costs.plan_stored`): all of them with strategy
    "store", the planned ones with "auto"."""
    if plan.strategy not in ("auto", "store"):
        return {}
    linear = {i: t for i, grad in enumerate(factored) if (t := norms_lib.storable(grad)) is not None}
    if plan.strategy == "auto":
        shapes = {i: t.x_BTP.shape + t.g_BTD.shape[-1:] + (jnp.result_type(t.x_BTP, t.g_BTD).itemsize,)
                  for i, t in linear.items()}
        rates = device_rates.current()
        budget = plan.store_budget_bytes if plan.store_budget_bytes is not None else rates.store_budget_bytes(
            plan.memory_budget_bytes)
        keep = norm_costs.plan_stored(shapes, rates, chunk_size=plan.chunk_size,
                                      memory_budget_bytes=plan.memory_budget_bytes, store_budget_bytes=budget)
        linear = {i: t for i, t in linear.items() if i in keep}
    return {i: norms_lib.per_example_gradients(factored[i]) for i in linear}


@accepts_old_keywords
def fused_clip(l2_norm_clip: float, noise_multiplier: float, *, expected_batch_size: float,
               key: jax.Array | None = None, accumulation_steps: int = 1, secure_noise: bool = False,
               clip: ClipSpec = ClipSpec(), norms: NormPlan = NormPlan(),
               mechanism: Any = DPSGD()) -> optax.GradientTransformation:
    """DP-SGD aggregation: clip per example, sum, add Gaussian noise once per logical batch.

    `update(grads, state, params=None)` takes per-example gradients, either the
    `FactoredGrad`s of `jaxdp.per_example_grads` or plain arrays with a
    leading batch axis (as optax's `differentially_private_aggregate`; then
    with `params`, which checks their shapes), and
    returns parameter-shaped updates

        (sum_b clip(G_b) + N(0, sigma^2 C'^2 I)) / expected_batch_size,   C' = C * SENSITIVITY_FACTOR

    on the last micro-step of each logical batch, and zeros on the others
    (`jaxdp.clipping.rules.SENSITIVITY_FACTOR` = sqrt(1 + 2**-12) = 1.000122 covers the rounding of
    per-example norms, so C' is a sensitivity that holds in floating point).

    Formal guarantee: with Poisson sampling at rate q = expected_batch_size / N,
    each example's total contribution to the sum has L2 norm <= C' for every
    `clipping` (group thresholds satisfy sum C_g^2 = C^2) and every
    `strategy`, even when its per-example gradient cancels (see
    `jaxdp.clipping.rules`), so each logical batch is the subsampled Gaussian
    mechanism with noise multiplier sigma; the noise must be secret (`key`);
    `jaxdp.accounting.epsilon` turns (sigma, q, steps, delta) into epsilon. Dividing by
    the EXPECTED batch size (not the realised count) is what keeps that true.

    Composition: `fused_clip` must be first in the chain (a transform before
    it sees the whole batch), no transform after it may take the loss
    (`value=`: it is not noised), and the `accumulation_steps` micro-batches
    must split one Poisson draw.

    Edge cases: C <= 0 and sigma < 0 are errors; an example whose norm is
    non-finite contributes exactly zero (never NaN); an empty or fully masked
    batch gives pure noise / expected_batch_size.

    Args:
      l2_norm_clip: C, the bound on each example's contribution.
      noise_multiplier: sigma; noise std is sigma * C * SENSITIVITY_FACTOR. 0 disables noise (no privacy).
      expected_batch_size: q * N, the divisor of the noised sum.
      key: the noise PRNG key kept in the state (split once per logical
        batch). None (the default): every `init` call draws a fresh one from
        the operating system's entropy (`jaxdp.noise.draws.init_key`; under jit or
        vmap when the program runs); a pinned key reproduces the noise, and
        whoever knows it can remove the noise: never pin one key for two runs.
      clip: how each example is bounded (`jaxdp.ClipSpec`: "flat" / "per_layer" / callable groups,
        "abadi" or "automatic" clipping, gamma, group weights). Default: flat, Abadi.
      norms: how the norms and sums are computed (`jaxdp.NormPlan`: strategy "auto" (per layer the fastest
        of ghost / instantiate / store under a scratch budget, by the cost model of
        `jaxdp.clipping.norm_costs` and the device's rates), "ghost", "instantiate", "store" or "pallas"
        (the `jaxdp.pallas` kernels; the single-pass kernel where a group holds one linear term); chunk
        and budgets). Every plan gives the same guarantee.
      accumulation_steps: micro-batches per logical batch; clipped sums are
        accumulated and noise is added once, on the last. To keep the
        optimizer still on the other micro-steps, wrap it:
        `optax.MultiSteps(opt, accumulation_steps, use_grad_mean=False)`.
      secure_noise: draw each noise value as the sum of 4 scaled normals / 2
        (Opacus' `secure_mode`) and round the noisy sum to a grid of ~std / 2^8
        (snapping): a mitigation of floating-point attacks on the noise, at four
        draws instead of one. Use it when noisy sums (not only the final model)
        are released: see `jaxdp.noise.draws`, "Floating-point noise".
      mechanism: the noise's correlation over logical batches (`jaxdp.noise.mechanisms`): `DPSGD()`,
        independent (the default), or `BandMF(coefs)` (`jaxdp.noise.strategies.bandmf(steps, bands)`):
        the noise of batch t is row t of C^{-1} Z, from b - 1 float32 buffers per parameter in the
        state. Its epsilon is the amplified BandMF analysis (`jaxdp.accounting.mechanisms`), which
        holds only when batches come from cyclic Poisson sampling of b groups (`jaxdp.sampling.cyclic`).

    Returns:
      An `optax.GradientTransformation`.

    References:
      Abadi et al. 2016, Deep Learning with Differential Privacy, arXiv:1607.00133.
      Li et al. 2022 (ghost norms for sequences), arXiv:2110.05679.
      Bu et al. 2023, Automatic Clipping, arXiv:2206.07136.

    Example:
      >>> tx = optax.chain(
      ...     jaxdp.fused_clip(1.0, 0.9, expected_batch_size=512),
      ...     optax.adamw(3e-4))
    """
    spec = DPSpec(l2_norm_clip, noise_multiplier, expected_batch_size, clip,
                  noise_lib.check_secure(secure_noise, "fused_clip"), mechanism)  # every setting checked here
    check_norm_plan(norms)
    if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be an integer >= 1, got {accumulation_steps!r}")
    pinned = noise_lib.check_key(key, "fused_clip")
    privatizer = spec.privatizer()

    def init_fn(params):
        accumulated = None
        if accumulation_steps > 1:
            accumulated = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        return FusedClipState(privatizer.init(params, pinned), jnp.zeros((), jnp.int32), accumulated)

    def update_fn(grads, state, params=None):
        _check_parameter_shapes(grads, params)
        sums, _ = clipped_aggregate(grads, l2_norm_clip, clip=clip, norms=norms)
        if state.accumulated is not None:
            sums = jax.tree.map(lambda a, s: a + s.astype(a.dtype), state.accumulated, sums)
        is_last = state.micro_step == accumulation_steps - 1

        def emit(sums, key):
            updates, key = privatizer.update(sums, key)
            return updates, key, jax.tree.map(jnp.zeros_like, sums)

        def hold(sums, key):
            return jax.tree.map(jnp.zeros_like, sums), key, sums

        if accumulation_steps == 1:
            updates, key, _ = emit(sums, state.noise_key)
            return updates, FusedClipState(key, state.micro_step, None)
        updates, key, accumulated = jax.lax.cond(is_last, emit, hold, sums, state.noise_key)
        micro_step = (state.micro_step + 1) % accumulation_steps
        return updates, FusedClipState(key, micro_step, accumulated)

    return optax.GradientTransformation(init_fn, update_fn)
