"""DP (and non-DP) language-model pretraining: the tested logic behind `experiments/pretrain_gpt2.py`.

`train(config)` runs one training job described by an ml_collections config
(every field: `experiments/configs/default.py`; a Llama model:
`experiments/configs/llama_tiny.py`):

  1. `prepare(config)` (`preparation`) validates every value (`config`),
     loads the corpus, builds the tokenizer and the token windows (the DP records), calibrates
     sigma and checks any existing run directory, all BEFORE anything is
     written to the workdir; a bad value raises `ConfigError` with a one-line
     message. `config.model.family` ("gpt2" | "llama") picks the model.
  2. The loop (`loop`): Poisson sampling on the host, one jitted step per
     micro-batch (`steps`: `per_example_grads` -> `fused_clip` -> adamw inside
     `nnx.Optimizer`, the plain mean-loss gradient when `dp.enabled=False`, or
     `jaxdp.sharding.ShardedDPStep` on a (data, seq) mesh when
     `mesh.data * mesh.seq > 1` or `dp.method="two_pass"`), and the privacy accountant, which stops
     training before `dp.target_epsilon` is exceeded.
  3. The run directory (`run_dir`, `generation`): `config.json`,
     `metrics.jsonl`, `tokenizer/`, orbax checkpoints (the latest is kept;
     they alone hold the run's secret root seed), `summary.json`, plots,
     `samples.txt` (continuations of public prompts) and `model/` (the final
     parameters alone: the model to share; README's "What is protected").

Several hosts (`hosts`) run the same loop together, process 0 writing the run directory.
Rerunning with the same config resumes from the latest checkpoint and writes
exactly the metrics of an uninterrupted run; a different config in the same
workdir is an error, not a silent mix. `load_for_generation(workdir)` and
`generate` sample from a finished (or interrupted) run. `finetune_job` is the fine-tuning job on this
loop (`experiments/finetune.py`).
"""

from jaxdp._lazy import lazy_names

# name -> the module that defines it. Loaded on first use (PEP 562): the jobs' command lines import
# `jaxdp.training.cli` and parse their flags before JAX and the training stack load.
_PUBLIC = {
    "DEFAULT_PROMPTS": "jaxdp.training.generation",
    "MODEL_FAMILIES": "jaxdp.training.config",
    "ConfigError": "jaxdp.training.config",
    "Prepared": "jaxdp.training.preparation",
    "build_model": "jaxdp.training.config",
    "evaluate": "jaxdp.training.steps",
    "generate": "jaxdp.training.generation",
    "load_for_generation": "jaxdp.training.generation",
    "maybe_initialize_distributed": "jaxdp.training.hosts",
    "model_config": "jaxdp.training.config",
    "prepare": "jaxdp.training.preparation",
    "read_metrics": "jaxdp.training.run_dir",
    "train": "jaxdp.training.loop",
    "validate_config": "jaxdp.training.config",
}
_SUBMODULES = ("cli", "config", "finetune_job", "generation", "hosts", "loop", "preparation", "receipt", "run_dir",
               "steps")

__getattr__, __dir__ = lazy_names(__name__, _PUBLIC, {m: f"{__name__}.{m}" for m in _SUBMODULES})

__all__ = sorted(_PUBLIC)
