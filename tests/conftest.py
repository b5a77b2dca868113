import atexit
import os
import shutil
import tempfile

# Must precede `import jax`. Eight fake CPU devices for the sharding tests; XLA:CPU's LLVM
# without its expensive passes: the suite's tiny programs compile ~25% faster, same results.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                      "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
# Tests rebuild the same tiny models and steps, and CLI tests run them in subprocesses (which
# inherit this environment): one persistent compilation cache for the session compiles each once.
_CACHE = tempfile.mkdtemp(prefix="jaxdp_test_jax_cache_")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import gc  # noqa: E402

import pytest  # noqa: E402

# Tracing allocates millions of container objects that live as long as their program: at Python's
# default thresholds (700, 10, 10) the cyclic collector re-walks the growing heap thousands of times per
# test module. Collecting 10x less often in each generation walks it far fewer times, at the same peak memory;
# the full collection after each module (below) stays.
gc.set_threshold(10_000, 10, 10)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """XLA:CPU maps every compiled program's code into this process (~3 memory maps each). The suite
    compiles ~20,000 programs: kept alive by JAX's caches they reach Linux's vm.max_map_count (65,530)
    in test_two_pass and the next compile or cache write segfaults (CI, 2026-11-24). Dropping JAX's
    caches after each test module frees them; within a module tests still share their compiles."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tiny real-text corpus file (`job_testing.write_tiny_corpus`), one per test module. The job helpers
    are imported here, not above: only a module that asks for a corpus loads them."""
    from job_testing import write_tiny_corpus
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"))
