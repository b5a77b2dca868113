"""Gaussian noise for DP-SGD, and the secret randomness it rests on.

The (epsilon, delta) guarantee of DP-SGD assumes the noise is secret: anyone
who knows the noise key and every other record can replay the clipped sum
and subtract the noise exactly. The same holds for the Poisson sampling
draws. So, everywhere in jaxdp:

- Keys come from the operating system's entropy (`secrets`) unless the user pins one:
  `fused_clip(key=None)` and `ShardedDPStep(key=None)` draw a fresh key at every `init`
  (`init_key`); seeds (the sampler's, the job's root) are `jaxdp.noise.seeds`'. A pinned key
  reproduces a run bit for bit, and the guarantee then assumes it is secret (as Opacus'
  `secure_mode`).
- The pretraining job derives the noise key from its root seed (`jaxdp.noise.seeds.derive_seed(root,
  NOISE)`) and keeps the root in the checkpoint only (`jaxdp.training`), never in a file a user
  would share.

Noise, once per logical batch: `split_step_key(key, n)` splits the state's
key into the next state key and one key per parameter leaf; `gaussians`
draws each leaf's noise from its key, or, when the leaf is reduce-scattered
over devices (ZeRO 2/3), each shard draws its own block from
`fold_in(leaf_key, shard)` so no device generates the full noise tensor.
`jaxdp.noise.privatizer.GaussianPrivatizer` is the one caller of these draws (`jaxdp.fused_clip` and
`jaxdp.sharding.ShardedDPStep` both release through it), so a replicated leaf gets exactly the same
noise on a mesh as on one device.

The noise standard deviation is `noise_std(l2_norm_clip, noise_multiplier)`:
sigma times the sensitivity the clipping guarantees, which is C times
`jaxdp.clipping.rules.SENSITIVITY_FACTOR` (a 1.2e-4 relative allowance for the
rounding error of per-example norms; see `jaxdp.clipping.rules`).

Floating-point noise (Mironov 2012, "On significance of the least significant
bits for differential privacy"). Whoever sees a released noisy sum y exactly
and knows the sum up to one example can test each candidate sum s against y in
float32 arithmetic, and two properties of float32 noise give the answer away:
(1) `jax.random.normal` maps 23 random bits through erfinv, so one draw takes one
of 2^23 values, a sparse subset of the floats near it: the true candidate leaves
y - s among them on 66% of coordinates, the other on 15% (2^18 coordinates,
sigma = 1, the other examples' sum as large as the noise;
`tests/test_noise_and_accumulation.py::test_floating_point_noise_attack`);
(2) where s and n cancel, fl32(s + n) is exact and finer than n's own grid, so a
candidate for which no float32 n gives fl32(s + n) = y is ruled out, whatever
the noise's distribution (the wrong candidate can be ruled out, the true one
never). Either tells the candidates apart with certainty. `secure=True` closes both: each value is the sum of
`SECURE_DRAWS` = 4 normals, each scaled by std before the sum (the mitigation of
Opacus' `secure_mode`, after Holohan & Braghin 2021, arXiv:2107.10138; scaling
after the sum left gaps of the multiplier's mantissa, up to 15% of the values
near 1.4 std), and `release` rounds s + n to a power-of-two grid
g in (std / 2^(SNAP_BITS+1), std / 2^SNAP_BITS] (Mironov's snapping), so y - s
spans an interval holding many noise values for every candidate. The rounding
moves a value by at most g / 2 <= std / 512 beyond float32's own rounding of
s + n, and the tests above find no difference between the candidates (noise for
a bf16 leaf is drawn and added in float32: bf16 has too few values near any noise
value). It is a mitigation, not a floating-point proof, and it costs four draws
(their predicted cost is in WORKSPACE.md). The pretraining job releases only the final parameters, from
which the exact noisy sums cannot be read back; publish intermediate noisy sums
only with `secure=True`.

Where the bits come from. By default, XLA's RngBitGenerator (Philox), a statistical generator:
fast, but not cryptographic, so whoever recovered its state could predict the noise. Under
`secure=True` every bit comes from ChaCha20 (`jaxdp.noise.chacha`, a CSPRNG, as Opacus' `secure_mode`
draws from one): the state key is ratcheted by one ChaCha20 block per logical batch
(`split_step_key`: next key and the step's noise key), and each leaf reads its own words of the
step key's streams (`_secure_gaussians`; on a GPU the words come from one Triton kernel,
`jaxdp.pallas.chacha_words`). The secret is the 128-bit key from the operating system's entropy
(`init_key`), or a pinned one.
"""

from __future__ import annotations

import functools
import math
import secrets

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jaxdp.core import rows as rows_lib
from jaxdp.noise import chacha
from jaxdp.noise.seeds import secret_seed, seed_words, several_processes

SECURE_DRAWS = 4  # normals summed per coordinate under secure=True (their sum / sqrt(4) is N(0, 1))
_MAX_TRACED_START = 2**31 - 1  # secure=True: a leaf's words are read at traced int32 starts up to this
SNAP_BITS = 8     # secure=True rounds the released sum to a grid of std / 2^8 .. std / 2^9
_RATCHET = (0xFFFFFFFF,) * 3  # the ChaCha20 nonce that turns a state key into (next key, step key)


# Noise keys use XLA's RngBitGenerator ("rbg": one HLO op per draw, 128-bit keys) rather than the
# default threefry, which JAX lowers into ~100 HLO ops per draw: the noise's threefry draws took most of
# the DP step's XLA:GPU compile (WORKSPACE.md).
NOISE_IMPL = "rbg"


def key_from_seed(seed: int, impl: str | None = None) -> jax.Array:
    """A typed JAX PRNG key of `impl` (default: JAX's default) whose data are words of `seed`.

    Unlike `jax.random.key(seed)`, every bit of the key comes from the seed:
    a 256-bit seed fills the key data (64 bits for threefry2x32, 128 for rbg).
    """
    shape = jax.random.key_data(jax.random.key(0, impl=impl)).shape
    return jax.random.wrap_key_data(seed_words(seed, int(np.prod(shape))).reshape(shape), impl=impl)


def noise_key_from_seed(seed: int) -> jax.Array:
    """The noise key (`NOISE_IMPL`) whose data are words of `seed`."""
    return key_from_seed(seed, impl=NOISE_IMPL)


def secret_key() -> jax.Array:
    """A noise key from the operating system's entropy source (`secret_seed`: process 0's on several)."""
    return noise_key_from_seed(secret_seed(256))


def check_secure(secure, owner: str) -> bool:
    """`secure` (the floating-point noise mitigation flag) as a bool; raises TypeError naming `owner`."""
    if not isinstance(secure, (bool, np.bool_)):
        raise TypeError(f"{owner}: secure_noise must be True or False, got {secure!r}")
    return bool(secure)


def check_key(key, owner: str) -> jax.Array | None:
    """`key` as a noise key (`NOISE_IMPL`; another key is mapped to one deterministically), or None for None
    (each `init` then draws a fresh one: `init_key`); raises TypeError naming `owner` for an integer."""
    if key is None:
        return None
    if isinstance(key, (int, np.integer)):
        raise TypeError(f"{owner}: key must be a jax.random.key(...) or None (a secret key from the "
                        f"operating system), got the integer {key!r}; pass key=jax.random.key({key}) to pin it")
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)  # a raw uint32 key (jax.random.PRNGKey)
    if str(jax.random.key_impl(key)) != NOISE_IMPL:
        shape = jax.random.key_data(jax.random.key(0, impl=NOISE_IMPL)).shape
        key = jax.random.wrap_key_data(jax.random.bits(key, shape, jnp.uint32), impl=NOISE_IMPL)
    return key


def init_key(pinned: jax.Array | None, state) -> jax.Array:
    """The noise key of one `init` call: the `pinned` key (`check_key`), else a fresh secret key per call, so
    two optimizers (or a re-init) of one transform never share noise. An init traced
    under jit / vmap / eval_shape draws its key from the operating system when the program runs
    (`io_callback`: once per call, and once per vmapped member whose `state` differs), never at tracing,
    where one key would serve every call. A vmapped init whose state is the same for every member (not
    batched) runs once, so its members share one key: give each member its own `key=` there.

    On several processes (multi-host) every process must add the same noise: an eager init takes process
    0's key (`secret_key`); a traced one cannot broadcast and is refused (pass `key=`)."""
    if pinned is not None:
        return pinned
    leaves = jax.tree.leaves(state)
    traced = isinstance(jnp.zeros(()), jax.core.Tracer) or any(isinstance(x, jax.core.Tracer) for x in leaves)
    if traced and several_processes():
        raise ValueError("key=None on several processes: an init under jit / vmap would draw a different "
                         "noise key on each process; init eagerly, or pass key= (one secret key, the same "
                         "on every process)")
    if not traced:
        return secret_key()  # eager (a constant made under jit is a tracer: a closed-over state is caught too)
    shape = jax.random.key_data(jax.random.key(0, impl=NOISE_IMPL)).shape
    # One element of every leaf: the callback then varies (is batched) wherever the state does.
    probe = jnp.stack([jnp.sum(jnp.ravel(x)[:1].astype(jnp.float32)) for x in leaves] or [jnp.zeros(())])
    words = io_callback(lambda _: np.frombuffer(secrets.token_bytes(4 * math.prod(shape)), np.uint32).reshape(shape),
                        jax.ShapeDtypeStruct(shape, jnp.uint32), probe, ordered=False)
    return jax.random.wrap_key_data(words, impl=NOISE_IMPL)



def split_step_key(key: jax.Array, num_leaves: int, secure: bool = False) -> tuple[jax.Array, list[jax.Array]]:
    """(the next state key, one noise key per leaf) for one logical batch.

    `secure`: both come from one ChaCha20 block of the state key (`jaxdp.noise.chacha`; nonce `_RATCHET`): words
    0-3 are the next state key, words 4-7 the step's noise key, the same for every leaf (`gaussians` gives
    each leaf its own part of that key's streams). A state key seen later (a checkpoint) does not give
    back earlier steps' keys unless ChaCha20 is broken."""
    if not secure:
        key, noise_key = jax.random.split(key)
        return key, list(jax.random.split(noise_key, num_leaves))
    block = chacha.blocks(jax.random.key_data(key), jnp.asarray(_RATCHET, jnp.uint32), jnp.zeros(1, jnp.uint32))
    block = jax.lax.optimization_barrier(block)  # else XLA fuses this block into every noise word (compile time)
    wrap = functools.partial(jax.random.wrap_key_data, impl=NOISE_IMPL)
    step_key = wrap(block[..., 0, 4:8])
    return wrap(block[..., 0, :4]), [step_key] * num_leaves


def normal_from_bits(bits: jax.Array, dtype) -> jax.Array:
    """Standard normals from uniformly random uint32 `bits` (float64: two words per value, last axis 2),
    by `jax.random.normal`'s own transform: sqrt(2) erfinv(u), u uniform on (-1, 1) from the top mantissa
    bits (23 for float32). `jax.random.normal(k, shape)` equals it on `jax.random.bits(k, shape)`."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 8:
        bits = (bits[..., 0].astype(jnp.uint64) << 32) | bits[..., 1].astype(jnp.uint64)
    nbits, nmant = 8 * dtype.itemsize, jnp.finfo(dtype).nmant
    one = jnp.array(1.0, dtype).view(bits.dtype)
    floats = jax.lax.bitcast_convert_type((bits >> (nbits - nmant)) | one, dtype) - 1  # [0, 1)
    lo = np.nextafter(np.array(-1.0, dtype), np.array(0.0, dtype))
    u = jnp.maximum(lo, floats * (1 - lo) + lo)
    return np.array(np.sqrt(2), dtype) * jax.lax.erf_inv(u)


def gaussians(leaf_keys, leaves, std: float, shards=None, secure: bool = False) -> list[jax.Array]:
    """N(0, std^2) noise like each of `leaves` (arrays or ShapeDtypeStructs) from its key.

    `secure`: each value is the sum of `SECURE_DRAWS` normals, each times std, over sqrt(SECURE_DRAWS),
    in at least float32 (the module docstring, "Floating-point noise"); add it with
    `release(..., secure=True)`.

    `shards[i]` (None, or a traced device index): leaf i is this device's block of a
    reduce-scattered gradient, drawn from `fold_in(leaf_keys[i], shards[i])`. Leaves of
    one shape, dtype and sharding draw in ONE vmapped call, so the program holds one
    random-number generator per group (GPT-2 small: 13 instead of 148; the per-leaf draws
    made up 2/3 of the DP step's HLO and most of its compile time). With the rbg keys
    (`NOISE_IMPL`) the vmapped draw is not bit-equal to one call per leaf (only a group's
    first leaf is): the leaves' noise is still independent N(0, std^2), and leaves grouped
    the same way get the same values (one device and a mesh without ZeRO 2/3 sharding).
    """
    shards = [None] * len(leaves) if shards is None else list(shards)
    if secure:
        return _secure_gaussians(leaf_keys, leaves, std, shards)
    groups: dict = {}
    for i, (leaf, shard) in enumerate(zip(leaves, shards)):
        groups.setdefault((tuple(leaf.shape), jnp.dtype(leaf.dtype), shard is None), []).append(i)
    out = [None] * len(leaves)
    for (shape, dtype, replicated), members in groups.items():
        keys = jnp.stack([leaf_keys[i] for i in members])
        if not replicated:
            index = [shards[i] for i in members]
            keys = jax.vmap(jax.random.fold_in)(keys, jnp.stack(index))
        draws = std * jax.vmap(lambda k: jax.random.normal(k, shape, dtype))(keys)
        for i, draw in zip(members, rows_lib.rows_apart(draws)):  # each leaf's update its own kernel
            out[i] = draw
    return out


def _secure_gaussians(leaf_keys, leaves, std: float, shards) -> list[jax.Array]:
    """`gaussians(secure=True)`: bits from ChaCha20 (`jaxdp.noise.chacha`), never from XLA's Philox.

    Leaves that share one key object (`split_step_key(secure=True)` gives every leaf the step's key), one
    shard index object and one float width draw from ONE stream, each leaf its own consecutive words:
    one ChaCha20 fusion for all of GPT-2's replicated leaves (a stream per leaf would compile ~150 of
    them). The stream's nonce is (0 for replicated / 1 for sharded, the group's first leaf, the shard),
    so no two groups read the same (key, nonce) stream, even where two leaves get equal keys."""
    from jaxdp.pallas import chacha_words  # imports jax.experimental.pallas only when used
    groups: dict = {}
    for i, (leaf, shard) in enumerate(zip(leaves, shards)):
        wide = jnp.promote_types(leaf.dtype, jnp.float32)  # bf16 has too few values for noise
        groups.setdefault((id(leaf_keys[i]), id(shard), wide), []).append(i)
    out = [None] * len(leaves)
    for (_, _, wide), members in groups.items():
        first, shard = members[0], shards[members[0]]
        per_value = SECURE_DRAWS * (2 if jnp.dtype(wide).itemsize == 8 else 1)
        words_per_draw = per_value // SECURE_DRAWS
        sizes = [words_per_draw * math.prod(leaves[i].shape) for i in members]
        nonce = jnp.stack([jnp.uint32(shard is not None), jnp.uint32(first),
                           jnp.uint32(0) if shard is None else jnp.asarray(shard).astype(jnp.uint32)])
        # ChaCha20's words, word by word (16 arrays of N blocks, `chacha.block_words`): draw d reads arrays
        # 4d .. 4d+3 end to end, and a leaf the same span of every draw (no interleaved copy of the words).
        n = max(1, -(-sum(sizes) * SECURE_DRAWS // chacha.WORDS_PER_BLOCK))
        words = chacha_words.keystream_words(jax.random.key_data(leaf_keys[first]), nonce, n)  # Triton on a GPU
        per = chacha.WORDS_PER_BLOCK // SECURE_DRAWS

        offsets = np.cumsum([0] + sizes)
        for i, lo, hi in zip(members, offsets[:-1], offsets[1:]):
            # this leaf's words: (word array w, start, length) per piece, the same for every draw d
            spans = [(w, max(lo, w * n) - w * n, min(hi, (w + 1) * n) - max(lo, w * n))
                     for w in range(per) if max(lo, w * n) < min(hi, (w + 1) * n)]
            if sum(length for *_, length in spans) != hi - lo or any(a < 0 or a + length > n for _, a, length in spans):
                raise RuntimeError(f"secure noise: leaf {i}'s words {spans} are not [{lo}, {hi}) of {per} arrays of "
                                   f"{n}")  # a dynamic slice would clamp silently: overlapping noise
            # Read through a barrier of the leaf's own, at traced starts (`jaxdp.core.rows.rows_apart`'s reasons: read
            # as slices of one array, many leaves' updates merge into one kernel that spills registers).
            # Starts past int32 (over 2^33 values in the group) read by static slices.
            traced = n <= _MAX_TRACED_START
            if traced:
                view, starts = jax.lax.optimization_barrier((words, jnp.asarray([a for _, a, _ in spans], jnp.int32)))

            def piece(d, k):
                w, a, length = spans[k]
                if traced:
                    return jax.lax.dynamic_slice_in_dim(view[per * d + w], starts[k], length)
                return words[per * d + w][a:a + length]

            def draw(d):
                pieces = [piece(d, k) for k in range(len(spans))]
                if not pieces:  # a zero-size leaf
                    return jnp.zeros((0,), jnp.uint32)
                return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)

            bits = jnp.stack([draw(d) for d in range(SECURE_DRAWS)])
            bits = bits.reshape((SECURE_DRAWS,) + tuple(leaves[i].shape) + ((2,) if words_per_draw == 2 else ()))
            # each draw scaled before the sum: a product after it would leave gaps (module docstring)
            out[i] = (normal_from_bits(bits, wide) * std).sum(0) * (1 / SECURE_DRAWS ** 0.5)
    return out


def snap_grid(std: float) -> float:
    """The power of two `release(secure=True)` rounds to: in (std / 2^(SNAP_BITS+1), std / 2^SNAP_BITS]."""
    return 2.0 ** (math.floor(math.log2(std)) - SNAP_BITS)


def release(s: jax.Array, noise: jax.Array, std: float, secure: bool = False) -> jax.Array:
    """The noisy sum as released: s + noise; under `secure`, formed in at least float32, rounded to the
    nearest multiple of `snap_grid(std)` (values of magnitude >= 2^23 grid steps are multiples of it
    already), then cast to s's dtype."""
    if not secure:
        return s + noise
    if not std >= 2.0**-100:  # 1 / snap_grid(std) must be a float32
        raise ValueError(f"secure noise needs a noise std >= 2**-100, got {std!r}")
    g = snap_grid(std)
    y = s.astype(jnp.promote_types(s.dtype, jnp.float32)) + noise
    return jnp.where(jnp.abs(y) < 2.0**23 * g, jnp.round(y * (1 / g)) * g, y).astype(s.dtype)
