"""jaxdp/sharding/longest_context.py: the longest-fit search, and its sweep on 8 fake CPU devices.

- `longest_fitting` returns a length that fits, and no length two resolution
  steps beyond it fits, for any non-decreasing bytes curve and any start.
- On tiny GPT-2 (per-device bytes of the compiled `ShardedDPStep`, DP with
  remat and non-DP without, seq degree 1 and 4): one table row per (mesh,
  remat); context parallelism makes a longer sequence fit per device; and
  DP with remat fits at least the context of non-DP without remat on a
  coarse grid (256 or 512 tokens per device). Finer grids show XLA:CPU's
  estimate of DP a few percent short, since it gives remat no credit (see
  experiments/long_context.py's docstring). The full sweep is
  `python -m experiments.long_context --smoke` (about 15 CPU minutes).
"""

import random

import pytest

from jaxdp.analysis import hlo_cost
from jaxdp.sharding import longest_context


@pytest.mark.parametrize("seed", range(4))
def test_longest_fitting_is_the_longest_fit_to_resolution(seed):
    rng = random.Random(seed)
    for _ in range(200):
        granularity = rng.choice([1, 8, 64])
        lo = granularity * rng.randint(1, 8)
        hi = lo * rng.randint(1, 64)
        c0, c1, c2 = rng.random(), rng.random(), rng.random()

        def bytes_at(T, c0=c0, c1=c1, c2=c2):  # a non-decreasing quadratic
            return c0 + c1 * T + c2 * T * T

        budget = rng.uniform(0.5, 1.2) * bytes_at(hi)
        start = rng.choice([None, lo * rng.randint(1, 32)])
        tried = []

        def recorded(T, tried=tried, bytes_at=bytes_at):
            tried.append(T)
            return bytes_at(T)

        T, nbytes = longest_context.longest_fitting(recorded, lo, hi, granularity, budget, start)
        assert all(lo <= t <= hi for t in tried)
        fitting = [t for t in range(lo, hi + 1) if bytes_at(t) <= budget]
        if not fitting:
            assert T is None and nbytes is None
            continue
        assert nbytes == bytes_at(T) <= budget
        assert max(fitting) - T < 2 * granularity  # bisection stops within a step (or two, unaligned)


def test_context_grows_with_seq_degree_and_dp_with_remat_reaches_non_dp():
    # LongShield's comparison, DP with remat vs non-DP without, on 1 and 4 sequence shards: two
    # lengths per device (256, 512 tokens) and a budget between the per-device bytes of T = 256 on
    # one device (<= 10 MiB) and of T = 512 on one device (> 16 MiB); six compiles in all.
    cfg = dict(longest_context.SMOKE_CONFIG, time=False, min_seq_len=256, max_seq_len=512, granularity=1024,
               budget_bytes=12 * 2**20)
    variants = ((False, "none"), (True, "full"))
    rows = [longest_context.measure("gpt2-tiny", dp, remat, 1, seq, cfg) for seq in (1, 4) for dp, remat in variants]

    lines = longest_context.table(rows).splitlines()
    assert [line.split(" | ")[1:3] for line in lines[2:]] == [
        ["1 x 1", "full"], ["1 x 1", "none"], ["1 x 4", "full"], ["1 x 4", "none"]]
    assert all(r["step_bytes"] <= cfg["budget_bytes"] for r in rows if r["max_seq_len"])

    max_T = {(r["seq"], r["dp"]): r["max_seq_len"] or 0 for r in rows}
    for seq in (1, 4):
        assert max_T[seq, True] >= max_T[seq, False] > 0
    for dp in (False, True):
        assert max_T[4, dp] > max_T[1, dp]


def test_gpu_target_without_the_cuda_plugin_says_what_to_install():
    """`--target=h100` (XLA:GPU deviceless compile) needs JAX's CUDA plugin, which CI does not install."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
        pytest.skip("the CUDA plugin is installed here")
    except ImportError:
        pass
    with pytest.raises(RuntimeError, match="pip install jax-cuda12-plugin"):
        hlo_cost.target_devices("h100", 1)
