"""jaxdp.analysis.throughput (one DP-Adam step per method, and its measurement) and jaxdp.analysis.kernels
(the DP pieces of one linear layer: their functions, FLOP and byte counts, timing and roofline)."""

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdp.analysis import kernels, throughput
from jaxdp.analysis.rows_merged import rows_merged
from tests.dp_testing import EXPECTED_BATCH_SIZE, RTOL, gpt2_case, lm_loss, max_rel_err, reference_update

DP_METHODS = [m for m in throughput.ALL_METHODS if m != "non_dp"]


@pytest.mark.parametrize("method", DP_METHODS)
def test_every_dp_method_is_the_reference_clipped_mean_at_sigma_0(method):
    """At sigma 0 each method's DP gradient (its grads_of, then its transform) is the vmap reference's
    clipped sum over the expected batch size, with C between the smallest and largest per-example norm."""
    model, batch, C, _ = gpt2_case(remat=False)
    transform, grads_of = throughput.dp_gradients(method, lm_loss, l2_norm_clip=C, noise_multiplier=0.0,
                                                  expected_batch_size=EXPECTED_BATCH_SIZE)

    @nnx.jit
    def dp_mean(model, batch):
        with rows_merged() if method == throughput.MERGED else contextlib.nullcontext():
            params = nnx.state(model, nnx.Param)
            return transform.update(grads_of(model, batch, jax.random.key(3)), transform.init(params), params)[0]

    clipping = "per_layer" if method in ("per_layer", "pallas_per_layer") else "flat"
    expected = reference_update(False, clipping, "abadi")
    actual = dp_mean(model, batch)
    assert max_rel_err(actual, expected) <= RTOL
    other = reference_update(False, "per_layer" if clipping == "flat" else "flat", "abadi")
    assert max_rel_err(actual, other) > 10 * RTOL  # the comparison sees which clipping ran


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="unknown method"):
        throughput.dp_gradients("dp_magic", lm_loss, expected_batch_size=1.0)


def _tiny(method, **overrides):
    return {**dict(model="tiny", B=2, T=32, method=method, dtype="float32", vocab=97, attention="auto", steps=1,
                   warmup=1, target=None, profile_dir=None), **overrides}


# One method per way the step forms its gradients (plain backward, two passes, book-keeping, the Pallas
# kernels): every DP method's gradients are checked against the reference above; the step around them is
# the same code, so compiling all eleven here would cost minutes and check nothing more.
@pytest.mark.parametrize("method", ["non_dp", "two_pass", "auto", "pallas_per_layer"])
def test_a_method_of_each_kind_steps_on_a_tiny_gpt2(method):
    """The method's step compiles from its abstract arguments, runs on the real ones, and moves the model's
    parameters, keeping them finite."""
    step, abstract, inputs = throughput.step_fn(_tiny(method))
    compiled = step.trace(*abstract).lower().compile()
    state, batch, key = inputs()
    assert jax.tree.map(lambda a: (a.shape, a.dtype), state) == jax.tree.map(lambda a: (a.shape, a.dtype), abstract[0])
    before = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(state) if p[0] == 0}  # the model's
    after = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(compiled(state, batch, key)) if p[0] == 0}
    assert before and all(np.isfinite(a).all() for a in after.values())
    assert all(not np.array_equal(before[p], after[p]) for p in before)  # Adam moves every parameter


@pytest.mark.parametrize("method", ["non_dp", "auto"])
def test_run_one_measures_a_step(method):
    compiled_seen = []
    row = throughput.run_one(_tiny(method), repeats=2, on_compiled=lambda: compiled_seen.append(True))
    assert compiled_seen == [True]
    assert row["status"] == "ok" and row["method"] == method
    assert row["timing"] == "median of 2 x 1 steps, one sync each"
    assert row["step_s"] > 0 and row["tokens_per_s"] == pytest.approx(2 * 32 / row["step_s"])
    assert row["compiled_bytes"] > 0 and row["peak_bytes"] > 0
    row = throughput.run_one(_tiny(method, steps=0))
    assert "step_s" not in row and row["peak_source"] == "memory_analysis"
    assert row["peak_bytes"] == row["compiled_bytes"]


def test_only_a_target_gets_a_deviceless_environment():
    assert throughput.child_env({"target": None}) is None
    env = throughput.child_env({"target": "h100"})
    assert env["JAXDP_DEVICE_KIND"] == "h100" and env["JAXDP_PALLAS_INTERPRET"] == "0"


def test_kernel_counts_of_a_small_shape():
    """B 2, T 4, P 3, D 5, float32: every tile edge is the 16 minimum, one chunk of 8 examples."""
    B, T, P, D, itemsize = 2, 4, 3, 5, 4
    io, out, gemm = B * T * (P + D) * 4, P * D * 4, 2 * B * T * P * D
    assert (io, out, gemm) == (256, 60, 240)
    counts = kernels.counts(B, T, P, D, itemsize)
    assert list(counts) == list(kernels.methods())
    assert counts["nondp_wgrad"] == (240, 316)
    assert counts["xla_clipped_sum"] == counts["pallas_clipped_sum"] == (240 + 40, 316)
    assert counts["pallas_sq_norms"] == (counts["xla_inst_norms"][0], 256 + 2 * 4)  # one (P, D) tile each
    assert counts["pallas_ghost_norms"] == (2 * 4 * (4 + 16) * 8, 256 + 2 * 4)  # one (T, T) tile each
    assert counts["pallas_single_pass"] == (240 + 4 * 30, 256 + 2 * 30 * 4 + 2 * 60)  # B P D = 30


def test_kernel_methods_agree_with_their_xla_twins():
    B, T, P, D = 2, 16, 48, 40
    kx, kg = jax.random.split(jax.random.key(0))
    x, g = jax.random.normal(kx, (B, T, P)), jax.random.normal(kg, (B, T, D))
    c = jnp.linspace(0.2, 1.0, B)
    out = {name: jax.jit(fn)(x, g, c) for name, fn in kernels.methods().items()}
    sq = jnp.einsum("btp,btd->bpd", x, g)
    np.testing.assert_allclose(out["xla_inst_norms"], jnp.sum(sq ** 2, axis=(1, 2)), rtol=1e-4)
    for pallas, xla in (("pallas_sq_norms", "xla_inst_norms"), ("pallas_ghost_norms", "xla_ghost_norms"),
                        ("pallas_clipped_sum", "xla_clipped_sum")):
        np.testing.assert_allclose(out[pallas], out[xla], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out["nondp_wgrad"], sq.sum(0), rtol=1e-4, atol=1e-4)


def test_roofline_and_a_failing_method_is_a_row():
    row = dict(flops=1e9, bytes=1e6, status="ok", seconds=2e-3)
    assert kernels.roofline(row, R=1e12, W=1e9) == dict(intensity=1e3, floor_s=1e-3, bound="compute", of_floor=0.5)
    assert kernels.roofline(row, R=1e13, W=1e9)["bound"] == "memory"

    def fails(x):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory\nmore")
    bad = kernels.measured_row("oom", fails, (jnp.ones(3),), (1, 2), repeats=1, iters=1)
    assert bad == dict(method="oom", flops=1, bytes=2, status="RuntimeError", error="RESOURCE_EXHAUSTED: out of memory")
    assert kernels.roofline(bad, 1.0, 1.0)["of_floor"] is None


def test_one_program_runs_f_iters_times():
    calls = kernels.in_one_program(lambda v: v * 2, 5)(jnp.ones(3))
    assert float(calls) == 5 * 6.0
    assert kernels.seconds_per_call(lambda v: v + 1, (jnp.ones(4),), repeats=2, iters=2) > 0
    assert math.isfinite(kernels.seconds_per_call(jnp.sum, (jnp.ones(4),), repeats=1, stat=np.min))


def test_a_scanned_llama_steps():
    """`model` "llama-<preset>" and `scan` build a Llama with stacked blocks; its DP step compiles and moves the
    stacked parameters (the benchmark's scanned rows)."""
    cfg = dict(_tiny("auto"), model="llama-tiny", scan=True)
    config = throughput.model_config(cfg)
    assert type(config).__name__ == "LlamaConfig" and config.scan_layers
    step, abstract, inputs = throughput.step_fn(cfg)
    state, batch, key = inputs()
    blocks = lambda state: {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(state) if p[0] == 0 and "blocks" in p}
    before, after = blocks(state), blocks(step(state, batch, key))
    assert before and all(v.shape[0] == config.n_layer for v in before.values())
    assert all(np.isfinite(a).all() and not np.array_equal(before[p], a) for p, a in after.items())
