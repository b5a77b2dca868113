"""fused_clip(strategy="pallas") equals the vmap reference for every clipping style and clip_fn.

A copy of the jitted reference-equality test of test_fused_clip_reference.py
with the Pallas strategy (kernels in interpret mode on CPU), kept to one jit
compile: interpret-mode kernels are slow to compile on CPU.
"""

import jax
import pytest
from flax import nnx

import jaxdp
from dp_testing import lm_loss, max_rel_err
from test_fused_clip_reference import CLIPPINGS, EXPECTED_BATCH_SIZE, RTOL, expected_update, setup

CONFIGS = [(clipping, clip_fn) for clipping in CLIPPINGS for clip_fn in ("abadi", "automatic")]


def test_pallas_jit_equals_reference():
    """Every clipping x clip_fn with strategy="pallas" inside one jitted function (one compile).

    Without remat only: remat changes how the factors are computed, not the
    norms and sums this strategy replaces (test_fused_clip_reference covers it).
    """
    model, batch, C, _ = setup(False)
    grads_fn = jaxdp.per_example_grads(lm_loss)
    txs = [jaxdp.fused_clip(C, 0.0, expected_batch_size=EXPECTED_BATCH_SIZE, clipping=CLIPPINGS[c],
                            clip_fn=f, strategy="pallas") for c, f in CONFIGS]

    @nnx.jit
    def all_updates(model, batch):
        _, grads = grads_fn(model, batch)
        params = nnx.state(model, nnx.Param)
        return [tx.update(grads, tx.init(params), params)[0] for tx in txs]

    for (clipping, clip_fn), updates in zip(CONFIGS, all_updates(model, batch)):
        err = max_rel_err(updates, expected_update(False, clipping, clip_fn))
        assert err <= RTOL, (clipping, clip_fn, err)


def test_pallas_strategy_uses_the_kernels(monkeypatch):
    """The pallas strategy really routes linear norms and sums through jaxdp.pallas."""
    from jaxdp import pallas as pallas_lib
    calls = []
    for name in ("linear_sq_norms", "linear_ghost_sq_norms", "linear_clipped_sum"):
        original = getattr(pallas_lib, name)
        monkeypatch.setattr(pallas_lib, name,
                            lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
    model, batch, C, _ = setup(False)
    _, grads = jax.eval_shape(jaxdp.per_example_grads(lm_loss), model, batch)
    jax.eval_shape(lambda g: jaxdp.clipped_aggregate(g, C, strategy="pallas"), grads)  # tracing only
    assert "linear_clipped_sum" in calls
    assert {"linear_sq_norms", "linear_ghost_sq_norms"} & set(calls)
