"""jaxdp.analysis.hlo_cost: FLOPs, bytes and kernel launches of a compiled program from its optimized HLO."""

import os
import pathlib

import jax
import jax.numpy as jnp
import pytest

from jaxdp.analysis import hlo_cost
from jaxdp.clipping import device_rates

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


def test_a_scan_costs_its_slices_not_its_stacks():
    """A scan reads one row of its stacked input and writes one row of its stacked output per step
    (dynamic-slice, in-place dynamic-update-slice): bytes grow linearly with the length L. Charging
    every step the whole (L, N) stacks, as before, grew them as L^2 (38 -> 134 bytes per element
    for L = 8 -> 32)."""
    def f(xs):
        def body(c, x):
            c = jnp.sin(c + x)
            return c, c * 2.0
        return jax.lax.scan(body, jnp.zeros(xs.shape[1:]), xs)

    N = 4096
    per_element = {L: hlo_cost.step_cost(jax.jit(f).lower(jnp.ones((L, N))).compile()).bytes / (L * N * 4)
                   for L in (8, 32)}
    # a step reads its row and the carry, writes the carry and its row (plus loop bookkeeping)
    assert all(3 <= v <= 12 for v in per_element.values()), per_element
    assert per_element[32] <= 1.1 * per_element[8], per_element


FUSED_DUS_HLO = """HloModule m, is_scheduled=true

%fused (p0: f32[8,1,64], p1: s32[], p2: f32[1,1,64], p3: f32[1,1,64], p4: f32[1,1,64]) -> f32[8,1,64] {
  %p0 = f32[8,1,64]{2,1,0} parameter(0)
  %p2 = f32[1,1,64]{2,1,0} parameter(2)
  %p3 = f32[1,1,64]{2,1,0} parameter(3)
  %p4 = f32[1,1,64]{2,1,0} parameter(4)
  %a = f32[1,1,64]{2,1,0} add(%p2, %p3)
  %u = f32[1,1,64]{2,1,0} add(%a, %p4)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %d = f32[8,1,64]{2,1,0} dynamic-update-slice(%p0, %u, %p1, %c, %c)
}

ENTRY %main (s: f32[8,1,64], i: s32[], x: f32[1,1,64], y: f32[1,1,64], z: f32[1,1,64]) -> f32[8,1,64] {
  %s = f32[8,1,64]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = f32[1,1,64]{2,1,0} parameter(2)
  %y = f32[1,1,64]{2,1,0} parameter(3)
  %z = f32[1,1,64]{2,1,0} parameter(4)
  ROOT %f = f32[8,1,64]{2,1,0} fusion(%s, %i, %x, %y, %z), kind=kLoop, calls=%fused
}
"""


def test_an_in_place_fusion_reads_each_operand():
    """A fusion adding three rows into one row of a stack in place: it reads the three rows and the index and
    writes one row. (An earlier version named the operands from the root's own argument list, where the
    constant index stood at positions 3 and 4, and counted the rows y and z as one.)"""
    (kernel,) = hlo_cost.step_cost(FUSED_DUS_HLO).kernels
    row = 64 * 4
    assert kernel.bytes == 3 * row + 4 + row


def test_a_scatter_add_costs_its_rows():
    """An embedding gradient's scatter-add of B T rows into a (V, D) table touches those rows, in place."""
    V, D, n = 50000, 64, 256
    def f(table, ids, rows):
        return table.at[ids].add(rows)

    ids = jax.random.randint(jax.random.key(0), (n,), 0, V)
    compiled = jax.jit(f, donate_argnums=0).lower(jnp.ones((V, D)), ids, jnp.ones((n, D))).compile()
    cost = hlo_cost.step_cost(compiled)
    assert cost.bytes <= 8 * n * D * 4, (cost.bytes, V * D * 4)


def test_gpu_target_needs_the_plugin_or_names_the_target():
    with pytest.raises(ValueError, match="target must be one of"):
        hlo_cost.target_devices("tpu", 1)


_PTXAS_V = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'loop_add_fusion_30' for 'sm_90a'
ptxas info    : Function properties for loop_add_fusion_30
    3652 bytes stack frame, 3652 bytes spill stores, 3504 bytes spill loads
ptxas info    : Used 255 registers, used 0 barriers, 3652 bytes cumulative stack size
ptxas info    : Compiling entry function 'fusion_7' for 'sm_90a'
ptxas info    : Function properties for fusion_7
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers
"""


def test_register_use_reads_ptxas_per_kernel(tmp_path, monkeypatch):
    """`register_use` runs ptxas -v on each dumped PTX with kernels (a fake ptxas here: CI has none) and names
    the kernels as the optimized HLO does; an empty PTX file (XLA writes some) is skipped, not an error."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ptxas").write_text(f"#!/bin/sh\ncat >&2 <<'END'\n{_PTXAS_V}END\n")
    (bin_dir / "ptxas").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "module_0001.jit_step.3.ptx").write_text(".version 8.0\n.visible .entry loop_add_fusion_30(\n")
    (dump / "module_0001.jit_step.4.ptx").write_text("")
    assert hlo_cost.register_use(str(dump)) == {"loop_add_fusion.30": (255, 3652 + 3504), "fusion.7": (40, 0)}
