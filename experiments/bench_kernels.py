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
bytes (`_counts`: `norm_costs.pair_cost` for the XLA norm paths, the counts of the
`jaxdp/pallas` module docstrings for the kernels), arithmetic intensity, the
roofline floor max(FLOPs / R, bytes / W) and the fraction of it achieved.
R and W are measured in this process: R the best TFLOP/s of a plain square
matmul in the benchmark dtype, W the best bytes/s of a large copy (x * 2) or
sum. Both tables are printed as markdown and written to the JSON.
"""

from __future__ import annotations

import datetime
import math
import time

from absl import app, flags

from experiments._results import write_results

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
NORM_CHUNK = 8  # examples per chunk of the XLA norm paths


def _methods():
    """name -> fn(x, g, c)."""
    import jax.numpy as jnp

    from jaxdp import pallas as jp
    from jaxdp.clipping import norms

    fn = lambda sq: jnp.minimum(1.0, 1.0 / jnp.sqrt(sq))
    inst = lambda x, g: norms._per_example(lambda a, b: norms._linear_instantiate(a, b, a, b), (x, g), NORM_CHUNK)
    gh = lambda x, g: norms._per_example(lambda a, b: norms._linear_ghost(a, b, a, b), (x, g), NORM_CHUNK)
    return {
        "nondp_wgrad": lambda x, g, c: jnp.einsum("btp,btd->pd", x, g, preferred_element_type=jnp.float32),
        "xla_inst_norms": lambda x, g, c: inst(x, g),
        "xla_ghost_norms": lambda x, g, c: gh(x, g),
        "xla_clipped_sum": jp.linear_clipped_sum_reference,
        "pallas_sq_norms": lambda x, g, c: jp.linear_sq_norms(x, g),
        "pallas_ghost_norms": lambda x, g, c: jp.linear_ghost_sq_norms(x, g),
        "pallas_clipped_sum": lambda x, g, c: jp.linear_clipped_sum(x, g, c),
        "pallas_single_pass": lambda x, g, c: jp.linear_fused_clipped_sum(x, g, fn),
    }


def _counts(B, T, P, D, itemsize):
    """name -> (FLOPs, compulsory HBM bytes) of each method, at the defaults `_methods` calls.

    Bytes: inputs read once, outputs written once, HBM scratch written and read
    once (float32); tile re-reads of x and g (which L2 mostly absorbs) are not
    counted, so these are lower bounds.
    """
    from jaxdp.clipping.norm_costs import LayerShape, pair_cost
    from jaxdp.pallas import _common, ghost_norms, linear_norms, single_pass

    io = B * T * (P + D) * itemsize  # x and g read once
    out = P * D * 4  # a float32 (P, D) sum
    gemm = 2 * B * T * P * D
    shape = LayerShape(B, T, P, D, itemsize)
    inst = pair_cost("linear", "instantiate", shape, chunk_size=NORM_CHUNK)
    ghost = pair_cost("linear", "ghost", shape, chunk_size=NORM_CHUNK)
    n_p, n_d = (math.ceil(n / _common.block(n, blk)) for n, blk in ((P, linear_norms.BLOCK_P),
                                                                    (D, linear_norms.BLOCK_D)))
    bt = _common.block(T, ghost_norms.BLOCK_T)
    chunks = math.ceil(B / single_pass.DEFAULT_CHUNK_SIZE)
    return {
        "nondp_wgrad": (gemm, io + out),
        "xla_inst_norms": (inst.flops, inst.bytes_moved),
        "xla_ghost_norms": (ghost.flops, ghost.bytes_moved),
        "xla_clipped_sum": (gemm + B * T * D, io + out),
        "pallas_sq_norms": (inst.flops, io + B * n_p * n_d * 4),  # = inst. FLOPs, no G in HBM
        "pallas_ghost_norms": (B * T * (T + bt) * (P + D), io + B * math.ceil(T / bt) ** 2 * 4),
        "pallas_clipped_sum": (gemm + B * T * D, io + out),
        # float32 scratch written + read once; the accumulator read + written per chunk.
        "pallas_single_pass": (gemm + 4 * B * P * D, io + 2 * B * P * D * 4 + 2 * chunks * out),
    }


def _in_one_program(f, iters: int):
    """A jitted fn(*args) running f(*args) `iters` times in one `fori_loop`, so one dispatch times many calls.

    The arguments ride in the loop state through an optimization barrier (XLA cannot hoist f out of the
    loop as invariant), and each call's result is reduced into a carried scalar (it is not dead code):
    that reduction reads the output once more (P x D floats for a sum, B for norms).
    """
    import jax
    import jax.numpy as jnp

    def many(*args):
        def body(_, state):
            args, acc = state
            out = f(*args)
            acc = acc + sum(jnp.sum(o, dtype=jnp.float32) for o in jax.tree.leaves(out))
            return jax.lax.optimization_barrier(args), acc
        return jax.lax.fori_loop(0, iters, body, (args, jnp.zeros((), jnp.float32)))[1]

    return jax.jit(many)


def _time(f, args, repeats, stat=None, iters: int = 1):
    """Seconds per call of f: the median (or `stat`) over `repeats` timings of `iters` calls in one program."""
    import jax
    import numpy as np
    run = _in_one_program(f, iters)
    jax.block_until_ready(run(*args))
    jax.block_until_ready(run(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append((time.perf_counter() - t0) / iters)
    return float((stat or np.median)(times))


def _ceilings(dtype, probes, repeats, iters):
    """Measured R (FLOP/s, best square matmul in `dtype`) and W (bytes/s, best of copy and sum)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    sizes, n_elems = probes
    key = jax.random.key(1)
    matmul = {}
    for n in sizes:
        a = jax.random.normal(key, (n, n), jnp.float32).astype(dtype)
        matmul[str(n)] = 2 * n ** 3 / _time(jnp.matmul, (a, a), repeats, np.min, iters)
        del a
    v = jax.random.normal(key, (n_elems,), jnp.float32).astype(dtype)
    nbytes = n_elems * v.dtype.itemsize
    copy = 2 * nbytes / _time(lambda v: v * 2, (v,), repeats, np.min, iters)
    total = nbytes / _time(lambda v: jnp.sum(v, dtype=jnp.float32), (v,), repeats, np.min, iters)
    return dict(R=max(matmul.values()), W=max(copy, total), matmul_flops_per_s=matmul,
                copy_bytes_per_s=copy, sum_bytes_per_s=total, copy_elements=n_elems, dtype=str(dtype))


def _roofline(row, R, W):
    """Intensity, floor max(F / R, bytes / W), the resource that sets it, and floor / measured time."""
    t_flops, t_bytes = row["flops"] / R, row["bytes"] / W
    floor = max(t_flops, t_bytes)
    achieved = floor / row["seconds"] if row["status"] == "ok" else None
    return dict(intensity=row["flops"] / row["bytes"], floor_s=floor,
                bound="compute" if t_flops >= t_bytes else "memory", of_floor=achieved)


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
    ceil = _ceilings(dtype, CEILING_PROBES["smoke" if SMOKE.value else "gpu"], max(repeats, 3), iters)
    methods, itemsize = _methods(), jnp.dtype(dtype).itemsize
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
                    for name, (flops, nbytes) in _counts(B, T, P, D, itemsize).items():
                        row = dict(model=model, layer=layer, P=P, D=D, T=T, B=B, method=name, flops=flops,
                                   bytes=nbytes)
                        try:
                            s = _time(methods[name], (x, g, c), repeats, iters=iters)
                            row.update(status="ok", seconds=s, tflops=flops / s / 1e12)
                        except Exception as e:  # noqa: BLE001 - an OOM or a lowering failure is a result
                            row.update(status=type(e).__name__, error=str(e).splitlines()[0][:200])
                        row.update(_roofline(row, ceil["R"], ceil["W"]))
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
