"""ChaCha20, the cryptographically secure generator behind secure noise and Poisson sampling.

DP-SGD's guarantee assumes ideal randomness: noise and batches nobody can predict. A statistical
generator (XLA's Philox, NumPy's PCG64) passes every statistical test, but whoever recovers its
state from some outputs predicts the rest; a cryptographically secure one (CSPRNG) makes that as
hard as breaking a cipher (Opacus' `secure_mode` uses one: AES-CTR through torchcsprng). ChaCha20
is the CSPRNG of Linux's /dev/urandom and a TLS cipher (RFC 8439): 20 rounds of 32-bit additions,
rotations and xors, so one implementation runs on the host (NumPy: `jaxdp.sampling.poisson`) and inside a
jitted step (jax.numpy, or one Triton kernel on a GPU: `jaxdp.noise.draws` under `secure=True`).

`blocks(key, nonce, counters)` is the block function of RFC 8439 section 2.3 (its test vectors in
`tests/test_chacha.py`): the state is four constant words, eight key words, one 32-bit block
counter and three nonce words, and each block yields 16 words of keystream. A 4-word (128-bit)
key, such as a `jaxdp.noise.draws` key's data, is expanded as in Bernstein's original ChaCha (the
constants "expand 16-byte k", the key written twice); an 8-word key uses "expand 32-byte k".

Reference: D. J. Bernstein, "ChaCha, a variant of Salsa20" (2008); Y. Nir, A. Langley, RFC 8439
(2018).
"""

from __future__ import annotations

import numpy as np

_EXPAND_32 = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)  # "expand 32-byte k"
_EXPAND_16 = (0x61707865, 0x3120646E, 0x79622D36, 0x6B206574)  # "expand 16-byte k"
WORDS_PER_BLOCK = 16
MAX_BLOCKS = 1 << 32  # the block counter is 32 bits: one (key, nonce) stream holds 2^32 blocks


def _xp(*arrays):
    """jax.numpy if any argument is a JAX array or tracer, else NumPy."""
    import jax
    return jax.numpy if any(isinstance(a, jax.Array) for a in arrays) else np


def _quarter_round(s, a, b, c, d):
    """RFC 8439 section 2.1, in place on the list of 16 word arrays `s` (uint32: additions wrap)."""
    for x, y, z, r in ((a, b, d, 16), (c, d, b, 12), (a, b, d, 8), (c, d, b, 7)):
        s[x] = s[x] + s[y]
        t = s[z] ^ s[x]
        s[z] = (t << r) | (t >> (32 - r))


def _double_round(s):
    for a, b, c, d in ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15),   # columns
                       (0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14)):  # diagonals
        _quarter_round(s, a, b, c, d)
    return s


def blocks(key, nonce, counters):
    """Keystream blocks (..., N, 16) uint32 of ChaCha20 under `key` and `nonce` at block `counters`.

    Args:
      key: (..., 8) or (..., 4) uint32 words (a 256- or 128-bit key); leading axes batch keys.
      nonce: (..., 3) uint32 words; leading axes broadcast against the key's.
      counters: (N,) uint32 block counters.

    Returns:
      uint32 words; serialised little-endian, block i is the keystream of counter `counters[i]`.
      NumPy in, NumPy out; a JAX array (or tracer) anywhere gives a JAX array (jit- and vmap-able).
    """
    xp = _xp(key, nonce, counters)
    return xp.stack(_block_words(xp, key, nonce, counters), axis=-1)


def block_words(key, nonce, num_blocks: int) -> list:
    """Blocks 0 .. num_blocks - 1 of (key, nonce) word by word: 16 arrays (..., num_blocks), array w holding
    word w of every block (`blocks` transposed). The same keystream words, never interleaved into blocks.
    The reference of `jaxdp.pallas.chacha_words.keystream_words`, which `jaxdp.noise.draws` reads (one Triton
    kernel on a GPU)."""
    if not 0 < num_blocks <= MAX_BLOCKS:
        raise ValueError(f"a ChaCha20 stream holds {MAX_BLOCKS} blocks of 16 words; asked for {num_blocks}")
    xp = _xp(key, nonce)
    words = _block_words(xp, key, nonce, xp.arange(num_blocks, dtype=xp.uint32))
    if xp is np:
        return words
    # Stored once, then read: XLA:CPU fused the rounds into a consumer's concatenate and never finished.
    import jax
    return list(xp.moveaxis(jax.lax.optimization_barrier(xp.stack(words, axis=-2)), -2, 0))


def initial_state(key, nonce):
    """The 16-word state of block 0 (RFC 8439 section 2.3): constants, key, counter 0, nonce; (16,) uint32."""
    xp = _xp(key, nonce)
    constants, key = _expand(xp, xp.asarray(key).astype(xp.uint32))
    return xp.concatenate([xp.asarray(constants, xp.uint32), key, xp.zeros(1, xp.uint32),
                           xp.asarray(nonce).astype(xp.uint32)])


def _expand(xp, key):
    """(the four constant words, the 8-word key): a 128-bit key is written twice ("expand 16-byte k")."""
    if key.shape[-1] == 8:
        return _EXPAND_32, key
    return _EXPAND_16, xp.concatenate([key, key], axis=-1)


def _block_words(xp, key, nonce, counters) -> list:
    """The 16 keystream words of each block, as 16 arrays (..., N)."""
    key, nonce, counters = (xp.asarray(a).astype(xp.uint32) for a in (key, nonce, counters))
    if key.shape[-1:] not in ((4,), (8,)) or nonce.shape[-1:] != (3,) or counters.ndim != 1:
        raise ValueError(f"chacha.blocks takes key (..., 8) or (..., 4), nonce (..., 3) and counters (N,); "
                         f"got {key.shape}, {nonce.shape}, {counters.shape}")
    constants, key = _expand(xp, key)
    batch = np.broadcast_shapes(key.shape[:-1], nonce.shape[:-1])
    word = lambda w: xp.broadcast_to(w[..., None], batch + counters.shape)  # noqa: E731
    start = ([word(xp.full(batch, c, xp.uint32)) for c in constants] + [word(key[..., i]) for i in range(8)]
             + [xp.broadcast_to(counters, batch + counters.shape)] + [word(nonce[..., i]) for i in range(3)])
    s = list(start)
    for _ in range(10):  # unrolled: under jit, one elementwise fusion (a loop would store the state 10 times)
        s = _double_round(s)
    return [x + y for x, y in zip(s, start)]


def stream(key, nonce, num_words: int, first_block: int = 0):
    """The first `num_words` keystream words of (key, nonce) from block `first_block` on: (..., num_words)."""
    num_blocks = -(-int(num_words) // WORDS_PER_BLOCK)
    if first_block < 0 or first_block + num_blocks > MAX_BLOCKS:
        raise ValueError(f"a ChaCha20 stream holds {MAX_BLOCKS} blocks of 16 words; asked for blocks "
                         f"[{first_block}, {first_block + num_blocks})")
    xp = _xp(key, nonce)
    counters = xp.arange(first_block, first_block + num_blocks, dtype=xp.uint32)
    out = blocks(key, nonce, counters)
    return out.reshape(out.shape[:-2] + (-1,))[..., :num_words]
