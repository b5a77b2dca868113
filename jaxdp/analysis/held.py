"""Many benchmark processes in a short GPU lease: all compile first, N at a time, then each is timed alone.

Serially, each GPT-2 step process spends about a minute compiling (autotuning included), so some twenty
configurations do not fit one 10-minute device call. Here each child compiles, prints COMPILED and waits;
once every compile has ended (and an optional wait file exists, e.g. GPU tests run beside the compiles),
the children are released one at a time, in order, so no compile or autotuning runs beside a timed step.
Compile times are then contended (the caller records N).
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import tempfile
import time


def row_of(cfg: dict, returncode: int, stdout: str, stderr: str) -> dict:
    """A finished child's row: its last stdout line, or why it failed (OOM or the last line of stderr)."""
    if returncode == 0:
        return json.loads(stdout.strip().splitlines()[-1])
    oom = any(s in stderr for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory"))
    return dict(cfg, status="OOM" if oom else "error", error=stderr.strip().splitlines()[-1:] or [""])


def held_rows(cfgs: list[dict], command, jobs: int, timeout: float, wait_for: str | None = None):
    """Yields each configuration's row, in order: all compile first (`jobs` processes at a time), then each
    is timed alone. `command(cfg)` gives (argv, env) of a child that prints COMPILED once compiled, waits
    for a line on stdin, then prints its row as JSON on its last line."""
    procs, logs, compiled, timed_out = {}, {}, set(), set()
    waiting = list(range(len(cfgs)))
    with selectors.DefaultSelector() as sel:
        while waiting or sel.get_map():
            while waiting and len(sel.get_map()) < jobs:
                i = waiting.pop(0)
                cmd, env = command(cfgs[i])
                logs[i] = tempfile.TemporaryFile("w+")
                procs[i] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs[i],
                                            text=True, env=env)
                sel.register(procs[i].stdout, selectors.EVENT_READ, (i, time.monotonic()))
            for key, _ in sel.select(timeout=1.0) or []:
                line = key.fileobj.readline()
                if line.strip() == "COMPILED" or not line:  # compiled, or exited (its row will say why)
                    sel.unregister(key.fileobj)
                    if line:
                        compiled.add(key.data[0])
            for key in list(sel.get_map().values()):  # compiles past the per-configuration timeout
                i, started = key.data
                if time.monotonic() - started > timeout:
                    sel.unregister(key.fileobj)
                    procs[i].kill()
                    timed_out.add(i)
    waited = time.monotonic()
    while wait_for and not os.path.exists(wait_for) and time.monotonic() - waited < timeout:
        time.sleep(1.0)
    for i, cfg in enumerate(cfgs):
        proc = procs[i]
        try:
            if i in compiled:
                proc.stdin.write("go\n")
                proc.stdin.flush()
            stdout, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            timed_out.add(i)
        if i in timed_out:
            yield dict(cfg, status="timeout")
            continue
        logs[i].seek(0)
        yield dict(row_of(cfg, proc.returncode, stdout, logs[i].read()), jobs=jobs)
        logs[i].close()
