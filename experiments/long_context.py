"""The longest sequence that fits, and tokens/s there: LongShield's Tables 4-5 layout.

    python -m experiments.long_context --memory_budget_gb=80             # GPT-2 / Llama presets, one GPU
    python -m experiments.long_context --seq=1,2,4,8 --memory_budget_gb=80  # context parallel over 8 GPUs
    python -m experiments.long_context --smoke                           # tiny models, 8 fake CPU devices
    python -m experiments.long_context --dp_method=two_pass              # DP by two passes (flat clipping)
    python -m experiments.long_context --target=h100 --memory_budget_gb=80   # XLA:GPU's bytes, no GPU needed

For every model, remat policy and mesh (`--data` x each of `--seq`), DP
(`jaxdp.sharding.ShardedDPStep`: per-example gradients, clipping and noise,
then Adam) and non-DP (`ShardedDPStep(private=False)`: the mean-loss
gradient, then Adam, on the same mesh with the same shardings and
reductions), the sequence length is doubled from --min_seq_len x seq (seq
rounded up to a power of two; halved, not below --min_seq_len, if that does
not fit) while the compiled step's memory PER DEVICE (`memory_analysis()` of
the SPMD-partitioned program: arguments + outputs + temporaries - aliased,
from abstract shapes, so nothing is allocated) stays within
--memory_budget_gb, then bisected (on multiples of --granularity, rounded up
to a multiple of seq) up to the first length that does not fit. The longest
fitting step is then compiled in full, run and timed (tokens/s; skipped with
--notime). With seq > 1 every device holds T / seq tokens of each example
(context parallelism: keys / values all-gathered with causal offsets,
per-example gradient partials reduce-scattered over `seq`). The markdown
table is printed and JSON written to --out. Target (LongShield): with remat,
DP reaches the same maximum context as non-DP. `--dp_method` picks how DP
forms its clipped sums (`ShardedDPStep(method=...)`): "bookkeeping" keeps
every layer's input and output gradient until all norms are known;
"two_pass" keeps none (norms inside each layer's backward, then a
clip-weighted backward) at the cost of a second forward and backward.

`--target=h100` compiles for an H100 without one: XLA:GPU's deviceless
compile (`jaxdp.hlo_cost.target_devices`: `jax.experimental.topologies` with `jaxdp/gpu_targets/h100_sxm.txtpb`;
needs `pip install jax-cuda12-plugin==<jax version> jax-cuda12-pjrt==<same>`
and a `ptxas` on PATH, e.g. from `nvidia-cuda-nvcc-cu12`). The bytes are
then XLA:GPU's buffer assignment for the chip (compile only: no step runs,
no tokens/s), and remat gets its credit, unlike on XLA:CPU.

Neither step donates its state, so both count the old and the new state.
On CPU the bytes are XLA:CPU's buffer assignment: an estimate, not a GPU
measurement. It does not show remat's saving (a plain 8-layer
`jax.checkpoint` stack gets no fewer temporary bytes than without it), and
`jax.nn.dot_product_attention` materialises the T x T scores there, so where
they dominate the longest context grows like sqrt(seq), not like seq.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import time

from absl import app, flags

MODELS = flags.DEFINE_list("models", ["gpt2-small", "gpt2-medium", "llama-1B"],
                           "gpt2-<preset> | llama-<preset>")
REMATS = flags.DEFINE_list("remat", ["none", "full"], "remat policies: none | dots | full")
DATA = flags.DEFINE_integer("data", 1, "data-parallel degree (examples sharded)")
SEQ = flags.DEFINE_list("seq", ["1"], "context-parallel degrees to sweep (tokens sharded)")
ZERO = flags.DEFINE_integer("zero_stage", 0, "ZeRO stage 0-3 over the data axis")
DP_METHOD = flags.DEFINE_enum("dp_method", "bookkeeping", ["bookkeeping", "two_pass"],
                              "how DP forms its clipped sums (jaxdp.sharding.ShardedDPStep method)")
BUDGET = flags.DEFINE_float("memory_budget_gb", 80.0, "bytes per device allowed for the compiled step (GiB)")
MIN_SEQ = flags.DEFINE_integer("min_seq_len", 512, "first sequence length tried per seq shard (x seq)")
MAX_SEQ = flags.DEFINE_integer("max_seq_len", 131072, "longest sequence length tried")
GRANULARITY = flags.DEFINE_integer("granularity", 256, "bisection stops at this resolution (tokens)")
BATCH_SIZE = flags.DEFINE_integer("batch_size", 1, "examples per step per data shard")
DTYPE = flags.DEFINE_string("dtype", "bfloat16", "compute dtype")
TIME = flags.DEFINE_boolean("time", True, "run and time the longest fitting step")
STEPS = flags.DEFINE_integer("steps", 5, "timed steps (median)")
OUT = flags.DEFINE_string("out", "benchmarks/long_context.json", "JSON output path")
SMOKE = flags.DEFINE_boolean("smoke", False, "tiny GPT-2 and Llama, 8 fake CPU devices, seq 1/2/4/8, 16 MiB budget")
TARGET = flags.DEFINE_enum("target", None, ["h100"], "compile for this GPU without one (XLA:GPU deviceless "
                          "compile; compile only, implies --notime); default: the devices of this machine")

# --smoke: the sweep shrunk to tiny models on 8 fake CPU devices (compiles dominate: ~30 s of CPU per row).
SMOKE_CONFIG = dict(models=["gpt2-tiny", "llama-tiny"], remats=["none", "full"], data=1, seqs=[1, 2, 4, 8],
                    zero_stage=0, dp_method="bookkeeping", batch_size=1, dtype="float32", min_seq_len=128,
                    max_seq_len=16384, granularity=64, time=True, steps=3, budget_bytes=16 * 2**20)


_FAST_COMPILE = dict(xla_backend_optimization_level=0, xla_llvm_disable_expensive_passes=True)
def _model(name: str, T: int, dtype: str, remat: str):
    from jaxdp.models.gpt2 import GPT2, GPT2Config
    from jaxdp.models.llama import Llama, LlamaConfig
    family, preset = name.split("-", 1)
    if family == "gpt2":  # learned positions: the table grows with T
        return lambda rngs: GPT2(GPT2Config.preset(preset, seq_len=T, dtype=dtype, remat=remat), rngs=rngs)
    if family == "llama":
        return lambda rngs: Llama(LlamaConfig.preset(preset, seq_len=max(T, 64), dtype=dtype, remat=remat),
                                  rngs=rngs)
    raise ValueError(f"unknown model {name!r}; use gpt2-<preset> or llama-<preset>")


def loss_fn(model, batch, seq_axis=None):
    """Per-example mean next-token NLL over the GLOBAL sequence (a shard's share under context parallelism)."""
    import optax

    from jaxdp.sharding import context
    logits = model(batch["inputs"], seq_axis=seq_axis)
    return context.sequence_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]), seq_axis)


def _step(make_model, dp: bool, mesh, B: int, zero_stage: int, dp_method: str):
    """(step, model builder) of one configuration; `B` is the global batch size.

    DP and non-DP are the same `ShardedDPStep` (`private=dp`): same mesh, shardings
    and reductions, so the two differ only by what DP adds.
    """
    import optax
    from flax import nnx

    from jaxdp.sharding import ShardedDPStep

    step = ShardedDPStep(loss_fn, optax.adam(1e-4), mesh, l2_norm_clip=1.0, noise_multiplier=0.8,
                         expected_batch_size=float(B), zero_stage=zero_stage, private=dp, method=dp_method)
    return step, lambda: make_model(nnx.Rngs(0))


def _batch(B: int, T: int, step=None, key=None):
    """Abstract inputs / targets (B, T), or (with `key`) random ones placed as `step` expects."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    if key is None:
        tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
        return {"inputs": tokens, "targets": tokens}
    tokens = jax.random.randint(key, (B, T + 1), 0, 50)
    place = lambda a: jax.device_put(a, NamedSharding(step.mesh, step.batch_spec(a)))
    return {"inputs": place(tokens[:, :-1]), "targets": place(tokens[:, 1:])}


def step_bytes(compiled) -> int:
    """Per-device bytes of a compiled step: arguments + outputs + temporaries - aliased."""
    a = compiled.memory_analysis()
    return a.argument_size_in_bytes + a.output_size_in_bytes + a.temp_size_in_bytes - a.alias_size_in_bytes


def longest_fitting(bytes_at, lo: int, hi: int, granularity: int, budget: float, start: int | None = None):
    """(longest T in [lo, hi] with bytes_at(T) <= budget, its bytes), or (None, None).

    For `bytes_at` non-decreasing in T: doubling from `start` (default `lo`) while T
    fits, or halving (not below `lo`) while it does not, then bisection between the
    last fit and the first failure on multiples of `granularity`.
    """
    fit = fit_bytes = fail = None
    T = min(max(start or lo, lo), hi)
    while True:
        b = bytes_at(T)
        if b <= budget:
            fit, fit_bytes = T, b
            if fail is not None or T == hi:
                break
            T = min(2 * T, hi)
        else:
            fail = T
            if fit is not None or T == lo:
                break
            T = max(T // 2, lo)
    if fit is None:
        return None, None
    while fail is not None and fail - fit > granularity:
        mid = (fit + fail) // 2 // granularity * granularity
        if mid <= fit:
            break
        b = bytes_at(mid)
        if b <= budget:
            fit, fit_bytes = mid, b
        else:
            fail = mid
    return fit, fit_bytes


def measure(name: str, dp: bool, remat: str, data: int, seq: int, cfg: dict) -> dict:
    """One row: the longest T of one configuration on a (data, seq) mesh, its bytes per device, tokens/s."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxdp.hlo_cost import target_devices
    from jaxdp.sharding import make_mesh

    if cfg["min_seq_len"] % seq or cfg["max_seq_len"] % seq:
        raise ValueError(f"min_seq_len and max_seq_len must be multiples of seq={seq}")
    target = cfg.get("target")
    mesh = make_mesh(data, seq, devices=target_devices(target, data * seq))
    B = cfg["batch_size"] * data
    # XLA:CPU spends most of a compile in LLVM; its optimisation level does not change the buffer
    # assignment that memory_analysis() reports, so the search compiles at -O0 (~4x faster here).
    options = _FAST_COMPILE if target is None and jax.default_backend() == "cpu" else None

    def bytes_at(T):
        step, build = _step(_model(name, T, cfg["dtype"], remat), dp, mesh, B, cfg["zero_stage"],
                            cfg["dp_method"])
        state = nnx.eval_shape(lambda: step.init(build()))
        return step_bytes(step.lower(state, _batch(B, T)).compile(compiler_options=options))

    # Every device starts from about min_seq_len tokens; lengths tried (min_seq_len x 2^k, hi, multiples
    # of the granularity) stay multiples of seq.
    granularity = math.lcm(cfg["granularity"], seq)
    start = cfg["min_seq_len"] * 2 ** math.ceil(math.log2(seq))
    T, nbytes = longest_fitting(bytes_at, cfg["min_seq_len"], cfg["max_seq_len"], granularity,
                                cfg["budget_bytes"], start=start)
    row = dict(model=name, dp=dp, dp_method=cfg["dp_method"] if dp else None, remat=remat, data=data, seq=seq,
               max_seq_len=T, step_bytes=nbytes, tokens_per_s=None)
    if T is None or not cfg["time"] or target is not None:
        return row
    step, build = _step(_model(name, T, cfg["dtype"], remat), dp, mesh, B, cfg["zero_stage"],
                        cfg["dp_method"])
    state = step.init(build())
    batch = _batch(B, T, step, jax.random.key(1))
    state, _ = jax.block_until_ready(step(state, batch))  # compile (fully optimised) + warm up
    times = []
    for _ in range(cfg["steps"]):
        t0 = time.perf_counter()
        state, _ = jax.block_until_ready(step(state, batch))
        times.append(time.perf_counter() - t0)
    row["tokens_per_s"] = B * T / float(np.median(times))
    return row


def run(cfg: dict, log=print) -> list[dict]:
    """Every (model, mesh, remat, DP / non-DP) row of the sweep in `cfg`; meshes larger than the devices are skipped."""
    import jax
    rows = []
    for name in cfg["models"]:
        for seq in cfg["seqs"]:
            if cfg.get("target") is None and cfg["data"] * seq > jax.device_count():
                log(f"skipping {cfg['data']}x{seq}: {jax.device_count()} devices")
                continue
            for remat in cfg["remats"]:
                for dp in (False, True):
                    row = measure(name, dp, remat, cfg["data"], seq, cfg)
                    log(json.dumps(row))
                    rows.append(row)
    return rows


def table(rows: list[dict], device: str = "") -> str:
    unit = f"tokens/s ({device})" if device else "tokens/s"
    lines = ["| model | devices (data x seq) | remat | DP max T | non-DP max T | DP / non-DP | "
             + f"DP {unit} | non-DP {unit} |", "|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, spec="": "n/a" if x is None else format(x, spec)
    keys = sorted({(r["model"], r["data"], r["seq"], r["remat"]) for r in rows})
    for model, data, seq, remat in keys:
        by_dp = {r["dp"]: r for r in rows
                 if (r["model"], r["data"], r["seq"], r["remat"]) == (model, data, seq, remat)}
        d, nd = by_dp.get(True, {}), by_dp.get(False, {})
        T_dp, T_nondp = d.get("max_seq_len"), nd.get("max_seq_len")
        ratio = T_dp / T_nondp if T_dp and T_nondp else None
        lines.append(f"| {model} | {data} x {seq} | {remat} | {fmt(T_dp)} | {fmt(T_nondp)} | {fmt(ratio, '.2f')} | "
                     f"{fmt(d.get('tokens_per_s'), ',.0f')} | {fmt(nd.get('tokens_per_s'), ',.0f')} |")
    return "\n".join(lines)


def main(argv):
    del argv
    if SMOKE.value:  # 8 fake CPU devices for the context-parallel sweep; must precede the first `import jax`
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        xla_flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in xla_flags:
            os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count=8".strip()
        cfg = dict(SMOKE_CONFIG, time=TIME.value, dp_method=DP_METHOD.value)
        out_path = OUT.value if OUT.present else "benchmarks/long_context_smoke.json"
    else:
        cfg = dict(models=MODELS.value, remats=REMATS.value, data=DATA.value, seqs=[int(s) for s in SEQ.value],
                   zero_stage=ZERO.value, dp_method=DP_METHOD.value, batch_size=BATCH_SIZE.value,
                   dtype=DTYPE.value, min_seq_len=MIN_SEQ.value, max_seq_len=MAX_SEQ.value,
                   granularity=GRANULARITY.value,
                   time=TIME.value, steps=STEPS.value, budget_bytes=BUDGET.value * 2**30, target=TARGET.value)
        out_path = OUT.value
    import jax
    rows = run(cfg, log=lambda s: print(s, flush=True))
    device = jax.devices()[0].device_kind
    if TARGET.value:
        from jaxdp.hlo_cost import target_devices
        device = f"{target_devices(TARGET.value, 1)[0].device_kind}: XLA:GPU compile only, no GPU"
    elif jax.default_backend() == "cpu":
        device = f"CPU, {jax.device_count()} devices on {os.cpu_count()} cores"
    print(table(rows, device))
    num_devices = cfg["data"] * max(cfg["seqs"]) if TARGET.value else jax.device_count()
    out = dict(device=device, num_devices=num_devices, jax=jax.__version__, config=cfg,
               date=datetime.datetime.now(datetime.UTC).isoformat(), rows=rows)
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    app.run(main)
