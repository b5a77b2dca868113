"""Measured device rates for the `strategy="auto"` cost model (`jaxdp.clipping.norms`).

A per-layer choice between ghost norms, instantiated norms and stored
per-example gradients trades GEMM FLOPs against memory traffic, so `auto`
estimates each method's time as FLOPs / matmul rate + bytes / bandwidth with
the rates of the device it runs on. Every row below is a measurement (or says
that it is not one), with the command, device, JAX version and date.
Re-measure a device with `python -m benchmarks.measure_rates` and add its row.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    """Sustained rates of one device kind."""
    device_kind: str
    matmul_flops_per_s: Mapping[str, float]  # by GEMM input dtype ("bfloat16", "float32" at HIGHEST precision)
    bytes_per_s: float                       # copy bandwidth of device memory (read + write bytes / s)
    source: str
    memory_bytes: float | None = None        # device memory (None: unknown, e.g. a host)

    def matmul_rate(self, dtype) -> float:
        name = jnp.dtype(dtype).name
        if name in ("bfloat16", "float16"):
            return self.matmul_flops_per_s["bfloat16"]
        return self.matmul_flops_per_s["float32"]

    def store_budget_bytes(self, default: float) -> float:
        """What `strategy="auto"` may hold in kept per-example gradients: 1/4 of device memory, or `default`.

        Held G_b mostly take the place of activations the backward has freed (in XLA:GPU's compile,
        keeping every G_b left the peak at non-DP's: WORKSPACE.md), so the sum of G_b overstates what
        they add; the quarter bounds it where activations are small (remat)."""
        return self.memory_bytes / 4 if self.memory_bytes else default

    def seconds(self, flops: float, bytes_moved: float, dtype) -> float:
        """The time model: GEMM FLOPs at the matmul rate plus bytes at the copy bandwidth."""
        return flops / self.matmul_rate(dtype) + bytes_moved / self.bytes_per_s


H100 = DeviceRates(
    "NVIDIA H100 80GB HBM3",
    {"bfloat16": 8.0e14,   # measured: ~800 TFLOP/s dense bf16 (WORKSPACE.md, "Facts moved out of docstrings")
     "float32": 6.7e13},   # NOT measured: the FP32 (non-tensor-core) spec figure; f32 norms run at HIGHEST
    3.0e12,                # measured: ~3 TB/s copy (the same)
    "bf16 rate and copy bandwidth as measured (WORKSPACE.md); float32 from the spec sheet (not measured)",
    memory_bytes=80e9)     # the 80 GB of HBM3 (spec)

H200 = DeviceRates(
    "NVIDIA H200",
    {"bfloat16": 7.74e14,  # measured: 8192^3 GEMM, f32 accumulation, 50 in one program
     "float32": 5.13e13},  # measured: the same at HIGHEST precision (no TF32)
    4.06e12,               # measured: copy of 1 GiB float32 (read + write bytes)
    "python -m benchmarks.measure_rates, NVIDIA H200, JAX 0.11.2, 2026-11-27 (benchmarks/h200-2026-11-27/rates.log)",
    memory_bytes=143771 * 2**20)  # nvidia-smi's memory.total on that machine

CPU = DeviceRates(
    "cpu",
    {"bfloat16": 1.02e11, "float32": 1.57e11},
    1.23e10,
    "python -m benchmarks.measure_rates, cpu (2 cores), JAX 0.10.2, 2026-11-23")

TABLE = (H100, H200, CPU)


def current() -> DeviceRates:
    """The rates of the default device: its row of `TABLE` by device kind; an unlisted GPU gets the
    H100's, any other device the CPU's. JAXDP_DEVICE_KIND=<kind> overrides the device (a deviceless
    compile for a GPU on a CPU machine sets it: `experiments/bench_throughput.py --target`)."""
    device = jax.devices()[0]
    kind = os.environ.get("JAXDP_DEVICE_KIND") or device.device_kind
    for rates in TABLE:
        if rates.device_kind.lower() in kind.lower() or kind.lower() in rates.device_kind.lower():
            return rates
    return H100 if device.platform == "gpu" else CPU
