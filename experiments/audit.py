"""One-run privacy audit (Steinke, Nasr & Jagielski 2023): an empirical LOWER bound on epsilon.

    python -m experiments.audit                                   # black box, the default CPU run
    python -m experiments.audit --config.audit.kind=white_box     # gradient canaries (CI-sized, seconds)
    python -m experiments.audit --config.audit.kind=white_box --config.audit.bug=no_clipping
    python -m experiments.audit --config.audit.max_windows=1024 --config.dp.noise_multiplier=0
    python -m experiments.audit --config.audit.record_in=/tmp/jaxdp_run   # bound into the run's privacy.json
    python -m experiments.audit --config.audit.kind=white_box --config.dp.mechanism=bandmf --config.dp.bands=2

Black box: m random-token sequences, each added to the default config's
training windows with probability 1/2; one DP-Adam run of `config.steps`
steps at `config.batch_size`, sigma calibrated to `config.dp.target_epsilon`;
each canary scored by its loss drop. White box: m gradient canaries on the
real DP step (`jaxdp.auditing.runs.white_box_audit`). Either way the step runs
the config's clipping, clip_fn, secure_noise and accountant, the claim is the
accountant's epsilon (default 2: a claim of 8 is beyond what 1,000 canaries can
ever show, the "max attainable" line) and the audit's 95% lower bound must not
exceed it; one that does is evidence of a bug (exit status 1). A bound below the
claim proves nothing. The white box also audits the correlated-noise mechanisms
(`config.dp.mechanism` "bandmf" or "blt" with `config.dp.bands`: BandMF's
bands or BLT's min separation, the strategy optimised for the audit's steps;
BLT needs the extra jaxdp[mf]): its records are then sampled cyclically and the
claim is that mechanism's epsilon. The logic lives in `jaxdp.auditing.bound`
and `jaxdp.auditing.runs`.
"""

import os
import sys
import time

import numpy as np

from jaxdp.training import cli

_DEFAULT = os.path.join(os.path.dirname(__file__), "configs", "audit.py")
_CONFIG = cli.define_config("config", _DEFAULT, "Audit config file.")


def _black_box(config):
    from jaxdp import training
    from jaxdp.auditing import runs as audit_runs
    from jaxdp.data import windows as data
    docs = data.load_documents(config.data.path)
    tokenizer = data.make_tokenizer(config.data.tokenizer, docs)
    train = data.TokenWindows(docs, tokenizer, config.seq_len, split="train",
                              validation_fraction=config.data.validation_fraction,
                              cache_dir=config.data.cache_dir, progress=data.stderr_progress)
    n = train.num_windows if config.audit.max_windows is None else min(config.audit.max_windows, train.num_windows)
    windows = train.get(np.arange(n))
    mc = training.model_config(config.model, tokenizer.vocab_size, dtype=config.dtype, remat=config.remat)
    model = training.build_model(mc, 0 if config.seed is None else config.seed)

    def progress(step):
        print(f"\rstep {step}/{config.steps}", end="\n" if step == config.steps else "", file=sys.stderr, flush=True)

    settings = audit_runs.BlackBoxSettings(
        num_canaries=config.audit.num_canaries, steps=config.steps, batch_size=config.batch_size,
        learning_rate=config.learning_rate, overflow=config.dp.overflow, bug=config.audit.bug,
        confidence=config.audit.confidence)
    return audit_runs.black_box_audit(model, windows, tokenizer.vocab_size, settings=settings,
                                      claim=_claim(config, config.steps),
                                      seed=config.seed, progress=progress), \
        f"{n} windows, {config.model.family} d={config.model.d_model}"


def _data(config) -> str | None:
    """The data the audit trains on: the black box's data.path; None for the white box's synthetic records."""
    return config.data.path if config.audit.kind == "black_box" else None


def _mechanism(config) -> dict:
    """The audited run's clipping, clip function, noise and accountant: the audit runs them, not defaults."""
    dp = config.dp
    return dict(clipping=dp.clipping, clip_fn=dp.clip_fn, secure_noise=dp.secure_noise, accountant=config.accountant)


def _recorded_mechanism(config) -> dict:
    """`_mechanism` and, for correlated noise, its name as the run's receipt has it."""
    noise = config.dp.get("mechanism", "dpsgd")
    return {**_mechanism(config), **({} if noise == "dpsgd" else {"noise_mechanism": noise})}


def _noise(config, steps: int) -> dict:
    """The audited run's noise mechanism for `steps` audited steps, as `Claim` fields."""
    from jaxdp.noise import strategies
    dp = config.dp
    kind, bands = dp.get("mechanism", "dpsgd"), dp.get("bands")
    if kind == "dpsgd":
        return {}
    if kind not in ("bandmf", "blt") or not bands:
        raise ValueError(f"config.dp.mechanism must be 'dpsgd', or 'bandmf' / 'blt' with config.dp.bands >= 1, for "
                         f"an audit (the planner's choice is not audited), got {kind!r} with bands {bands!r}")
    if kind == "bandmf":
        return {"noise_mechanism": strategies.bandmf(steps, bands)}
    try:
        blt = strategies.blt(steps, dp.get("blt_buffers", 3), bands, None)
    except ImportError as e:
        raise ValueError(f"config.dp.mechanism='blt': {e}") from e
    return {"noise_mechanism": blt, "cycle_length": bands}


def _claim(config, steps: int):
    """The audited run's DP step and claim (`jaxdp.auditing.settings.Claim`) over `steps` audited steps."""
    from jaxdp.auditing.settings import Claim
    dp = config.dp
    return Claim(target_epsilon=dp.target_epsilon, noise_multiplier=dp.noise_multiplier, delta=dp.delta,
                 l2_norm_clip=dp.l2_norm_clip, **_mechanism(config), **_noise(config, steps))


def _white_box(config):
    from jaxdp.auditing import runs as audit_runs
    settings = audit_runs.WhiteBoxSettings(
        num_canaries=config.audit.num_canaries, num_examples=config.audit.white_box_examples,
        steps=config.audit.white_box_steps, sampling_probability=config.audit.white_box_sampling_rate,
        bug=config.audit.bug, confidence=config.audit.confidence)
    result = audit_runs.white_box_audit(settings=settings, claim=_claim(config, settings.steps), seed=config.seed)
    return result, f"{config.audit.white_box_examples} synthetic records, softmax regression"


def main(argv):
    del argv
    config = _CONFIG.value
    from jaxdp.auditing import runs as audit_runs
    from jaxdp.training import receipt
    kinds = {"black_box": _black_box, "white_box": _white_box}
    try:  # before the audit: a bad config or record_in must not cost a whole run
        audit_runs.check_audit_config(config)
        if config.audit.record_in is not None:
            receipt.check_recordable(receipt.audit_target(config.audit.record_in), _recorded_mechanism(config),
                                     bug=config.audit.bug, delta=config.dp.delta,
                                     claim=None if config.dp.noise_multiplier is not None else config.dp.target_epsilon)
            receipt.audit_on_run_data(config.audit.record_in, _data(config), seed_pinned=config.seed is not None)
        start = time.time()
        result, data_desc = kinds[config.audit.kind](config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    exceeded = result.audit.epsilon > result.claimed_epsilon  # evidence of a privacy bug: exit status 1
    print(audit_runs.report(result, config.audit.kind, data_desc, time.time() - start), flush=True)
    if config.audit.record_in is not None:
        try:
            receipt.record_audit(config.audit.record_in, result, config.audit.kind, data=_data(config))
        except (ValueError, OSError) as e:
            print(f"error: config.audit.record_in: {e}", file=sys.stderr)
            return 1 if exceeded else 2
        print(f"  recorded in      {os.path.join(config.audit.record_in, receipt.PRIVACY_FILE)}", flush=True)
    return 1 if exceeded else 0


if __name__ == "__main__":
    cli.run(main)
