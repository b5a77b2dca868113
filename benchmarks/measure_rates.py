"""Measures the device rates the `strategy="auto"` cost model uses (`jaxdp.clipping.device_rates`).

    python -m benchmarks.measure_rates            # prints one table row and a JSON line

Times, inside ONE jitted program each (a `lax.fori_loop` of `--iters`
iterations, so host dispatch does not count), after a warm-up:
  - a square GEMM in bfloat16 (float32 accumulation) and in float32 at
    HIGHEST precision (IEEE, no TF32), FLOP/s;
  - a copy (read + write) of a large float32 array, bytes/s.
Median of `--repeats`. Paste the row into `jaxdp/clipping/device_rates.py` with the
device, JAX version, date and this command.
"""

from __future__ import annotations

import datetime
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

SIZE = flags.DEFINE_integer("size", 0, "GEMM edge (0: 8192 on GPU, 1024 on CPU)")
COPY_MB = flags.DEFINE_integer("copy_mb", 0, "copied array size in MB (0: 1024 on GPU, 256 on CPU)")
ITERS = flags.DEFINE_integer("iters", 0, "iterations inside one program (0: 50 on GPU, 4 on CPU)")
REPEATS = flags.DEFINE_integer("repeats", 5, "timed repeats (median)")


def _timed(fn, *args) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(REPEATS.value):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def matmul_rate(dtype, n: int, iters: int) -> float:
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None

    @jax.jit
    def run(a, b):
        def body(_, acc):  # acc feeds back so XLA cannot hoist the product out of the loop
            return jnp.dot(a + acc[:1, :1].astype(dtype), b, precision=precision,
                           preferred_element_type=jnp.float32)
        return jax.lax.fori_loop(0, iters, body, jnp.zeros((n, n), jnp.float32))

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
    return 2 * n**3 * iters / _timed(run, a, b)


def copy_rate(megabytes: int, iters: int) -> float:
    n = megabytes * 2**20 // 4

    @jax.jit
    def run(x):
        return jax.lax.fori_loop(0, iters, lambda i, y: y * 1.0001 + 1.0, x)  # one read + one write per pass

    return 2 * 4 * n * iters / _timed(run, jnp.ones((n,), jnp.float32))


def main(argv):
    del argv
    gpu = jax.default_backend() == "gpu"
    n = SIZE.value or (8192 if gpu else 1024)
    iters = ITERS.value or (50 if gpu else 4)
    row = {
        "device_kind": jax.devices()[0].device_kind,
        "matmul_flops_per_s": {"bfloat16": matmul_rate(jnp.bfloat16, n, iters),
                               "float32": matmul_rate(jnp.float32, n, iters)},
        "bytes_per_s": copy_rate(COPY_MB.value or (1024 if gpu else 256), iters),
        "source": (f"python -m benchmarks.measure_rates, {jax.devices()[0].device_kind}, JAX {jax.__version__}, "
                   f"{datetime.date.today().isoformat()}"),
    }
    print("| device | bf16 GEMM TFLOP/s | f32 GEMM TFLOP/s | copy GB/s |")
    print("|---|---|---|---|")
    r = row["matmul_flops_per_s"]
    print(f"| {row['device_kind']} | {r['bfloat16'] / 1e12:.3f} | {r['float32'] / 1e12:.3f} | "
          f"{row['bytes_per_s'] / 1e9:.1f} |")
    print(json.dumps(row))


if __name__ == "__main__":
    app.run(main)
