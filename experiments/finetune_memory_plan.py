"""The memory plan for fine-tuning 7-9B models (`jaxdp.finetune.memory_plan`): one 80 GB GPU, or 8.

    PATH=/tmp/gpuenv/bin:$PATH JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 \\
        python -m experiments.finetune_memory_plan --target=h100            # XLA:GPU deviceless compile
    python -m experiments.finetune_memory_plan --models=llama-tiny --target= --budget_gb=0.05   # CPU, seconds

Every number is from a compile of the step from abstract shapes (nothing is allocated, no step runs): a
prediction of XLA's buffer assignment for the target, not a measurement on a GPU.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys

from absl import flags

from jaxdp.training import cli

MODELS = flags.DEFINE_list("models", ["llama-3.1-8b", "qwen2.5-7b"], "jaxdp.finetune.memory_plan.SHAPES names")
SEQ_LENS = flags.DEFINE_list("seq_lens", ["1024", "4096"], "tokens per example")
METHODS = flags.DEFINE_list("methods", ["lora", "full"], "fine-tuning methods (jaxdp.finetune.methods)")
TARGET = flags.DEFINE_string("target", "h100", "GPU to compile for without one; empty: this machine")
BUDGET_GB = flags.DEFINE_float("budget_gb", 80.0, "bytes per device a step may use, decimal GB")
REMAT = flags.DEFINE_enum("remat", "none", ["none", "dots", "full"], "per-block activation checkpointing")
VERIFY = flags.DEFINE_bool("verify", False, "also compile each row's predicted largest micro-batch")
DEPTH_FIT = flags.DEFINE_list("depth_fit", [], "compile at these two depths and extend the bytes to the model's "
                              "depth (jaxdp.finetune.memory_plan.PlanSpec.depth_fit: an approximation, see there); "
                              "empty (the default): compile at full depth")
OUT = flags.DEFINE_string("out", "", "JSON output path (none if empty)")


def main(argv):
    del argv
    import jax

    from jaxdp.finetune import memory_plan

    target = TARGET.value or None
    try:
        seq_lens = [int(s) for s in SEQ_LENS.value]
        depth_fit = tuple(int(n) for n in DEPTH_FIT.value) or None
        if depth_fit is not None and (len(depth_fit) != 2 or not 1 <= depth_fit[0] < depth_fit[1]):
            raise ValueError(f"--depth_fit must be two layer counts 1 <= l1 < l2, or empty, got {DEPTH_FIT.value}")
        spec = memory_plan.PlanSpec(target=target, budget_gb=BUDGET_GB.value, remat=REMAT.value, verify=VERIFY.value,
                                    depth_fit=depth_fit)
        for name in MODELS.value:
            memory_plan.model_config(name, seq_lens[0], spec)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if target:  # strategy="auto" plans with the target's rates (jaxdp.clipping.device_rates.current)
        os.environ["JAXDP_DEVICE_KIND"] = target
    rows = []
    for name in MODELS.value:
        for seq_len in seq_lens:
            rows += memory_plan.plan_rows(name, seq_len, spec, methods=tuple(METHODS.value),
                                          log=lambda line: print(line, flush=True))
    machine = f"XLA:GPU deviceless compile for {target}, not a run" if target else "this machine's compile"
    depth = f"bytes at {spec.depth_fit[0]} and {spec.depth_fit[1]} layers extended to the model's depth" \
        if spec.depth_fit else "compiled at full depth"
    print(f"\nDP by book-keeping, bf16, remat {REMAT.value}; {machine}; {depth}; JAX {jax.__version__}; "
          f"{datetime.date.today()}\n")
    print(memory_plan.table(rows, BUDGET_GB.value))
    if OUT.value:
        os.makedirs(os.path.dirname(OUT.value) or ".", exist_ok=True)
        with open(OUT.value, "w") as f:
            json.dump({"machine": machine, "jax": jax.__version__, "date": str(datetime.date.today()),
                       "spec": dataclasses.asdict(spec), "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    cli.run(main)
