"""The jobs' persistent compilation cache (`jaxdp.training.compilation_cache`).

Properties: a second process compiling the tiny job's step is served by the cache, says so on its progress
line and spends less time in its compile phase; the cache changes no output (metrics.jsonl and privacy.json
equal a run with the cache off); no program depends on the run's secret root (a run with another root
writes no new entry); the hit / miss the line states is JAX's own event, exactly.
"""

import contextlib
import json
import re

import jax
import jax.numpy as jnp
import pytest
from job_testing import cli_args, run_cli, tiny_cli_overrides, tiny_config

from jaxdp import training
from jaxdp.noise import draws, seeds
from jaxdp.training import compilation_cache

# Two steps, no samples: the step, the evaluation and the checkpoints, at the least cost.
SHORT = {"steps": 2, "checkpoint_every": 2, "log_every": 1, "eval_every": 2, "sample.num": 0}


def compile_line(stderr: str) -> tuple[str, float]:
    """The loop's final "compiling and running the first ... step" line and its seconds."""
    (line,) = [part for part in re.split(r"[\r\n]", stderr)
               if "compiling and running the first" in part and ": done in" in part]
    return line, float(re.search(r": done in ([0-9.]+) s", line).group(1))


def entries(directory) -> set[str]:
    return {p.name for p in directory.glob("*-cache")}


def test_a_second_process_loads_the_step_from_the_cache_and_nothing_changes(corpus, tmp_path):
    """Run A (a secret root) fills an empty cache; run B (another root, pinned) compiles the same programs:
    every one a hit, no new entry (so no program holds a root-dependent constant: noise key, seeds, init,
    sampled batch), its line says "compilation cache hit" and its compile phase is shorter than A's; run C
    (B's seed, cache off) writes the same metrics.jsonl and privacy.json as B, bit for bit.

    The margin asserted is B's phase < A's. Measured on this 2-core machine (loaded, 2026-11-28): A 3.4-9.5 s
    (XLA compiled the step in 2.7-8.0 s), B 1.3-1.5 s (the step loaded in 0.3-0.4 s; tracing and the step's run
    are the rest): 2.6x at the least, so only a machine slowed 2.6-fold between two runs a few seconds apart
    would fail it. The hit itself is JAX's event (test_the_line_states_jax_s_own_cache_events), not a time."""
    cache = tmp_path / "xla"

    def run(name, cache_dir, **extra):
        overrides = tiny_cli_overrides(corpus, tmp_path / name, compilation_cache_dir=cache_dir, **SHORT, **extra)
        if overrides.get("seed") is None:
            overrides.pop("seed")  # unset on the command line: a secret root
        out = run_cli(cli_args(overrides))
        assert out.returncode == 0, out.stderr[-2000:]
        return out

    a = run("a", str(cache), seed=None)
    assert f"compilation cache: {cache} (compiled programs, no data; safe to delete" in a.stderr
    line_a, seconds_a = compile_line(a.stderr)
    assert "compilation cache miss" in line_a and "saved" in line_a, line_a
    written = entries(cache)
    assert any(name.startswith("jit_dp_step-") for name in written), sorted(written)
    assert cache.stat().st_mode & 0o077 == 0  # trusted like code: the owner's alone

    b = run("b", str(cache))
    line_b, seconds_b = compile_line(b.stderr)
    assert "compilation cache hit" in line_b, line_b
    assert entries(cache) == written  # every program of B was one of A's: none depends on the root
    assert seconds_b < seconds_a, (line_a, line_b)

    c = run("c", "")
    line_c, _ = compile_line(c.stderr)
    assert "compilation cache: off" in c.stderr and "compilation cache off" in line_c, line_c
    assert entries(cache) == written
    for name in ("metrics.jsonl", "privacy.json"):
        assert (tmp_path / "b" / name).read_bytes() == (tmp_path / "c" / name).read_bytes(), name
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["steps"] == 2
    assert "compilation_cache" not in (tmp_path / "b" / "config.json").read_text()  # this machine's, not the run's
    # Where the programs are kept is not the run: resuming B with the cache off is not "a different config".
    training.prepare(tiny_config(corpus, tmp_path / "b", compilation_cache_dir="", **{
        k.replace(".", "__"): v for k, v in SHORT.items()}))


@contextlib.contextmanager
def cache_in(directory):
    """`compilation_cache.enable` in `directory` for this process, then the session's settings back."""
    names = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
             "jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes")
    before = {name: getattr(jax.config, name) for name in names}
    try:
        yield compilation_cache.enable({"compilation_cache_dir": str(directory)})
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache._reset()


def test_the_line_states_jax_s_own_cache_events(tmp_path):
    """A program compiled into an empty cache is "written" and the line says miss; the same program
    compiled again by a process that has forgotten it (`jax.clear_caches`) is a "hit"; with the cache off,
    "uncached"."""
    def scaled(x):
        return jnp.tanh(x) * 3.0

    x = jnp.arange(7.0)
    with cache_in(tmp_path / "xla"):
        with compilation_cache.Compiles() as first:
            jax.jit(scaled)(x).block_until_ready()
        jax.clear_caches()
        with compilation_cache.Compiles() as second:
            jax.jit(scaled)(x).block_until_ready()
    assert [(n, o) for n, o, _ in first.programs] == [("jit(scaled)", "written")]
    assert [(n, o) for n, o, _ in second.programs] == [("jit(scaled)", "hit")]
    assert first.describe().startswith(", compilation cache miss (compiled in")
    assert second.describe().startswith(", compilation cache hit (loaded in")
    jax.clear_caches()
    with cache_in(tmp_path / "off"):
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache._reset()
        with compilation_cache.Compiles() as off:
            jax.jit(scaled)(x).block_until_ready()
    assert [(n, o) for n, o, _ in off.programs] == [("jit(scaled)", "uncached")]
    assert off.describe().startswith(", compilation cache off")
    assert compilation_cache.Compiles().describe() == ""


def test_a_secret_baked_into_a_program_would_write_a_new_entry(tmp_path):
    """The root check above relies on this: a program that closes over a key (a constant: XLA may even fold
    it into the noise itself) is another program for each key, one entry each, where a key passed as an
    argument, as the job's optimizer state passes it, gives one entry for every key."""
    def baked_in(key):
        def baked(x):
            return x + jax.random.normal(key, x.shape)
        return baked

    def as_argument(x, key):
        return x + jax.random.normal(key, x.shape)

    x = jnp.zeros(5)
    with cache_in(tmp_path / "xla"):
        for root in (1, 2):
            key = draws.noise_key_from_seed(seeds.derive_seed(root, seeds.NOISE))
            jax.jit(baked_in(key))(x).block_until_ready()
            jax.jit(as_argument)(x, key).block_until_ready()
            jax.clear_caches()  # as a new process: the next compile asks the persistent cache
    names = entries(tmp_path / "xla")
    assert sum(n.startswith("jit_baked-") for n in names) == 2
    assert sum(n.startswith("jit_as_argument-") for n in names) == 1


@pytest.mark.parametrize("value,needle", [(3, "must be a directory's path"), ("FILE", "is not a directory")])
def test_a_bad_cache_dir_is_one_config_error(tmp_path, value, needle):
    (tmp_path / "file").write_text("")
    value = str(tmp_path / "file") if value == "FILE" else value
    with pytest.raises(training.ConfigError, match=needle):
        compilation_cache.enable({"compilation_cache_dir": value})


def test_default_directory_is_under_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation_cache.default_directory() == tmp_path / "jaxdp" / "xla"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert str(compilation_cache.default_directory()).endswith("/.cache/jaxdp/xla")
