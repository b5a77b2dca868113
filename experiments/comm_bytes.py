"""Bytes each device sends per step, by collective kind, DP vs non-DP, read from the compiled programs.

    python -m experiments.comm_bytes            # GPT-2 tiny 8x1 ZeRO 0-3, Llama tiny 4x2 ZeRO 0 and 3
    python -m experiments.comm_bytes --smoke    # GPT-2 tiny 8x1 ZeRO 3 and Llama tiny 4x2 ZeRO 3 only

Both steps are `jaxdp.sharding.ShardedDPStep` on the same (data, seq) mesh
with the same ZeRO stage: DP (per-example gradients, clipping, noise) and
`NonPrivate(B)` in place of the `DPSpec` (the mean-loss gradient by ordinary autodiff, same layout
and reductions). Each is lowered and compiled (nothing runs); its
collectives are read from the optimized HLO by
`jaxdp.analysis.collectives.bytes_by_kind` (ring formulas: see that
module). Without accelerators, 8 fake CPU devices are used. The markdown
table is printed; --out also writes JSON.
"""

from __future__ import annotations

import os

# Eight fake CPU devices when no accelerator is present; must precede the first `import jax`.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import app, flags

BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "examples per step (global)")
SEQ_LEN = flags.DEFINE_integer("seq_len", 16, "tokens per example")
VOCAB = flags.DEFINE_integer("vocab_size", 97, "vocabulary of the tiny models")
SMOKE = flags.DEFINE_boolean("smoke", False, "only the ZeRO-3 rows")
OUT = flags.DEFINE_string("out", "", "JSON output path (none if empty)")

# (model, (data, seq) mesh, ZeRO stage)
SETUPS = ([("gpt2", (8, 1), z) for z in (0, 1, 2, 3)] + [("llama", (4, 2), z) for z in (0, 3)])
SMOKE_SETUPS = [("gpt2", (8, 1), 3), ("llama", (4, 2), 3)]


def loss_fn(model, batch, seq_axis=None):
    """Per-example mean next-token NLL over the GLOBAL sequence (a shard's share under context parallelism)."""
    import optax

    from jaxdp.core import sequence_shards as context
    logits = model(batch["inputs"], seq_axis=seq_axis)
    return context.sequence_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]), seq_axis)


def _model(name: str, vocab_size: int, seq_len: int):
    from flax import nnx

    from jaxdp.models.gpt2 import GPT2, GPT2Config
    from jaxdp.models.llama import Llama, LlamaConfig
    if name == "gpt2":
        return GPT2(GPT2Config.preset("tiny", vocab_size=vocab_size, seq_len=max(seq_len, 32)), rngs=nnx.Rngs(0))
    return Llama(LlamaConfig.preset("tiny", vocab_size=vocab_size, seq_len=max(seq_len, 32)), rngs=nnx.Rngs(0))


def measure(name: str, mesh_shape: tuple[int, int], zero_stage: int, private: bool, B: int, T: int,
            vocab_size: int) -> tuple[dict[str, float], int]:
    """({kind: bytes per device per step}, parameter count) of one compiled sharded step."""
    import jax
    import optax
    from flax import nnx

    import jaxdp
    from jaxdp import sharding
    from jaxdp.analysis import collectives
    model = _model(name, vocab_size, T)
    tokens = jax.random.randint(jax.random.key(0), (B, T + 1), 0, vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    release = jaxdp.DPSpec(1.0, 1.0, float(B)) if private else sharding.NonPrivate(float(B))
    step = sharding.ShardedDPStep(loss_fn, optax.adam(1e-3), sharding.make_mesh(*mesh_shape), release,
                                  zero_stage=zero_stage)
    compiled = step.lower(step.init(model), batch).compile()
    psi = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return collectives.bytes_by_kind(compiled), psi


def table(rows: list[dict]) -> str:
    from jaxdp.analysis.collectives import KINDS
    lines = ["| setup | step | " + " | ".join(KINDS) + " | total |",
             "|---|---|" + "---:|" * (len(KINDS) + 1)]
    for r in rows:
        label = f"{r['model']} tiny (Psi = {r['psi']:,}), {r['data']}x{r['seq']}, ZeRO {r['zero_stage']}"
        diff = {k: r["dp"][k] - r["non_dp"][k] for k in KINDS}
        for i, (name, b) in enumerate((("DP", r["dp"]), ("non-DP", r["non_dp"]), ("DP - non-DP", diff))):
            cells = [f"{b[k]:,.0f}" for k in KINDS] + [f"{sum(b.values()):,.0f}"]
            lines.append(f"| {label if i == 0 else ''} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv):
    del argv
    import jax
    setups = SMOKE_SETUPS if SMOKE.value else SETUPS
    rows = []
    for name, (data, seq), zero_stage in setups:
        if data * seq > jax.device_count():
            raise SystemExit(f"{name} {data}x{seq} needs {data * seq} devices, {jax.device_count()} available")
        args = (BATCH_SIZE.value, SEQ_LEN.value, VOCAB.value)
        dp, psi = measure(name, (data, seq), zero_stage, True, *args)
        non_dp, _ = measure(name, (data, seq), zero_stage, False, *args)
        rows.append({"model": {"gpt2": "GPT-2", "llama": "Llama"}[name], "psi": psi, "data": data, "seq": seq,
                     "zero_stage": zero_stage, "dp": dp, "non_dp": non_dp})
        print(f"measured {name} {data}x{seq} ZeRO {zero_stage}", flush=True)
    print(f"\nBytes sent per device per step (B = {BATCH_SIZE.value}, T = {SEQ_LEN.value}, float32; "
          f"{jax.device_count()} x {jax.devices()[0].device_kind}, JAX {jax.__version__})\n")
    print(table(rows))
    if OUT.value:
        from experiments._results import write_results
        write_results(OUT.value, rows, batch_size=BATCH_SIZE.value, seq_len=SEQ_LEN.value)


if __name__ == "__main__":
    app.run(main)
