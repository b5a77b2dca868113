"""ChaCha20 keystream words in one Triton kernel; `keystream_words` picks it on a GPU and `jaxdp.noise.chacha`'s
jnp path (the reference) elsewhere.

XLA compiles the 20 unrolled rounds of `jaxdp.noise.chacha` (about 1,600 integer operations per block)
into one huge elementwise fusion, which XLA:GPU splits into large fusions that move far more
bytes than the words and are slow to compile. Here each program runs the rounds in a loop over
`BLOCK` counters held in registers and writes the 16 words of its blocks once (64 bytes per
block, the compulsory traffic): the rounds are the same code (`jaxdp.noise.chacha._double_round`), the
reference is `jaxdp.noise.chacha`'s jnp path, and the tests compare the two in the Pallas interpreter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxdp.noise import chacha
from jaxdp.pallas import _common

BLOCK = 1024  # counters per program


def _kernel(start_ref, *out_refs):
    start = [start_ref[w] for w in range(chacha.WORDS_PER_BLOCK)]
    # uint32 throughout: up to 2^32 blocks (int32 would wrap at 2^31 blocks, which one large draw of noise reaches)
    counters = pl.program_id(0).astype(jnp.uint32) * jnp.uint32(BLOCK) + jnp.arange(BLOCK, dtype=jnp.uint32)
    counters = counters + start[12]
    init = [counters if w == 12 else jnp.full((BLOCK,), s, jnp.uint32) for w, s in enumerate(start)]
    x = lax.fori_loop(0, 10, lambda _, s: tuple(chacha._double_round(list(s))), tuple(init))
    for w in range(chacha.WORDS_PER_BLOCK):
        out_refs[w][...] = x[w] + init[w]


def block_words(start_16: jax.Array, num_blocks: int, *, interpret: bool | None = None) -> list[jax.Array]:
    """16 arrays (num_blocks,) uint32: word w of blocks 0 .. num_blocks - 1 from the initial state `start_16`
    (constants, key, block counter 0, nonce: `jaxdp.noise.chacha.initial_state`). Sixteen outputs, not one
    (16, N) array: XLA fuses a consumer's slice of an output into the consumer, not a slice of a row."""
    word = _common.out_struct((num_blocks,), jnp.uint32, start_16)
    return pl.pallas_call(  # the last program's blocks past num_blocks are not stored (Pallas masks them)
        _kernel,
        out_shape=[word] * chacha.WORDS_PER_BLOCK,
        grid=(pl.cdiv(num_blocks, BLOCK),),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[pl.BlockSpec((BLOCK,), lambda i: (i,))] * chacha.WORDS_PER_BLOCK,
        compiler_params=_common.compiler_params(num_warps=4),
        interpret=_common.resolve_interpret(interpret),
        name="chacha20_block_words",
    )(start_16.astype(jnp.uint32))


def keystream_words(key, nonce, num_blocks: int, *, implementation: str | None = None) -> list[jax.Array]:
    """`jaxdp.noise.chacha.block_words(key, nonce, num_blocks)` for one (key, nonce): 16 arrays (num_blocks,) uint32.

    implementation: "pallas" (the Triton kernel, `block_words`), "xla" (`jaxdp.noise.chacha`'s jnp rounds), or
    None: "pallas" where Pallas compiles (a GPU), "xla" where it would only interpret. Both give the same
    words (tests/test_chacha.py)."""
    if implementation is None:
        implementation = "xla" if _common.resolve_interpret(None) else "pallas"
    if implementation == "xla":
        return chacha.block_words(key, nonce, num_blocks)
    if implementation != "pallas":
        raise ValueError(f'implementation must be "pallas", "xla" or None, got {implementation!r}')
    if not 0 < num_blocks <= chacha.MAX_BLOCKS:
        raise ValueError(f"a ChaCha20 stream holds {chacha.MAX_BLOCKS} blocks of 16 words; asked for {num_blocks}")
    return block_words(chacha.initial_state(key, nonce), num_blocks)
