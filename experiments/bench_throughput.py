"""One full DP-Adam training step per method, FlashDP's Table 1 layout: tokens/s and peak memory vs non-DP.

    python -m experiments.bench_throughput                       # GPT-2 S/M/L, seq 1024, B 1/2/4/8 (GPU)
    python -m experiments.bench_throughput --smoke               # tiny GPT-2 on CPU, seconds

Methods (flat clipping unless named):
  non_dp            ordinary step, mean loss, Adam
  explicit          jax.vmap(jax.grad) per-example gradients (jaxdp.reference; jax_privacy / Opacus style)
  ghost_2nd_bwd     ghost norms, then a second backward pass of sum_b c_b L_b (ghost clipping)
  bookkeeping_xla   jaxdp fused_clip, strategy="ghost" (norms from kept x, g; one clipped GEMM per layer)
  auto_flat         jaxdp fused_clip, strategy="auto"
  pallas_flat       jaxdp fused_clip, strategy="pallas"
  pallas_per_layer  jaxdp fused_clip, strategy="pallas", clipping="per_layer"
Every configuration runs in its own process so its peak memory is clean; the
parent prints a markdown table (ratios to non_dp of the same model and batch)
and writes JSON. Peak memory: device.memory_stats()["peak_bytes_in_use"]
where the backend reports it, else the compiled step's memory_analysis().
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time

from absl import app, flags

from experiments._results import write_results

METHODS = ("non_dp", "explicit", "ghost_2nd_bwd", "bookkeeping_xla", "auto_flat", "pallas_flat",
           "pallas_per_layer")
MODELS = flags.DEFINE_list("models", ["small", "medium", "large"], "GPT-2 presets")
BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8"], "micro-batch sizes")
SEQ_LEN = flags.DEFINE_integer("seq_len", 1024, "tokens per example")
METHODS_FLAG = flags.DEFINE_list("methods", list(METHODS), "methods to run")
DTYPE = flags.DEFINE_string("dtype", "bfloat16", "compute dtype")
STEPS = flags.DEFINE_integer("steps", 10, "timed steps (median reported)")
WARMUP = flags.DEFINE_integer("warmup", 3, "untimed steps after compilation")
OUT = flags.DEFINE_string("out", "benchmarks/bench_throughput.json", "JSON output path")
SMOKE = flags.DEFINE_boolean("smoke", False, "tiny GPT-2, seq 32, B 2, 2 steps: a CPU check")
CHILD = flags.DEFINE_string("child", None, "internal: run one configuration (JSON) and print its result")
TIMEOUT = flags.DEFINE_integer("timeout", 1800, "seconds per configuration")


def _step_fn(method: str, model_name: str, B: int, T: int, dtype: str, vocab: int):
    """(jitted step, state, batch) of one configuration."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jaxdp
    from jaxdp.models.gpt2 import GPT2, GPT2Config

    def losses_fn(model, batch):
        logits = model(batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean(-1)

    config = GPT2Config.preset(model_name, seq_len=T, dtype=dtype, vocab_size=vocab)
    model = GPT2(config, rngs=nnx.Rngs(0))
    C, sigma, expected_B = 1.0, 0.8, float(B)
    dp_kw = dict(expected_batch_size=expected_B)
    if method in ("non_dp", "ghost_2nd_bwd"):
        tx = optax.adam(1e-4)
    else:
        clipping = "per_layer" if method == "pallas_per_layer" else "flat"
        strategy = {"explicit": "auto", "bookkeeping_xla": "ghost", "auto_flat": "auto"}.get(method, "pallas")
        tx = optax.chain(jaxdp.fused_clip(C, sigma, clipping=clipping, strategy=strategy, **dp_kw),
                         optax.adam(1e-4))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    grads_fn = jaxdp.per_example_grads(losses_fn)

    def grads_of(model, batch, key):
        if method == "non_dp":
            return nnx.grad(lambda m: losses_fn(m, batch).mean())(model)
        if method == "explicit":
            _, per_example = jaxdp.reference.per_example_grads(losses_fn, model, batch)
            flat = list(nnx.to_flat_state(nnx.state(model, nnx.Param)))
            return nnx.from_flat_state([(p, v.replace(per_example[tuple(p)])) for p, v in flat])
        if method == "ghost_2nd_bwd":
            _, factored = grads_fn(model, batch)
            _, norms = jaxdp.clipped_aggregate(factored, C, strategy="ghost")  # the sums are dead code
            n = norms["all"]
            c = jnp.where(jnp.isfinite(n), jnp.minimum(1.0, C / n), 0.0)
            summed = nnx.grad(lambda m: jnp.sum(jax.lax.stop_gradient(c) * losses_fn(m, batch)))(model)
            leaves, treedef = jax.tree.flatten(summed)
            keys = jax.random.split(key, len(leaves))
            return jax.tree.unflatten(treedef, [(s + sigma * C * jax.random.normal(k, s.shape, s.dtype)) / expected_B
                                                for s, k in zip(leaves, keys)])
        return grads_fn(model, batch)[1]

    @jax.jit
    def step(state, batch, key):
        model, optimizer = nnx.merge(graphdef, state)
        optimizer.update(model, grads_of(model, batch, key))
        return nnx.state((model, optimizer))

    tokens = jax.random.randint(jax.random.key(1), (B, T + 1), 0, vocab)
    return step, state, {"tokens": tokens}


def run_one(cfg: dict) -> dict:
    import jax
    import numpy as np
    step, state, batch = _step_fn(cfg["method"], cfg["model"], cfg["B"], cfg["T"], cfg["dtype"], cfg["vocab"])
    key = jax.random.key(2)
    compiled = step.lower(state, batch, key).compile()
    analysis = compiled.memory_analysis()
    for _ in range(cfg["warmup"]):
        state = compiled(state, batch, key)
    jax.block_until_ready(state)
    times = []
    for _ in range(cfg["steps"]):
        t0 = time.perf_counter()
        state = jax.block_until_ready(compiled(state, batch, key))
        times.append(time.perf_counter() - t0)
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    source = "peak_bytes_in_use"
    if peak is None and analysis is not None:
        peak = (analysis.temp_size_in_bytes + analysis.argument_size_in_bytes
                + analysis.output_size_in_bytes - analysis.alias_size_in_bytes)
        source = "memory_analysis"
    median = float(np.median(times))
    return dict(cfg, status="ok", step_s=median, tokens_per_s=cfg["B"] * cfg["T"] / median,
                peak_bytes=peak, peak_source=source)


def _spawn(cfg: dict) -> dict:
    cmd = [sys.executable, "-m", "experiments.bench_throughput", f"--child={json.dumps(cfg)}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT.value)
    except subprocess.TimeoutExpired:
        return dict(cfg, status="timeout")
    if proc.returncode == 0:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    err = proc.stderr
    oom = any(s in err for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory"))
    return dict(cfg, status="OOM" if oom else "error", error=err.strip().splitlines()[-1:] or [""])


def _fmt(row, base):
    if row["status"] != "ok":
        return [row["status"]] * 4
    tps, mem = row["tokens_per_s"], row["peak_bytes"]
    if base is None or base.get("status") != "ok":
        return [f"{tps:,.0f}", "-", f"{mem / 2**20:,.0f}" if mem else "-", "-"]
    return [f"{tps:,.0f}", f"{tps / base['tokens_per_s']:.2f}", f"{mem / 2**20:,.0f}" if mem else "-",
            f"{mem / base['peak_bytes']:.2f}" if mem and base["peak_bytes"] else "-"]


def main(argv):
    del argv
    if CHILD.value:
        print(json.dumps(run_one(json.loads(CHILD.value))))
        return
    import jax
    if SMOKE.value:
        models, batch_sizes, T, steps, warmup, vocab, dtype = ["tiny"], [2], 32, 2, 1, 97, "float32"
    else:
        models, batch_sizes, T = MODELS.value, [int(b) for b in BATCH_SIZES.value], SEQ_LEN.value
        steps, warmup, vocab, dtype = STEPS.value, WARMUP.value, 50257, DTYPE.value
    methods = METHODS_FLAG.value if "non_dp" in METHODS_FLAG.value else ["non_dp"] + METHODS_FLAG.value
    rows = []
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"{datetime.date.today()}, seq {T}, {dtype}\n")
    print("| model | B | method | tokens/s | vs non-DP | peak MiB | vs non-DP |")
    print("|---|---|---|---|---|---|---|")
    for model in models:
        for B in batch_sizes:
            base = None
            for method in methods:
                cfg = dict(model=model, B=B, T=T, method=method, dtype=dtype, vocab=vocab,
                           steps=steps, warmup=warmup)
                row = _spawn(cfg)
                base = row if method == "non_dp" else base
                rows.append(row)
                print(f"| {model} | {B} | {method} | " + " | ".join(_fmt(row, base)) + " |", flush=True)
    write_results(OUT.value, rows)


if __name__ == "__main__":
    app.run(main)
