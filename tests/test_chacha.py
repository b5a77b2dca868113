"""ChaCha20 (`jaxdp.noise.chacha`) against published test vectors, and secure noise drawn from it alone."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdp
from jaxdp.noise import chacha
from jaxdp.noise import draws as noise
from jaxdp.clipping.settings import DPSpec

# RFC 8439 section 2.3.2: key 00..1f, nonce 00:00:00:09:00:00:00:4a:00:00:00:00, block counter 1.
RFC_KEY = np.frombuffer(bytes(range(32)), "<u4")
RFC_NONCE = np.frombuffer(bytes.fromhex("000000090000004a00000000"), "<u4")
RFC_BLOCK = [0xE4E7F110, 0x15593BD1, 0x1FDD0F50, 0xC47120A3, 0xC7F4D1C7, 0x0368C033, 0x9AAA2204, 0x4E6CD4C3,
             0x466482D2, 0x09AA9F07, 0x05D7C214, 0xA2028BD9, 0xD19C12B5, 0xB94E16DE, 0xE883D0CB, 0x4E3C50A2]
# RFC 8439 appendix A.1, test vector 1: all-zero 256-bit key and nonce, counter 0 (keystream bytes).
ZERO_256 = ("76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
            "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586")
# draft-strombergson-chacha-test-vectors TC1, 20 rounds: all-zero 128-bit key and IV.
ZERO_128 = ("89670952608364fd00b2f90936f031c8e756e15dba04b8493d00429259b20f46"
            "cc04f111246b6c2ce066be3bfb32d9aa0fddfbc12123d4b9e44f34dca05a103f")


def keystream_hex(words) -> str:
    return np.asarray(words).astype("<u4").tobytes().hex()


def test_block_function_matches_the_published_vectors():
    """NumPy and jitted JAX give RFC 8439's blocks (256-bit keys) and the original ChaCha's (128-bit keys);
    a stream is its blocks in counter order from `first_block`, and leading axes batch keys and nonces."""
    one = np.array([1], np.uint32)
    zero = np.zeros(1, np.uint32)
    assert [int(w) for w in chacha.blocks(RFC_KEY, RFC_NONCE, one)[0]] == RFC_BLOCK
    assert keystream_hex(chacha.blocks(np.zeros(8, np.uint32), np.zeros(3, np.uint32), zero)) == ZERO_256
    assert keystream_hex(chacha.blocks(np.zeros(4, np.uint32), np.zeros(3, np.uint32), zero)) == ZERO_128
    jitted = jax.jit(chacha.stream, static_argnums=(2, 3))
    assert [int(w) for w in jitted(jnp.asarray(RFC_KEY), jnp.asarray(RFC_NONCE), 16, 1)] == RFC_BLOCK
    rng = np.random.default_rng()
    keys = rng.integers(0, 2**32, (3, 4), dtype=np.uint32)
    nonce = rng.integers(0, 2**32, 3, dtype=np.uint32)
    words = chacha.stream(keys, nonce, 100, first_block=5)
    assert words.shape == (3, 100)
    for key, row in zip(keys, words):
        expected = np.concatenate([chacha.blocks(key, nonce, np.array([c], np.uint32))[0] for c in range(5, 12)])
        np.testing.assert_array_equal(row, expected[:100])
        np.testing.assert_array_equal(np.asarray(jitted(jnp.asarray(key), jnp.asarray(nonce), 100, 5)), row)
    batched = rng.integers(0, 2**32, (2, 3, 4), dtype=np.uint32)  # two batch axes, NumPy and jnp alike
    np.testing.assert_array_equal(np.stack(chacha.block_words(jnp.asarray(batched), jnp.asarray(nonce), 5)),
                                  np.stack(chacha.block_words(batched, nonce, 5)))
    np.testing.assert_array_equal(np.stack(chacha.block_words(keys, nonce, 7), axis=-2),  # word by word
                                  np.swapaxes(chacha.blocks(keys, nonce, np.arange(7, dtype=np.uint32)), -1, -2))
    with pytest.raises(ValueError, match="holds 4294967296 blocks"):
        chacha.stream(keys[0], nonce, 32, first_block=chacha.MAX_BLOCKS - 1)
    with pytest.raises(ValueError, match="key"):
        chacha.blocks(np.zeros(5, np.uint32), nonce, one)


@pytest.mark.parametrize("wide", [False, True])
def test_normal_from_bits_is_jax_random_normal(wide):
    """The secure draws use jax.random.normal's own transform (the floating-point analysis of
    `jaxdp.noise.draws` is about it): equal on the same bits, float32 and float64 (two words per value)."""
    key = jax.random.key(int(np.random.default_rng().integers(2**31)), impl=noise.NOISE_IMPL)
    with jax.enable_x64(wide):
        dtype = jnp.float64 if wide else jnp.float32
        bits = jax.random.bits(key, (5000,), jnp.uint64 if wide else jnp.uint32)
        if wide:
            bits = jnp.stack([(bits >> 32).astype(jnp.uint32), bits.astype(jnp.uint32)], axis=-1)
        np.testing.assert_array_equal(noise.normal_from_bits(bits, dtype), jax.random.normal(key, (5000,), dtype))


def primitives(fn, *args) -> str:
    """The program as lowered (StableHLO): JAX's random primitives appear as what they lower to."""
    return jax.jit(fn).lower(*args).as_text()


def test_secure_noise_comes_from_chacha_alone():
    """Under secure noise neither the step key's split nor the noise uses XLA's generators (Philox through
    RngBitGenerator, threefry): fused_clip and ShardedDPStep alike; without it they do (the planted
    contrast). Two leaves given equal keys still get different noise, as do two shards of one leaf; the
    state key moves on every step."""
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}
    grads = {"w": jax.random.normal(jax.random.key(1), (2, 64, 32)), "b": jnp.ones((2, 32))}  # per example
    for secure in (False, True):
        tx = jaxdp.fused_clip(1.0, 1.0, expected_batch_size=2.0, key=jax.random.key(0), secure_noise=secure)
        text = primitives(tx.update, grads, tx.init(params), params)
        assert ("rng_bit_generator" in text and "threefry2x32" in text) != secure, secure
    state = tx.init(params)
    keys = [state.noise_key]
    for _ in range(3):
        _, state = tx.update(grads, state, params)
        keys.append(state.noise_key)
    assert len({bytes(np.asarray(jax.random.key_data(k))) for k in keys}) == 4

    key = noise.secret_key()
    copy = jax.random.wrap_key_data(jax.random.key_data(key), impl=noise.NOISE_IMPL)
    leaf = jax.ShapeDtypeStruct((4096,), jnp.float32)
    a, b = noise.gaussians([key, copy], [leaf, leaf], 1.0, secure=True)
    c, d = (noise.gaussians([key], [leaf], 1.0, shards=[s], secure=True)[0] for s in (jnp.int32(0), jnp.int32(1)))
    for x, y in ((a, b), (c, d), (a, c)):
        assert np.mean(np.asarray(x) == np.asarray(y)) < 1e-3
    empty = [jax.ShapeDtypeStruct((0, 3), jnp.float32), leaf]  # a zero-size leaf (attacker review 17)
    assert [x.shape for x in noise.gaussians([key, key], empty, 1.0, secure=True)] == [(0, 3), (4096,)]

    class Lin(nnx.Module):
        def __init__(self):
            self.lin = jaxdp.core.nn.Linear(8, 16, rngs=nnx.Rngs(0))

    def loss_fn(model, batch):
        return jnp.where(batch["mask"], model.lin(batch["x"]).sum((1, 2)), 0.0)

    batch = {"x": jnp.ones((2, 3, 8)), "mask": jnp.ones((2,), bool)}
    for secure in (False, True):
        step = jaxdp.sharding.ShardedDPStep(loss_fn, optax.sgd(1.0), jaxdp.sharding.make_mesh(1),
                                            DPSpec(l2_norm_clip=1.0, noise_multiplier=1.0,
                                                   expected_batch_size=2.0, secure_noise=secure),
                                            key=jax.random.key(0))
        state = step.init(Lin())
        text = primitives(lambda s: step(s, batch), state)
        assert ("rng_bit_generator" in text and "threefry2x32" in text) != secure, secure


def test_each_leaf_reads_its_own_span_of_the_stream():
    """`gaussians(secure=True)`: leaf i of a group is sum_d normal(words of draw d at [lo_i, hi_i)) * std / 2,
    draw d being word arrays 4d .. 4d+3 of the group's ChaCha20 stream end to end, lo_i the sizes of the
    leaves before it; the stream rebuilt from NumPy's ChaCha20, jitted as a step is. Fresh key and shapes
    with leaves that cross a word array's end. A reference reading one word later (the planted error) or
    two leaves sharing a span (noise an attacker could cancel) differ from it."""
    rng = np.random.default_rng()
    shapes = [(int(rng.integers(3, 40)),), (int(rng.integers(2, 6)), int(rng.integers(3, 20))),
              (int(rng.integers(1, 30)),), (5, 7)]
    leaves = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    key, std = noise.secret_key(), float(rng.uniform(0.5, 3.0))
    got = jax.jit(lambda k: noise.gaussians([k] * len(leaves), leaves, std, secure=True))(key)

    sizes = [int(np.prod(s)) for s in shapes]
    n = -(-sum(sizes) * noise.SECURE_DRAWS // chacha.WORDS_PER_BLOCK)
    words = chacha.block_words(np.asarray(jax.random.key_data(key)), np.zeros(3, np.uint32), n)  # nonce (0, 0, 0)
    streams = [np.concatenate(words[4 * d:4 * d + 4]) for d in range(noise.SECURE_DRAWS)]

    def expected(shift):
        out, lo = [], 0
        for shape, size in zip(shapes, sizes):
            bits = np.stack([np.roll(stream, -shift)[lo:lo + size] for stream in streams]).reshape((-1,) + shape)
            out.append(np.asarray((noise.normal_from_bits(jnp.asarray(bits), jnp.float32) * std).sum(0) / 2))
            lo += size
        return out

    assert any(lo % n + size > n for lo, size in zip(np.cumsum([0] + sizes), sizes)), "no leaf crosses an array end"
    with pytest.MonkeyPatch.context() as patch:  # a group too long for int32 starts reads by static slices
        patch.setattr(noise, "_MAX_TRACED_START", n - 1)
        static = jax.jit(lambda k: noise.gaussians([k] * len(leaves), leaves, std, secure=True))(key)
    ulps = 4 * np.finfo(np.float32).eps
    for g, s, e in zip(got, static, expected(0)):
        np.testing.assert_allclose(g, e, rtol=ulps, atol=ulps * std)
        np.testing.assert_allclose(s, e, rtol=ulps, atol=ulps * std)
    assert not any(np.allclose(g, e) for g, e in zip(got, expected(1)))
    assert not np.allclose(got[3].ravel()[:3], got[0].ravel()[:3])


def test_triton_kernel_is_the_block_function():
    """The GPU path (`jaxdp.pallas.chacha_words`, one Triton kernel) gives `jaxdp.noise.chacha`'s words: equal in
    the Pallas interpreter over a partial last program (3,000 blocks of 1,024 per program), 128- and
    256-bit keys; and it lowers to Triton for a GPU."""
    from jaxdp.pallas import chacha_words
    rng = np.random.default_rng()
    nonce = jnp.asarray(rng.integers(0, 2**32, 3, dtype=np.uint32))
    for width in (4, 8):
        key = jnp.asarray(rng.integers(0, 2**32, width, dtype=np.uint32))
        kernel = jax.jit(lambda k, n: chacha_words.block_words(chacha.initial_state(k, n), 3000, interpret=True))
        expected = np.stack(chacha.block_words(np.asarray(key), np.asarray(nonce), 3000))
        np.testing.assert_array_equal(np.stack(kernel(key, nonce)), expected)
    lowered = jax.jit(lambda k, n: chacha_words.block_words(chacha.initial_state(k, n), 3000, interpret=False))
    assert "chacha20_block_words" in lowered.trace(key, nonce).lower(lowering_platforms=("cuda",)).as_text()
    if jax.default_backend() == "gpu":  # the compiled kernel itself (benchmarks/gpu_session.sh check)
        np.testing.assert_array_equal(np.stack(lowered(key, nonce)), expected)


def test_keystream_words_is_the_reference_in_either_implementation():
    """`jaxdp.pallas.chacha_words.keystream_words`, what the secure noise reads: the kernel (interpreted here)
    and the jnp rounds both give `jaxdp.noise.chacha.block_words`' words; an unknown implementation is refused."""
    from jaxdp.pallas import chacha_words
    rng = np.random.default_rng()
    key, nonce = rng.integers(0, 2**32, 4, dtype=np.uint32), rng.integers(0, 2**32, 3, dtype=np.uint32)
    expected = np.stack(chacha.block_words(key, nonce, 40))
    for implementation in ("xla", "pallas", None):
        got = chacha_words.keystream_words(jnp.asarray(key), jnp.asarray(nonce), 40, implementation=implementation)
        np.testing.assert_array_equal(np.stack(got), expected)
    with pytest.raises(ValueError, match="implementation"):
        chacha_words.keystream_words(jnp.asarray(key), jnp.asarray(nonce), 40, implementation="cuda")
