"""A memory plan for fine-tuning 7-9B models: what fits one 80 GB GPU, and which 8-GPU mesh fits the rest.

For each model shape (`SHAPES`: the published configs of Llama-3.1-8B, Qwen2.5-7B, ...), method and sequence
length, DP and non-DP, `plan_rows` compiles the training step from abstract shapes (nothing is allocated; the
weights are `jax.ShapeDtypeStruct`s) for a target device and reads XLA's buffer assignment
(`memory_analysis()`: arguments + outputs + temporaries - aliased, per device):

  one GPU     `jaxdp.finetune.memory.step_memory`: the method's model (LoRA, full, ...), bf16 compute with
              the frozen weights held in bf16, trainable parameters and Adam's moments in float32, DP by
              book-keeping (per-example gradients -> fused_clip -> adamw) or the non-DP mean-loss gradient;
  8 GPUs      full fine-tuning with `jaxdp.sharding.ShardedDPStep` (ZeRO-3: parameters, gradients and
              optimizer state sharded over `data`), on the first mesh of `MESHES` whose step fits at one
              example per device: (8 x 1) data parallel, then context parallel (4 x 2), (2 x 4), (1 x 8).

The largest micro-batch per device is read off an affine fit of the bytes at 1 and 2 examples per device,
`bytes(B) = bytes(1) + (B - 1) * (bytes(2) - bytes(1))` (the step's buffers are the weights, which do not
grow with B, plus activations and per-example terms, which grow about linearly); `verify=True` then compiles
the prediction and refits through the nearest compiled batches, at most 3 more compiles, until the largest
batch that fits has its successor over the budget (the note lists the batches compiled). A row that does not
fit says what would (`PlanRow.note`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdp.analysis.hlo_cost import target_devices
from jaxdp.finetune import memory
from jaxdp.models import registry
from jaxdp.models.llama import LlamaConfig

# The model shapes of the published configs (config.json of each checkpoint).
SHAPES = {
    "llama-tiny": lambda **kw: LlamaConfig.preset("tiny", **kw),  # for trying the plan on CPU in seconds
    "llama-3.1-8b": lambda **kw: LlamaConfig.preset("8B", **kw),
    "qwen2.5-7b": lambda **kw: LlamaConfig(
        vocab_size=152064, n_layer=28, n_head=28, n_kv_head=4, d_model=3584, d_ff=18944, rope_theta=1e6,
        rope_scaling=None, rms_norm_eps=1e-6, tie_embeddings=False, qkv_bias=True, family="qwen2", **kw),
    "gemma-2-9b": lambda **kw: _gemma(
        vocab_size=256000, n_layer=42, n_head=16, n_kv_head=8, d_model=3584, d_ff=14336, head_dim=256,
        query_pre_attn_scalar=256.0, sliding_window=4096, attn_softcap=50.0, final_softcap=30.0, family="gemma2",
        **kw),
}


def _gemma(**kw):
    from jaxdp.models.gemma import GemmaConfig
    return GemmaConfig(**kw)
MESHES = ((8, 1), (4, 2), (2, 4), (1, 8))  # (data, seq) of 8 GPUs, tried in this order
GB = 1e9
# XLA:GPU rematerialises (recomputes) on its own to squeeze a program that exceeds the device into it, so its
# bytes stop growing with B near the limit and a batch "fits" at an uncounted compute cost. The plan compiles
# without that (a limit no program reaches): the bytes are the program's own, and remat is the config's choice.
NO_XLA_REMAT = {"xla_gpu_memory_limit_slop_factor": 1_000_000}


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """What the plan measures.

    Attributes:
      target: the GPU to compile for (`jaxdp.analysis.hlo_cost.GPU_TARGETS`; None: this machine's device).
      budget_gb: bytes per device a step may use (decimal GB).
      dtype: the compute dtype (frozen weights are held in it).
      remat: per-block activation checkpointing of the model ("none" | "dots" | "full").
      verify: compile around the predicted largest micro-batch to pin it (at most 3 more compiles per row).
      depth_fit: None (compile at full depth), or two layer counts (l1, l2): each step is compiled at those
        depths and its bytes extended along the line through them to the model's depth; two compiles of a few
        layers instead of one of all of them. An approximation: the blocks are alike, but where XLA puts the
        peak can move with depth (it matched full depth for Llama-3.1-8B's one-GPU LoRA step to 0.1%, and
        missed its 8-GPU ZeRO-3 step by 19% and Gemma-2-9B's LoRA step by 29%).
    """
    target: str | None = "h100"
    budget_gb: float = 80.0
    dtype: str = "bfloat16"
    remat: str = "none"
    verify: bool = False
    depth_fit: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One (model, method, seq_len, DP or not) row: per-device GB at 1 and 2 examples per device, the largest
    micro-batch per device that fits (0: none), the mesh it ran on and a note (what would fit, or checks)."""
    model: str
    method: str
    seq_len: int
    dp: bool
    mesh: tuple[int, int]
    gb_at_1: float
    gb_at_2: float | None
    max_batch: int
    note: str = ""


def model_config(name: str, seq_len: int, spec: PlanSpec):
    """The config of `SHAPES[name]` for sequences of `seq_len` tokens."""
    if name not in SHAPES:
        raise ValueError(f"model must be one of {sorted(SHAPES)}, got {name!r}")
    # On a GPU target cuDNN's fused attention (what the job's "auto" picks there), which keeps no T x T scores;
    # Gemma 2's soft-capped attention has no fused kernel and computes its scores either way.
    attention = "cudnn" if spec.target else "auto"
    return SHAPES[name](seq_len=seq_len, dtype=spec.dtype, remat=spec.remat, attention=attention)


def largest_batch(gb_at_1: float, gb_at_2: float, budget_gb: float) -> int:
    """The largest B whose affine fit through (1, gb_at_1), (2, gb_at_2) is within `budget_gb`; 0 if B = 1 is
    not."""
    if gb_at_1 > budget_gb:
        return 0
    slope = gb_at_2 - gb_at_1
    if slope <= 0:
        raise ValueError(f"memory did not grow with the batch ({gb_at_1:.3f} -> {gb_at_2:.3f} GB): "
                         "the affine fit does not apply")
    return 1 + math.floor((budget_gb - gb_at_1) / slope)


def _at_depth(gb_of_config, config, spec: PlanSpec) -> float:
    """`gb_of_config(config)`, or with `spec.depth_fit` its line through two shallower copies at the full depth."""
    if spec.depth_fit is None:
        return gb_of_config(config)
    (l1, l2), depth = spec.depth_fit, config.n_layer
    shallow = {n: gb_of_config(dataclasses.replace(config, n_layer=n, **_layer_fields(config, n))) for n in (l1, l2)}
    return shallow[l1] + (depth - l1) * (shallow[l2] - shallow[l1]) / (l2 - l1)


def _layer_fields(config, n: int) -> dict:
    """Per-layer fields of `config` cut to `n` layers (Gemma's layer_types)."""
    types = getattr(config, "layer_types", None)
    return {} if types is None else {"layer_types": tuple(types[:n])}


def one_gpu_gb(name: str, method: str, step: memory.StepSpec, spec: PlanSpec) -> float:
    """Peak GB of one step of `method` on one device."""
    device = target_devices(spec.target, 1)[0]

    def gb_of_config(config):
        result = memory.step_memory(config, method, step=step, frozen_dtype=jnp.dtype(spec.dtype), device=device,
                                    compiler_options=NO_XLA_REMAT if spec.target else None)
        return result.peak / GB
    return _at_depth(gb_of_config, model_config(name, step.seq_len, spec), spec)


def mesh_gb(name: str, step: memory.StepSpec, mesh_shape: tuple[int, int], spec: PlanSpec) -> float:
    """Peak GB per device of one ZeRO-3 full fine-tuning step on a (data, seq) mesh, `step.batch_size` examples
    per `data` shard."""
    from jaxdp.sharding import longest_context
    from jaxdp.sharding.mesh import make_mesh
    data, seq = mesh_shape
    mesh = make_mesh(data, seq, devices=target_devices(spec.target, data * seq))
    B = step.batch_size * data

    def gb_of_config(config):
        dp_step, build = longest_context.make_step(lambda rngs: registry.build(config, rngs), step.dp, mesh, B, 3,
                                                   "bookkeeping")
        state = nnx.eval_shape(lambda: dp_step.init(build()))
        compiled = dp_step.lower(state, longest_context.make_batch(B, step.seq_len)).compile(
            compiler_options=NO_XLA_REMAT if spec.target else None)
        return longest_context.step_bytes(compiled) / GB
    return _at_depth(gb_of_config, model_config(name, step.seq_len, spec), spec)


def _row(name: str, method: str, seq_len: int, dp: bool, gb_of, mesh_shape, spec: PlanSpec) -> PlanRow:
    """`gb_of(B)` at 1 and 2 examples per device, the fit, and (with `spec.verify`) the fit checked."""
    gb1 = gb_of(1)
    if gb1 > spec.budget_gb:
        return PlanRow(name, method, seq_len, dp, mesh_shape, gb1, None, 0)
    gb2 = gb_of(2)
    best = largest_batch(gb1, gb2, spec.budget_gb)
    if not spec.verify:
        return PlanRow(name, method, seq_len, dp, mesh_shape, gb1, gb2, best)
    checked = {1: gb1, 2: gb2}
    for _ in range(3):  # at most 3 more compiles
        fit = max(b for b, gb in checked.items() if gb <= spec.budget_gb)
        over = min((b for b, gb in checked.items() if gb > spec.budget_gb), default=None)
        if over == fit + 1:
            break
        # The line through the largest fitting batch and the smallest one over (or the two largest fitting).
        b0, b1 = (fit, over) if over is not None else sorted(b for b in checked if checked[b] <= spec.budget_gb)[-2:]
        slope = (checked[b1] - checked[b0]) / (b1 - b0)
        guess = b0 + math.floor((spec.budget_gb - checked[b0]) / slope) if slope > 0 else fit + 1
        guess = max(guess, fit + 1) if over is None else min(max(guess, fit + 1), over - 1)
        if guess in checked:
            break
        checked[guess] = gb_of(guess)
    best = max(b for b, gb in checked.items() if gb <= spec.budget_gb)
    tried = ", ".join(f"B={b}: {_gb(gb)}" for b, gb in sorted(checked.items()) if b > 2)
    note = f"compiled {tried} GB" if tried else ""
    return PlanRow(name, method, seq_len, dp, mesh_shape, gb1, gb2, best, note)


def full_state_gb(name: str, seq_len: int, spec: PlanSpec) -> float:
    """GB of full fine-tuning's float32 state on one device: parameters, gradients and Adam's two moments
    (16 bytes per parameter), a floor under any step's peak."""
    config = model_config(name, seq_len, spec)
    model = nnx.eval_shape(lambda: registry.build(config, nnx.Rngs(0)))
    return 16 * sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(model, nnx.Param))) / GB


def _with_full_remat(name: str, method: str, seq_len: int, dp: bool, spec: PlanSpec) -> str:
    """What remat "full" (each block's activations recomputed in the backward) makes of a row that does not fit."""
    if spec.remat == "full":
        return "nor with remat='full'"
    full = dataclasses.replace(spec, remat="full")
    row = _row(name, method, seq_len, dp,
               lambda B: one_gpu_gb(name, method, memory.StepSpec(B, seq_len, dp=dp), full), (1, 1), full)
    if row.max_batch == 0:
        return f"nor with remat='full' ({_gb(row.gb_at_1)} GB at B=1)"
    return f"with remat='full': {_gb(row.gb_at_1)} GB at B=1, largest B {row.max_batch}"


def plan_rows(name: str, seq_len: int, spec: PlanSpec, methods=("lora", "full"), log=print) -> list[PlanRow]:
    """Every row of one model at one sequence length: each method on one GPU, DP and non-DP; then, for full
    fine-tuning when it does not fit one GPU, the first 8-GPU ZeRO-3 mesh of `MESHES` that fits."""
    rows = []
    for method in methods:
        for dp in (False, True):
            state_gb = full_state_gb(name, seq_len, spec) if method == "full" else 0.0
            if state_gb > spec.budget_gb:  # no compile needed to know
                row = PlanRow(name, method, seq_len, dp, (1, 1), state_gb, None, 0,
                              f"does not fit one GPU: float32 parameters, gradients and Adam's two moments alone are "
                              f"{_gb(state_gb)} GB (not compiled); see the 8-GPU rows")
                log(_log_line(row))
                rows.append(row)
                continue
            gb_of = lambda B, method=method, dp=dp: one_gpu_gb(name, method, memory.StepSpec(B, seq_len, dp=dp), spec)
            row = _row(name, method, seq_len, dp, gb_of, (1, 1), spec)
            if row.max_batch == 0 and method == "full":
                row = dataclasses.replace(row, note="does not fit one GPU: see the 8-GPU rows")
            elif row.max_batch == 0:
                row = dataclasses.replace(row, note="does not fit one GPU; " + _with_full_remat(name, method, seq_len,
                                                                                                 dp, spec))
            log(_log_line(row))
            rows.append(row)
    if "full" in methods and any(r.method == "full" and r.max_batch == 0 for r in rows):
        for dp in (False, True):
            for mesh_shape in MESHES:
                if seq_len % mesh_shape[1]:
                    continue
                gb_of = lambda B, dp=dp, mesh_shape=mesh_shape: mesh_gb(name, memory.StepSpec(B, seq_len, dp=dp),
                                                                          mesh_shape, spec)
                row = _row(name, "full", seq_len, dp, gb_of, mesh_shape, spec)
                log(_log_line(row))
                rows.append(row)
                if row.max_batch:
                    break
    return rows


def _gb(x: float | None) -> str:
    """GB with two decimals, or three significant digits below 1 GB (tiny models on CPU)."""
    return "-" if x is None else f"{x:.2f}" if x >= 1 else f"{x:.3g}"


def _log_line(row: PlanRow) -> str:
    kind = "DP" if row.dp else "non-DP"
    return (f"{row.model} {row.method} T={row.seq_len} {kind} mesh={row.mesh[0]}x{row.mesh[1]}: "
            f"{_gb(row.gb_at_1)} GB at B=1, {_gb(row.gb_at_2)} at B=2, largest B {row.max_batch} {row.note}".rstrip())


def table(rows: list[PlanRow], budget_gb: float) -> str:
    """Markdown: one line per (model, method, seq_len, mesh), non-DP beside DP."""
    lines = ["| model | method | seq | GPUs (data x seq) | non-DP GB at B=1 | DP GB at B=1 | DP / non-DP | "
             f"largest B non-DP | largest B DP (<= {budget_gb:g} GB) | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    keys = list(dict.fromkeys((r.model, r.method, r.seq_len, r.mesh) for r in rows))
    for key in keys:
        pair = {r.dp: r for r in rows if (r.model, r.method, r.seq_len, r.mesh) == key}
        d, nd = pair.get(True), pair.get(False)
        fmt = lambda r, f: "-" if r is None else f(r)
        ratio = f"{d.gb_at_1 / nd.gb_at_1:.2f}" if d and nd else "-"
        devices = "1" if key[3] == (1, 1) else f"{key[3][0]} x {key[3][1]}"
        if d and nd and d.note == nd.note:
            notes = d.note
        else:
            notes = "; ".join(x for x in (fmt(nd, lambda r: r.note and f"non-DP {r.note}"),
                                          fmt(d, lambda r: r.note and f"DP {r.note}")) if x and x != "-")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {devices} | {fmt(nd, lambda r: _gb(r.gb_at_1))} | "
                     f"{fmt(d, lambda r: _gb(r.gb_at_1))} | {ratio} | {fmt(nd, lambda r: r.max_batch)} | "
                     f"{fmt(d, lambda r: r.max_batch)} | {notes} |")
    return "\n".join(lines)
