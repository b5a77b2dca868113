"""jaxdp.analysis.profile: a step's GPU time from a trace, each kernel counted once."""

import gzip
import json
import os

from jaxdp.analysis import profile as _profile


def _trace():
    meta = lambda pid, tid, what, name: dict(ph="M", pid=pid, tid=tid, name=what, args=dict(name=name))
    kernel = lambda tid, name, ts, dur, pid=1: dict(ph="X", pid=pid, tid=tid, name=name, ts=ts, dur=dur)
    return {"traceEvents": [
        meta(1, None, "process_name", "/device:GPU:0"), meta(2, None, "process_name", "/host:CPU"),
        meta(1, 10, "thread_name", "Stream #20(Compute)"), meta(1, 11, "thread_name", "Stream #21(Compute)"),
        meta(1, 12, "thread_name", "XLA Ops"), meta(2, 13, "thread_name", "python3"),
        kernel(10, "sm90_xmma_gemm_bf16bf16_bf16f32", 0, 100),      # GEMM
        kernel(11, "loop_add_fusion_3", 50, 100),                    # overlaps the GEMM on another stream
        kernel(10, "triton_linear_grad_tiles", 200, 50),             # a Pallas (Triton) kernel
        kernel(10, "cudnn_generated_fort_native_sdpa", 300, 40),     # attention
        kernel(12, "dot.1", 0, 100),                                 # the same time again as an op: not a kernel
        kernel(13, "PjitFunction(step)", 0, 400, pid=2),             # host
    ]}


def test_kernels_by_kind_and_busy_time_count_each_kernel_once():
    summary = _profile.summarize_trace(_trace(), steps=2)
    assert summary["kernels"] == 2.0  # 4 kernels over 2 steps; the XLA Ops and host lines are not kernels
    assert summary["busy_ms"] == (150 + 50 + 40) / 1e3 / 2  # the overlapping two streams count once
    assert (summary["gemm_ms"], summary["fusion_ms"], summary["pallas_ms"], summary["attention_ms"]) == (
        0.05, 0.05, 0.025, 0.02)
    assert summary["top"][0] == ("sm90_xmma_gemm_bf16bf16_bf16f32", 0.05)


def test_summarize_reads_the_newest_trace_of_a_profiler_folder(tmp_path):
    for run, dur in (("2026_01_01_00_00_00", 10), ("2026_01_01_00_00_09", 100)):
        os.makedirs(tmp_path / "plugins" / "profile" / run)
        trace = _trace()
        trace["traceEvents"][6]["dur"] = dur
        with gzip.open(tmp_path / "plugins" / "profile" / run / "perfetto_trace.json.gz", "wt") as f:
            json.dump(trace, f)
    assert _profile.summarize(str(tmp_path), steps=1)["gemm_ms"] == 0.1
