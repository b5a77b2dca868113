"""Correlated noise through the one privatizer: `fused_clip(mechanism=BandMF(...))` and `ShardedDPStep` release
row t of C^{-1} Z, where Z are exactly the draws DP-SGD makes from the same key (so the mechanism changes how
draws combine, never the draws); noise once per logical batch under accumulation; the buffers are float32
state, laid out like the gradients on a mesh (ZeRO 2 shards them)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_testing import lm_loss, tiny_gpt2

import jaxdp
from jaxdp import sharding
from jaxdp.clipping.settings import DPSpec
from jaxdp.noise.mechanisms import BLT, DPSGD, BandMF
from jaxdp.noise.privatizer import GaussianPrivatizer, NoiseState

COEFS = (0.68298, 0.48280, 0.41446, 0.35869)  # the optimised BandMF b = 4 of 100 steps, norm ~1
STEPS = 5


def dense_inverse(coefs, n):
    """C^{-1} of the n x n banded lower-triangular Toeplitz C, by a dense solve (the reference)."""
    C = sum(np.diag(np.full(n - j, c), -j) for j, c in enumerate(coefs) if j < n)
    return np.linalg.inv(C)


def _releases(mechanism, sigma, steps, key, accumulation_steps=1):
    """fused_clip's releases x ebs for zero per-example gradients: the noise alone, per step, {name: (steps, ...)}"""
    params = {"w": jnp.zeros((3, 4)), "b": jnp.zeros((4,))}
    grads = {"w": jnp.zeros((2, 3, 4)), "b": jnp.zeros((2, 4))}
    tx = jaxdp.fused_clip(1.0, sigma, expected_batch_size=2.0, key=key, mechanism=mechanism,
                          accumulation_steps=accumulation_steps)
    state, out = tx.init(params), []
    update = jax.jit(lambda g, s: tx.update(g, s, params))
    for _ in range(steps * accumulation_steps):
        u, state = update(grads, state)
        out.append(jax.tree.map(lambda a: np.asarray(a, np.float64) * 2.0, u))
    if accumulation_steps > 1:
        assert all(not np.any(o["w"]) for i, o in enumerate(out) if (i + 1) % accumulation_steps)  # zeros between
        out = out[accumulation_steps - 1::accumulation_steps]
    return {k: np.stack([o[k] for o in out]) for k in params}, state


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_bandmf_noise_is_c_inverse_of_dpsgds_draws(accumulation_steps):
    key = jax.random.key(np.random.default_rng().integers(2**31))
    z, _ = _releases(DPSGD(), 1.3, STEPS, key, accumulation_steps)
    x, state = _releases(BandMF(COEFS), 1.3, STEPS, key, accumulation_steps)
    norm = np.sqrt(np.sum(np.square(COEFS)))  # the draws' std is sigma C' ||c||
    inv = dense_inverse(COEFS, STEPS)
    for name in z:
        want = np.einsum("ts,s...->t...", inv, z[name] * norm)
        np.testing.assert_allclose(x[name], want, rtol=2e-5, atol=1e-5)
        planted = np.einsum("ts,s...->t...", dense_inverse((0.7,) + COEFS[1:], STEPS), z[name] * norm)
        assert not np.allclose(x[name], planted, rtol=2e-5, atol=1e-5)  # a wrong coefficient is seen
    noise_state = state.noise_key
    assert isinstance(noise_state, NoiseState) and all(b.dtype == jnp.float32 and b.shape[0] == 3
                                                       for b in noise_state.buffers)


def test_one_band_is_dpsgd_bit_for_bit():
    key = jax.random.key(5)
    z, state = _releases(DPSGD(), 0.9, 3, key)
    x, _ = _releases(BandMF((1.0,)), 0.9, 3, key)
    for name in z:
        np.testing.assert_array_equal(x[name], z[name])
    assert not isinstance(state.noise_key, NoiseState)  # DP-SGD's state is the bare key, as before


def test_the_privatizer_streams_blt_and_refuses_missing_buffers():
    blt = BLT((0.9, 0.5), (0.2, 0.3))
    privatizer = GaussianPrivatizer(1.0, 1.0, mechanism=blt)
    leaves = [jnp.zeros((7,))]
    state = privatizer.init(leaves, jax.random.key(1))
    draws = []
    for _ in range(4):
        keyed, step_keys = privatizer.begin_step(state, 1)
        z = jax.random.normal(step_keys[0], (7,), jnp.float32)  # the DP-SGD draw of this key and shape
        draws.append(np.asarray(z))
        out, state = privatizer.update(leaves, state)
        assert np.isfinite(np.asarray(out[0])).all()
    with pytest.raises(ValueError, match="buffers"):
        privatizer.privatize(leaves, [jax.random.key(0)])
    with pytest.raises(TypeError, match="BLT"):
        DPSpec(1.0, 1.0, 4.0, mechanism=blt)


def _sharded_grads(mechanism, sigma, zero_stage, steps=3):
    model = tiny_gpt2(seed=1)
    tokens = jax.random.randint(jax.random.key(3), (8, 17), 0, 97)
    batch = {"tokens": tokens, "mask": jnp.arange(8) < 7}
    step = sharding.ShardedDPStep(lm_loss, optax.sgd(0.0), sharding.make_mesh(8, 1),  # lr 0: the same sums
                                  DPSpec(0.05, sigma, 6.0, mechanism=mechanism), key=jax.random.key(7),
                                  zero_stage=zero_stage)
    state, out = step.init(model), []
    for _ in range(steps):
        state, o = step(state, batch)
        out.append({"/".join(map(str, p)): np.asarray(g, np.float64) * 6.0
                    for p, g in jax.tree_util.tree_leaves_with_path(o["grads"])})
    return out, state


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_the_mesh_step_releases_c_inverse_of_its_draws(zero_stage):
    """On 8 devices, ZeRO 0 (replicated buffers) and ZeRO 2 (each device its shard of the buffers)."""
    clean, _ = _sharded_grads(DPSGD(), 0.0, zero_stage)
    plain, _ = _sharded_grads(DPSGD(), 2.0, zero_stage)
    banded, state = _sharded_grads(BandMF(COEFS), 2.0, zero_stage)
    inv, norm = dense_inverse(COEFS, 3), np.sqrt(np.sum(np.square(COEFS)))
    for name in clean[0]:
        z = np.stack([p[name] - c[name] for p, c in zip(plain, clean)]) * norm
        x = np.stack([b[name] - c[name] for b, c in zip(banded, clean)])
        np.testing.assert_allclose(x, np.einsum("ts,s...->t...", inv, z), rtol=1e-4, atol=2e-4 * np.abs(z).max())
    buffers = state.noise_key.buffers
    if zero_stage == 2:  # some buffer is split over the devices like its gradient
        assert any(not b.sharding.is_fully_replicated for b in buffers)
