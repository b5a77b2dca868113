"""The streaming noise of each mechanism (`jaxdp.noise.mechanisms`) equals C^{-1} Z for a dense C built
from the coefficients, in float32 whatever the draws' dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp.noise.mechanisms import BLT, DPSGD, BandMF

STEPS = 48
SHAPE = (3, 5)


def dense_strategy(mechanism, n):
    """C (n x n, float64) straight from the definitions: c_k down the k-th subdiagonal."""
    if isinstance(mechanism, DPSGD):
        c = np.eye(n)[:, 0]
    elif isinstance(mechanism, BandMF):
        c = np.zeros(n)
        c[:min(n, mechanism.bands)] = mechanism.coefs[:n]
    else:
        k = np.arange(1, n)[:, None]
        c = np.concatenate([[1.0], (np.array(mechanism.output_scale)
                                    * np.array(mechanism.buf_decay) ** (k - 1)).sum(axis=1)])
    rows, cols = np.indices((n, n))
    return np.where(rows >= cols, c[np.clip(rows - cols, 0, n - 1)], 0.0)


def stream(mechanism, z_TS, jit=True):
    """x_t = mechanism.next(z_t, buffers) for t = 0..T-1 (one parameter leaf of shape z_TS.shape[1:])."""
    def step(buffers, z):
        x, buffers = mechanism.next(z, buffers)
        return buffers, x

    if jit:
        return jax.lax.scan(step, mechanism.init_buffers(z_TS[0]), z_TS)[1]
    buffers, out = mechanism.init_buffers(z_TS[0]), []
    for z in z_TS:
        buffers, x = step(buffers, z)
        out.append(x)
    return jnp.stack(out)


def dense_noise(mechanism, z_TS):
    z = np.asarray(z_TS, np.float64).reshape(z_TS.shape[0], -1)
    return np.linalg.solve(dense_strategy(mechanism, z_TS.shape[0]), z).reshape(z_TS.shape)


MECHANISMS = {
    "bandmf1": BandMF((1.0,)),
    "bandmf2": BandMF((0.8, 0.6)),
    "bandmf4": BandMF((0.683, 0.483, 0.414, 0.359)),
    "blt2": BLT((0.98886, 0.77299), (0.14603, 0.32354)),
    "blt3": BLT((0.99261, 0.90458, 0.51991), (0.11351, 0.17560, 0.20913)),
}


def assert_close_f32(x, reference):
    """float32 tolerance scaled by the reference's size: each x_t sums at most ~T float32 terms."""
    scale = np.abs(reference).max()
    np.testing.assert_allclose(np.asarray(x, np.float64), reference, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_stream_equals_dense_inverse(name):
    mechanism = MECHANISMS[name]
    z = jax.random.normal(jax.random.key(sorted(MECHANISMS).index(name)), (STEPS, *SHAPE), jnp.float32)
    x = stream(mechanism, z)
    assert x.dtype == jnp.float32 and x.shape == z.shape
    assert_close_f32(x, dense_noise(mechanism, z))


def test_stream_without_jit_equals_jit():
    z = jax.random.normal(jax.random.key(1), (12, 4), jnp.float32)
    for mechanism in (MECHANISMS["bandmf4"], MECHANISMS["blt3"]):
        np.testing.assert_allclose(stream(mechanism, z, jit=False), stream(mechanism, z), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["bandmf4", "blt2"])
def test_a_planted_wrong_coefficient_is_caught(name):
    """The dense comparison above fails when the reference has one coefficient off by 1%."""
    mechanism = MECHANISMS[name]
    if isinstance(mechanism, BandMF):
        wrong = BandMF(mechanism.coefs[:2] + (mechanism.coefs[2] * 1.01,) + mechanism.coefs[3:])
    else:
        wrong = BLT(mechanism.buf_decay, (mechanism.output_scale[0] * 1.01,) + mechanism.output_scale[1:])
    z = jax.random.normal(jax.random.key(2), (STEPS, *SHAPE), jnp.float32)
    with pytest.raises(AssertionError):
        assert_close_f32(stream(mechanism, z), dense_noise(wrong, z))


@pytest.mark.parametrize("mechanism", [DPSGD(), BandMF((1.0,))], ids=["dpsgd", "bandmf_b1"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_independent_noise_is_z_exactly(mechanism, dtype):
    z = jax.random.normal(jax.random.key(3), (STEPS, *SHAPE), dtype)
    x = stream(mechanism, z)
    assert x.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(x), np.asarray(z.astype(jnp.float32)))
    assert mechanism.init_buffers(z[0]).shape == (0, *SHAPE)


def test_bf16_draws_keep_float32_buffers():
    """bf16 draws: the buffers and x stay float32 and equal the stream of the same draws in float32."""
    z16 = jax.random.normal(jax.random.key(4), (STEPS, *SHAPE), jnp.bfloat16)
    for mechanism in (MECHANISMS["bandmf4"], MECHANISMS["blt3"]):
        buffers = mechanism.init_buffers(jnp.zeros(SHAPE, jnp.bfloat16))
        assert buffers.dtype == jnp.float32 and buffers.shape == (mechanism.num_buffers, *SHAPE)
        x, buffers = mechanism.next(z16[0], buffers)
        assert x.dtype == buffers.dtype == jnp.float32
        np.testing.assert_array_equal(stream(mechanism, z16), stream(mechanism, z16.astype(jnp.float32)))


def test_a_shard_of_the_leaf_streams_its_shard_of_the_noise():
    """The recursions are elementwise: a device holding rows 1:3 of a leaf and of its buffers computes rows
    1:3 of the noise (ZeRO sharding of the buffers)."""
    z = jax.random.normal(jax.random.key(5), (10, 4, 6), jnp.float32)
    for mechanism in (MECHANISMS["bandmf4"], MECHANISMS["blt2"]):
        np.testing.assert_array_equal(stream(mechanism, z[:, 1:3]), stream(mechanism, z)[:, 1:3])


def test_zero_draws_add_zero_noise():
    for mechanism in MECHANISMS.values():
        assert not np.any(np.asarray(stream(mechanism, jnp.zeros((STEPS, *SHAPE)))))


def test_mechanisms_are_hashable_static_arguments():
    a, b = BandMF([0.8, 0.6]), BandMF((np.float32(0.8), 0.6))
    assert a.coefs == (0.8, 0.6) and all(type(c) is float for c in a.coefs)
    assert hash(BLT((0.5,), (0.2,))) == hash(BLT([0.5], [0.2])) and a.num_buffers == 1
    assert b.coefs[0] == pytest.approx(0.8)
    f = jax.jit(lambda m, z, buf: m.next(z, buf), static_argnums=0)
    x, _ = f(a, jnp.ones(3), a.init_buffers(jnp.ones(3)))
    np.testing.assert_allclose(x, np.ones(3) / 0.8, rtol=1e-6)


@pytest.mark.parametrize("make, field", [
    (lambda: BandMF(()), "BandMF.coefs"),
    (lambda: BandMF((0.0, 1.0)), "BandMF.coefs"),
    (lambda: BandMF((1.0, float("nan"))), "BandMF.coefs"),
    (lambda: BLT((1.0,), (0.1,)), "BLT.buf_decay"),
    (lambda: BLT((0.0,), (0.1,)), "BLT.buf_decay"),
    (lambda: BLT((0.5, 0.6), (0.1,)), "BLT.output_scale"),
    (lambda: BLT((0.5,), (float("inf"),)), "BLT.output_scale"),
    (lambda: BLT((), ()), "BLT.buf_decay"),
])
def test_bad_parameters_name_the_field(make, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make()


def test_buffers_of_the_wrong_shape_are_refused():
    mechanism = MECHANISMS["bandmf4"]
    with pytest.raises(ValueError, match="init_buffers"):
        mechanism.next(jnp.ones((3, 5)), jnp.zeros((3, 5, 3)))
