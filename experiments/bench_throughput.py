"""One full DP-Adam step per method (FlashDP's Table 1 layout): tokens/s, peak memory and compile time vs non-DP.

    python -m experiments.bench_throughput --jobs=8         # the default grid on a GPU, 8 compiles at a time
    python -m experiments.bench_throughput --target=h100    # predicted: XLA:GPU deviceless compile, no GPU
    python -m experiments.bench_throughput --smoke          # tiny GPT-2 on CPU, seconds

Configurations are `model:micro_batch:seq_len` (default: GPT-2 small at seq 1024 with
micro-batch 4 and 16, and at seq 16384 with micro-batch 1). Methods (flat clipping unless named):
  non_dp            ordinary step, mean loss, Adam: the baseline (cuDNN attention on GPU, as every method)
  explicit          jax.vmap(jax.grad) per-example gradients (jaxdp.core.reference; jax_privacy / Opacus style)
  two_pass          jaxdp.two_pass_clipped_sums: norms inside the backward, then a clip-weighted backward
  ghost             fused_clip, strategy="ghost" (book-keeping: norms from kept x, g; one clipped GEMM per layer)
  store             fused_clip, strategy="store" (per-example gradients kept: no clipped-sum GEMM)
  auto              fused_clip, strategy="auto" (per layer: ghost / instantiate / store by device rates)
  per_layer         fused_clip, strategy="auto", clipping="per_layer"
  pallas_flat       fused_clip, strategy="pallas"
  pallas_per_layer  fused_clip, strategy="pallas", clipping="per_layer" (single-pass kernel)
Every configuration runs in its own process so its peak memory is clean; the
parent prints a markdown table (ratios to non_dp of the same configuration)
and writes JSON. Serially (`--jobs=1`) a DP process spent 63-90 s compiling
on an H100 (2026-11-23); with `--jobs=8` all compile first, 8 at a time, then each is timed
alone (21 configurations of GPT-2 small / medium took under 5 minutes on an
H200, 2026-11-27; their compile times are then contended). Steps are timed
back to back with one sync per repeat, as a training loop dispatches them.
Peak memory: device.memory_stats()["peak_bytes_in_use"] where the backend
reports it, else the compiled step's memory_analysis(). With
`--target`, nothing runs: each row is the compiled step's bytes, its FLOPs,
bytes and kernel launches read from the optimized HLO (`jaxdp.analysis.hlo_cost`),
their roofline time with the target's rates (`jaxdp.clipping.device_rates`), the
kernels ptxas gives 255 registers or register spills (memory-bound kernels
that run below the roofline's rate) and the compile time on this machine.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from experiments._results import write_results
from jaxdp.analysis import held as _held
from jaxdp.analysis.rows_merged import rows_merged
from jaxdp.clipping.settings import ClipSpec, NormPlan

METHODS = ("non_dp", "explicit", "two_pass", "ghost", "store", "auto", "per_layer", "pallas_flat",
           "pallas_per_layer")
PROFILED_STEPS = 3
SECURE = "auto_secure"  # auto with fused_clip(secure_noise=True); on request (--methods), not in the default grid
MERGED = "auto_merged"  # auto as before 3d602f0 (no jaxdp.core.rows.rows_apart): its A/B on the same GPU, on request
CONFIGS = flags.DEFINE_list("configs", ["small:4:1024", "small:16:1024", "small:1:16384"],
                            "model:micro_batch:seq_len of GPT-2 presets, optionally :method+method+... "
                            "(that configuration's methods instead of --methods)")
METHODS_FLAG = flags.DEFINE_list("methods", list(METHODS),
                                 f"methods to run (non_dp is always added; also {SECURE}, {MERGED})")
DTYPE = flags.DEFINE_string("dtype", "bfloat16", "compute dtype")
ATTENTION = flags.DEFINE_enum("attention", "auto", ["auto", "xla", "cudnn"], "attention implementation")
STEPS = flags.DEFINE_integer("steps", 10, "steps per timed repeat, dispatched back to back; 0: compile and "
                             "memory analysis only")
REPEATS = flags.DEFINE_integer("repeats", 3, "timed repeats (median of their per-step times)")
WARMUP = flags.DEFINE_integer("warmup", 3, "untimed steps after compilation")
TARGET = flags.DEFINE_enum("target", None, ["h100"], "compile for this GPU without one (predictions only)")
OUT = flags.DEFINE_string("out", "benchmarks/bench_throughput.json", "JSON output path")
SMOKE = flags.DEFINE_boolean("smoke", False, "tiny GPT-2, seq 32, B 2, 2 steps: a CPU check")
CHILD = flags.DEFINE_string("child", None, "internal: run one configuration (JSON) and print its result")
TIMEOUT = flags.DEFINE_integer("timeout", 1800, "seconds per configuration")
JOBS = flags.DEFINE_integer("jobs", 1, "processes compiling at once; >1: all compile first (JOBS at a time), "
                            "then each is timed alone (a GPU's lease is short; compile_s is then contended)")
WAIT_FOR = flags.DEFINE_string("wait_for", None, "with --jobs > 1: before timing, wait (up to --timeout) until this "
                                "file exists (e.g. GPU tests run beside the compiles write it when done)")
PROFILE_DIR = flags.DEFINE_string("profile_dir", None, "also trace 3 steps per configuration (jax.profiler) under "
                                   "this folder and print where the GPU time goes (jaxdp/analysis/profile.py)")
HOLD = flags.DEFINE_boolean("hold", False, "internal: after compiling, print COMPILED and wait for a line on stdin")


def _step_fn(cfg: dict):
    """(jitted step, its abstract arguments (state, batch, key), a function building the real ones).

    Compiling from shapes keeps a held process's device memory free for the process being timed."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jaxdp
    import jaxdp.core.reference
    from jaxdp.clipping.rules import noise_std
    from jaxdp.models.gpt2 import GPT2, GPT2Config
    from jaxdp.noise.privatizer import GaussianPrivatizer

    method, B, T = cfg["method"], cfg["B"], cfg["T"]

    def losses_fn(model, batch):
        logits = model(batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean(-1)

    config = GPT2Config.preset(cfg["model"], seq_len=T, dtype=cfg["dtype"], vocab_size=cfg["vocab"],
                               attention=cfg["attention"])
    C, sigma, expected_B = 1.0, 0.8, float(B)
    if method in ("non_dp", "two_pass"):
        tx = optax.adam(1e-4)
    else:
        clipping = "per_layer" if method in ("per_layer", "pallas_per_layer") else "flat"
        strategy = {"explicit": "auto", "ghost": "ghost", "store": "store", "auto": "auto", SECURE: "auto",
                    MERGED: "auto", "per_layer": "auto"}.get(method, "pallas")
        tx = optax.chain(jaxdp.fused_clip(C, sigma, expected_batch_size=expected_B, secure_noise=method == SECURE,
                                          clip=ClipSpec(clipping=clipping),
 norms=NormPlan(strategy=strategy)), optax.adam(1e-4))

    def build():
        model = GPT2(config, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    graphdef, abstract_state = nnx.split(nnx.eval_shape(build))
    grads_fn = jaxdp.per_example_grads(losses_fn)
    two_pass = jaxdp.two_pass_clipped_sums(losses_fn, C, norms=NormPlan(allow_low_precision=True))  # timing only

    def grads_of(model, batch, key):
        if method == "non_dp":
            return nnx.grad(lambda m: losses_fn(m, batch).mean())(model)
        if method == "explicit":
            _, per_example = jaxdp.core.reference.per_example_grads(losses_fn, model, batch)
            flat = list(nnx.to_flat_state(nnx.state(model, nnx.Param)))
            return nnx.from_flat_state([(p, v.replace(per_example[tuple(p)])) for p, v in flat])
        if method == "two_pass":
            _, sums, _ = two_pass(model, batch)
            return GaussianPrivatizer(noise_std(C, sigma), expected_B).update(sums, key)[0]
        return grads_fn(model, batch)[1]

    @jax.jit
    def step(state, batch, key):
        with rows_merged() if method == MERGED else contextlib.nullcontext():
            model, optimizer = nnx.merge(graphdef, state)
            optimizer.update(model, grads_of(model, batch, key))
            return nnx.state((model, optimizer))

    def inputs():
        """The step's real arguments, built after compiling (a held process keeps no state on the device)."""
        _, state = nnx.split(build())
        return state, {"tokens": jax.random.randint(jax.random.key(1), (B, T + 1), 0, cfg["vocab"])}, jax.random.key(2)

    sharding = None
    if cfg.get("target"):
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        from jaxdp.analysis.hlo_cost import target_devices
        sharding = NamedSharding(Mesh(target_devices(cfg["target"], 1), ("x",)), PartitionSpec())
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                            (abstract_state, jax.ShapeDtypeStruct((B, T + 1), jnp.int32), jax.random.key(2)))
    state_spec, tokens_spec, key_spec = abstract
    return step, (state_spec, {"tokens": tokens_spec}, key_spec), inputs


def run_one(cfg: dict) -> dict:
    import jax
    import numpy as np
    if cfg.get("target"):  # the step's PTX, for its kernels' registers (XLA reads the flag at its first compile)
        ptx_dir = tempfile.mkdtemp(prefix="bench_ptx_")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_dump_to={ptx_dir} --xla_dump_hlo_module_re=jit_step")
    step, abstract_args, inputs = _step_fn(cfg)
    t0 = time.perf_counter()
    compiled = step.trace(*abstract_args).lower().compile()
    compile_s = time.perf_counter() - t0
    analysis = compiled.memory_analysis()
    compiled_bytes = (analysis.temp_size_in_bytes + analysis.argument_size_in_bytes
                      + analysis.output_size_in_bytes - analysis.alias_size_in_bytes) if analysis else None
    row = dict(cfg, status="ok", compile_s=compile_s, compiled_bytes=compiled_bytes)
    if HOLD.value:  # --jobs > 1: the parent times one process at a time, after every compile has finished
        print("COMPILED", flush=True)
        sys.stdin.readline()
    if cfg.get("target"):
        from jaxdp.analysis import hlo_cost
        from jaxdp.clipping import device_rates
        rates = device_rates.H100
        cost = hlo_cost.step_cost(compiled)
        try:
            registers = hlo_cost.register_use(ptx_dir)
        finally:
            shutil.rmtree(ptx_dir, ignore_errors=True)
        heavy = {name for name, (regs, spill) in registers.items() if regs >= 255 or spill}
        return dict(row, **hlo_cost.summary(cost, rates, cfg["dtype"]), peak_bytes=compiled_bytes,
                    peak_source="memory_analysis", heavy_kernels=len(heavy),
                    heavy_gbytes=sum(k.bytes * k.count for k in cost.kernels if k.name in heavy) / 1e9)
    if not cfg["steps"]:  # compile time and memory analysis only
        return dict(row, peak_bytes=compiled_bytes, peak_source="memory_analysis")
    state, batch, key = inputs()
    for _ in range(cfg["warmup"]):
        state = compiled(state, batch, key)
    jax.block_until_ready(state)
    # Steps dispatched back to back, as a training loop runs them: host dispatch overlaps the device's
    # work (a sync per step would add the same host time to every method and pull ratios toward 1).
    times = []
    for _ in range(REPEATS.value):
        t0 = time.perf_counter()
        for _ in range(cfg["steps"]):
            state = compiled(state, batch, key)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t0) / cfg["steps"])
    stats = jax.devices()[0].memory_stats() or {}
    peak, source = stats.get("peak_bytes_in_use"), "peak_bytes_in_use"
    if peak is None:
        peak, source = compiled_bytes, "memory_analysis"
    if cfg.get("profile_dir"):
        from jaxdp.analysis import profile as _profile
        log_dir = os.path.join(cfg["profile_dir"], f"{cfg['model']}_{cfg['B']}_{cfg['T']}_{cfg['method']}")
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            for _ in range(PROFILED_STEPS):
                state = compiled(state, batch, key)
            jax.block_until_ready(state)
        row["profile"] = _profile.summarize(log_dir, PROFILED_STEPS)
    median = float(np.median(times))
    return dict(row, step_s=median, tokens_per_s=cfg["B"] * cfg["T"] / median, peak_bytes=peak, peak_source=source,
                timing=f"median of {REPEATS.value} x {cfg['steps']} steps, one sync each")


def _parse_config(text: str) -> tuple[str, int, int, list[str] | None]:
    parts = text.split(":")
    if len(parts) not in (3, 4) or not parts[1].isdigit() or not parts[2].isdigit():
        raise app.UsageError(f"--configs: {text!r} is not model:micro_batch:seq_len[:method+method...]")
    return parts[0], int(parts[1]), int(parts[2]), parts[3].split("+") if len(parts) == 4 else None


def _command(cfg: dict, hold: bool = False) -> tuple[list[str], dict | None]:
    cmd = [sys.executable, "-m", "experiments.bench_throughput", f"--child={json.dumps(cfg)}"] + ["--hold"] * hold
    # A deviceless GPU compile: no CUDA driver to check, the Pallas kernels compile (not interpret), and
    # strategy="auto" plans with the target's rates.
    deviceless = dict(JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", JAXDP_PALLAS_INTERPRET="0",
                      JAXDP_DEVICE_KIND=cfg.get("target") or "")
    return cmd, dict(os.environ, **deviceless) if cfg.get("target") else None


def _spawn(cfg: dict) -> dict:
    cmd, env = _command(cfg)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT.value, env=env)
    except subprocess.TimeoutExpired:
        return dict(cfg, status="timeout")
    return _held.row_of(cfg, proc.returncode, proc.stdout, proc.stderr)


def _ratio(row, base, key, fmt):
    value = row.get(key)
    if value is None:
        return ["-", "-"]
    ok = base is not None and base.get("status") == "ok" and base.get(key)
    return [fmt(value), f"{value / base[key]:.2f}" if ok else "-"]


def _cells(row, base, predicted: bool) -> list[str]:
    if row["status"] != "ok":
        return [row["status"]] * (10 if predicted else 7)
    mem = _ratio(row, base, "peak_bytes", lambda b: f"{b / 2**20:,.0f}")
    comp = _ratio(row, base, "compile_s", lambda s: f"{s:.0f}")
    if predicted:  # time ratio: the non-DP roofline over this one's (a tokens/s ratio)
        ms = row["roofline_ms"]
        speed = f"{base['roofline_ms'] / ms:.2f}" if base and base.get("status") == "ok" else "-"
        heavy = f"{row['heavy_kernels']} ({row['heavy_gbytes']:.1f} GB)"
        return [f"{ms:.1f}", speed, f"{row['gflop']:,.0f}", f"{row['gbytes']:.1f}", str(row["launches"]), heavy] \
            + mem + comp
    return _ratio(row, base, "tokens_per_s", lambda t: f"{t:,.0f}") + mem + comp + [row["peak_source"]]


def _print_profiles(rows: list[dict]) -> None:
    """Where each step's GPU time goes (ms per step, from the traced steps)."""
    from jaxdp.analysis.profile import ALL_KINDS as kinds
    print("\n| model | B | T | method | GPU busy ms | " + " | ".join(f"{k} ms" for k in kinds) + " | kernels |")
    print("|---|---|---|---|---|" + "---|" * len(kinds) + "---|")
    for row in rows:
        if "profile" in row:
            prof = row["profile"]
            print(f"| {row['model']} | {row['B']} | {row['T']} | {row['method']} | {prof['busy_ms']:.2f} | "
                  + " | ".join(f"{prof[f'{k}_ms']:.2f}" for k in kinds) + f" | {prof['kernels']:.0f} |")


def main(argv):
    del argv
    if CHILD.value:
        print(json.dumps(run_one(json.loads(CHILD.value))))
        return
    import jax
    if SMOKE.value:
        configs, steps, warmup, vocab, dtype = [("tiny", 2, 32, None)], 2, 1, 97, "float32"
    else:
        configs = [_parse_config(c) for c in CONFIGS.value]
        steps, warmup, vocab, dtype = STEPS.value, WARMUP.value, 50257, DTYPE.value
    target = TARGET.value
    attention = "cudnn" if target and ATTENTION.value == "auto" else ATTENTION.value
    methods = ["non_dp"] + [m for m in METHODS_FLAG.value if m != "non_dp"]
    unknown = sorted(set(methods).union(*(c[3] or () for c in configs)) - set(METHODS) - {SECURE, MERGED})
    if unknown:
        raise app.UsageError(f"--methods: unknown {unknown}; allowed: {', '.join(METHODS + (SECURE, MERGED))}")
    where = f"predicted for {target} (XLA:GPU deviceless compile on {jax.devices()[0].device_kind})" if target else \
        f"device: {jax.devices()[0].device_kind} ({jax.default_backend()})"
    print(f"{where}, jax {jax.__version__}, {datetime.date.today()}, {dtype}, attention {attention}\n")
    if target:
        print("| model | B | T | method | roofline ms | vs non-DP (speed) | GFLOP | GB moved | launches | "
              "255-register or spilling kernels (their GB) | MiB | vs non-DP | compile s | vs non-DP |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    else:
        print("| model | B | T | method | tokens/s | vs non-DP | peak MiB | vs non-DP | compile s | vs non-DP | "
              "memory |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    cfgs = [dict(model=model, B=B, T=T, method=method, dtype=dtype, vocab=vocab, attention=attention, steps=steps,
                 warmup=warmup, target=target, profile_dir=PROFILE_DIR.value)
            for model, B, T, config_methods in configs
            for method in ["non_dp"] + [m for m in config_methods or methods if m != "non_dp"]]
    held = JOBS.value > 1 and not target
    rows, base = [], None
    held_command = lambda cfg: _command(cfg, hold=True)
    rows_of = (_held.held_rows(cfgs, held_command, JOBS.value, TIMEOUT.value, WAIT_FOR.value) if held
               else map(_spawn, cfgs))
    for cfg, row in zip(cfgs, rows_of):
        base = row if cfg["method"] == "non_dp" else base
        rows.append(row)
        print(f"| {cfg['model']} | {cfg['B']} | {cfg['T']} | {cfg['method']} | "
              + " | ".join(_cells(row, base, bool(target))) + " |", flush=True)
        write_results(OUT.value, rows, target=target, jobs=JOBS.value, quiet=True)  # a killed run keeps its rows
    if any("profile" in row for row in rows):
        _print_profiles(rows)
    write_results(OUT.value, rows, target=target, jobs=JOBS.value)

if __name__ == "__main__":
    app.run(main)
