"""The longest sequence whose compiled sharded DP step fits a per-device memory budget, and tokens/s there.

LongShield's Tables 4-5 layout (`experiments/long_context.py` is its main).
For one model, remat policy and (data, seq) mesh, DP (`ShardedDPStep`:
per-example gradients, clipping and noise, then Adam) or non-DP
(`ShardedDPStep(..., NonPrivate(B))`: the mean-loss gradient, then Adam, on the
same mesh with the same shardings and reductions), `measure` searches the
sequence length (`longest_fitting`: doubling from min_seq_len x seq, then
bisection on multiples of the granularity) whose compiled step's memory PER
DEVICE (`step_bytes`: `memory_analysis()` of the SPMD-partitioned program,
from abstract shapes, so nothing is allocated) stays within the budget, then
compiles that step in full, runs and times it (tokens/s). `run` sweeps a
config (`SMOKE_CONFIG` is the tiny one); `table` prints the rows. Bytes on
XLA:CPU are its buffer assignment, an estimate that gives remat no credit
(see the experiment's docstring).
"""

from __future__ import annotations

import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from jaxdp.analysis.hlo_cost import target_devices
from jaxdp.core import sequence_shards as context
from jaxdp.clipping.settings import DPSpec, NormPlan
from jaxdp.sharding.dp_step import NonPrivate, ShardedDPStep
from jaxdp.sharding.mesh import make_mesh

# --smoke: the sweep shrunk to tiny models on 8 fake CPU devices (compiles dominate its time).
SMOKE_CONFIG = dict(models=["gpt2-tiny", "llama-tiny"], remats=["none", "full"], data=1, seqs=[1, 2, 4, 8],
                    zero_stage=0, dp_method="bookkeeping", batch_size=1, dtype="float32", min_seq_len=128,
                    max_seq_len=16384, granularity=64, time=True, steps=3, budget_bytes=16 * 2**20)

# XLA:CPU spends most of a compile in LLVM; its optimisation level does not change the buffer assignment
# that memory_analysis() reports, so the search compiles at -O0 (much faster, same bytes).
FAST_COMPILE = dict(xla_backend_optimization_level=0, xla_llvm_disable_expensive_passes=True)


def make_model(name: str, T: int, dtype: str, remat: str):
    """rngs -> model of preset `name` ("gpt2-<preset>" | "llama-<preset>") for sequences of T tokens."""
    # Imported here: the models import jaxdp.sharding, which imports this module.
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
    logits = model(batch["inputs"], seq_axis=seq_axis)
    return context.sequence_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]), seq_axis)


def make_step(build_model, dp: bool, mesh, B: int, zero_stage: int, dp_method: str):
    """(step, model builder) of one configuration; `B` is the global batch size.

    DP and non-DP are the same `ShardedDPStep` (`NonPrivate` for non-DP): same mesh, shardings
    and reductions, so the two differ only by what DP adds.
    """
    release = DPSpec(1.0, 0.8, float(B)) if dp else NonPrivate(float(B))
    step = ShardedDPStep(loss_fn, optax.adam(1e-4), mesh, release, zero_stage=zero_stage, method=dp_method,
                         norms=NormPlan(allow_low_precision=True))  # measures memory and time; releases nothing
    return step, lambda: build_model(nnx.Rngs(0))


def make_batch(B: int, T: int, step=None, key=None):
    """Abstract inputs / targets (B, T), or (with `key`) random ones placed as `step` expects."""
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
    if cfg["min_seq_len"] % seq or cfg["max_seq_len"] % seq:
        raise ValueError(f"min_seq_len and max_seq_len must be multiples of seq={seq}")
    target = cfg.get("target")
    mesh = make_mesh(data, seq, devices=target_devices(target, data * seq))
    B = cfg["batch_size"] * data
    options = FAST_COMPILE if target is None and jax.default_backend() == "cpu" else None

    def bytes_at(T):
        step, build = make_step(make_model(name, T, cfg["dtype"], remat), dp, mesh, B, cfg["zero_stage"],
                            cfg["dp_method"])
        state = nnx.eval_shape(lambda: step.init(build()))
        return step_bytes(step.lower(state, make_batch(B, T)).compile(compiler_options=options))

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
    step, build = make_step(make_model(name, T, cfg["dtype"], remat), dp, mesh, B, cfg["zero_stage"],
                        cfg["dp_method"])
    state = step.init(build())
    batch = make_batch(B, T, step, jax.random.key(1))
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
    """The markdown table of `rows`: one line per (model, mesh, remat), DP beside non-DP."""
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
