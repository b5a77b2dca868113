"""jaxdp.core.losses.completion_losses: the loss of the text after a marker (the fine-tuning job's label loss).

Properties: on random tokens it equals a float64 NumPy computation from the model's logits, counting
exactly the targets after the window's last marker (none without one, none past a PAD); a planted
off-by-one (counting from the first marker) is told apart; the DP step's per-example gradients of it
equal the vmap reference.
"""

import numpy as np
from dp_testing import by_path, max_rel_err, reference_grads, tiny_gpt2
from flax import nnx

import jaxdp
from jaxdp.core.losses import completion_losses
from jaxdp.data.windows import PAD

MARKER = (5, 6, 7)
VOCAB, T = 97, 16


def batch_with_markers(seed):
    """(B, T + 1) random tokens from 8.. (never a marker token) with markers planted; the mask."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(8, VOCAB, (6, T + 1)).astype(np.int32)
    tokens[0, 3:6] = MARKER                               # one marker
    tokens[0, -3:] = PAD                                  # a padded tail: not counted
    tokens[1, 2:5] = tokens[1, 9:12] = MARKER             # two: after the last one only
    tokens[3, T - 2:] = MARKER                            # at the very end: no target after it
    tokens[4, 0:3] = MARKER                               # at the start
    tokens[5, 6:9] = MARKER                               # masked out below
    return {"tokens": tokens, "mask": np.arange(6) < 5}    # window 2 has no marker


def expected_losses(model, batch, first=False):
    """float64 NumPy: mean -log p(target) over the targets after the (last, or `first`) marker."""
    tokens = batch["tokens"]
    logits = np.asarray(model(np.maximum(tokens[:, :-1], 0)), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    out = np.zeros(len(tokens))
    for b, row in enumerate(tokens):
        ends = [s + len(MARKER) - 1 for s in range(len(row) - len(MARKER) + 1)
                if tuple(row[s:s + len(MARKER)]) == MARKER]
        if not ends or not batch["mask"][b]:
            continue
        e = ends[0] if first else ends[-1]
        counted = [t for t in range(e, T) if row[t + 1] >= 0]  # target t is token t + 1
        if counted:
            out[b] = -np.mean([logp[b, t, row[t + 1]] for t in counted])
    return out


def test_completion_losses_count_the_text_after_the_last_marker():
    model = tiny_gpt2(3, vocab_size=VOCAB)
    batch = batch_with_markers(11)
    got = np.asarray(completion_losses(MARKER)(model, batch), np.float64)
    want = expected_losses(model, batch)
    tol = 20 * np.finfo(np.float32).eps * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    assert got[2] == got[3] == got[5] == 0.0 and (got[[0, 1, 4]] > 0).all()  # none / at the end / masked
    planted = expected_losses(model, batch, first=True)  # counting from the first marker: caught
    assert np.abs(got - planted).max() > 1e3 * tol
    assert completion_losses(list(MARKER)[:2] + [7]) is completion_losses(MARKER)  # one function per marker


def test_per_example_grads_of_the_completion_loss_equal_the_reference():
    model = tiny_gpt2(4, vocab_size=VOCAB)
    batch = batch_with_markers(12)
    loss = completion_losses(MARKER)

    @nnx.jit
    def dense_grads(model, batch):  # one compile (eagerly the op-by-op dispatch is the slow part)
        _, grads = jaxdp.per_example_grads(loss)(model, batch)
        return {p: sum(jaxdp.core.terms.instantiate(t) for t in g.terms) for p, g in by_path(grads).items()}
    dense = dense_grads(model, batch)
    _, ref = reference_grads(loss, model, batch)
    assert max_rel_err(dense, ref) <= 1e-5
    assert np.abs(np.asarray(ref[("wte", "embedding")])[[2, 3, 5]]).max() == 0.0  # windows with no target
