"""Where a step's GPU time goes: a jax.profiler trace of a few steps, summed by kind of kernel.

    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        ...  # `steps` steps
    summarize(log_dir, steps)  # {"busy_ms": ..., "gemm_ms": ..., "kernels": ..., "top": [...]}

Only kernels on the device's streams count (threads named "Stream ..." of a process named for a GPU):
the trace's "XLA Ops" / "XLA Modules" lines repeat the same time as ops and would count it twice.
Busy time is the union of kernel intervals (overlapping streams count once); the kinds are read off
kernel names, so they are a guide: cuBLAS / CUTLASS / XLA's Triton GEMMs ("gemm"), cuDNN's fused
attention ("attention"), other Triton kernels, i.e. jaxdp's Pallas kernels ("pallas"), copies and
sets ("memcpy"), everything else XLA's own fusions ("fusion").
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os

KINDS = {  # kind -> name fragments (lower case), tried in this order
    "attention": ("cudnn", "flash", "fmha", "sdpa"),
    "gemm": ("gemm", "xmma", "nvjet", "cutlass", "cublas", "matmul"),
    "pallas": ("triton",),
    "memcpy": ("memcpy", "memset"),
}
ALL_KINDS = (*KINDS, "fusion")  # "fusion": whatever matches none of KINDS


def kind_of(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, parts in KINDS.items() if any(p in lower for p in parts)), "fusion")


def kernel_events(trace: dict) -> list[dict]:
    """The 'X' events on GPU stream threads of a Chrome / Perfetto trace."""
    events = trace["traceEvents"]
    meta = lambda what: {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
                         if e.get("ph") == "M" and e.get("name") == what}
    gpu_pids = {pid for (pid, _), name in meta("process_name").items() if "gpu" in name.lower()}
    streams = {key for key, name in meta("thread_name").items() if key[0] in gpu_pids and "stream" in name.lower()}
    return [e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarize_trace(trace: dict, steps: int, top: int = 8) -> dict:
    """Per step: busy ms, ms by kind, kernel launches, and the `top` kernels by time."""
    kernels = kernel_events(trace)
    by_kind, by_name = collections.Counter(), collections.Counter()
    for e in kernels:
        by_kind[kind_of(e["name"])] += e["dur"]
        by_name[e["name"]] += e["dur"]
    per_step_ms = lambda us: round(us / 1e3 / steps, 3)
    return dict(busy_ms=per_step_ms(_union_us([(e["ts"], e["ts"] + e["dur"]) for e in kernels])),
                **{f"{kind}_ms": per_step_ms(by_kind[kind]) for kind in ALL_KINDS},
                kernels=round(len(kernels) / steps, 1),
                top=[(name[:80], per_step_ms(us)) for name, us in by_name.most_common(top)])


def summarize(log_dir: str, steps: int) -> dict:
    """`summarize_trace` of the newest perfetto trace under `log_dir` (jax.profiler.trace's layout)."""
    paths = sorted(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "perfetto_trace.json.gz")))
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}")
    with gzip.open(paths[-1], "rt") as f:
        return summarize_trace(json.load(f), steps)
