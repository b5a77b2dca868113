"""The fine-tuning memory plan (`jaxdp.finetune.memory_plan`) on CPU at tiny size.

The plan's largest micro-batch comes from an affine fit of the step's bytes at 1 and 2 examples; here the
fit is checked against real compiles on either side of it (the predicted batch fits, one more does not),
and the 8-GPU search is run on the 8 fake CPU devices.
"""

import dataclasses
import subprocess
import sys

import pytest

from jaxdp.finetune import memory, memory_plan

SPEC = memory_plan.PlanSpec(target=None, dtype="float32")


def test_largest_batch_arithmetic():
    assert memory_plan.largest_batch(10.0, 12.0, 80.0) == 36      # 10 + 35 * 2 = 80
    assert memory_plan.largest_batch(10.0, 12.0, 79.9) == 35
    assert memory_plan.largest_batch(81.0, 90.0, 80.0) == 0
    with pytest.raises(ValueError, match="did not grow"):
        memory_plan.largest_batch(10.0, 10.0, 80.0)


def test_unknown_model_is_named():
    with pytest.raises(ValueError, match="model must be one of"):
        memory_plan.model_config("llama-70b", 64, SPEC)


def test_affine_fit_predicts_the_largest_batch_that_compiles():
    gb = lambda B: memory_plan.one_gpu_gb("llama-tiny", "lora", memory.StepSpec(B, 32, dp=True), SPEC)
    gb1, gb2 = gb(1), gb(2)
    budget = gb1 + 2.5 * (gb2 - gb1)                   # between B = 3 and B = 4 on the fit
    best = memory_plan.largest_batch(gb1, gb2, budget)
    assert best == 3
    assert gb(best) <= budget < gb(best + 1)


def test_full_fine_tuning_moves_to_eight_devices_when_one_does_not_fit():
    spec = memory_plan.PlanSpec(target=None, dtype="float32")
    one = memory_plan.one_gpu_gb("llama-tiny", "full", memory.StepSpec(1, 32, dp=True), spec)
    eight = memory_plan.mesh_gb("llama-tiny", memory.StepSpec(1, 32, dp=True), (8, 1), spec)
    assert eight < one                                   # ZeRO-3: weights and Adam's moments are an eighth each
    budget = (one + eight) / 2                           # full DP does not fit one device, fits eight
    rows = memory_plan.plan_rows("llama-tiny", 32, dataclasses.replace(spec, budget_gb=budget), methods=("full",),
                                 log=lambda line: None)
    on_one = [r for r in rows if r.mesh == (1, 1) and r.dp]
    on_eight = [r for r in rows if r.mesh == (8, 1) and r.dp]
    assert on_one[0].max_batch == 0 and "8-GPU" in on_one[0].note
    assert on_eight and on_eight[0].max_batch >= 1
    assert "| llama-tiny | full | 32 | 8 x 1 |" in memory_plan.table(rows, budget)


def test_job_refuses_an_unknown_model():
    out = subprocess.run([sys.executable, "-m", "experiments.finetune_memory_plan", "--models=gpt5", "--target="],
                         capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: model must be one of ['gemma-2-9b', 'llama-3.1-8b', 'llama-tiny', 'qwen2.5-7b'], got 'gpt5'"]


@pytest.mark.parametrize("curve", [lambda B: 10 + 3 * B, lambda B: 10 + 4 * B - 0.02 * B * B,
                                   lambda B: 10 + 2 * B + 0.2 * B * B])
def test_verify_pins_the_largest_batch_on_curved_memory(curve):
    """With `verify`, the row's batch is the largest that fits and the next one is over, also where memory is not
    affine in B (the fit from B = 1, 2 alone is then off), within the 3 extra compiles."""
    spec = dataclasses.replace(SPEC, budget_gb=60.0, verify=True)
    compiled = []
    row = memory_plan._row("m", "lora", 64, True, lambda B: compiled.append(B) or curve(B), (1, 1), spec)
    truth = max(B for B in range(1, 100) if curve(B) <= 60.0)
    assert row.max_batch == truth, (row, compiled)
    assert len(compiled) <= 5


def test_depth_fit_extends_the_line_through_two_depths():
    """`depth_fit` compiles two shallow copies (Gemma's layer kinds cut with them) and extends their line."""
    seen = []

    def gb_of_config(config):
        seen.append((config.n_layer, len(getattr(config, "layer_types", ()) or ())))
        return 3.0 + 0.5 * config.n_layer
    config = memory_plan.model_config("gemma-2-9b", 64, SPEC)
    spec = dataclasses.replace(SPEC, depth_fit=(2, 4))
    assert memory_plan._at_depth(gb_of_config, config, spec) == pytest.approx(3.0 + 0.5 * 42)
    assert seen == [(2, 2), (4, 4)]
    assert memory_plan._at_depth(gb_of_config, config, SPEC) == pytest.approx(3.0 + 0.5 * 42)


def test_a_row_that_does_not_fit_says_what_would(monkeypatch):
    """A LoRA row over the budget at the spec's remat is retried with remat "full" and says what it gives; full
    fine-tuning over one GPU points to the 8-GPU rows."""
    def fake_gb(name, method, step, spec):
        return (100.0 if spec.remat == "none" else 10.0) + step.batch_size
    monkeypatch.setattr(memory_plan, "one_gpu_gb", fake_gb)
    monkeypatch.setattr(memory_plan, "mesh_gb", lambda name, step, mesh, spec: 5.0 + step.batch_size)
    rows = memory_plan.plan_rows("llama-tiny", 64, dataclasses.replace(SPEC, budget_gb=60.0), log=lambda line: None)
    lora = [r for r in rows if r.method == "lora"]
    assert all(r.max_batch == 0 and r.note == "does not fit one GPU; with remat='full': 11.00 GB at B=1, largest B 50"
               for r in lora), lora
    full_one = [r for r in rows if r.method == "full" and r.mesh == (1, 1)]
    assert all(r.note == "does not fit one GPU: see the 8-GPU rows" for r in full_one)
    assert [(r.mesh, r.max_batch) for r in rows if r.mesh != (1, 1)] == [((8, 1), 55), ((8, 1), 55)]


def test_full_fine_tuning_over_the_budget_by_its_state_alone_is_not_compiled(monkeypatch):
    """Full fine-tuning's float32 parameters, gradients and Adam moments (16 bytes a parameter) over the budget:
    the one-GPU row says so without compiling, and the 8-GPU search runs."""
    state = memory_plan.full_state_gb("llama-tiny", 64, SPEC)
    monkeypatch.setattr(memory_plan, "one_gpu_gb", lambda *a: pytest.fail("compiled"))
    monkeypatch.setattr(memory_plan, "mesh_gb", lambda name, step, mesh, spec: state / 8 * step.batch_size)
    spec = dataclasses.replace(SPEC, budget_gb=state / 2 * 1.001)
    rows = memory_plan.plan_rows("llama-tiny", 64, spec, methods=("full",), log=lambda line: None)
    assert [(r.mesh, r.max_batch) for r in rows] == [((1, 1), 0), ((1, 1), 0), ((8, 1), 4), ((8, 1), 4)]
    assert "alone are" in rows[0].note and rows[0].gb_at_1 == pytest.approx(state)
