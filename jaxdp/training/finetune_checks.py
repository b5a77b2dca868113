"""The tripwires every fine-tuning run ends with (`jaxdp.finetune.tripwires`), on the run's final checkpoint.

    summary = jaxdp.training.train(p.config, prepared=p)
    jaxdp.training.finetune_checks.run_tripwires(p)      # experiments.finetune does this after every run

`run_tripwires(p)` rebuilds the run's model twice from the loaded init weights with the same seed
(`p.build_model`): once as loaded (the digests of its frozen leaves and of its trainable leaves before
training, then dropped), once with the final checkpoint restored into it (the state the loop trained, frozen leaves
included). Then: the frozen leaves bit for bit the loaded ones, at least one trainable leaf changed (when the
run took a step), and for "lora" the merged model's logits on the fixed probe batch within the tolerance of the
unmerged model's. The result goes into summary.json as `tripwires` ({"passed": true, ...} or {"passed": false,
"failure": the message}); a failure raises `TripwireError` after writing it and deletes nothing, so the run's
outputs stay for a look. The checks read only parameters and a public probe batch: nothing in the record is
private.

Cost: two models built one after the other, one checkpoint read, a SHA-256 of every parameter's bytes and, for
LoRA, two forward passes of a 2 x 32 probe batch.
"""

from __future__ import annotations

import json

from flax import nnx

from jaxdp.core import nn
from jaxdp.finetune import tripwires
from jaxdp.finetune.tripwires import TripwireError
from jaxdp.noise import seeds
from jaxdp.training.preparation import Prepared
from jaxdp.training.run_dir import (
    CHECKPOINT_DIR,
    SUMMARY_FILE,
    Checkpointer,
    read_json,
    write_text_atomic,
)

__all__ = ["TripwireError", "final_model", "run_tripwires"]


def final_model(p: Prepared):
    """(digests of the run's model as loaded, before training: {"frozen", "trainable"} by path; the model with
    its latest checkpoint restored, frozen leaves included; that checkpoint's step, None without one). The
    loaded model is gone before the trained one is built: one extra model in memory at a time."""
    seed = p.derive_seed(seeds.INIT)
    loaded = p.build_model(seed)
    before = {"frozen": tripwires.digests(loaded, nn.Frozen), "trainable": tripwires.digests(loaded, nnx.Param)}
    del loaded
    trained = p.build_model(seed)
    checkpointer = Checkpointer(p.workdir / CHECKPOINT_DIR)
    try:
        step = checkpointer.latest_step()
        if step is not None:
            checkpointer.restore_model(step, trained)
    finally:
        checkpointer.close()
    return before, trained, step


def check(p: Prepared, before: dict, trained: nnx.Module, steps: int) -> dict:
    """The tripwires' result on the digests of a run's loaded model (`final_model`) and its trained model;
    TripwireError on a failure."""
    result = {"frozen_leaves_unchanged": tripwires.check_frozen(before["frozen"], trained)}
    if steps > 0:
        changed = tripwires.check_trained(before["trainable"], trained)
        result["trainable_leaves_changed"] = f"{changed} of {len(before['trainable'])}"
    if p.config.finetune.method == "lora":
        probe = tripwires.probe_tokens(p.model_config.vocab_size, p.config.seq_len)
        result["lora_merge"] = tripwires.check_lora_merge(trained, probe)
    return result


def run_tripwires(p: Prepared) -> dict:
    """Checks the run's final state (see the module doc), records the result in summary.json and returns it;
    TripwireError (after recording it) when a check fails, or when the run has no checkpoint to check."""
    if p.build_model is None:
        raise ValueError("run_tripwires checks fine-tuning runs (jaxdp.training.finetune_job.prepare)")
    before, trained, step = final_model(p)
    try:
        if step is None:
            raise TripwireError(f"{p.workdir} has no checkpoint: the run's final state cannot be checked")
        result = {"passed": True, **check(p, before, trained, step)}
    except TripwireError as e:
        _record(p, {"passed": False, "failure": str(e)})
        raise
    _record(p, result)
    return result


def _record(p: Prepared, result: dict) -> None:
    path = p.workdir / SUMMARY_FILE
    summary = read_json(path)
    if summary is None or summary.get("tripwires") == result:  # a rerun of a checked run rewrites nothing
        return
    summary["tripwires"] = result
    write_text_atomic(path, json.dumps(summary, indent=2) + "\n")
