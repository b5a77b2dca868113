"""`privacy.json`: the privacy receipt of a run, what was guaranteed and how, in one file.

An auditor (or the user's privacy officer) should not have to read the
config, the code and `summary.json` to know what a run claims. The receipt
states the unit and adjacency, the mechanism as it ran (clipping, the
sensitivity the noise is calibrated to, sigma, normalisation), how batches
were sampled (Poisson rate, padding, truncation and its slack), the
accountant and its delta, the epsilon spent, the audit's lower bound when
one ran (`record_audit`, from `python -m experiments.audit` with
`config.audit.record_in`), and which outputs of the run lie outside the guarantee.

A run with `config.dp.mechanism` "bandmf", "blt" or "auto" also names its noise mechanism (`noise_mechanism`: the
kind, bands, the strategy's coefficients with their SHA-256 and source, its sensitivity, the sampling and
the DpEvent it was accounted as, `jaxdp.accounting.mechanisms.describe`) and, when the planner chose, its
table (`noise_plan`); never the secret partition of the units into groups. A default (DP-SGD) run's receipt
is as before these fields.

It holds no secret (no seed, key or loss) and may be shared; like
`epsilon.png` it gives the sampling rate q = batch_size / N, hence N, unless
`config.privacy.num_units_bound` B is set (q = batch_size / B).
"""

from __future__ import annotations

import json
import math
import pathlib

from jaxdp.accounting import mechanisms as mechanisms_accounting
from jaxdp.clipping import rules as clipping_lib
from jaxdp.clipping.rules import SENSITIVITY_FACTOR
from jaxdp.data.corpus import TEXT_SECTION_CHARS, is_single_text_file
from jaxdp.training import noise_choice
from jaxdp.training.run_dir import read_json, write_text_atomic

PRIVACY_FILE = "privacy.json"

def _unit_note(config) -> str:
    unit, k, field = config.privacy.unit, config.privacy.windows_per_unit, config.data.id_field
    if unit == "window":
        return (f"{config.seq_len + 1} consecutive tokens of one document (a document is cut into windows, "
                "its last one padded); text of one person over n windows is protected only by group privacy "
                "(about n x epsilon)") + _txt_note(config)
    who = ("all windows of one document" if unit == "document" else "all documents of one user") + (
        f" (documents with equal '{field}' are one unit)" if field else "")
    windows = f"{k} window{'s' if k != 1 else ''}"
    return f"{who}; clipping bounds the summed gradient of the up to {windows} it gives a step" + _txt_note(config)


def _txt_note(config) -> str:
    """A single .txt corpus's documents are sections of a cut that one paragraph's removal moves."""
    path = config.data.path
    if path is None or not is_single_text_file(path):
        return ""
    return (f"; data.path is one .txt file, cut into documents of >= {TEXT_SECTION_CHARS} characters of "
            "consecutive paragraphs (jaxdp.data.corpus.split_text_file): removing one paragraph re-cuts every "
            "section after it and can move other paragraphs between train and validation, so the guarantee "
            "covers the sections of this cut, not paragraphs; for a per-record guarantee give a .jsonl (one "
            "record per line) or a directory of .txt files (one document each)")


_OVERFLOW_NOTE = {  # config.dp.overflow: what a draw above max_batch_size does (jaxdp.sampling.poisson)
    "truncate": "a draw above max_batch_size is truncated to a uniformly random max_batch_size of its units",
    "resample": "a draw above max_batch_size is redrawn until it fits (Poisson conditioned on fitting)",
    "error": "a draw above max_batch_size stops the run with an error (a rerun with a new seed is another draw, "
             "to be paid for too)",
}

OUTSIDE_THE_GUARANTEE = {
    "metrics.jsonl, loss.png, summary.json, stderr": "noiseless training loss on private batches, "
                                                      "validation loss (and a fine-tuning run's held-out "
                                                      "accuracy) on private held-out text, N, and each "
                                                      "step's realised batch size (the loss is a mean over "
                                                      "the sampled units, 0.0 for an empty step; tokens/s "
                                                      "counts the sampled tokens)",
    "checkpoints/": "the secret root seed and noise key: with them the noise can be subtracted",
    "tokenizer/ (a trained bpe<N>)": "learned from the private text without privacy; the model's guarantee "
                                     "holds given the tokenizer: removing a unit can change the vocabulary "
                                     "and so how every other unit is tokenised (use data.tokenizer='gpt2' "
                                     "or one trained on public text)",
    "samples.txt (with a trained bpe<N>)": "decoded through that tokenizer's vocabulary, strings learned from "
                                           "the private text: share samples.txt only with the tokenizer",
    "privacy.json, epsilon.png (sampling_probability)": "q = batch_size / N, with config.json's batch_size, "
                                                        "gives N: the number of units (users) in the data. "
                                                        "q, sigma, max_batch_size and the default delta are "
                                                        "computed from N, so the guarantee is stated given N: "
                                                        "between neighbours with N and N + 1 units these "
                                                        "values differ and tell them apart (unless "
                                                        "config.privacy.num_units_bound is set)",
    "the token cache (config.data.cache_dir)": "the private text's tokens",
    "hyperparameters": "chosen by looking at private metrics, they are outside the guarantee",
}


def _init_weights(p) -> dict | None:
    """A fine-tuning run's init weights (`config.finetune.init`: its folder name and SHA-256, not the local
    path) and what is known of their privacy: their privacy.json, else a run
    directory's config.json, which says whether DP ran and on which data (an init trained on this run's
    data composes with it)."""
    config = p.config
    if "finetune" not in config:
        return None
    init = pathlib.Path(str(config.finetune.init)).expanduser()
    own, run = read_json(init / PRIVACY_FILE), read_json(init / "config.json")
    is_run = run is not None and isinstance(run.get("dp"), dict) and (init / "tokenizer").is_dir()
    run = run if is_run else None  # a pretrain_gpt2 run's config (an HF config.json is not one)
    if own is not None:
        known = own.get("guarantee") or own.get("note") or "not stated"
    elif run is None:
        known = "unknown (no privacy.json: e.g. a published checkpoint, whose privacy is its publisher's)"
    elif not run["dp"].get("enabled", True):
        known = "none: the init run trained without DP (its config.json: dp.enabled = false)"
    else:
        known = ("not stated: an unfinished DP run (no privacy.json yet); what it spent is in its checkpoint's "
                 "accountant, and it adds to this run's epsilon if it trained on the same data")
    data = run.get("data") if run is not None else None
    same_data = (_same_data(data.get("path") if isinstance(data, dict) else None, config.data.path, init)
                 if run is not None else False)  # a published checkpoint: its publisher's data
    note = ("needed to use the model (model/params.npz holds only the trained parameters); epsilon covers the "
            "fine-tuning data only. If the init weights were trained on the same private data, the two runs "
            "compose: the data's privacy is at best the sum of both epsilons (and deltas)")
    if same_data is True:
        note = ("THE INIT RUN TRAINED ON THIS RUN'S DATA (its config.json names config.data.path): this run's "
                "guarantee does not cover the model with them; " + note)
    return {"name": init.resolve().name, "sha256": p.init_key, "their_guarantee": known,
            "trained_on_this_data": same_data, "note": note}


def _same_data(theirs, ours, init: pathlib.Path) -> bool | str:
    """Whether the init run's data.path (`theirs`, as its config.json keeps it) holds this run's data file
    (`ours`): True for the same file, a byte-identical copy, or a folder holding it; False for a readable
    file of other bytes; "unknown" where that cannot be told (no such path, e.g. relative to another
    working directory)."""
    if theirs is None:
        return "unknown"
    ours_path = pathlib.Path(str(ours)).expanduser()
    candidates = [pathlib.Path(str(theirs)).expanduser()]
    if not candidates[0].is_absolute():
        candidates.append(init / candidates[0])  # relative to where the init run was started: unknown; try its dir
    for path in candidates:
        try:
            if path.is_dir():
                return any(f.samefile(ours_path) or _same_bytes(f, ours_path) for f in path.rglob("*") if f.is_file())
            if path.is_file():
                return path.samefile(ours_path) or _same_bytes(path, ours_path)
        except OSError:
            continue
    return "unknown"


def _same_bytes(a: pathlib.Path, b: pathlib.Path) -> bool:
    import filecmp
    return a.stat().st_size == b.stat().st_size and filecmp.cmp(a, b, shallow=False)


GUESSABLE_SEED_NOTE = ("NONE as run: config.seed was pinned below 2^64, a value an attacker can search for, and "
                       "with it replay the batches and subtract the noise; for a secret seed it would be: ")


def privacy_receipt(config, prepared, *, steps: int, epsilon: float | None,
                    overflowed_steps: int) -> dict:
    """The receipt of a run of `config` (`prepared` = `prepare(config)`) after `steps` steps."""
    p, dp = prepared, config.dp
    if not dp.enabled:
        return {"dp": False, "guarantee": None,
                "note": "non-DP baseline (config.dp.enabled=False): no privacy guarantee"}
    sampler, unit, k = p.sampler, config.privacy.unit, config.privacy.windows_per_unit
    init = _init_weights(p)
    public_tokenizer = config.data.tokenizer == "gpt2"
    bound = config.privacy.get("num_units_bound")
    size = [f"the number N of training {unit}s"] if bound is None else []  # with a bound nothing follows N
    if init is None:
        given, outside = size + ([] if public_tokenizer else ["the tokenizer"]), dict(OUTSIDE_THE_GUARANTEE)
    else:  # a fine-tuning run's tokenizer is its init's (jaxdp.training.finetune_job): as private or public as they are
        given = size + ["the init weights" + ("" if public_tokenizer else " and their tokenizer")]
        outside = {k: v for k, v in OUTSIDE_THE_GUARANTEE.items() if not k.startswith(("tokenizer/", "samples.txt"))}
        outside["the init weights (config.finetune.init)"] = f"see init_weights: {init['note']}"
        if not public_tokenizer and init["trained_on_this_data"] is True:
            outside["tokenizer/ (the init's)"] = ("the init run's tokenizer, learned from this run's data without "
                                                  "privacy: share neither it nor samples.txt")
        elif not public_tokenizer and init["trained_on_this_data"] == "unknown":
            outside["tokenizer/ (the init's)"] = ("the init run's tokenizer, learned from its data (its config.json's "
                                                  "data.path, which could not be compared with this run's): if that "
                                                  "held this run's data, share neither it nor samples.txt")
        elif not public_tokenizer:
            outside["tokenizer/ (the init's)"] = ("the init checkpoint's own tokenizer, not learned from this run's "
                                                  "data: share it, and samples.txt decoded through it, as the init "
                                                  "weights' source allows")
    if bound is not None:
        outside["privacy.json, epsilon.png (sampling_probability)"] = (
            "q = batch_size / num_units_bound: the public bound, not N (N is in summary.json and the metrics)")
    guessable = p.seed_guessable
    noise, cyclic, blt = p.noise, p.noise.kind in ("bandmf", "blt"), p.noise.kind == "blt"
    groups = noise.cycle_length
    if cyclic:
        outside["checkpoints/"] += (f"; and {'BLT' if blt else 'BandMF'}'s noise buffers (the past steps' noise, "
                                    "as secret as the key)")
    receipt = {
        "dp": True,
        "guarantee": (GUESSABLE_SEED_NOTE if guessable else "") + (
            f"({epsilon:.6g}, {p.delta:.3g})-DP for adding or removing one training {unit}") + (
            "" if bound is None else f", both data sets of at most {bound} (config.privacy.num_units_bound)") + (
            f", given {', '.join(given[:-1]) + ' and ' if len(given) > 1 else ''}{given[-1]} "
            "(see outside_the_guarantee)" if given else ""),
        "unit": unit,
        "unit_note": _unit_note(config),
        "adjacency": f"add or remove one {unit}" + (" (all its windows)" if unit != "window" else ""),
        "epsilon": epsilon,
        "target_epsilon": dp.target_epsilon,
        "delta": p.delta,
        "delta_from": p.delta_from,
        "delta_mechanism": p.delta_mechanism,
        "sampling_slack": p.sampling_slack,
        "accountant": config.accountant,
        "pld_interval": p.pld_interval if config.accountant == "pld" else None,
        "steps": steps,
        "mechanism": {
            "clipping": dp.clipping,
            "clip_fn": dp.clip_fn,
            "l2_norm_clip": dp.l2_norm_clip,
            "sensitivity": dp.l2_norm_clip * SENSITIVITY_FACTOR,
            "sensitivity_note": "C x SENSITIVITY_FACTOR: the float32 rounding allowance of the norms "
                                "(jaxdp.clipping); the noise is calibrated to it. Not included: the float32 "
                                "rounding of the sum over a batch (measured within it up to 4,096 examples "
                                "per step, up to 1.0006 C at 32,768; README)",
            "noise_multiplier": p.noise_multiplier,
            "noise_std": clipping_lib.noise_std(dp.l2_norm_clip, p.noise_multiplier) * noise.column_norm,
            "normalisation": "the noisy sum of clipped gradients divided by the expected batch size "
                             f"{config.batch_size}, never by the realised batch size",
            "noise_added": "once per logical batch (accumulation over micro-batches adds none)" + (
                f"; correlated (BLT, {noise.mechanism.num_buffers} buffers): step t adds row t of C^-1 Z, Z i.i.d. "
                "Gaussian of std noise_std (sigma x sensitivity x the strategy's min-separation sensitivity), from "
                "float32 buffers of decaying sums of the past noise (see noise_mechanism)" if blt else
                f"; correlated (BandMF, {noise.bands} bands): step t adds row t of C^-1 Z, Z i.i.d. Gaussian of "
                "std noise_std, from the last bands - 1 steps' noise kept as float32 buffers (see noise_mechanism)"
                if cyclic else ""),
            "secure_noise": dp.secure_noise,
            "noise_sampler": ("each value the sum of 4 float32 normals scaled by the std, / 2 (Opacus' secure_mode), "
                              "the noisy sum rounded to a grid of ~std / 2^8 (snapping): a mitigation of "
                              "floating-point attacks, not a proof; random bits from ChaCha20 (a CSPRNG)"
                              if dp.secure_noise else
                              "one float32 normal per value (23 random bits from XLA's Philox, a statistical "
                              "generator: attackable by whoever sees an exact noisy sum; this run releases only "
                              "the final parameters; README)"),
        },
        "sampling": {
            "method": (f"Poisson: each {unit} independently with probability q at every step" if not cyclic else
                       f"cyclic Poisson: each {unit} assigned once to one of {groups} groups, uniformly and "
                       f"independently (a secret partition, never written); step t samples the {unit}s of group "
                       f"t mod {groups}, each independently with probability group_sampling_probability "
                       f"(q_b = {groups} q, so the expected batch is batch_size)" + (
                           f"; BLT's analysis uses only that a {unit} joins steps {groups} apart, at most "
                           f"{noise.participations} of them ({groups}-min-separated participation): no "
                           "amplification by the sampling is claimed" if blt else "")) + (
                "" if unit == "window" else
                f"; a sampled {unit} gives min({k}, its windows) of its windows, drawn without replacement"),
            **({} if not cyclic else {"groups": groups,
                                      "group_sampling_probability": sampler.group_sampling_probability}),
            "random_bits": "ChaCha20 (a cryptographically secure generator) keyed by a SHA-256 of the secret "
                           "root seed, step and attempt (jaxdp.sampling)",
            "sampling_probability": sampler.sampling_probability,
            "num_units_bound": bound,
            "population": ("q = batch_size / N: q, sigma, max_batch_size and the default delta follow from N, "
                           "which the run therefore does not hide" if bound is None else
                           f"q = batch_size / num_units_bound ({bound}): drawn over {bound} units of which those "
                           "beyond the data set's do not exist; q, sigma, max_batch_size and delta do not depend "
                           "on N. expected_batch_size is the draw's over the bound; the real units' share, q N, "
                           "is not released (and the signal is N / bound of the expected batch's)"),
            "expected_batch_size": config.batch_size,
            "max_batch_size": sampler.max_batch_size,
            "max_batch_size_from": p.max_batch_size_from,
            "overflow": dp.overflow,
            "overflow_probability": sampler.overflow_probability,
            "overflowed_steps_this_process": overflowed_steps,
            "slack_note": _OVERFLOW_NOTE[dp.overflow] + "; the probability that any step overflows is paid "
                          "inside delta as (1 + e^epsilon) x steps x overflow_probability",
        },
        "randomness": ("config.seed pinned below 2^64: guessable, so this run has no guarantee (see guarantee)"
                       if guessable else
                       "config.seed pinned: the guarantee assumes the seed is secret" if p.seed_pinned else
                       "a 128-bit root seed from the operating system, kept only in checkpoints/"),
        "audits": [],
        **({} if init is None else {"init_weights": init}),
        "outside_the_guarantee": outside,
    }
    if p.records_noise_mechanism:  # config.dp.mechanism "bandmf" / "auto"
        record = mechanisms_accounting.describe(
            p.accounting(steps), p.noise_multiplier, p.delta_mechanism, parameters=noise.parameters(config.steps),
            accountant=config.accountant, value_discretization_interval=p.pld_interval)
        record["delta_note"] = "delta here is delta_mechanism, the accountant's (the run's delta less the sampling slack)"
        receipt["noise_mechanism"] = record
        plan = noise_choice.table_record(noise)
        if plan is not None:
            receipt["noise_plan"] = {
                "chosen": planner_label(noise),
                "rule": ("the least RMS noise of each step's release (step_rms_error)" if noise.criterion == "steps"
                         else "the least expected RMS noise of the released prefix sums (rms_error)")
                        + " (jaxdp.training.planner), each candidate calibrated to the run's target epsilon and "
                        "delta_mechanism at the same expected batch; sigma here at the planner's PLD grid, the run's "
                        "own is mechanism.noise_multiplier",
                "rows": plan}
    return receipt


# The headline's pointer to the composition (a reader of the headline alone would miss it)
_WITH_AUDITS_NOTE = "; audits recorded below trained on this run's data: see guarantee_with_audits"


def write_privacy_receipt(workdir, receipt: dict) -> dict:
    """Writes `receipt` as `workdir`'s privacy.json, atomically (`write_text_atomic`), and returns what it wrote.
    Audits already recorded in the file (`record_audit`) are kept when `receipt` has none (a resumed run
    rewrites its receipt), and the guarantee with those that trained on the run's data is restated
    (`guarantee_with_audits`)."""
    path = pathlib.Path(workdir, PRIVACY_FILE)
    old = read_json(path) if path.is_file() else None
    if receipt.get("dp") is True and old and old.get("audits") and not receipt.get("audits"):
        receipt = {**receipt, "audits": old["audits"]}
    receipt.pop("guarantee_with_audits", None)
    if isinstance(receipt.get("guarantee"), str):
        receipt["guarantee"] = receipt["guarantee"].removesuffix(_WITH_AUDITS_NOTE)
    on_data = [a for a in receipt.get("audits") or [] if a.get("trained_on_run_data") is not False]
    if on_data and all(isinstance(receipt.get(k), (int, float)) for k in ("epsilon", "delta")):
        receipt["guarantee"] = str(receipt.get("guarantee") or "") + _WITH_AUDITS_NOTE
        eps = receipt["epsilon"] + sum(a["claimed_epsilon"] for a in on_data)
        delta = receipt["delta"] + sum(a["delta"] for a in on_data)
        void = str(receipt.get("guarantee") or "").startswith(GUESSABLE_SEED_NOTE)  # a void guarantee stays void
        receipt["guarantee_with_audits"] = (GUESSABLE_SEED_NOTE if void else "") + (
            f"({eps:.6g}, {delta:.3g})-DP for the run's data: {len(on_data)} recorded audit(s) trained on it (or "
            "may have), and their released bounds compose with this run (basic composition: epsilons and deltas add)")
    rest = {k: v for k, v in receipt.items() if k != "in_plain_words"}
    receipt = {"in_plain_words": in_plain_words(rest), **rest}  # first: what a person reads
    write_text_atomic(path, json.dumps(receipt, indent=2) + "\n")
    return receipt


def in_plain_words(receipt: dict) -> str:
    """The sentence privacy.json opens with: the guarantee (with recorded audits composed) for a reader who
    reads nothing else."""
    if receipt.get("dp") is not True:
        return ("This model was trained without differential privacy (config.dp.enabled=False): nothing limits what "
                "it reveals about its training text.")
    if str(receipt.get("guarantee") or "").startswith(GUESSABLE_SEED_NOTE):
        return ("This run has NO privacy guarantee: config.seed was pinned to a value below 2^64, which an attacker "
                "can find by search and use to replay the batches and subtract the noise.")
    eps, delta, unit = receipt.get("epsilon"), receipt.get("delta"), receipt.get("unit") or "unit"
    if not all(isinstance(x, (int, float)) for x in (eps, delta)):
        return f"See guarantee: {receipt.get('guarantee')}"
    on_data = [a for a in receipt.get("audits") or [] if a.get("trained_on_run_data") is not False]
    eps += sum(a["claimed_epsilon"] for a in on_data)
    delta += sum(a["delta"] for a in on_data)
    return (f"Whoever sees the trained model can tell only to a bounded degree whether any one training {unit} was "
            f"in the data: ({eps:.3g}, {delta:.2g})-differential privacy, where e^epsilon = {math.exp(eps):.3g} bounds "
            f"how much the model can change the odds of any guess about that {unit} and delta = {delta:.2g} is the "
            "probability that this bound fails" + (f" (with the {len(on_data)} recorded audit(s) on this data)"
                                                    if on_data else "") + _noise_in_words(receipt) +
            "; what it assumes and what lies outside it follow.")


def planner_label(noise) -> str:
    """The planner's label of the run's `noise_choice.NoiseChoice` ("dpsgd", "bandmf b=4", "blt 3 buffers")."""
    return {"dpsgd": "dpsgd", "bandmf": f"bandmf b={noise.bands}",
            "blt": f"blt {noise.mechanism.num_buffers} buffers"}[noise.kind]


def _noise_in_words(receipt: dict) -> str:
    """in_plain_words' clause on a correlated-noise run ("" for DP-SGD)."""
    noise = receipt.get("noise_mechanism") or {}
    if noise.get("mechanism") == "blt":
        groups = (noise.get("parameters") or {}).get("groups")
        return (". The noise is correlated across steps (BLT: each step's noise partly cancels the previous steps' "
                f"in the running sum of the updates) and the batches come from {groups} secret groups in turn, so a "
                f"unit joins steps at least {groups} apart; the guarantee treats the whole run as one Gaussian "
                "release with the worst such participation, without amplification by the sampling")
    if noise.get("mechanism") != "bandmf":
        return ""
    bands = (noise.get("parameters") or {}).get("bands")
    return (f". The noise is correlated across steps (DP-BandMF with {bands} bands: each step's noise partly "
            "cancels the previous steps' in the running sum of the updates) and the batches come from "
            f"{bands} secret groups in turn; the guarantee is its amplified accounting, which holds only for "
            "that sampling")


# What must match between an audit and the run it is recorded into: the implementation it tested.
_SAME_IMPLEMENTATION = ("clipping", "clip_fn", "secure_noise")


def audit_target(workdir) -> dict:
    """The receipt an audit may be recorded into (checked before the audit runs); raises ValueError naming why not."""
    path = pathlib.Path(workdir, PRIVACY_FILE)
    if path.is_symlink() or not path.is_file():
        raise ValueError(f"no {PRIVACY_FILE} file in {str(workdir)!r} (or a symlink): record an audit in a DP "
                         "run's workdir")
    receipt = read_json(path)
    if receipt is None:
        raise ValueError(f"{path} is not a JSON object: not a privacy receipt")
    if receipt.get("dp") is not True:
        raise ValueError(f"{path} is the receipt of a non-DP run (dp = {receipt.get('dp')!r}): there is no "
                         "guarantee to audit")
    eps = receipt.get("epsilon")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps):
        raise ValueError(f"{path} states no finite epsilon ({eps!r}): there is no guarantee to audit")
    return receipt


# An audit calibrated to the run's target claims ~1e-7 above the run's epsilon (which stops at or below the
# target); a claim within this relative slack of the run's epsilon tests the same guarantee.
_CLAIM_SLACK = 1e-3


def check_recordable(receipt: dict, mechanism: dict, *, bug: str = "none", claim: float | None = None,
                     delta: float | None = None) -> None:
    """Raises ValueError naming why an audit may not go into `receipt`: a planted `bug`, a `claim` above the run's
    epsilon or a `delta` above its delta (a weaker guarantee either way), another mechanism
    (`check_same_mechanism`). The CLI checks it before the audit runs (claim: the target it calibrates to),
    `record_audit` again with the audit's claim."""
    if delta is not None and not delta <= receipt.get("delta", 0) * (1 + 1e-9):
        raise ValueError(f"the audit's delta {delta:.3g} is above this run's {receipt.get('delta')!r}: it tests a "
                         "weaker guarantee than the run's; audit at config.dp.delta <= the run's delta")
    if bug != "none":
        raise ValueError(f"an audit with a planted bug ({bug!r}) audits the bug, not this code: "
                         "only an audit with bug='none' goes into a receipt")
    if claim is not None and claim > receipt["epsilon"] * (1 + _CLAIM_SLACK):
        raise ValueError(f"the audit claims epsilon {claim:.6g}, above this run's {receipt['epsilon']:.6g}: it tests a "
                         "weaker guarantee than the run's; audit at a claim <= the run's epsilon "
                         "(config.dp.target_epsilon)")
    check_same_mechanism(receipt, mechanism)


def audit_on_run_data(workdir, data: str | None, *, seed_pinned: bool) -> bool | str:
    """Whether an audit on `data` (a black box's data.path; None: synthetic) trained on the run's data (its
    config.json's data.path): True, False or "unknown". ValueError when it did (or may have) with a pinned seed,
    whose noise is then as public as the seed (checked by the CLI before the audit runs, and when recorded)."""
    run_data = ((read_json(pathlib.Path(workdir, "config.json")) or {}).get("data") or {}).get("path")
    on_data = (False if data is None else "unknown" if run_data is None else
               _same_data(data, run_data, pathlib.Path(workdir)))
    if on_data is not False and seed_pinned:
        raise ValueError("the audit trained on this run's data (or it cannot be told apart) with a pinned seed: "
                         "its noise is as public as that seed, so its released bound is not private; rerun "
                         "without config.seed")
    return on_data


def check_same_mechanism(receipt: dict, mechanism: dict) -> None:
    """Raises ValueError naming what differs when an audit's `mechanism` (clipping, clip_fn, secure_noise,
    accountant: `jaxdp.auditing.runs`; the noise mechanism, DP-SGD unless it names another) is not the run's
    `receipt`'s; the CLI checks it before the audit runs."""
    run_mech = dict(receipt.get("mechanism") or {})
    # Receipts written before the field name the secure sampler in their text.
    run_mech.setdefault("secure_noise", "sum of 4" in str(run_mech.get("noise_sampler", "")))
    run_mech["accountant"] = receipt.get("accountant")
    differ = {k: (mechanism[k], run_mech.get(k)) for k in _SAME_IMPLEMENTATION + ("accountant",)
              if mechanism[k] != run_mech.get(k)}
    # The one-run audit runs DP-SGD's noise: it does not test a correlated-noise run's mechanism.
    run_noise = (receipt.get("noise_mechanism") or {}).get("mechanism", "dpsgd")
    if mechanism.get("noise_mechanism", "dpsgd") != run_noise:
        differ["noise_mechanism"] = (mechanism.get("noise_mechanism", "dpsgd"), run_noise)
    if differ:
        raise ValueError("the audit runs another mechanism than this run: " + ", ".join(
            f"{k} {ours!r} (run: {theirs!r})" for k, (ours, theirs) in differ.items()))


def record_audit(workdir, result, kind: str, *, data: str | None = None) -> dict:
    """Appends a one-run audit (`jaxdp.auditing.runs` result of `kind`) to `workdir`'s receipt; returns the receipt.

    The audit is its own run of the DP step with canaries (`python -m experiments.audit`): its sigma, q and
    steps are its own, recorded beside the run's. Refused (ValueError): a planted bug; no noise or no finite
    claim; a claim above the run's epsilon (it tests a weaker guarantee); a bound this audit could never push
    above its claim (`max_epsilon`: nothing could have been caught); an implementation other than the run's
    (clipping, clip_fn, secure noise, accountant); an audit on `data` (a black box's data.path; None:
    synthetic) that is the run's (its config.json's data.path), or cannot be told apart, with a pinned
    seed, whose noise is then as public as the seed. Every audit is kept (`audits`); one that trained on
    the run's data composes with it (`guarantee_with_audits`)."""
    receipt = audit_target(workdir)
    a, mech = result.audit, result.mechanism
    claim = result.claimed_epsilon
    if not (result.noise_multiplier > 0 and math.isfinite(claim)):
        raise ValueError(f"the audit ran with noise_multiplier {result.noise_multiplier:g} (claimed epsilon "
                         f"{claim:g}): an audit without a finite claim checks no guarantee, and a noiseless run "
                         "on private data is not private; only an audit with noise goes into a receipt")
    if not math.isfinite(a.epsilon) or a.max_epsilon <= claim:
        raise ValueError(f"this audit could not have caught anything: its largest attainable bound "
                         f"{a.max_epsilon:.4g} (every guess right) is <= its claim {claim:.4g}; use more canaries "
                         "or a smaller claimed epsilon (config.dp.target_epsilon)")
    check_recordable(receipt, mech, bug=result.bug, claim=claim, delta=result.delta)
    on_data = audit_on_run_data(workdir, data, seed_pinned=result.seed_pinned)
    entry = {"kind": kind, "lower_bound": a.epsilon, "confidence": a.confidence, "max_attainable": a.max_epsilon,
             "exceeds_claim": a.epsilon > claim, "claimed_epsilon": claim,
             "noise_multiplier": result.noise_multiplier, "sampling_probability": result.sampling_probability,
             "steps": result.steps, "delta": result.delta, **mech, "num_canaries": a.num_canaries,
             "data": "synthetic (white box)" if data is None else str(data), "trained_on_run_data": on_data,
             "note": "a separate run of the same DP step with canaries (Steinke, Nasr & Jagielski 2023): a "
                     "lower_bound above claimed_epsilon is evidence of a privacy bug; one below proves nothing"}
    receipt["audits"] = list(receipt.get("audits") or []) + [entry]
    receipt.pop("audit", None), receipt.pop("audit_lower_bound", None)  # the one-audit fields of older versions
    return write_privacy_receipt(workdir, receipt)
