"""Times the DP pieces of one linear layer against its non-DP weight-gradient GEMM.

    python -m experiments.bench_kernels                 # GPT-2 S/M/L + Llama-1B-like shapes (GPU)
    python -m experiments.bench_kernels --smoke         # two tiny shapes on CPU (interpreted kernels)

For x (B, T, P), g (B, T, D): the non-DP wgrad x^T g; the XLA DP paths
(instantiate norms, ghost norms, the clipped GEMM); the Pallas kernels
(`jaxdp.pallas`: sq_norms, ghost_sq_norms, clipped_sum, fused per-layer
single pass). Median time after warm-up, achieved TFLOP/s (useful FLOPs of
each method / time), and time as a ratio to the non-DP GEMM. A markdown
table is printed and JSON written.
"""

from __future__ import annotations

import datetime
import time

from absl import app, flags

from experiments._results import write_results

MODELS = flags.DEFINE_list("models", ["gpt2-small", "gpt2-medium", "gpt2-large", "llama-1b"], "shape sets")
SEQ_LENS = flags.DEFINE_list("seq_lens", ["512", "1024", "2048", "4096"], "T values")
BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8"], "B values")
DTYPE = flags.DEFINE_string("dtype", "bfloat16", "input dtype of x and g")
REPEATS = flags.DEFINE_integer("repeats", 10, "timed repeats (median)")
OUT = flags.DEFINE_string("out", "benchmarks/bench_kernels.json", "JSON output path")
SMOKE = flags.DEFINE_boolean("smoke", False, "tiny shapes, 2 repeats: a CPU check")

# (layer, P, D) per model: inputs x outputs of every linear weight.
SHAPES = {
    "gpt2-small": [("c_attn", 768, 2304), ("c_proj", 768, 768), ("c_fc", 768, 3072), ("mlp.c_proj", 3072, 768)],
    "gpt2-medium": [("c_attn", 1024, 3072), ("c_proj", 1024, 1024), ("c_fc", 1024, 4096),
                    ("mlp.c_proj", 4096, 1024)],
    "gpt2-large": [("c_attn", 1280, 3840), ("c_proj", 1280, 1280), ("c_fc", 1280, 5120),
                   ("mlp.c_proj", 5120, 1280)],
    # Llama-3.2-1B-like: d 2048, 32 q heads + 8 kv heads of 64, SwiGLU 8192.
    "llama-1b": [("qkv", 2048, 3072), ("o", 2048, 2048), ("gate_up", 2048, 16384), ("down", 8192, 2048)],
    "smoke": [("odd", 48, 40), ("square", 64, 64)],
}


def _methods(B, T, P, D):
    """name -> (fn(x, g, c), useful FLOPs)."""
    import jax.numpy as jnp

    from jaxdp import pallas as jp
    from jaxdp import norms

    gemm = 2 * B * T * P * D
    ghost = 2 * B * T * T * (P + D)
    fn = lambda sq: jnp.minimum(1.0, 1.0 / jnp.sqrt(sq))
    inst = lambda x, g: norms._per_example(lambda a, b: norms._linear_instantiate(a, b, a, b), (x, g), 8)
    gh = lambda x, g: norms._per_example(lambda a, b: norms._linear_ghost(a, b, a, b), (x, g), 8)
    return {
        "nondp_wgrad": (lambda x, g, c: jnp.einsum("btp,btd->pd", x, g, preferred_element_type=jnp.float32), gemm),
        "xla_inst_norms": (lambda x, g, c: inst(x, g), gemm),
        "xla_ghost_norms": (lambda x, g, c: gh(x, g), ghost),
        "xla_clipped_sum": (lambda x, g, c: jp.linear_clipped_sum(x, g, c, implementation="xla"), gemm),
        "pallas_sq_norms": (lambda x, g, c: jp.linear_sq_norms(x, g), gemm),
        "pallas_ghost_norms": (lambda x, g, c: jp.linear_ghost_sq_norms(x, g), ghost),
        "pallas_clipped_sum": (lambda x, g, c: jp.linear_clipped_sum(x, g, c), gemm),
        "pallas_single_pass": (lambda x, g, c: jp.linear_fused_clipped_sum(x, g, fn), gemm),
    }


def _time(f, args, repeats):
    import jax
    import numpy as np
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    if SMOKE.value:
        models, seq_lens, batch_sizes, repeats, dtype = ["smoke"], [32], [1, 2], 2, "float32"
    else:
        models, seq_lens = MODELS.value, [int(t) for t in SEQ_LENS.value]
        batch_sizes, repeats, dtype = [int(b) for b in BATCH_SIZES.value], REPEATS.value, DTYPE.value
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"{datetime.date.today()}, {dtype}\n")
    print("| model | layer | P x D | T | B | method | ms | TFLOP/s | vs non-DP |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for model in models:
        for layer, P, D in SHAPES[model]:
            for T in seq_lens:
                for B in batch_sizes:
                    kx, kg = jax.random.split(jax.random.key(0))
                    x = jax.random.normal(kx, (B, T, P), jnp.float32).astype(dtype)
                    g = jax.random.normal(kg, (B, T, D), jnp.float32).astype(dtype)
                    c = jnp.linspace(0.2, 1.0, B, dtype=jnp.float32)
                    base = None
                    for name, (fn, flops) in _methods(B, T, P, D).items():
                        try:
                            s = _time(jax.jit(fn), (x, g, c), repeats)
                            row = dict(model=model, layer=layer, P=P, D=D, T=T, B=B, method=name, status="ok",
                                       seconds=s, flops=flops, tflops=flops / s / 1e12)
                        except Exception as e:  # noqa: BLE001 - an OOM or a lowering failure is a result
                            row = dict(model=model, layer=layer, P=P, D=D, T=T, B=B, method=name,
                                       status=type(e).__name__, error=str(e).splitlines()[0][:200])
                        base = row if name == "nondp_wgrad" else base
                        rows.append(row)
                        if row["status"] == "ok":
                            ratio = row["seconds"] / base["seconds"] if base and base["status"] == "ok" else float("nan")
                            cells = [f"{row['seconds'] * 1e3:.3f}", f"{row['tflops']:.2f}", f"{ratio:.2f}"]
                        else:
                            cells = [row["status"]] * 3
                        print(f"| {model} | {layer} | {P} x {D} | {T} | {B} | {name} | " + " | ".join(cells) + " |",
                              flush=True)
    write_results(OUT.value, rows, dtype=dtype)


if __name__ == "__main__":
    app.run(main)
