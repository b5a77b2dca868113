"""jaxdp.hlo_cost: FLOPs, bytes and kernel launches of a compiled program from its optimized HLO."""

import pathlib

import jax
import jax.numpy as jnp
import pytest

from jaxdp import device_rates, hlo_cost

H100_HLO = pathlib.Path(__file__).parent / "data" / "h100_matmul_attention.hlo"


def test_cpu_program_flops_are_its_dots_times_trip_counts():
    """A dot before a 5-step loop whose body runs one: 6 dots of 2 M K N FLOPs."""
    def f(a, b):
        return jax.lax.fori_loop(0, 5, lambda i, x: jnp.tanh(x @ b), a @ b)

    M, K = 64, 128
    cost = hlo_cost.step_cost(jax.jit(f).lower(jnp.ones((M, K)), jnp.ones((K, K))).compile())
    assert cost.flops == 6 * 2 * M * K * K
    assert cost.launches >= 6 and cost.bytes > 0
    assert 0 < hlo_cost.roofline_seconds(cost, device_rates.CPU, "float32") < 1


def test_h100_program_counts_gemm_and_cudnn_attention():
    """XLA:GPU's deviceless compile for an H100 (saved HLO) of a bf16 GEMM (256 x 512 @ 512 x 1024, a
    Triton GEMM fusion) and cuDNN causal attention (B 2, T 128, N 4, H 64: 4 B N T^2 H / 2)."""
    cost = hlo_cost.step_cost(H100_HLO.read_text())
    by_opcode = {k.opcode: k for k in cost.kernels if k.flops}
    assert by_opcode["fusion"].flops == 2 * 256 * 512 * 1024
    assert by_opcode["custom-call"].flops == 4 * 2 * 4 * 128 * 128 * 64 / 2
    # The GEMM reads a and b (bf16) and writes its float32 split-K partials (XLA split K in 4: f32[4,256,1024]).
    assert by_opcode["fusion"].bytes == (256 * 512 + 512 * 1024) * 2 + 4 * 256 * 1024 * 4
    assert hlo_cost.summary(cost, device_rates.H100)["launches"] == len(cost.kernels)


def test_gpu_target_needs_the_plugin_or_names_the_target():
    with pytest.raises(ValueError, match="target must be one of"):
        hlo_cost.target_devices("tpu", 1)
