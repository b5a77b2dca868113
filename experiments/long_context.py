"""The longest sequence that fits, and tokens/s there: LongShield's Tables 4-5 layout.

    python -m experiments.long_context --memory_budget_gb=80      # GPT-2 / Llama presets (GPU)
    python -m experiments.long_context --smoke                    # tiny models on CPU, seconds

For every model, DP (per_example_grads -> fused_clip -> Adam) and non-DP
(mean-loss gradient -> Adam), and every remat policy, the sequence length is
doubled from --min_seq_len while the compiled step's memory per device
(`memory_analysis()`: arguments + outputs + temporaries - aliased, from
abstract shapes, so nothing is allocated) stays within --memory_budget_gb,
then bisected (multiples of --granularity) up to the first length that does
not fit. The longest fitting step is then run and timed (tokens/s) when its
bytes fit the device for real (skipped with --notime). One device, batch size
--batch_size. The markdown table is printed and JSON written to --out.
Target (LongShield): with remat, DP reaches the same maximum context as non-DP.
"""

from __future__ import annotations

import datetime
import json
import os
import time

from absl import app, flags

MODELS = flags.DEFINE_list("models", ["gpt2-small", "gpt2-medium", "llama-1B"],
                           "gpt2-<preset> | llama-<preset>")
REMATS = flags.DEFINE_list("remat", ["none", "full"], "remat policies: none | dots | full")
BUDGET = flags.DEFINE_float("memory_budget_gb", 80.0, "bytes per device allowed for the compiled step (GiB)")
MIN_SEQ = flags.DEFINE_integer("min_seq_len", 512, "first sequence length tried")
MAX_SEQ = flags.DEFINE_integer("max_seq_len", 131072, "longest sequence length tried")
GRANULARITY = flags.DEFINE_integer("granularity", 256, "bisection stops at this resolution")
BATCH_SIZE = flags.DEFINE_integer("batch_size", 1, "examples per step")
DTYPE = flags.DEFINE_string("dtype", "bfloat16", "compute dtype")
TIME = flags.DEFINE_boolean("time", True, "run and time the longest fitting step")
STEPS = flags.DEFINE_integer("steps", 5, "timed steps (median)")
OUT = flags.DEFINE_string("out", "benchmarks/long_context.json", "JSON output path")
SMOKE = flags.DEFINE_boolean("smoke", False, "tiny GPT-2, 4 MiB budget, seq 16..256: a CPU check")


def _model(name: str, T: int, dtype: str, remat: str):
    from jaxdp.models.gpt2 import GPT2, GPT2Config
    from jaxdp.models.llama import Llama, LlamaConfig
    family, preset = name.split("-", 1)
    if family == "gpt2":
        return lambda rngs: GPT2(GPT2Config.preset(preset, seq_len=T, dtype=dtype, remat=remat), rngs=rngs)
    if family == "llama":
        return lambda rngs: Llama(LlamaConfig.preset(preset, seq_len=max(T, 64), dtype=dtype, remat=remat),
                                  rngs=rngs)
    raise ValueError(f"unknown model {name!r}; use gpt2-<preset> or llama-<preset>")


def _step(make_model, dp: bool, B: int, T: int):
    """(jitted step, abstract state, abstract batch) of one configuration."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jaxdp

    def losses_fn(model, batch):
        logits = model(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean(-1)

    tx = optax.adam(1e-4)
    if dp:
        tx = optax.chain(jaxdp.fused_clip(1.0, 0.8, expected_batch_size=float(B)), tx)

    def build():
        model = make_model(nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    graphdef, state = nnx.split(nnx.eval_shape(build))
    grads_fn = jaxdp.per_example_grads(losses_fn)

    @jax.jit
    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        if dp:
            grads = grads_fn(model, batch)[1]
        else:
            grads = nnx.grad(lambda m: losses_fn(m, batch).mean())(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer))

    tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
    return step, build, state, {"inputs": tokens, "targets": tokens}


def step_bytes(lowered) -> int:
    """Per-device bytes of a compiled step: arguments + outputs + temporaries - aliased."""
    a = lowered.compile().memory_analysis()
    return a.argument_size_in_bytes + a.output_size_in_bytes + a.temp_size_in_bytes - a.alias_size_in_bytes


def longest_fitting(bytes_at, lo: int, hi: int, granularity: int, budget: float):
    """(longest T in [lo, hi] with bytes_at(T) <= budget, its bytes), or (None, None); doubling, then bisection."""
    fit, fit_bytes, fail = None, None, None
    T = lo
    while T <= hi:
        b = bytes_at(T)
        if b > budget:
            fail = T
            break
        fit, fit_bytes = T, b
        T *= 2
    if fit is None:
        return None, None
    fail = fail or hi + granularity
    while fail - fit > granularity:
        mid = (fit + fail) // 2 // granularity * granularity
        if mid <= fit:
            break
        b = bytes_at(mid)
        if b <= budget:
            fit, fit_bytes = mid, b
        else:
            fail = mid
    return fit, fit_bytes


def measure(name: str, dp: bool, remat: str, cfg: dict) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    B = cfg["batch_size"]
    budget = cfg["budget_bytes"]

    def bytes_at(T):
        step, _, state, batch = _step(_model(name, T, cfg["dtype"], remat), dp, B, T)
        return step_bytes(step.lower(state, batch))

    T, nbytes = longest_fitting(bytes_at, cfg["min_seq_len"], cfg["max_seq_len"], cfg["granularity"], budget)
    row = dict(model=name, dp=dp, remat=remat, max_seq_len=T, step_bytes=nbytes, tokens_per_s=None)
    if T is None or not cfg["time"]:
        return row
    step, build, _, _ = _step(_model(name, T, cfg["dtype"], remat), dp, B, T)
    state = nnx.state(build())
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, 50)
    batch = {"inputs": tokens, "targets": tokens}
    state = jax.block_until_ready(step(state, batch))  # compile + warm up
    times = []
    for _ in range(cfg["steps"]):
        t0 = time.perf_counter()
        state = jax.block_until_ready(step(state, batch))
        times.append(time.perf_counter() - t0)
    row["tokens_per_s"] = B * T / float(np.median(times))
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | remat | non-DP max T | DP max T | non-DP tokens/s | DP tokens/s |",
             "|---|---|---|---|---|---|"]
    fmt = lambda x, spec="": "n/a" if x is None else format(x, spec)
    keys = sorted({(r["model"], r["remat"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for model, remat in keys:
        by_dp = {r["dp"]: r for r in rows if r["model"] == model and r["remat"] == remat}
        nd, d = by_dp.get(False, {}), by_dp.get(True, {})
        lines.append(f"| {model} | {remat} | {fmt(nd.get('max_seq_len'))} | {fmt(d.get('max_seq_len'))} | "
                     f"{fmt(nd.get('tokens_per_s'), ',.0f')} | {fmt(d.get('tokens_per_s'), ',.0f')} |")
    return "\n".join(lines)


def main(argv):
    del argv
    import jax
    cfg = dict(batch_size=BATCH_SIZE.value, dtype=DTYPE.value, min_seq_len=MIN_SEQ.value,
               max_seq_len=MAX_SEQ.value, granularity=GRANULARITY.value, time=TIME.value,
               steps=STEPS.value, budget_bytes=BUDGET.value * 2**30)
    models, remats = MODELS.value, REMATS.value
    if SMOKE.value:
        models, remats = ["gpt2-tiny"], ["none", "full"]
        cfg.update(dtype="float32", min_seq_len=16, max_seq_len=256, granularity=32, steps=2,
                   budget_bytes=4 * 2**20)
    rows = []
    for name in models:
        for remat in remats:
            for dp in (False, True):
                row = measure(name, dp, remat, cfg)
                print(json.dumps(row), flush=True)
                rows.append(row)
    print(table(rows))
    out = dict(device=str(jax.devices()[0].device_kind), num_devices=jax.device_count(), config=cfg,
               date=datetime.datetime.now(datetime.UTC).isoformat(), rows=rows)
    os.makedirs(os.path.dirname(OUT.value) or ".", exist_ok=True)
    with open(OUT.value, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    app.run(main)
