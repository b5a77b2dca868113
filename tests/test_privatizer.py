"""The privatizer (`jaxdp.noise.privatizer`): the Gaussian mechanism on a clipped sum, the only noise in the library.

Properties: zero noise releases sum / expected batch exactly; the noise is N(0, std^2), fresh each step,
reproduced by a pinned key; a reduce-scattered leaf's blocks differ across shards while a replicated leaf
gets the noise it gets on one device; bad settings are refused; no other module draws DP noise.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdp.clipping.rules import SENSITIVITY_FACTOR, noise_std
from jaxdp.noise import draws as noise
from jaxdp.noise.privatizer import GaussianPrivatizer

EBS = 8.0


def sums_tree(seed=0):
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.standard_normal((64, 32)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal((32,)), jnp.float32)}


def test_zero_noise_releases_the_sum_over_the_expected_batch_exactly():
    sums = sums_tree()
    released, _ = GaussianPrivatizer(0.0, EBS).update(sums, jax.random.key(0, impl=noise.NOISE_IMPL))
    for k in sums:
        np.testing.assert_array_equal(np.asarray(released[k]), np.asarray(sums[k]) / np.float32(EBS))


@pytest.mark.parametrize("secure", [False, True])
def test_noise_is_gaussian_with_the_stated_std_fresh_each_step_and_pinned_by_the_key(secure):
    std = 0.7
    privatizer = GaussianPrivatizer(std, EBS, secure)
    zeros = {"w": jnp.zeros((256, 256), jnp.float32), "b": jnp.zeros((1000,), jnp.float32)}
    key = noise.check_key(jax.random.key(np.random.default_rng().integers(2**31)), "test")
    state = privatizer.init(zeros, key)
    update = jax.jit(privatizer.update)
    first, state1 = update(zeros, state)
    second, _ = update(zeros, state1)
    again, _ = update(zeros, privatizer.init(zeros, key))
    values = np.concatenate([np.ravel(np.asarray(x, np.float64)) * EBS for x in jax.tree.leaves(first)])
    assert abs(values.std() / std - 1) < 0.01 and abs(values.mean()) < 5 * std / np.sqrt(values.size)
    assert not np.array_equal(np.asarray(first["w"]), np.asarray(second["w"]))  # the state moved on
    assert not np.array_equal(np.asarray(first["w"][:128]), np.asarray(first["w"][128:]))
    for k in zeros:
        np.testing.assert_array_equal(np.asarray(first[k]), np.asarray(again[k]))  # the pinned key reproduces
    with pytest.raises(AssertionError):  # the check above can fail: a mis-scaled noise is caught
        assert abs(values.std() * 1.05 / std - 1) < 0.01


def test_a_sharded_leaf_draws_its_own_block_and_a_replicated_one_the_single_device_noise():
    privatizer = GaussianPrivatizer(1.0, EBS)
    leaves = [jnp.zeros((16, 8), jnp.float32), jnp.zeros((16, 8), jnp.float32)]
    state = privatizer.init(leaves, noise.check_key(jax.random.key(3), "test"))
    _, keys = privatizer.begin_step(state, len(leaves))
    single, _ = privatizer.privatize(leaves, keys)
    replicated, _ = privatizer.privatize(leaves, keys, [None, None])
    blocks = [privatizer.privatize(leaves, keys, [None, jnp.int32(s)])[0][1] for s in (0, 1)]
    np.testing.assert_array_equal(np.asarray(replicated[0]), np.asarray(single[0]))
    assert not np.array_equal(np.asarray(blocks[0]), np.asarray(blocks[1]))  # shards never share noise
    assert not np.array_equal(np.asarray(single[0]), np.asarray(single[1]))  # nor do leaves


def test_as_an_optax_transform_it_is_update():
    privatizer = GaussianPrivatizer(noise_std(1.0, 0.5), EBS)
    key = jax.random.key(5)
    tx = optax.chain(privatizer.transform(key=key), optax.sgd(1.0))
    sums = sums_tree(1)
    updates, _ = tx.update(sums, tx.init(sums))
    released, _ = privatizer.update(sums, noise.check_key(key, "test"))
    for k in sums:
        np.testing.assert_allclose(np.asarray(updates[k]), -np.asarray(released[k]), rtol=1e-6)
    assert privatizer.std == 0.5 * SENSITIVITY_FACTOR


@pytest.mark.parametrize("std,ebs,secure", [(float("nan"), 1.0, False), (-1.0, 1.0, False), (1.0, 0.0, False),
                                            (1.0, float("nan"), False), (1.0, 1.0, "yes")])
def test_bad_settings_are_refused(std, ebs, secure):
    with pytest.raises((ValueError, TypeError)):
        GaussianPrivatizer(std, ebs, secure)


def test_no_other_module_draws_dp_noise():
    """The noise draws (`gaussians`, `release`, `split_step_key`) are called from the privatizer alone."""
    root = pathlib.Path(__file__).resolve().parents[1] / "jaxdp"
    callers = sorted(str(f.relative_to(root)) for f in root.rglob("*.py")
                     if str(f.relative_to(root)) not in ("noise/draws.py", "noise/privatizer.py")
                     and re.search(r"\b(gaussians|release|split_step_key)\(", f.read_text()))
    assert callers == [], callers
