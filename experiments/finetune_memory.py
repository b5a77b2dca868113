"""MemDPT's memory table for our fine-tuning methods: peak training memory, DP and non-DP.

    python -m experiments.finetune_memory                      # GPT-2 large, B = 32, T = 128, bf16 (XLA:CPU)
    python -m experiments.finetune_memory --model=small        # GPT-2 small, same batch
    python -m experiments.finetune_memory --dp_method=two_pass # DP keeping no layer's terms (two passes)
    PATH=/tmp/gpuenv/bin:$PATH JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 \\
        python -m experiments.finetune_memory --target=h100    # XLA:GPU's deviceless compile for an H100

For every method (`jaxdp.finetune.methods.METHODS`) the training step is compiled
from abstract shapes (nothing allocated) and its `memory_analysis()` read:
arguments + outputs + temporaries - aliased (`jaxdp.finetune.memory`). DP is
per-example gradients (book-keeping) -> fused_clip (flat, noise) -> adamw,
or with --dp_method=two_pass norms inside each layer's backward and a
clip-weighted second backward -> noise -> adamw; non-DP the mean-loss gradient -> adamw; trainable parameters and optimizer
state donated, frozen weights in bf16. On CPU the bytes are XLA:CPU's
buffer assignment (an estimate, not a GPU measurement); `--target=h100` gives
XLA:GPU's for an H100 (a prediction: compile only, no step runs). The
deviceless compile of "prompt" (B (T + 20) = 4736 rows) fails in XLA:GPU's
Triton GEMM tiling ("Couldn't find output tile sizes");
`XLA_FLAGS=--xla_gpu_enable_triton_gemm=false` compiles it. A row that fails
to compile is reported and skipped. The seed's column is MemDPT's GPT-2-large table (GB at epsilon 8 for DP, epsilon = inf
for non-DP, where it gives them). Accuracy at epsilon 1.6 / 8 / inf needs the
fine-tuning job (issue 14 item 3) and is not measured here.
"""

from __future__ import annotations

import datetime
import json
import os
import time

from absl import app, flags

MODEL = flags.DEFINE_enum("model", "large", ["tiny", "small", "medium", "large", "xl"], "GPT-2 preset")
METHODS = flags.DEFINE_list("methods", ["full", "lora", "adapter", "bitfit", "prompt", "side", "reversible"],
                            "jaxdp.finetune.methods methods")
BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "examples per step")
SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "tokens per example")
DTYPE = flags.DEFINE_string("dtype", "bfloat16", "compute dtype (frozen weights are held in it)")
DP_METHOD = flags.DEFINE_enum("dp_method", "bookkeeping", ["bookkeeping", "two_pass"],
                              "how DP forms its clipped sums (jaxdp.finetune.memory.step_memory)")
REV_KEEP = flags.DEFINE_integer("rev_keep_streams_every", 2, "also a reversible row keeping the streams every "
                                "k layers (exact at depth; jaxdp.models.reversible); 0: no such row")
TARGET = flags.DEFINE_enum("target", None, ["h100"], "compile for this GPU without one (XLA:GPU deviceless)")
ACCURACY_RUNS = flags.DEFINE_list("accuracy_runs", [], "finished `experiments.finetune` run directories: their "
                                  "held-out accuracy is printed after the memory table (--methods= for that only)")
OUT = flags.DEFINE_string("out", "", "JSON output path (none if empty); with --accuracy_runs it holds their "
                          "held-out accuracy and val loss, private metrics like their summary.json")

def _fmt(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    from jaxdp.analysis import hlo_cost
    from jaxdp.finetune import memory as finetune_memory
    from jaxdp.finetune.settings import Reversible
    from jaxdp.models.gpt2 import GPT2Config
    from jaxdp.training import finetune_job

    try:  # bad run directories: one line, before any compile
        accuracy = finetune_job.accuracy_rows(ACCURACY_RUNS.value)
    except ValueError as e:
        raise SystemExit(f"error: --accuracy_runs: {e}") from None
    device = hlo_cost.target_devices(TARGET.value, 1)[0]
    if TARGET.value:  # strategy="auto" plans with the target's rates (jaxdp.clipping.device_rates.current)
        os.environ["JAXDP_DEVICE_KIND"] = TARGET.value
    config = GPT2Config.preset(MODEL.value, dtype=DTYPE.value, **({"seq_len": 64} if MODEL.value == "tiny" else {}))
    runs = [(m, m, None) for m in METHODS.value]
    if "reversible" in METHODS.value and REV_KEEP.value:
        runs.append((f"reversible k={REV_KEEP.value}", "reversible", Reversible(keep_streams_every=REV_KEEP.value)))
    rows = {}
    for label, method, options in runs:
        row = {}
        for dp in (False, True):
            start = time.time()
            try:
                step = finetune_memory.StepSpec(BATCH_SIZE.value, SEQ_LEN.value, dp=dp, dp_method=DP_METHOD.value)
                memory = finetune_memory.step_memory(config, method, step=step, options=options,
                                                     frozen_dtype=jnp.dtype(DTYPE.value), device=device)
            except Exception as e:  # e.g. XLA:GPU's deviceless GEMM tiling (see WORKSPACE): report, go on
                print(f"{label} {'DP' if dp else 'non-DP'}: compile failed: {str(e).splitlines()[0][:200]}")
                break
            row["dp" if dp else "nondp"] = memory.peak / 1e9
            row[("dp" if dp else "nondp") + "_detail"] = dict(memory.__dict__)
            row["trainable_params"] = memory.trainable_params
            print(f"{label} {'DP' if dp else 'non-DP'}: {memory.peak / 1e9:.2f} GB "
                  f"(temporaries {memory.temporaries / 1e9:.2f}), compiled in {time.time() - start:.0f} s", flush=True)
        if "dp" in row:
            rows[label] = row

    machine = "XLA:GPU deviceless H100 compile, not a run" if TARGET.value else "CPU, compiled memory analysis"
    if rows:
        print(f"\nGPT-2 {MODEL.value}, B = {BATCH_SIZE.value}, T = {SEQ_LEN.value}, {DTYPE.value}, "
              f"DP by {DP_METHOD.value}; {machine}; "
              f"JAX {jax.__version__}; {datetime.date.today()}\n")
        print("| method | trainable params | non-DP GB | DP GB | DP / non-DP | seed DP (eps 8) GB | seed non-DP GB |")
        print("|---|---|---|---|---|---|---|")
        for method, r in rows.items():
            seed_dp, seed_nondp = finetune_memory.SEED_GB.get(method.split()[0], (None, None))
            print(f"| {method} | {r['trainable_params']:,} | {r['nondp']:.2f} | {r['dp']:.2f} | "
                  f"{r['dp'] / r['nondp']:.3f} | {_fmt(seed_dp)} | {_fmt(seed_nondp)} |")
        print("\nTargets (issue 14):\n" + "\n".join("- " + t for t in finetune_memory.target_checks(rows)))
    if accuracy:
        print("\nHeld-out accuracy on Rotten Tomatoes (the runs' summary.json, CPU):\n\n"
              "| run | method | epsilon | sigma | steps | val loss | accuracy | majority class | examples "
              "| positive labels | positive predictions |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|")
        for r in accuracy:
            print(f"| {r['run']} | {r['method']} | {r['epsilon']:.2f} | {_fmt(r['noise_multiplier'], 3)} | "
                  f"{r['steps']} | {r['val_loss']:.4f} | {r['accuracy']:.3f} | {r['majority_class_accuracy']:.3f} | "
                  f"{r['examples']} | {r['label_positive_fraction']:.3f} | "
                  f"{_fmt(r['predicted_positive_fraction'], 3)} |")
    if not OUT.value:
        return
    os.makedirs(os.path.dirname(OUT.value) or ".", exist_ok=True)
    with open(OUT.value, "w") as f:
        json.dump({"model": MODEL.value, "batch_size": BATCH_SIZE.value, "seq_len": SEQ_LEN.value,
                   "dtype": DTYPE.value, "dp_method": DP_METHOD.value, "machine": machine, "jax": jax.__version__,
                   "date": str(datetime.date.today()), "rows": rows, "accuracy": accuracy}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
