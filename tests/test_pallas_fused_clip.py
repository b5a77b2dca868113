"""fused_clip(strategy="pallas") equals the vmap reference for every clipping style and clip_fn.

A copy of the jitted reference-equality test of test_fused_clip_reference.py
with the Pallas strategy (kernels in interpret mode on CPU), kept to one jit
compile: interpret-mode kernels are slow to compile on CPU.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_testing import (
    CLIPPINGS,
    EXPECTED_BATCH_SIZE,
    RTOL,
    first_updates_fn,
    gpt2_case,
    lm_loss,
    max_rel_err,
    reference_update,
)
from flax import nnx

import jaxdp
import jaxdp.core.reference  # the vmap oracle: not exported by jaxdp
from jaxdp.core.terms import DenseTerm, FactoredGrad, LinearTerm, instantiate
from jaxdp.clipping.settings import ClipSpec, NormPlan

# Every clipping and every clip_fn, each clip_fn once under the single-pass kernel (per_layer): clip_fn
# maps norms to factors in jnp between the kernels, the same code for every clipping; the full grid runs
# on the XLA strategies (test_fused_clip_reference). Two of the six configurations fewer: ~1/3 of the compile.
CONFIGS = [("flat", "abadi"), ("per_layer", "abadi"), ("per_layer", "automatic"), ("by_block", "automatic")]


def test_pallas_jit_equals_reference():
    """Every clipping x clip_fn with strategy="pallas" inside one jitted function (one compile).

    Without remat only: remat changes how the factors are computed, not the
    norms and sums this strategy replaces (test_fused_clip_reference covers it).
    """
    model, batch, C, _ = gpt2_case(False)
    txs = [jaxdp.fused_clip(C, 0.0, expected_batch_size=EXPECTED_BATCH_SIZE,
                            clip=ClipSpec(clipping=CLIPPINGS[c], clip_fn=f),
 norms=NormPlan(strategy="pallas")) for c, f in CONFIGS]
    all_updates = first_updates_fn(lm_loss, txs)

    for (clipping, clip_fn), updates in zip(CONFIGS, all_updates(model, batch)):
        err = max_rel_err(updates, reference_update(False, clipping, clip_fn))
        assert err <= RTOL, (clipping, clip_fn, err)


def test_pallas_strategy_uses_the_kernels(monkeypatch):
    """The pallas strategy really routes linear norms and sums through jaxdp.pallas."""
    from jaxdp import pallas as pallas_lib
    calls = []
    for name in ("linear_sq_norms", "linear_ghost_sq_norms", "linear_clipped_sum"):
        original = getattr(pallas_lib, name)
        monkeypatch.setattr(pallas_lib, name,
                            lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
    model, batch, C, _ = gpt2_case(False)
    _, grads = jax.eval_shape(jaxdp.per_example_grads(lm_loss), model, batch)
    jax.eval_shape(lambda g: jaxdp.clipped_aggregate(g, C, norms=NormPlan(strategy="pallas")), grads)  # tracing only
    assert "linear_clipped_sum" in calls
    assert {"linear_sq_norms", "linear_ghost_sq_norms"} & set(calls)


def test_per_layer_takes_the_single_pass_kernel(monkeypatch):
    """per_layer: every Linear and the tied head go through linear_fused_clipped_sum; flat: none do."""
    from jaxdp.pallas import single_pass
    calls = []
    original = single_pass.linear_fused_clipped_sum
    monkeypatch.setattr(single_pass, "linear_fused_clipped_sum",
                        lambda *a, **k: calls.append(a[0].shape) or original(*a, **k))
    model, batch, C, _ = gpt2_case(False)
    _, grads = jax.eval_shape(jaxdp.per_example_grads(lm_loss), model, batch)
    num_linear = sum(isinstance(m, jaxdp.core.nn.Linear) for _, m in nnx.iter_graph(model))
    jax.eval_shape(lambda g: jaxdp.clipped_aggregate(g, C, clip=ClipSpec(clipping="per_layer"),
                                                     norms=NormPlan(strategy="pallas")), grads)
    assert len(calls) == num_linear + 1  # + the tied embedding's head use
    calls.clear()
    jax.eval_shape(lambda g: jaxdp.clipped_aggregate(g, C, clip=ClipSpec(clipping="flat"),
                                                     norms=NormPlan(strategy="pallas")), grads)
    assert not calls


def _by_path(nested):
    return {(layer, name): v for layer, params in nested.items() for name, v in params.items()}


def _two_layer_grads(seed):
    """Factored grads of two linear layers (one with a bias), odd sizes, and their instantiated twins.

    Example 1 has a NaN input in layer a (dropped before the single pass);
    example 2 has finite inputs in layer b whose squared norm overflows to inf
    (dropped only after the pass of layer a): both must contribute nothing.
    """
    ka, kb, kc, kd = jax.random.split(jax.random.key(seed), 4)
    B, T = 5, 7
    xa, ga = jax.random.normal(ka, (B, T, 9)), jax.random.normal(kb, (B, T, 5))
    xb, gb = jax.random.normal(kc, (B, T, 6)), jax.random.normal(kd, (B, T, 11))
    xa = xa.at[1, 3, 2].set(jnp.nan)
    xb, gb = xb.at[2].multiply(1e11), gb.at[2].multiply(1e11)
    factored = {"a": {"kernel": FactoredGrad((LinearTerm(xa, ga),)),
                      "bias": FactoredGrad((DenseTerm(ga.sum(axis=1)),))},
                "b": {"kernel": FactoredGrad((LinearTerm(xb, gb),))}}
    dense = {("a", "kernel"): instantiate(LinearTerm(xa, ga)), ("a", "bias"): ga.sum(axis=1),
             ("b", "kernel"): instantiate(LinearTerm(xb, gb))}
    return factored, dense


@pytest.mark.parametrize("clip_fn", ["abadi", "automatic"])
def test_single_pass_drops_non_finite_examples_like_the_reference(clip_fn):
    factored, dense = _two_layer_grads(seed=21)
    C = 3.0
    expected, expected_norms = jaxdp.core.reference.clipped_sum(dense, C, clipping="per_layer", clip_fn=clip_fn)
    assert not bool(jnp.isfinite(expected_norms[("b",)][2]))  # the overflow really happens
    sums, norms = jaxdp.clipped_aggregate(factored, C, clip=ClipSpec(clipping="per_layer", clip_fn=clip_fn),
                                          norms=NormPlan(strategy="pallas", chunk_size=2))
    assert max_rel_err(_by_path(sums), expected) <= RTOL
    for group, n in expected_norms.items():
        finite = jnp.isfinite(n)
        np.testing.assert_array_equal(jnp.isfinite(norms[group]), finite)
        np.testing.assert_allclose(norms[group][finite], n[finite], rtol=RTOL)


def test_planted_error_skipping_the_late_drop_is_caught(monkeypatch):
    """Without the recompute after the global drop rule, example 2 leaks into layer a's sum."""
    from jaxdp.clipping import single_pass as single_pass_clipping
    monkeypatch.setattr(single_pass_clipping, "redo_if_dropped_late", lambda linear_sums, *_: linear_sums)
    factored, dense = _two_layer_grads(seed=21)
    expected, _ = jaxdp.core.reference.clipped_sum(dense, 3.0, clipping="per_layer")
    sums, _ = jaxdp.clipped_aggregate(factored, 3.0, clip=ClipSpec(clipping="per_layer"),
                                      norms=NormPlan(strategy="pallas", chunk_size=2))
    assert max_rel_err(_by_path(sums), expected) > 1e-2
