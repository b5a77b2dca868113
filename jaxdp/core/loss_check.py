"""`check_per_example_loss`: a host-side check that a loss does not couple examples.

DP-SGD bounds each example's contribution to the clipped sum by C. That holds
only if `losses[b]` depends on example b's data alone: with a loss that couples
examples (batch statistics, logits normalised over the batch, in-batch
negatives) example b also moves the other examples' gradients, and its
contribution to the clipped sum is no longer bounded by C.

The check runs the loss up to five times: on the batch, on a copy in which
example 0's data is replaced by another example's (example j's), and on the
batch without example 0, without the example of the largest loss and without
that of the smallest (which catch a loss divided by the count of examples or
normalised by the batch's extremes). A per-example loss leaves
every other example's loss unchanged and gives example 0 example j's loss.
Replacing one example's content, rather than permuting the batch, is what
catches permutation-equivariant couplings such as subtracting the batch mean.
Example 0 must also take example j's loss with its data: with Poisson sampling
an example's row depends on which others were sampled, so a loss that depends
on the row (a weight per position) couples examples too. It is a necessary
condition checked on one batch, not a proof.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdp.core.per_example import LossFn, _check_losses

# Default relative tolerance, in ulps of the loss dtype. Both evaluations run
# the same ops on the same shapes, so a per-example loss gives (nearly) bitwise
# the same losses; the slack covers a row computed at another batch position.
_RTOL_ULPS = 64


def check_per_example_loss(loss_fn: LossFn, model: nnx.Module, batch: Any, *,
                           rtol: float | None = None) -> None:
    """Raises a ValueError if `loss_fn` is not a per-example loss on `batch`.

    Run it once, eagerly, before training (it cannot raise inside `jax.jit`):

      >>> jaxdp.check_per_example_loss(loss_fn, model, first_batch)
      >>> grads_fn = jaxdp.per_example_grads(loss_fn)

    `jaxdp.per_example_grads` requires `losses[b]` to be a function of example
    b's data only. This evaluates `losses = loss_fn(model, batch)`, then the
    losses of a batch in which example 0's data (every batch leaf whose
    leading axis has size B) is replaced by example j's, the first example
    whose data differs from example 0's; it requires every other example's
    loss to be unchanged and example 0's loss to equal example j's, each to
    `rtol * max_b |losses[b]|`. The model is not changed (the loss runs on
    clones of it). A few examples suffice; the loss runs up to five times (three
    without one example: example 0, the largest loss's, the smallest's; the
    other losses must not change). Turn dropout
    off for the check: a mask drawn per row does not follow the data.

    Args:
      loss_fn: `loss_fn(model, batch) -> losses` of shape (B,), as for
        `jaxdp.per_example_grads`.
      model: the model (an `nnx.Module`), e.g. a `jaxdp.models` GPT-2 or Llama.
      batch: a pytree of arrays; leaves with leading axis B hold per-example
        data, other leaves are shared by all examples. B >= 2, and at least
        two examples must differ.
      rtol: relative tolerance; None means 64 ulps of the loss dtype.

    Raises:
      ValueError: if the losses are not of shape (B,), B < 2, no two examples
        differ, a loss is not finite, or a loss changed with another
        example's data (or did not follow its own).
    """
    losses = _losses(loss_fn, model, batch)
    _check_losses(losses)
    B = losses.shape[0]
    if B < 2:
        raise ValueError(
            f"check_per_example_loss needs a batch of at least 2 examples; loss_fn returned "
            f"B={B} losses for `batch`.")
    source = _differing_example(batch, B)
    moved = jax.tree.map(lambda a: _copy_row(a, source, B) if _is_per_example(a, B) else a, batch)
    moved_losses = _losses(loss_fn, model, moved)
    not_finite = np.flatnonzero(~(np.isfinite(losses) & np.isfinite(moved_losses)))
    if not_finite.size:
        raise ValueError(
            "check_per_example_loss needs finite losses; the loss of example(s) "
            f"{not_finite.tolist()} is not finite.")

    rtol = _RTOL_ULPS * float(jnp.finfo(losses.dtype).eps) if rtol is None else rtol
    losses, moved_losses = losses.astype(np.float64), moved_losses.astype(np.float64)
    tol = rtol * float(np.max(np.abs(losses)))
    why = ("Per-example losses must not couple examples (no batch statistics, normalisation "
           "over the batch, or in-batch negatives): the clip bound C on each example's "
           "contribution to the clipped sum, and with it the DP guarantee, no longer holds.")
    change_B = np.abs(moved_losses - losses)
    change_B[0] = 0.0
    b = int(np.argmax(change_B))
    if change_B[b] > tol:
        raise ValueError(
            f"loss_fn couples examples: replacing example 0's data by example {source}'s "
            f"changed the loss of example {b} by {change_B[b]:.3g} (from {losses[b]:.8g} to "
            f"{moved_losses[b]:.8g}; tolerance {tol:.3g}). {why}")
    if abs(moved_losses[0] - losses[source]) > tol:
        raise ValueError(
            "loss_fn depends on more than each example's own data (on its row or on other "
            "examples; turn dropout off for this check): example 0 with example "
            f"{source}'s data has loss {moved_losses[0]:.8g}, example {source} has "
            f"{losses[source]:.8g} (difference {abs(moved_losses[0] - losses[source]):.3g}; "
            f"tolerance {tol:.3g}). {why}")
    # Removing an example (its rows) must leave every other loss as it was: a swap keeps the batch's count of
    # examples and its extremes, so a loss divided by the count (mask.sum()) or by the batch's largest loss
    # passes the checks above, though one example then moves every other loss and the clipped sum by more
    # than C. Removed: example 0 and the examples of the largest and the smallest loss.
    for r in dict.fromkeys([0, int(np.argmax(losses)), int(np.argmin(losses))]):
        others = np.arange(B) != r
        kept = _losses(loss_fn, model, jax.tree.map(lambda a: a[others] if _is_per_example(a, B) else a, batch))
        change = np.abs(kept.astype(np.float64) - losses[others])
        b = int(np.argmax(change))
        if change[b] > tol:
            k = int(np.flatnonzero(others)[b])
            raise ValueError(
                f"loss_fn couples examples: removing example {r} changed the loss of example {k} by "
                f"{change[b]:.3g} (from {losses[k]:.8g} to {kept[b]:.8g}; tolerance {tol:.3g}): it depends on "
                f"the batch's size, count of examples or extremes (e.g. divides by mask.sum()). {why}")


def _losses(loss_fn: LossFn, model: nnx.Module, batch) -> np.ndarray:
    """The losses as a host array, on a clone so that `model` keeps its state."""
    return np.asarray(jax.device_get(loss_fn(nnx.clone(model), batch)))


def _is_per_example(leaf, B: int) -> bool:
    return getattr(leaf, "ndim", 0) >= 1 and leaf.shape[0] == B


def _copy_row(leaf, source: int, B: int):
    """`leaf` with row 0 replaced by row `source` (a NumPy leaf stays NumPy)."""
    if isinstance(leaf, np.ndarray):
        out = leaf.copy()
        out[0] = leaf[source]
        return out
    return leaf.at[0].set(leaf[source])


def _differing_example(batch, B: int) -> int:
    """The first example j >= 1 whose per-example data differs from example 0's."""
    rows = [np.asarray(leaf) for leaf in jax.tree.leaves(batch) if _is_per_example(leaf, B)]
    if not rows:
        raise ValueError(
            f"check_per_example_loss found no leaf of `batch` with leading axis B={B} (the "
            "number of losses); per-example data must be batched along axis 0.")
    for j in range(1, B):
        if any(not np.array_equal(r[0], r[j]) for r in rows):
            return j
    raise ValueError(
        f"all {B} examples of `batch` are identical; check_per_example_loss needs at least "
        "two examples that differ.")
