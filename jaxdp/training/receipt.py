"""`privacy.json`: the privacy receipt of a run, what was guaranteed and how, in one file.

An auditor (or the user's privacy officer) should not have to read the
config, the code and `summary.json` to know what a run claims. The receipt
states the unit and adjacency, the mechanism as it ran (clipping, the
sensitivity the noise is calibrated to, sigma, normalisation), how batches
were sampled (Poisson rate, padding, truncation and its slack), the
accountant and its delta, the epsilon spent, the audit's lower bound when
one ran, and which outputs of the run lie outside the guarantee.

It holds no secret (no seed, key or loss) and may be shared; like
`epsilon.png` it gives the sampling rate q = batch_size / N, a hint of N.
"""

from __future__ import annotations

import json
import pathlib

from jaxdp import noise as noise_lib
from jaxdp.clipping import SENSITIVITY_FACTOR

PRIVACY_FILE = "privacy.json"

OUTSIDE_THE_GUARANTEE = {
    "metrics.jsonl, loss.png, summary.json, stderr": "noiseless training loss on private batches, "
                                                      "validation loss on private held-out text, N",
    "checkpoints/": "the secret root seed and noise key: with them the noise can be subtracted",
    "tokenizer/ (a trained bpe<N>)": "learned from the private text without privacy",
    "the token cache (config.data.cache_dir)": "the private text's tokens",
    "hyperparameters": "chosen by looking at private metrics, they are outside the guarantee",
}


def privacy_receipt(config, prepared, *, steps: int, epsilon: float | None,
                    overflowed_steps: int, audit_lower_bound: float | None = None) -> dict:
    """The receipt of a run of `config` (`prepared` = `prepare(config)`) after `steps` steps."""
    p, dp = prepared, config.dp
    if not dp.enabled:
        return {"dp": False, "guarantee": None,
                "note": "non-DP baseline (config.dp.enabled=False): no privacy guarantee"}
    sampler = p.sampler
    return {
        "dp": True,
        "guarantee": f"({epsilon:.6g}, {p.delta:.3g})-DP for adding or removing one training window",
        "unit": f"window: {config.seq_len + 1} consecutive tokens; windows do not overlap and may span a "
                "document boundary; text of one person over k windows is protected only by group privacy",
        "adjacency": "add or remove one window",
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
                                "(jaxdp.clipping); the noise is calibrated to it",
            "noise_multiplier": p.noise_multiplier,
            "noise_std": noise_lib.noise_std(dp.l2_norm_clip, p.noise_multiplier),
            "normalisation": "the noisy sum of clipped gradients divided by the expected batch size "
                             f"{config.batch_size}, never by the realised batch size",
            "noise_added": "once per logical batch (accumulation over micro-batches adds none)",
        },
        "sampling": {
            "method": "Poisson: each window independently with probability q at every step",
            "sampling_probability": sampler.sampling_probability,
            "expected_batch_size": config.batch_size,
            "max_batch_size": sampler.max_batch_size,
            "max_batch_size_from": p.max_batch_size_from,
            "overflow": dp.overflow,
            "overflow_probability": sampler.overflow_probability,
            "overflowed_steps_this_process": overflowed_steps,
            "slack_note": "a draw above max_batch_size is truncated; its probability is paid inside delta "
                          "as (1 + e^epsilon) x steps x overflow_probability",
        },
        "randomness": ("config.seed pinned: the guarantee assumes the seed is secret" if p.seed_pinned else
                       "a 128-bit root seed from the operating system, kept only in checkpoints/"),
        "audit_lower_bound": audit_lower_bound,
        "outside_the_guarantee": OUTSIDE_THE_GUARANTEE,
    }


def write_privacy_receipt(workdir, receipt: dict) -> None:
    pathlib.Path(workdir, PRIVACY_FILE).write_text(json.dumps(receipt, indent=2) + "\n")
