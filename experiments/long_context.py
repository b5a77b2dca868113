"""The longest sequence that fits, and tokens/s there: LongShield's Tables 4-5 layout.

    python -m experiments.long_context --memory_budget_gb=80             # GPT-2 / Llama presets, one GPU
    python -m experiments.long_context --seq=1,2,4,8 --memory_budget_gb=80  # context parallel over 8 GPUs
    python -m experiments.long_context --smoke                           # tiny models, 8 fake CPU devices
    python -m experiments.long_context --dp_method=two_pass              # DP by two passes (flat clipping)
    python -m experiments.long_context --target=h100 --memory_budget_gb=80   # XLA:GPU's bytes, no GPU needed

For every model, remat policy and mesh (`--data` x each of `--seq`), DP
(`jaxdp.sharding.ShardedDPStep`: per-example gradients, clipping and noise,
then Adam) and non-DP (`ShardedDPStep(..., NonPrivate(B))`: the mean-loss
gradient, then Adam, on the same mesh with the same shardings and
reductions), the sequence length is doubled from --min_seq_len x seq (seq
rounded up to a power of two; halved, not below --min_seq_len, if that does
not fit) while the compiled step's memory PER DEVICE (`memory_analysis()` of
the SPMD-partitioned program: arguments + outputs + temporaries - aliased,
from abstract shapes, so nothing is allocated) stays within
--memory_budget_gb, then bisected (on multiples of --granularity, rounded up
to a multiple of seq) up to the first length that does not fit. The longest
fitting step is then compiled in full, run and timed (tokens/s; skipped with
--notime). The search, the timing and the table are
`jaxdp.sharding.longest_context`; this is its main. With seq > 1 every device holds T / seq tokens of each example
(context parallelism: keys / values all-gathered with causal offsets,
per-example gradient partials reduce-scattered over `seq`). The markdown
table is printed and JSON written to --out. Target (LongShield): with remat,
DP reaches the same maximum context as non-DP. `--dp_method` picks how DP
forms its clipped sums (`ShardedDPStep(method=...)`): "bookkeeping" keeps
every layer's input and output gradient until all norms are known;
"two_pass" keeps none (norms inside each layer's backward, then a
clip-weighted backward) at the cost of a second forward and backward.

`--target=h100` compiles for an H100 without one: XLA:GPU's deviceless
compile (`jaxdp.analysis.hlo_cost.target_devices`: `jax.experimental.topologies` with `jaxdp/analysis/gpu_targets/h100_sxm.txtpb`;
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
import os

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


def main(argv):
    del argv
    if SMOKE.value:  # 8 fake CPU devices for the context-parallel sweep; must precede the first `import jax`
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        xla_flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in xla_flags:
            os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count=8".strip()
        from jaxdp.sharding.longest_context import SMOKE_CONFIG  # after the XLA flags: imports jax
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

    from jaxdp.sharding import longest_context
    rows = longest_context.run(cfg, log=lambda s: print(s, flush=True))
    device = jax.devices()[0].device_kind
    if TARGET.value:
        from jaxdp.analysis.hlo_cost import target_devices
        device = f"{target_devices(TARGET.value, 1)[0].device_kind}: XLA:GPU compile only, no GPU"
    elif jax.default_backend() == "cpu":
        device = f"CPU, {jax.device_count()} devices on {os.cpu_count()} cores"
    print(longest_context.table(rows, device))
    num_devices = cfg["data"] * max(cfg["seqs"]) if TARGET.value else jax.device_count()
    out = dict(device=device, num_devices=num_devices, jax=jax.__version__, config=cfg,
               date=datetime.datetime.now(datetime.UTC).isoformat(), rows=rows)
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    app.run(main)
