"""jaxdp.analysis.held (bench_throughput --jobs): every configuration compiles first (at most `jobs` at
once), then each is timed alone, in order, after the --wait_for file exists; a crash or a hang is its own row."""

import json
import sys
import threading
import time

from jaxdp.analysis import held as _held

# A stand-in for one configuration's child: logs when it compiles and when it is timed.
FAKE_CHILD = r"""
import json, sys, time
cfg, log = json.loads(sys.argv[1]), sys.argv[2]
def note(what):
    with open(log, "a") as f:
        f.write(json.dumps([what, cfg["method"], time.monotonic()]) + "\n")
if cfg["method"] == "crash":
    sys.exit("RESOURCE_EXHAUSTED: out of memory while compiling")
note("compile_start")
print("a library's chatter on stdout", flush=True)
time.sleep(60 if cfg["method"] == "hang" else 0.3)
note("compile_end")
print("COMPILED", flush=True)
sys.stdin.readline()
note("time_start")
time.sleep(0.1)
note("time_end")
print(json.dumps(dict(cfg, status="ok")))
"""


def test_held_rows_compile_first_then_time_each_alone(tmp_path):
    log, ready = str(tmp_path / "log"), str(tmp_path / "checks.done")
    command = lambda cfg: ([sys.executable, "-c", FAKE_CHILD, json.dumps(cfg), log], None)
    methods = ["a", "b", "crash", "c", "hang", "d", "e"]
    # The GPU checks beside the compiles end after them (the hang is killed at 2.5 s).
    threading.Timer(4.0, lambda: open(ready, "w").close()).start()
    t0 = time.monotonic()
    rows = list(_held.held_rows([dict(method=m) for m in methods], command, jobs=2, timeout=2.5, wait_for=ready))

    assert [r["method"] for r in rows] == methods
    assert [r["status"] for r in rows] == ["ok", "ok", "OOM", "ok", "timeout", "ok", "ok"]
    events = [json.loads(line) for line in open(log)]
    at = lambda what: [(m, t) for w, m, t in events if w == what]
    # Timing starts after every compile has ended and after the wait file appeared.
    last_compile = max(t for _, t in at("compile_end"))
    assert last_compile < t0 + 4.0 < min(t for _, t in at("time_start"))
    # Timed one at a time, in order.
    spans = list(zip(at("time_start"), at("time_end")))
    assert [m for (m, _), _ in spans] == ["a", "b", "c", "d", "e"]
    assert all(end <= next_start for (_, (_, end)), ((_, next_start), _) in zip(spans, spans[1:]))
    # Never more than `jobs` compiling at once.
    changes = sorted([(t, 1) for _, t in at("compile_start")] + [(t, -1) for _, t in at("compile_end")])
    running = [sum(d for _, d in changes[:k + 1]) for k in range(len(changes))]
    assert max(running) <= 2
