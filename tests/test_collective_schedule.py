"""jaxdp.analysis.collectives reads a scheduled HLO module: async pairs, operands, compute in between
(experiments/collective_schedule.py prints it)."""

from jaxdp.analysis import collectives

HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  ROOT %r = f32[] add(%a, %b)
}

ENTRY %main (p0: f32[8]) -> f32[2] {
  %p0 = f32[8]{0} parameter(0)
  %rs-start = ((f32[8]{0}, f32[8]{0}), (f32[2]{0}, f32[2]{0})) reduce-scatter-start(%p0, %p0), to_apply=%add
  %fusion.1 = f32[8]{0} fusion(%p0), kind=kLoop
  %cc = f32[8]{0} custom-call(%fusion.1), custom_call_target="__cublas$gemm"
  %rs-done = (f32[2]{0}, f32[2]{0}) reduce-scatter-done(%rs-start)
  %ar-start = f32[2]{0} all-reduce-start(%cc), to_apply=%add
  %ar-done = f32[2]{0} all-reduce-done(%ar-start)
  ROOT %ag = f32[8]{0} all-gather(%ar-done), dimensions={0}
}
"""


def test_pairs_operands_and_compute_between():
    pairs = collectives.collective_pairs(HLO)  # the ENTRY computation's 8 instructions, not %add's
    assert [(p["kind"], p["operands"], p["between"]) for p in pairs] == [
        ("reduce-scatter", 2, 2), ("all-reduce", 1, 0), ("all-gather", 1, None)]
    assert pairs[0]["at"] == 1 / 8
    lines = collectives.schedule_table({"prog": pairs}).splitlines()
    assert lines[2].startswith("| prog | all-gather | 1 | 0 | 1 | n/a | 0 |")
    assert "| prog | reduce-scatter | 1 | 1 | 2 | 2 / 2 / 2 | 0 | 0.12-0.12 |" in lines
