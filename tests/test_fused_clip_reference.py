"""per_example_grads + fused_clip (sigma = 0) equals the vmap reference, every configuration."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_testing import (
    CLIPPINGS,
    EXPECTED_BATCH_SIZE,
    RTOL,
    by_path,
    first_updates_fn,
    gpt2_case,
    gpt2_case_with_reference,
    lm_batch,
    lm_loss,
    max_rel_err,
    reference_update,
    tiny_gpt2,
)
from flax import nnx

import jaxdp
from jaxdp.clipping.settings import ClipSpec, NormPlan
import jaxdp.core.reference  # the vmap oracle: not exported by jaxdp

@functools.lru_cache(maxsize=None)
def eager_grads(remat):
    model, batch, _, _ = gpt2_case(remat)
    return jaxdp.per_example_grads(lm_loss)(model, batch)


# chunk_size 8 >= B: one vmap; 4: two chunks. Chunking only regroups examples after the per-example gradients,
# which is all remat changes: chunked with remat is test_jit_equals_reference's.
@pytest.mark.parametrize("chunk_size, remat", [(8, False), (4, False), (8, True)],
                         ids=["vmap-no_remat", "chunked-no_remat", "vmap-remat"])
@pytest.mark.parametrize("strategy", ["ghost", "instantiate", "auto"])
@pytest.mark.parametrize("clip_fn", ["abadi", "automatic"])
@pytest.mark.parametrize("clipping", list(CLIPPINGS))
def test_eager_equals_reference(clipping, clip_fn, strategy, chunk_size, remat):
    """Every clipping x clip_fn x strategy x chunking, eagerly (each op compiled once, shared by all cases)."""
    model, _, C, _ = gpt2_case(remat)
    _, grads = eager_grads(remat)
    tx = jaxdp.fused_clip(C, 0.0, expected_batch_size=EXPECTED_BATCH_SIZE,
                          clip=ClipSpec(clipping=CLIPPINGS[clipping], clip_fn=clip_fn),
                          norms=NormPlan(strategy=strategy, chunk_size=chunk_size))
    params = nnx.state(model, nnx.Param)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert max_rel_err(updates, reference_update(remat, clipping, clip_fn)) <= RTOL


# Under jit (the eager test has every combination): each clipping, clip_fn, strategy and chunking at least once.
JIT_CONFIGS = [("flat", "abadi", "ghost", 4), ("per_layer", "automatic", "instantiate", 4), ("by_block", "abadi", "auto", 8)]
# "store" keeps instantiated G_b whole (no chunks), from the same factors with or without remat: one case.
STORE_CONFIGS = [(clipping, clip_fn, "store", 8) for clipping in CLIPPINGS for clip_fn in ("abadi", "automatic")]


@pytest.mark.parametrize("remat", [False, True], ids=["no_remat", "remat"])
def test_jit_equals_reference(remat):
    """per_example_grads + fused_clip traced under jit, JIT_CONFIGS (and "store") in one jitted function."""
    model, batch, C, _ = gpt2_case(remat)
    configs = JIT_CONFIGS + ([] if remat else STORE_CONFIGS)
    txs = [jaxdp.fused_clip(C, 0.0, expected_batch_size=EXPECTED_BATCH_SIZE,
                            clip=ClipSpec(clipping=CLIPPINGS[c], clip_fn=f),
                            norms=NormPlan(strategy=s, chunk_size=chunk_size)) for c, f, s, chunk_size in configs]
    all_updates = first_updates_fn(lm_loss, txs)

    for (clipping, clip_fn, strategy, chunk_size), updates in zip(configs, all_updates(model, batch)):
        err = max_rel_err(updates, reference_update(remat, clipping, clip_fn))
        assert err <= RTOL, (clipping, clip_fn, strategy, chunk_size, err)


@pytest.mark.parametrize("remat", [False, True], ids=["no_remat", "remat"])
def test_jit_train_step_with_nnx_optimizer(remat):
    """The user's train step: nnx.jit, nnx.Optimizer, optax.chain(fused_clip, sgd(lr=1))."""
    model, batch, C, _ = gpt2_case(remat)
    model = nnx.clone(model)
    before = by_path(nnx.state(model, nnx.Param))
    tx = optax.chain(
        jaxdp.fused_clip(C, 0.0, expected_batch_size=EXPECTED_BATCH_SIZE, clip=ClipSpec(clipping="per_layer")),
        optax.sgd(1.0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    grads_fn = jaxdp.per_example_grads(lm_loss)
    traces = []

    @nnx.jit
    def step(model, optimizer, batch):
        traces.append(1)
        losses, grads = grads_fn(model, batch)
        optimizer.update(model, grads)
        return losses

    step(model, optimizer, batch)
    after = by_path(nnx.state(model, nnx.Param))
    expected = reference_update(remat, "per_layer", "abadi")
    # sgd(1): params -= update; the subtraction costs ~|param| eps absolute.
    for p, e in expected.items():
        tol = RTOL * float(jnp.max(jnp.abs(e))) + 4 * np.finfo(np.float32).eps * float(jnp.max(jnp.abs(before[p])))
        assert float(jnp.max(jnp.abs(before[p] - after[p] - e))) <= tol, p
    # Later steps reuse the compiled step (on 9428dda per_example_grads labelled the caller's model
    # inside the first call, which changed its graphdef: the second call traced and compiled again).
    step(model, optimizer, batch)
    step(model, optimizer, batch)
    assert len(traces) == 1


def test_losses_equal_reference():
    losses, _ = eager_grads(False)
    _, _, _, (ref_losses, _) = gpt2_case_with_reference(False)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert float(losses[-1]) == 0.0  # the masked padding example


def test_per_example_gradients_equal_reference():
    """Every factored per-example gradient, instantiated, equals the vmap one."""
    _, _, _, ref_grads = gpt2_case(False)
    _, grads = eager_grads(False)
    for path, grad in by_path(grads).items():
        dense = sum(jaxdp.core.terms.instantiate(t) for t in grad.terms)
        ref = ref_grads[path]
        assert float(jnp.max(jnp.abs(dense - ref)) / jnp.max(jnp.abs(ref))) <= RTOL, path
        assert float(jnp.max(jnp.abs(dense[-1]))) == 0.0, path  # masked example


def test_tied_embedding_has_both_uses():
    _, grads = eager_grads(False)
    terms = by_path(grads)[("wte", "embedding")].terms
    assert [type(t).__name__ for t in terms] == ["EmbedTerm", "LinearTerm"]


def test_norms_equal_reference_float64():
    """Per-example norms (flat and per layer) equal the reference's in float64."""
    jax.config.update("jax_enable_x64", True)
    try:
        model = tiny_gpt2(seed=3, dtype="float64")
        nnx.update(model, jax.tree.map(lambda a: a.astype(jnp.float64), nnx.state(model)))
        batch = lm_batch(seed=4)
        grads_fn = jaxdp.per_example_grads(lm_loss)
        configs = [(c, s) for c in ("flat", "per_layer") for s in ("ghost", "instantiate", "auto")]

        @nnx.jit
        def all_norms(model, batch):
            _, grads = grads_fn(model, batch)
            return [jaxdp.clipped_aggregate(grads, 1.0,
                                            clip=ClipSpec(clipping=c),
 norms=NormPlan(strategy=s))[1] for c, s in configs]

        ref_grads = jax.jit(lambda m, b: jaxdp.core.reference.per_example_grads(lm_loss, m, b)[1])(model, batch)
        for (clipping, strategy), norms in zip(configs, all_norms(model, batch)):
            _, ref_norms = jaxdp.core.reference.clipped_sum(ref_grads, 1.0, clipping=clipping)
            if True:
                assert norms.keys() == ref_norms.keys()
                for g in ref_norms:
                    assert norms[g].dtype == jnp.float64
                    np.testing.assert_allclose(norms[g], ref_norms[g], rtol=1e-12, atol=1e-300)
    finally:
        jax.config.update("jax_enable_x64", False)


def test_plain_per_example_arrays():
    """fused_clip also takes materialised per-example gradients (B, ...), like optax's DP aggregate, with the
    parameters (which check that they are per-example: a summed gradient is refused)."""
    model, _, C, ref_grads = gpt2_case(False)
    tx = jaxdp.fused_clip(C, 0.0, expected_batch_size=EXPECTED_BATCH_SIZE, clip=ClipSpec(clipping="per_layer"))
    nested = nnx.from_flat_state(list(ref_grads.items()))
    params = nnx.state(model, nnx.Param)
    updates, _ = tx.update(nested, tx.init(params), params)
    assert max_rel_err(updates, reference_update(False, "per_layer", "abadi")) <= RTOL


def test_planted_error_is_caught(monkeypatch):
    """Dropping the tied-embedding cross term must break reference equality."""
    from jaxdp.clipping import norms as norms_lib
    _, _, C, ref_grads = gpt2_case(False)
    _, grads = eager_grads(False)
    original = norms_lib.squared_norms_and_roots

    def without_cross_terms(grad, strategy="auto", **kw):
        parts = [original(jaxdp.FactoredGrad((t,)), strategy, **kw) for t in grad.terms]
        return sum(sq for sq, _ in parts), sum(roots for _, roots in parts)

    monkeypatch.setattr(norms_lib, "squared_norms_and_roots", without_cross_terms)
    _, norms = jaxdp.clipped_aggregate(grads, C)
    _, ref_norms = jaxdp.core.reference.clipped_sum(ref_grads, C)  # the vmap reference's (jitted in gpt2_case)
    rel = jnp.abs(norms["all"] - ref_norms["all"])[:-1] / ref_norms["all"][:-1]
    assert float(jnp.max(rel)) > 100 * RTOL
