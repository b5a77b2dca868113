"""Per-example language-model losses: the `loss_fn` of the DP step.

Each returns one loss per window (B,): the mean next-token NLL over the
window's targets, exactly 0 where `batch["mask"]` is False (padding slots),
so a masked window contributes nothing to any gradient. Windows may end in
`jaxdp.data.windows.PAD` (a document's padded last window): PAD targets are not
counted and PAD inputs are read as token 0; they follow every real token,
so causal attention keeps them out of the real positions.

`completion_losses(marker)` counts only the targets after the last occurrence
of a token sequence in the window (the label after a prompt: a completion-only
loss, as in instruction tuning); a window without the marker has no target.
`instruction_losses` counts the completion tokens of instruction windows
(`jaxdp.data.instructions`), which carry their own mask: a context token id i is
stored as `-2 - i`, read back as an input and never counted as a target.

A frozen head (fine-tuning: every `jaxdp.finetune.methods` method but full) runs over
chunks of tokens (`token_nll`): each chunk's logits are recomputed in the
backward, so the (B, T, V) float32 logits and their gradient never exist
whole (GPT-2 large, B 32, T 128: 0.82 GB each).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxdp.core import sequence_shards as context


def lm_losses(model: nnx.Module, batch) -> jax.Array:
    """Per-window mean next-token NLL (B,) of {"tokens" (B, T + 1), "mask" (B,)}."""
    tokens_BT1 = batch["tokens"]
    return _mean_nll(model, tokens_BT1, batch["mask"], tokens_BT1[:, 1:] >= 0)


def instruction_losses(model: nnx.Module, batch) -> jax.Array:
    """Per-window mean NLL (B,) over the completion targets of instruction windows (`jaxdp.data.instructions`):
    a stored token t >= 0 is a counted token, t <= -2 the context token `-2 - t` (an input only), PAD (-1)
    neither. A window with no counted target has loss 0."""
    tokens_BT1 = batch["tokens"]
    ids_BT1 = jnp.where(tokens_BT1 <= -2, -2 - tokens_BT1, tokens_BT1)  # PAD stays -1: token 0 below
    return _mean_nll(model, ids_BT1, batch["mask"], tokens_BT1[:, 1:] >= 0)


def completion_losses(marker: Sequence[int]) -> Callable:
    """The loss `(model, batch) -> (B,)`: per-window mean NLL over the targets after the last occurrence of
    the token sequence `marker` in the window's tokens (e.g. the encoded prompt before a label); 0 for a
    window without it. The marker's own tokens and everything before are context only. One function per
    marker (jitted steps cache on it)."""
    marker = tuple(int(t) for t in marker)
    if not marker:
        raise ValueError("completion_losses: marker must hold at least one token id")
    return _completion_losses(marker)


@functools.lru_cache(maxsize=None)
def _completion_losses(marker: tuple[int, ...]) -> Callable:
    def losses(model: nnx.Module, batch) -> jax.Array:
        tokens_BT1 = batch["tokens"]
        return _mean_nll(model, tokens_BT1, batch["mask"], completion_targets(tokens_BT1, marker))
    losses.__qualname__ = losses.__name__ = f"completion_losses{marker}"
    return losses


def completion_targets(tokens_BT1: jax.Array, marker: tuple[int, ...]) -> jax.Array:
    """(B, T) bool: the targets `completion_losses(marker)` counts (non-PAD, after the window's last
    `marker`); all False in a window without it."""
    return (tokens_BT1[:, 1:] >= 0) & _after_last(tokens_BT1, marker)[:, :-1]


def _after_last(tokens_BT1: jax.Array, marker: tuple[int, ...]) -> jax.Array:
    """(B, T + 1) bool: position j holds the last token of the window's last `marker` or comes later
    (so the target predicted at j lies after the marker); all False in a window without it."""
    m, n = len(marker), tokens_BT1.shape[1]
    if m > n:
        return jnp.zeros(tokens_BT1.shape, bool)
    ends = jnp.ones((tokens_BT1.shape[0], n - m + 1), bool)  # ends[:, s]: the marker occupies s .. s + m - 1
    for k, token in enumerate(marker):
        ends &= tokens_BT1[:, k:n - m + 1 + k] == token
    pos = jnp.arange(m - 1, n)
    last_end_B = jnp.max(jnp.where(ends, pos, -1), axis=1)
    return (jnp.arange(n)[None, :] >= last_end_B[:, None]) & (last_end_B[:, None] >= 0)


def _mean_nll(model: nnx.Module, tokens_BT1: jax.Array, mask_B: jax.Array, counted_BT: jax.Array) -> jax.Array:
    """Mean NLL over each window's counted targets (0 with none), 0 where `mask_B` is False."""
    nll_BT = token_nll(model, jnp.maximum(tokens_BT1[:, :-1], 0), jnp.maximum(tokens_BT1[:, 1:], 0))
    per_example = (jnp.where(counted_BT, nll_BT, 0.0).astype(jnp.float32).sum(axis=-1)
                   / jnp.maximum(counted_BT.sum(axis=-1), 1))
    return jnp.where(mask_B, per_example, 0.0)


HEAD_CHUNK_BYTES = 2**27  # float32 logits of one chunk of a frozen head: 128 MiB (667 tokens at V = 50,257)


def token_nll(model: nnx.Module, inputs_BT: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """(B, T) next-token NLL of `targets_BT` (ids in [0, V)) after `inputs_BT`.

    A model whose head is frozen (`model.frozen_head()` not None) gives its features once, and the head and
    the softmax run over chunks of HEAD_CHUNK_BYTES / (4 V) tokens under `jax.checkpoint` (recomputed in
    the backward): one GEMM of the head more per step, and the peak holds one chunk's logits. The chunks
    mix tokens of several examples, but each token's NLL reads only its own features, so per-example
    gradients are unchanged. Otherwise the plain float32 logits.
    """
    head = getattr(model, "frozen_head", lambda: None)()
    if head is None:
        return optax.softmax_cross_entropy_with_integer_labels(model(inputs_BT), targets_BT)
    h_BTD = model.features(inputs_BT)
    (B, T, D), V = h_BTD.shape, jax.eval_shape(head, h_BTD[:1, :1]).shape[-1]
    n = B * T
    chunk = min(n, max(1, HEAD_CHUNK_BYTES // (4 * V)))
    pad = -n % chunk
    h_KCD = jnp.pad(h_BTD.reshape(n, D), ((0, pad), (0, 0))).reshape(-1, chunk, D)
    t_KC = jnp.pad(targets_BT.reshape(n), (0, pad)).reshape(-1, chunk)

    @jax.checkpoint
    def chunk_nll(args):
        h_CD, t_C = args
        return optax.softmax_cross_entropy_with_integer_labels(head(h_CD[None])[0], t_C)
    return jax.lax.map(chunk_nll, (h_KCD, t_KC)).reshape(-1)[:n].reshape(B, T)


def cp_lm_losses(model: nnx.Module, batch, seq_axis: str | None = None) -> jax.Array:
    """`lm_losses` on {"inputs", "targets", "mask"}; with `seq_axis` (the mesh axis sharding the sequence,
    context parallelism) this shard's share, passing `seq_axis` to the model's call."""
    inputs_BT = jnp.maximum(batch["inputs"], 0)
    logits_BTV = model(inputs_BT) if seq_axis is None else model(inputs_BT, seq_axis=seq_axis)
    targets_BT = batch["targets"]
    nll_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, jnp.maximum(targets_BT, 0))
    valid_BT = targets_BT >= 0
    # This shard's share: its valid targets' NLL over the example's valid targets on all shards.
    per_example = (jnp.where(valid_BT, nll_BT, 0.0).astype(jnp.float32).sum(axis=-1)
                   / jnp.maximum(context.sequence_count(valid_BT, seq_axis), 1.0))
    return jnp.where(batch["mask"], per_example, 0.0)
