"""JAX's persistent compilation cache for the jobs, and whether it served a compile.

The jobs call `enable(config)` before their first compile: JAX then writes each compiled program
(an XLA executable, keyed by the program's text, its compile options, the devices and the jax / jaxlib
versions) under `config.compilation_cache_dir` and reads it back when a later process compiles the same
program, so a resume or a rerun with the same shapes does not recompile. `None` (the default): JAX's own
setting when one is given (`JAX_COMPILATION_CACHE_DIR`), else `$XDG_CACHE_HOME/jaxdp/xla` or
`~/.cache/jaxdp/xla`; `""`: off.

What the cache holds: compiled programs, no data. Every array of the job (the tokens, the parameters,
the optimizer state with the noise PRNG key) is an argument of its programs, never a constant baked into
one, and the seeds and the sampling are host-side NumPy that never reach a program: a run with another
secret root compiles exactly the same programs, so it writes no new entry (tests/test_compilation_cache.py;
a key closed over by a program would be one entry per key, and XLA may fold it into the noise itself).
Deleting the directory is always safe (the next compile writes it again). It is trusted like code: whoever
can write to it can make a job run what they wrote there (JAX's warning), so it is created for its owner
alone (0700).

`CompileTicker` is the loop's "compiling the first step" line; it ends by saying whether the cache
served the step's compile.
"""

from __future__ import annotations

import os
import pathlib
import threading

import jax

from jaxdp.training.config import check_compilation_cache_dir
from jaxdp.training.run_dir import Ticker, log

# Every program the job compiles is written, however fast its compile (JAX's default writes only those of
# 1 s and more): a resume loads its evaluation, sampling and init programs too, and a step that compiles
# fast (a small model, a fast machine) is still cached. -1: no minimum entry size (0 lets JAX pick one).
MIN_COMPILE_TIME_S = 0.0
MIN_ENTRY_SIZE_BYTES = -1

_HIT = "/jax/compilation_cache/cache_hits"  # a program loaded from the cache
_WRITTEN = "/jax/compilation_cache/cache_misses"  # a compiled program written to the cache
_CONSULTED = "/jax/compilation_cache/compile_requests_use_cache"  # the cache was looked up
_COMPILED = "/jax/core/compile/backend_compile_duration"  # ends every XLA compile or cache load, with its time


def default_directory() -> pathlib.Path:
    """`$XDG_CACHE_HOME/jaxdp/xla`, else `~/.cache/jaxdp/xla`."""
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "jaxdp" / "xla"


def enable(config) -> pathlib.Path | None:
    """Turns JAX's persistent compilation cache on in `config.compilation_cache_dir` (module docstring), or
    off for `""`; returns the directory, None when off. Silent: `announce` says where it is, after the
    config has passed its checks (a bad input stays one error line). Call it before the process's first
    compile (a later call still applies to the compiles after it). ConfigError for a value that is not a
    path."""
    value = config.get("compilation_cache_dir")
    check_compilation_cache_dir(value)
    if value == "":
        jax.config.update("jax_enable_compilation_cache", False)
        _reset()
        return None
    directory = pathlib.Path(value or jax.config.jax_compilation_cache_dir or default_directory()).expanduser()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", MIN_ENTRY_SIZE_BYTES)
    _reset()
    return directory


def announce(directory: pathlib.Path | None, verbose: bool = True) -> None:
    """Prints where the cache is (or that it is off) once, and warns when other users can write to it."""
    if directory is None:
        log("compilation cache: off (config.compilation_cache_dir is empty): every process compiles its programs",
            verbose)
        return
    log(f"compilation cache: {directory} (compiled programs, no data; safe to delete; "
        "--config.compilation_cache_dir='' turns it off)", verbose)
    if directory.stat().st_mode & 0o022:
        log(f"warning: the compilation cache {directory} is writable by other users: they can make this job run "
            "code they wrote there", verbose)


def _reset() -> None:
    """JAX opens its cache once, at the process's first compile: a setting changed after that applies from
    the next compile on."""
    from jax.experimental.compilation_cache import compilation_cache
    compilation_cache.reset_cache()


class Compiles:
    """The XLA compiles of this process while it is entered, each with its outcome: "hit" (loaded from the
    persistent cache), "written" (compiled and written to it), "missed" (looked up, compiled, not written:
    below the cache's thresholds) or "uncached" (the cache is off), and its seconds. JAX's monitoring
    events say it exactly: a compile's cache events come on its thread before the event ending it."""

    def __init__(self):
        self.programs: list[tuple[str, str, float]] = []  # (name, outcome, seconds)
        self._pending: dict[int, set[str]] = {}  # thread -> cache events of the compile running on it
        self._lock = threading.Lock()

    def _on_event(self, event: str, **kwargs) -> None:
        if event in (_HIT, _WRITTEN, _CONSULTED):
            with self._lock:
                self._pending.setdefault(threading.get_ident(), set()).add(event)

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event != _COMPILED:
            return
        with self._lock:
            seen = self._pending.pop(threading.get_ident(), set())
            outcome = ("hit" if _HIT in seen else "written" if _WRITTEN in seen else
                       "missed" if _CONSULTED in seen else "uncached")
            self.programs.append((str(kwargs.get("fun_name", "?")), outcome, float(duration)))

    def __enter__(self) -> "Compiles":
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_listener(self._on_event)
        jax.monitoring.unregister_event_duration_listener(self._on_duration)

    def describe(self) -> str:
        """', compilation cache hit (loaded in 0.1 s)' when the cache served every program it could hold,
        ', compilation cache miss (compiled in 3.2 s, saved)', ', 2 of 3 programs from the compilation
        cache (...)', ', compilation cache off'; '' when nothing compiled."""
        counted = [p for p in self.programs if p[1] in ("hit", "written")] or self.programs
        if not counted:
            return ""
        outcomes = {o for _, o, _ in counted}
        seconds = sum(s for _, _, s in counted)
        hits = sum(o == "hit" for _, o, _ in counted)
        if outcomes == {"hit"}:
            return f", compilation cache hit (loaded in {seconds:.1f} s)"
        if outcomes == {"written"}:
            return f", compilation cache miss (compiled in {seconds:.1f} s, saved)"
        if outcomes == {"uncached"}:
            return f", compilation cache off (compiled in {seconds:.1f} s)"
        if hits:
            return f", {hits} of {len(counted)} programs from the compilation cache ({seconds:.1f} s)"
        return f", compilation cache miss (compiled in {seconds:.1f} s, not saved)"


class CompileTicker(Ticker):
    """`run_dir.Ticker` whose final line says how the compiles under it went (`Compiles.describe`)."""

    def __enter__(self) -> "CompileTicker":
        self._compiles = Compiles().__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        self._compiles.__exit__(*exc)
        self.status += self._compiles.describe()
        super().__exit__(*exc)
