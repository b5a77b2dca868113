"""Every jaxdp.pallas kernel equals its plain-jnp reference (interpret mode on CPU) and lowers for CUDA."""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp import pallas as jp
from jaxdp.clipping.rules import SENSITIVITY_FACTOR
from jaxdp.pallas import _common
from jaxdp.pallas.single_pass import SinglePassConfig

RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
# (B, T, P, D): one tile-aligned case and one with every size odd (masking inside the kernels).
SHAPES = {"aligned": (2, 32, 32, 16), "odd": (3, 19, 37, 21)}


def clip_factors(sq_B):
    """Abadi factors at a threshold between the norms; zero for non-finite norms."""
    return jnp.where(jnp.isfinite(sq_B), jnp.minimum(1.0, 7.0 / jnp.sqrt(sq_B)), 0.0)


def inputs(shape, dtype, seed):
    B, T, P, D = shape
    kx, kg, kc = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (B, T, P), jnp.float32).astype(dtype)
    g = jax.random.normal(kg, (B, T, D), jnp.float32).astype(dtype)
    c = jax.random.uniform(kc, (B,), jnp.float32, 0.1, 1.3)
    return x, g, c


# name: (op, reference, args from (x, g, c), small-block kwargs so the odd case spans several tiles)
KERNELS = {
    "sq_norms": (jp.linear_sq_norms, jp.linear_sq_norms_reference, lambda x, g, c: (x, g),
                 dict(block_t=16, block_p=16, block_d=16)),
    "ghost_sq_norms": (jp.linear_ghost_sq_norms, jp.linear_ghost_sq_norms_reference, lambda x, g, c: (x, g),
                       dict(block_t=16, block_f=16)),
    "clipped_sum": (jp.linear_clipped_sum, jp.linear_clipped_sum_reference, lambda x, g, c: (x, g, c),
                    dict(block_k=16, block_p=16, block_d=16)),
    "fused_clipped_sum": (
        functools.partial(jp.linear_fused_clipped_sum, clip_factors_fn=clip_factors, chunk_size=2),
        functools.partial(jp.linear_fused_clipped_sum_reference, clip_factors_fn=clip_factors),
        lambda x, g, c: (x, g), dict(config=SinglePassConfig(block_t=16, block_p=16, block_d=16))),
}
# The keywords that make each op lower for Triton, not run in the interpreter.
COMPILED = {name: dict(interpret=False) for name in KERNELS} | {
    "fused_clipped_sum": dict(config=SinglePassConfig(interpret=False))}


def rel_err(actual, expected):
    actual, expected = jax.tree.leaves(actual), jax.tree.leaves(expected)
    return max(float(jnp.max(jnp.abs(a - e)) / jnp.max(jnp.abs(e))) for a, e in zip(actual, expected))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernel_equals_reference(kernel, dtype, shape):
    op, reference, args_of, blocks = KERNELS[kernel]
    args = args_of(*inputs(SHAPES[shape], dtype, seed=zlib.crc32(f"{kernel}{shape}".encode()) % 1000))
    out = jax.jit(functools.partial(op, **blocks))(*args)
    expected = reference(*args)
    for o, e in zip(jax.tree.leaves(out), jax.tree.leaves(expected)):
        assert o.dtype == jnp.float32 and o.shape == e.shape
    assert rel_err(out, expected) <= RTOL[dtype]


def test_default_blocks_and_bf16_scratch():
    """Default (GPU) tile sizes on a multi-tile shape, and the half-size scratch of the single pass."""
    x, g, c = inputs((2, 70, 80, 66), jnp.float32, seed=9)
    assert rel_err(jp.linear_sq_norms(x, g), jp.linear_sq_norms_reference(x, g)) <= 1e-5
    assert rel_err(jp.linear_clipped_sum(x, g, c), jp.linear_clipped_sum_reference(x, g, c)) <= 1e-5
    out = jp.linear_fused_clipped_sum(x, g, clip_factors, config=SinglePassConfig(scratch_dtype=jnp.bfloat16))
    assert rel_err(out, jp.linear_fused_clipped_sum_reference(x, g, clip_factors)) <= 1e-2


def test_bf16_scratch_clips_what_it_sums():
    """A bfloat16 scratch rounds the G_b tiles the sum reads; the norm must be of those rounded tiles.
    Entries 1 + 0.6 * 2**-7 all round up (by 0.31%): clipping by the unrounded norm released 1.0031 C."""
    x = jnp.ones((1, 1, 40), jnp.float32)
    g = jnp.full((1, 1, 24), 1 + 0.6 * 2.0 ** -7, jnp.float32)
    C = 1.0
    out, _ = jp.linear_fused_clipped_sum(x, g, lambda sq: jnp.minimum(1.0, C / jnp.sqrt(sq)),
                                         config=SinglePassConfig(block_p=16, block_d=16,
                                                                 scratch_dtype=jnp.bfloat16))
    # within the float32 rounding the noise allows for (a sum of 960 equal squares: ~3e-6 here), not 3e-3
    assert float(np.linalg.norm(np.asarray(out, np.float64))) <= C * SENSITIVITY_FACTOR


def test_zero_scale_examples_contribute_exact_zeros():
    """c_b = 0 (a dropped example) gives exact zeros even when its x_b, g_b hold NaN / inf."""
    x, g, c = inputs(SHAPES["odd"], jnp.float32, seed=6)
    x, g, c = x.at[1, 3, 4].set(jnp.nan), g.at[1, 0, 0].set(jnp.inf), c.at[1].set(0.0)
    expected = jp.linear_clipped_sum_reference(x, g, c)
    assert bool(jnp.all(jnp.isfinite(expected)))
    assert rel_err(jp.linear_clipped_sum(x, g, c, block_k=16), expected) <= 1e-5
    total, sq = jp.linear_fused_clipped_sum(x, g, clip_factors, chunk_size=3)
    assert bool(jnp.all(jnp.isfinite(total))) and not bool(jnp.isfinite(sq[1]))
    ref_total, _ = jp.linear_fused_clipped_sum_reference(x, g, clip_factors)
    assert rel_err(total, ref_total) <= 1e-5


def test_extra_sq_norms_enter_the_clip_factor():
    x, g, _ = inputs(SHAPES["odd"], jnp.float32, seed=7)
    extra = jnp.array([0.0, 1e4, 5.0])
    out = jp.linear_fused_clipped_sum(x, g, clip_factors, extra_sq_norms_B=extra)
    expected = jp.linear_fused_clipped_sum_reference(x, g, clip_factors, extra_sq_norms_B=extra)
    assert rel_err(out, expected) <= 1e-5
    assert rel_err(out[0], jp.linear_fused_clipped_sum_reference(x, g, clip_factors)[0]) > 1e-3


@pytest.mark.parametrize("kernel", ["sq_norms", "clipped_sum"])
def test_planted_error_is_caught(kernel, monkeypatch):
    """A tile load that drops its last row (a masking bug) must fail the reference comparison."""
    original = _common.load_tile

    def drops_last_row(ref, row0, rows, col0, cols):
        tile = original(ref, row0, rows, col0, cols)
        return jnp.where((jnp.arange(rows) < rows - 1)[:, None], tile, 0).astype(tile.dtype)

    monkeypatch.setattr(_common, "load_tile", drops_last_row)
    op, reference, args_of, blocks = KERNELS[kernel]
    args = args_of(*inputs(SHAPES["odd"], jnp.float32, seed=8))
    assert rel_err(op(*args, **blocks), reference(*args)) > 100 * RTOL[jnp.float32]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_lowers_for_cuda(kernel, dtype):
    """The Triton lowering (Pallas -> TTIR) runs on CPU; it rejects e.g. non-power-of-two tiles."""
    op, _, args_of, _ = KERNELS[kernel]
    x, g, c = inputs(SHAPES["odd"], dtype, seed=0)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args_of(x, g, c)]
    lowered = jax.jit(functools.partial(op, **COMPILED[kernel])).trace(*specs).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()


def test_lowering_rejects_bad_blocks():
    with pytest.raises(ValueError, match="powers of two"):
        jp.linear_sq_norms(*inputs(SHAPES["odd"], jnp.float32, seed=0)[:2], block_t=24)


def test_the_single_pass_takes_its_old_launch_keywords_for_one_release():
    """`block_t=`, ..., `scratch_dtype=` give the same sums as the `SinglePassConfig` that replaced them, with a
    DeprecationWarning; a bad setting is refused by name where the config is built."""
    x, g, _ = inputs(SHAPES["odd"], jnp.float32, seed=10)
    config = SinglePassConfig(block_t=16, block_p=32, block_d=16, scratch_dtype=jnp.bfloat16)
    with pytest.warns(DeprecationWarning, match=r"config=SinglePassConfig\(block_t=\.\.\."):
        old = jp.linear_fused_clipped_sum(x, g, clip_factors, block_t=16, block_p=32, block_d=16,
                                          scratch_dtype=jnp.bfloat16)
    new = jp.linear_fused_clipped_sum(x, g, clip_factors, config=config)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), old, new)
    exact = jp.linear_fused_clipped_sum(x, g, clip_factors, config=SinglePassConfig(block_t=16, block_p=32, block_d=16))
    assert not np.array_equal(np.asarray(exact[0]), np.asarray(new[0]))  # the setting does reach the kernel
    with pytest.raises(TypeError, match="together"):
        jp.linear_fused_clipped_sum(x, g, clip_factors, config=config, num_warps=8)
    for field, value in (("block_p", 24), ("scratch_dtype", jnp.int32), ("num_warps", 0), ("interpret", "yes")):
        with pytest.raises((ValueError, TypeError), match=field):
            SinglePassConfig(**{field: value})


def test_interpret_resolves_to_cpu():
    assert _common.resolve_interpret(None) == (jax.default_backend() == "cpu")
    assert _common.resolve_interpret(False) is False
    np.testing.assert_equal(_common.block(19, 64), 32)
    np.testing.assert_equal(_common.block(3, 64), 16)
