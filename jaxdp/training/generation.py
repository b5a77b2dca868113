"""Sampling from a trained model: `generate`, `samples.txt`, and loading a run directory for generation.

`samples.txt` continues PUBLIC prompts (`config.sample.prompts`, by default
`DEFAULT_PROMPTS`), never text of the private corpus: a continuation is
post-processing of the DP model, a prompt cut from the validation split would
publish that text verbatim.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdp.data import windows as data_lib
from jaxdp.noise import draws as noise_lib
from jaxdp.noise import seeds
from jaxdp.training.config import ConfigError, build_model, model_config
from jaxdp.training.preparation import Prepared
from jaxdp.training.run_dir import (
    CONFIG_FILE,
    SAMPLES_FILE,
    TOKENIZER_DIR,
    read_trained,
)

# The prompts of samples.txt when config.sample.prompts is None: short, public, corpus-independent.
DEFAULT_PROMPTS = ("The", "In the", "We", "It is", "This year")


def generate(model: nnx.Module, prompt: list[int], num_tokens: int, *, seed: int = 0,
             key: jax.Array | None = None, temperature: float = 1.0, top_k: int | None = 40) -> list[int]:
    """Samples `num_tokens` continuation ids of `prompt` (a fixed-shape window of the model's length).

    The sampling key is `key`, else `jax.random.key(seed)`. A model with a soft prompt (prompt tuning) has
    its length fewer positions for tokens.
    """
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None (all tokens) or an integer >= 1, got {top_k!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
    soft_prompt = getattr(model, "soft_prompt", None)
    T = model.config.seq_len - (0 if soft_prompt is None else soft_prompt.length)
    ids = list(prompt)[-(T - 1):] if len(prompt) >= T else list(prompt)
    key = jax.random.key(seed) if key is None else key
    out = []
    for _ in range(num_tokens):
        window = ids[-T:]
        buf = np.zeros((1, T), np.int32)
        buf[0, :len(window)] = window
        key, sub = jax.random.split(key)
        nxt = int(_next_token(model, buf, len(window) - 1, sub, temperature, top_k))
        ids.append(nxt)
        out.append(nxt)
    return out


@nnx.jit(static_argnums=(4, 5))
def _next_token(model, buf_1T, pos, key, temperature, top_k):
    logits_V = model(buf_1T)[0, pos]
    if temperature <= 0:
        return jnp.argmax(logits_V)
    logits_V = logits_V / temperature
    if top_k is not None and top_k < logits_V.shape[0]:
        kth = jax.lax.top_k(logits_V, top_k)[0][-1]
        logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
    return jax.random.categorical(key, logits_V)


def write_samples(model, p: Prepared, config) -> None:
    """`samples.txt`: continuations of the public prompts `config.sample.prompts` (or `DEFAULT_PROMPTS`).

    Sample i continues prompt i (cycling), after an end-of-text token (a
    document's start), with the key `derive_seed(root, SAMPLES, i)`.
    """
    prompts = tuple(config.sample.prompts or DEFAULT_PROMPTS)
    parts = []
    for i in range(config.sample.num):
        text = prompts[i % len(prompts)]
        prompt = [p.tokenizer.eot_id] + p.tokenizer.encode(text)
        cont = generate(model, prompt, config.sample.tokens,
                        key=noise_lib.key_from_seed(p.derive_seed(seeds.SAMPLES, i)))
        parts.append(f"=== sample {i + 1} ===\n[prompt] {text}\n[continuation] {p.tokenizer.decode(cont)}\n")
    (p.workdir / SAMPLES_FILE).write_text("\n".join(parts))


def load_for_generation(workdir) -> tuple[nnx.Module, data_lib.Tokenizer, dict]:
    """(model with the run's final parameters, tokenizer, config json) of a run directory.

    The parameters come from `model/` (the shareable model a finished run
    writes), else from the latest checkpoint (an interrupted run). A fine-tuning
    run's `model/` holds only what its method trained: they are put on its init
    weights (`config.finetune.init`, read from where the run read them). The model is
    the run's `GPT2` or `Llama` (`config.model.family`; run directories written
    before that key existed are GPT-2), without remat.
    """
    workdir = pathlib.Path(workdir)
    if not (workdir / CONFIG_FILE).is_file():
        raise ConfigError(f"{workdir} is not a run directory (no {CONFIG_FILE})")
    cfg = json.loads((workdir / CONFIG_FILE).read_text())
    tokenizer = data_lib.Tokenizer.load(workdir / TOKENIZER_DIR)
    model_json = dict({"family": "gpt2"}, **cfg["model"])
    mc = model_config(model_json, tokenizer.vocab_size, dtype=cfg["dtype"], remat=False)
    if "finetune" in cfg:  # model/ holds only the trained parameters: they go on the init weights
        from jaxdp.training import finetune_job
        model = finetune_job.untrained_model(cfg, mc, workdir)
    else:
        model = build_model(mc, seed=0)  # overwritten by the saved parameters
    if not read_trained(workdir, model):
        raise ConfigError(f"{workdir} has no checkpoint yet")
    return model, tokenizer, cfg
