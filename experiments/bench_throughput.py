"""One full DP-Adam step per method (FlashDP's Table 1 layout): tokens/s, peak memory and compile time vs non-DP.

    python -m experiments.bench_throughput --jobs=8         # the default grid on a GPU, 8 compiles at a time
    python -m experiments.bench_throughput --target=h100    # predicted: XLA:GPU deviceless compile, no GPU
    python -m experiments.bench_throughput --smoke          # tiny GPT-2 on CPU, seconds
    python -m experiments.bench_throughput --target=h100 --configs=small:4:1024 --methods=auto \
        --mechanisms=dpsgd,bandmf:4,bandmf:8,bandmf:16     # the noise buffers' cost
    python -m experiments.bench_throughput --configs=small:2:256,llama-1B:1:256 --methods=auto --steps=0 \
        --layouts=unrolled,scan                           # compile seconds, DP vs non-DP, unrolled vs scanned

Configurations are `model:micro_batch:seq_len`, model a GPT-2 preset or llama-<preset> (default: GPT-2
small at seq 1024 with micro-batch 4 and 16, and at seq 16384 with micro-batch 1), each in the `--layouts`
asked (unrolled blocks, or stacked and scanned: "(scan)" in the table); the methods and what each row measures are
`jaxdp.analysis.throughput`'s. Every configuration runs in its own process so its peak memory is
clean; the parent prints a markdown table (ratios to non_dp of the same configuration) and writes
JSON. With `--jobs=N` all compile first, N at a time, then each is timed alone
(`jaxdp.analysis.held`; compile times are then contended). With `--target`, nothing runs: each row
is the compiled step's roofline for that GPU and the kernels ptxas gives 255 registers or spills.
"""

from __future__ import annotations

import datetime
import json
import sys

from absl import app, flags

from experiments._results import write_results
from jaxdp.analysis import held as _held
from jaxdp.analysis import throughput as tp

CONFIGS = flags.DEFINE_list("configs", ["small:4:1024", "small:16:1024", "small:1:16384"],
                            "model:micro_batch:seq_len of GPT-2 presets, optionally :method+method+... "
                            "(that configuration's methods instead of --methods)")
METHODS_FLAG = flags.DEFINE_list("methods", list(tp.METHODS),
                                 f"methods to run (non_dp is always added; also {tp.SECURE}, {tp.MERGED})")
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
LAYOUTS = flags.DEFINE_list("layouts", ["unrolled"], "the blocks' layouts to compile: unrolled, scan "
                             "(scan_layers: stacked, run by lax.scan)")
MECHANISMS = flags.DEFINE_list("mechanisms", ["dpsgd"], "noise mechanisms of each fused_clip method: dpsgd, "
                                "bandmf:<bands>, blt:<buffers> (jaxdp.analysis.throughput.mechanism_of)")
HOLD = flags.DEFINE_boolean("hold", False, "internal: after compiling, print COMPILED and wait for a line on stdin")


def _parse_config(text: str) -> tuple[str, int, int, list[str] | None]:
    parts = text.split(":")
    if len(parts) not in (3, 4) or not parts[1].isdigit() or not parts[2].isdigit():
        raise app.UsageError(f"--configs: {text!r} is not model:micro_batch:seq_len[:method+method...]")
    return parts[0], int(parts[1]), int(parts[2]), parts[3].split("+") if len(parts) == 4 else None


def _command(cfg: dict, hold: bool = False) -> tuple[list[str], dict | None]:
    return ([sys.executable, "-m", "experiments.bench_throughput", f"--child={json.dumps(cfg)}"] + ["--hold"] * hold,
            tp.child_env(cfg))


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
        def wait_for_turn():  # --jobs > 1: the parent times one process at a time, after every compile
            print("COMPILED", flush=True)
            sys.stdin.readline()
        print(json.dumps(tp.run_one(json.loads(CHILD.value), repeats=REPEATS.value,
                                 on_compiled=wait_for_turn if HOLD.value else None)))
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
    if unknown := sorted(set(methods).union(*(c[3] or () for c in configs)) - set(tp.ALL_METHODS)):
        raise app.UsageError(f"--methods: unknown {unknown}; allowed: {', '.join(tp.ALL_METHODS)}")
    if unknown := sorted(set(LAYOUTS.value) - {"unrolled", "scan"}):
        raise app.UsageError(f"--layouts: unknown {unknown}; allowed: unrolled, scan")
    for name in MECHANISMS.value:
        try:
            tp.mechanism_of(name)
        except ValueError as e:
            raise app.UsageError(f"--mechanisms: {e}") from None
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
                 warmup=warmup, target=target, profile_dir=PROFILE_DIR.value,
                 **({} if mechanism == "dpsgd" else {"mechanism": mechanism}),
                 **({"scan": True} if layout == "scan" else {}))
            for model, B, T, config_methods in configs
            for layout in LAYOUTS.value
            for method in ["non_dp"] + [m for m in config_methods or methods if m != "non_dp"]
            for mechanism in (["dpsgd"] if method in ("non_dp", "two_pass") else MECHANISMS.value)]
    rows, base, held = [], None, JOBS.value > 1 and not target
    rows_of = (_held.held_rows(cfgs, lambda c: _command(c, hold=True), JOBS.value, TIMEOUT.value, WAIT_FOR.value)
               if held else (tp.spawned_row(cfg, _command(cfg)[0], TIMEOUT.value) for cfg in cfgs))
    for cfg, row in zip(cfgs, rows_of):
        base = row if cfg["method"] == "non_dp" else base
        rows.append(row)
        label = cfg["method"] + (f" {cfg['mechanism']}" if "mechanism" in cfg else "")
        print(f"| {cfg['model']}{' (scan)' if cfg.get('scan') else ''} | {cfg['B']} | {cfg['T']} | {label} | "
              + " | ".join(_cells(row, base, bool(target))) + " |", flush=True)
        write_results(OUT.value, rows, target=target, jobs=JOBS.value, quiet=True)  # a killed run keeps its rows
    if any("profile" in row for row in rows):
        _print_profiles(rows)
    write_results(OUT.value, rows, target=target, jobs=JOBS.value)

if __name__ == "__main__":
    app.run(main)
