"""Times the DP pieces of one linear layer against its non-DP weight-gradient GEMM, and says where the time goes.

    python -m experiments.bench_kernels                 # GPT-2 S/M/L + Llama-1B-like shapes (GPU)
    python -m experiments.bench_kernels --smoke         # two tiny shapes on CPU (interpreted kernels)

For x (B, T, P), g (B, T, D): the non-DP wgrad x^T g; the XLA DP paths
(instantiate norms, ghost norms, the clipped GEMM); the Pallas kernels
(`jaxdp.pallas`: sq_norms, ghost_sq_norms, clipped_sum, fused per-layer
single pass). Each method runs `--iters` times inside ONE jitted program (a
`fori_loop`), so host dispatch does not count (the first H100 run timed single
dispatches: every op, the plain GEMM included, landed at 2-30% of its floor).
Median time per call after warm-up, achieved TFLOP/s and time as a ratio to
the non-DP GEMM (first table).

Where the time goes (second table): each method's FLOPs and compulsory HBM
bytes (`jaxdp.analysis.kernels.counts`), arithmetic intensity, the
roofline floor max(FLOPs / R, bytes / W) and the fraction of it achieved.
R and W are measured in this process: R the best TFLOP/s of a plain square
matmul in the benchmark dtype, W the best bytes/s of a large copy (x * 2) or
sum. Both tables are printed as markdown and written to the JSON.
"""

from __future__ import annotations

import datetime

from absl import app, flags

from experiments._results import write_results
from jaxdp.analysis import kernels

MODELS = flags.DEFINE_list("models", ["gpt2-small", "gpt2-medium", "gpt2-large", "llama-1b"], "shape sets")
SEQ_LENS = flags.DEFINE_list("seq_lens", ["512", "1024", "2048", "4096"], "T values")
BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8"], "B values")
DTYPE = flags.DEFINE_string("dtype", "bfloat16", "input dtype of x and g")
REPEATS = flags.DEFINE_integer("repeats", 5, "timed repeats (median)")
ITERS = flags.DEFINE_integer("iters", 20, "calls per timed program (one dispatch times them all)")
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
# Ceiling probes: square matmul sizes n (2 n^3 FLOPs) and the element count of the copy / sum.
CEILING_PROBES = {"gpu": ((4096, 8192), 1 << 28), "smoke": ((256, 512), 1 << 22)}


def _print_where_time_goes(rows, ceil, device):
    R, W = ceil["R"], ceil["W"]
    sizes = "/".join(ceil["matmul_flops_per_s"])
    print(f"\nwhere time goes, {device}: R = {R / 1e12:.3g} TFLOP/s (best {ceil['dtype']} n x n matmul, "
          f"n = {sizes}), W = {W / 1e9:.3g} GB/s (best of copy {ceil['copy_bytes_per_s'] / 1e9:.3g}, "
          f"sum {ceil['sum_bytes_per_s'] / 1e9:.3g}), ridge R / W = {R / W:.3g} FLOP/byte; "
          "floor = max(FLOPs / R, bytes / W)\n")
    print("| model | layer | P x D | T | B | method | GFLOP | HBM MB | FLOP/byte | bound | floor ms | ms | of floor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms, frac = ((f"{r['seconds'] * 1e3:.3f}", f"{r['of_floor']:.3f}") if r["status"] == "ok"
                    else (r["status"], "-"))
        print(f"| {r['model']} | {r['layer']} | {r['P']} x {r['D']} | {r['T']} | {r['B']} | {r['method']} | "
              f"{r['flops'] / 1e9:.4g} | {r['bytes'] / 1e6:.4g} | {r['intensity']:.3g} | {r['bound']} | "
              f"{r['floor_s'] * 1e3:.4g} | {ms} | {frac} |")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    if SMOKE.value:
        models, seq_lens, batch_sizes, repeats, iters, dtype = ["smoke"], [32], [1, 2], 2, 2, "float32"
    else:
        models, seq_lens = MODELS.value, [int(t) for t in SEQ_LENS.value]
        batch_sizes, repeats, iters, dtype = ([int(b) for b in BATCH_SIZES.value], REPEATS.value, ITERS.value,
                                              DTYPE.value)
    dev, backend = jax.devices()[0], jax.default_backend()
    cpu_note = " [CPU numbers: kernels interpreted, not a GPU measurement]" if backend == "cpu" else ""
    device = f"{dev.device_kind} ({backend}){cpu_note}"
    print(f"device: {device}, jax {jax.__version__}, {datetime.date.today()}, {dtype}\n")
    ceil = kernels.ceilings(dtype, CEILING_PROBES["smoke" if SMOKE.value else "gpu"], max(repeats, 3), iters)
    methods, itemsize = kernels.methods(), jnp.dtype(dtype).itemsize
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
                    for name, counted in kernels.counts(B, T, P, D, itemsize).items():
                        row = dict(model=model, layer=layer, P=P, D=D, T=T, B=B,
                                   **kernels.measured_row(name, methods[name], (x, g, c), counted,
                                                          repeats=repeats, iters=iters))
                        row.update(kernels.roofline(row, ceil["R"], ceil["W"]))
                        base = row if name == "nondp_wgrad" else base
                        rows.append(row)
                        if row["status"] == "ok":
                            ok = base and base["status"] == "ok"
                            ratio = row["seconds"] / base["seconds"] if ok else float("nan")
                            cells = [f"{row['seconds'] * 1e3:.3f}", f"{row['tflops']:.2f}", f"{ratio:.2f}"]
                        else:
                            cells = [row["status"]] * 3
                        print(f"| {model} | {layer} | {P} x {D} | {T} | {B} | {name} | " + " | ".join(cells) + " |",
                              flush=True)
    _print_where_time_goes(rows, ceil, device)
    write_results(OUT.value, rows, dtype=dtype, ceilings=ceil)


if __name__ == "__main__":
    app.run(main)
