"""Samples text from a run directory of `experiments.pretrain_gpt2` (GPT-2 or Llama).

    python -m experiments.generate --workdir=runs/pretrain_gpt2 --prompt="In the"

The shareable part of a run directory is enough: `model/`, `config.json` and
`tokenizer/` (README, "What is protected"); for a fine-tuning run also its init
weights (`config.finetune.init`), on which `model/` holds the trained parameters.
"""

import sys

from absl import flags

from jaxdp.training import cli

_WORKDIR = flags.DEFINE_string("workdir", "runs/pretrain_gpt2", "Run directory.")
_PROMPT = flags.DEFINE_string("prompt", "In the", "Text to continue (any corpus).")
_TOKENS = flags.DEFINE_integer("num_tokens", 64, "Tokens to generate per sample.")
_SAMPLES = flags.DEFINE_integer("num_samples", 3, "Number of samples.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature (0 = greedy).")
_TOP_K = flags.DEFINE_integer("top_k", 40, "Sample from the k most likely tokens (0 = all).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")


def main(argv):
    del argv
    from jaxdp import training
    if _TOP_K.value < 0 or not _TEMPERATURE.value >= 0 or _TOKENS.value < 1 or _SAMPLES.value < 1:
        print(f"error: need --top_k >= 0 (0: all tokens), --temperature >= 0 (0: greedy), --num_tokens >= 1 and "
              f"--num_samples >= 1; got {_TOP_K.value}, {_TEMPERATURE.value}, {_TOKENS.value}, {_SAMPLES.value}",
              file=sys.stderr)
        return 2
    try:
        model, tokenizer, _ = training.load_for_generation(_WORKDIR.value)
    except (training.ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt = tokenizer.encode(_PROMPT.value) or [tokenizer.eot_id]
    for i in range(_SAMPLES.value):
        ids = training.generate(model, prompt, _TOKENS.value, seed=_SEED.value + i,
                                temperature=_TEMPERATURE.value, top_k=_TOP_K.value or None)
        print(f"=== sample {i + 1} ===\n{_PROMPT.value}{tokenizer.decode(ids)}\n", flush=True)
    return 0


if __name__ == "__main__":
    cli.run(main)
