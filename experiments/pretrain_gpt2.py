"""DP pretraining of GPT-2 (or Llama) on real text, end to end.

    python -m experiments.pretrain_gpt2                      # default CPU config (GPT-2)
    python -m experiments.pretrain_gpt2 --config=experiments/configs/gpt2_small.py
    python -m experiments.pretrain_gpt2 --config=experiments/configs/llama_tiny.py   # Llama (CPU)
    python -m experiments.pretrain_gpt2 --config=experiments/configs/llama_1b.py     # Llama 3.2 1B shape (GPU)
    python -m experiments.pretrain_gpt2 --config.dp.enabled=False --config.workdir=runs/nondp

    python -m experiments.pretrain_gpt2 --config.mesh.data=2 --config.mesh.seq=4 --config.mesh.zero_stage=1
    python -m experiments.pretrain_gpt2 --config.remat=dots  # "none" | "dots" | "full"
    python -m experiments.pretrain_gpt2 --config.dp.method=two_pass  # flat clipping in two backward passes

Several devices (`mesh.data * mesh.seq > 1`) or `dp.method=two_pass` run
`jaxdp.sharding.ShardedDPStep` (DP only, accumulation_steps=1). Several hosts: run the same command on each
with JAX_COORDINATOR_ADDRESS=<host 0>:<port>, JAX_NUM_PROCESSES=<hosts> and
JAX_PROCESS_ID=<0..hosts-1> set, `mesh.data * mesh.seq` the devices of all hosts and the workdir on a
shared filesystem; `jax.distributed.initialize()` is then called before anything else touches the devices,
and process 0 alone reports and writes the run directory (`jaxdp.training.hosts`).

`config.model.family` ("gpt2" | "llama") picks the model; each family has its
own `config.model` fields (see the two CPU configs). Rerunning the same command
resumes the run in `--config.workdir`. The logic lives in `jaxdp.training`.
"""

import os
import sys

from jaxdp.training import cli

_DEFAULT = os.path.join(os.path.dirname(__file__), "configs", "default.py")
_CONFIG = cli.define_config("config", _DEFAULT, "Training config file.")


def _print_summary(s: dict, workdir: str) -> None:
    def fmt(x, spec=".4f"):
        return "n/a" if x is None else format(x, spec)
    lines = [
        f"run: {workdir}" + (f"  ({s['stop_reason']})" if s.get("stop_reason") else ""),
        f"  steps            {s['steps']}",
        f"  train loss       {fmt(s['train_loss'])}  (perplexity {fmt(s['train_perplexity'], '.2f')})",
        f"  val loss         {fmt(s['val_loss'])}  (perplexity {fmt(s['val_perplexity'], '.2f')}; "
        f"untrained {fmt(s['initial_val_loss'])})",
        f"  epsilon          {fmt(s['epsilon'], '.4g')}" + (f"  ({s['accountant']} accountant)" if s["dp"]
                                                               else "  (non-DP baseline)")
        + ("  NO GUARANTEE: config.seed is pinned below 2^64 (guessable; privacy.json)"
           if s.get("seed_guessable") else ""),
        f"  delta            {fmt(s['delta'], '.3g')}" + ("" if not s["dp"] else
        f"  (mechanism {s['delta_mechanism']:.3g} + sampling slack {s['sampling_slack']:.2g})"),
        f"  sigma            {fmt(s['noise_multiplier'], '.4g')}",
        f"  tokens/s         {fmt(s['tokens_per_s'], ',.0f')}",
        f"  params           {s['num_params']:,} ({s['model']})   tokenizer {s['tokenizer']} (vocab {s['vocab_size']})",
    ]
    print("\n".join(lines), flush=True)


def main(argv):
    del argv
    import jax

    from jaxdp import training  # after flag parsing: a --help stays fast
    from jaxdp.data import windows as data
    from jaxdp.sharding.processes import Disagreement
    from jaxdp.training import compilation_cache
    config = _CONFIG.value
    training.maybe_initialize_distributed()  # multi-host: JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
    reports = training.hosts.writes_run_dir()  # several hosts: process 0 reports and writes the run
    if config.memory_budget_gb is not None and jax.default_backend() == "cpu":  # the walkthrough: silent hours
        print("note: this config sizes its micro-batch for a GPU (config.memory_budget_gb); on this CPU the search "
              "compiles the step several times and a GPT-2-small step takes minutes. The CPU configs are "
              "experiments/configs/default.py and llama_tiny.py", file=sys.stderr, flush=True)
    try:
        cache = compilation_cache.enable(config)  # before the first compile
        prepared = training.prepare(config, progress=data.stderr_progress if reports else None)
    except (training.ConfigError, Disagreement) as e:  # Disagreement: hosts that prepared different runs
        print(f"error: {e}", file=sys.stderr)
        return 2
    compilation_cache.announce(cache, verbose=reports)  # after the checks: a bad input is one error line
    summary = training.train(config, prepared=prepared)
    if reports:
        _print_summary(summary, config.workdir)
    return 0


if __name__ == "__main__":
    cli.run(main)
