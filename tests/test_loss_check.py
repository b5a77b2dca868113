"""check_per_example_loss: per-example losses pass, losses coupling examples fail, and why it matters."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_testing import lm_batch, lm_loss, tiny_gpt2, tiny_llama
from flax import nnx

import jaxdp


@pytest.fixture(scope="module")
def models():
    return {"gpt2": tiny_gpt2(seed=1), "llama": tiny_llama(seed=1)}


def batch_normalised_loss(model, batch):
    """lm_loss with the logits centred over the batch: every example's loss depends on all examples."""
    logits_BTV = model(batch["tokens"][:, :-1])
    logits_BTV = logits_BTV - logits_BTV.mean(axis=0, keepdims=True)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, batch["tokens"][:, 1:])
    return jnp.where(batch["mask"], nll.mean(axis=-1), 0.0)


def row_weighted_loss(model, batch):
    """lm_loss weighted by the row: with Poisson sampling the row depends on the other examples."""
    return lm_loss(model, batch) * (1.0 + jnp.arange(batch["mask"].shape[0]))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_per_example_lm_loss_passes(models, family):
    jaxdp.check_per_example_loss(lm_loss, models[family], lm_batch(2))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_batch_normalised_logits_fail(models, family):
    with pytest.raises(ValueError, match=r"couples examples: replacing example 0's data by "
                       r"example 1's changed the loss of example [1-5] by .*must not couple"):
        jaxdp.check_per_example_loss(batch_normalised_loss, models[family], lm_batch(2))


def test_row_dependent_loss_fails(models):
    with pytest.raises(ValueError, match="example 0 with example 1's data has loss"):
        jaxdp.check_per_example_loss(row_weighted_loss, models["gpt2"], lm_batch(2))


def test_loss_divided_by_the_count_of_examples_fails(models):
    """Attacker review 12: a loss divided by mask.sum() passed (swapping two examples keeps the count) and
    let one example move the clipped sum by 1.7 C; removing example 0 shows the coupling."""
    def count_normalised_loss(model, batch):
        return lm_loss(model, batch) * batch["mask"].shape[0] / batch["mask"].sum()
    with pytest.raises(ValueError, match="removing example 0 changed the loss of example .* count of examples"):
        jaxdp.check_per_example_loss(count_normalised_loss, models["gpt2"], lm_batch(2))

    def max_normalised_loss(model, batch):  # review 13: neither the swap nor removing example 0 moves the max
        losses = lm_loss(model, batch)
        return losses / jax.lax.stop_gradient(losses.max())
    with pytest.raises(ValueError, match="removing example [1-9] changed the loss"):
        jaxdp.check_per_example_loss(max_normalised_loss, models["gpt2"], lm_batch(2))


def test_scalar_loss_fails_with_shape_message(models):
    mean_loss = lambda model, batch: lm_loss(model, batch).mean()
    with pytest.raises(ValueError, match=r"per-example losses of shape \(B,\); got shape \(\)"):
        jaxdp.check_per_example_loss(mean_loss, models["gpt2"], lm_batch(2))


def test_batch_needs_two_differing_examples(models):
    squared_loss = lambda model, batch: jnp.sum(batch["x"] ** 2, axis=-1)
    x = jax.random.normal(jax.random.key(3), (1, 5))
    with pytest.raises(ValueError, match="at least 2 examples; loss_fn returned B=1 losses for `batch`"):
        jaxdp.check_per_example_loss(squared_loss, models["gpt2"], {"x": x})
    batch = lm_batch(2, num_masked=0)
    same = jax.tree.map(lambda a: jnp.broadcast_to(a[:1], a.shape), batch)
    with pytest.raises(ValueError, match="all 6 examples of `batch` are identical"):
        jaxdp.check_per_example_loss(lm_loss, models["gpt2"], same)
    # Example 1 equal to example 0: the check takes example 2 and still sees the coupling.
    batch["tokens"] = batch["tokens"].at[1].set(batch["tokens"][0])
    with pytest.raises(ValueError, match="by example 2's changed the loss of example [1-5]"):
        jaxdp.check_per_example_loss(batch_normalised_loss, models["gpt2"], batch)


class CountingLM(nnx.Module):
    """A language model that counts its calls in a state variable."""

    def __init__(self, lm):
        self.lm = lm
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, tokens_BT):
        self.calls[...] += 1
        return self.lm(tokens_BT)


def test_model_state_is_left_unchanged(models):
    model = CountingLM(models["gpt2"])
    before = jax.tree.map(np.asarray, nnx.state(model))
    jaxdp.check_per_example_loss(lm_loss, model, lm_batch(2))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(model)), before)
    assert int(model.calls[...]) == 0


class Bigram(nnx.Module):
    """The smallest jaxdp.core.nn language model: next-token logits from the current token."""

    def __init__(self, vocab_size, d_model, rngs):
        self.embed = jaxdp.core.nn.Embed(vocab_size, d_model, rngs=rngs)
        self.head = jaxdp.core.nn.Linear(d_model, vocab_size, rngs=rngs)

    def __call__(self, tokens_BT):
        return self.head(jnp.tanh(self.embed(tokens_BT)))


@nnx.jit
def contributions(model, batch, without_0, C):
    """||clipped sum(batch) - clipped sum(without_0)|| / C, for lm_loss and batch_normalised_loss."""
    def clipped_sum(loss_fn, batch):
        _, grads = jaxdp.per_example_grads(loss_fn)(model, batch)
        return jaxdp.clipped_aggregate(grads, C)[0]

    def contribution(loss_fn):
        diff = jax.tree.map(jnp.subtract, clipped_sum(loss_fn, batch), clipped_sum(loss_fn, without_0))
        return optax.tree.norm(diff) / C

    return contribution(lm_loss), contribution(batch_normalised_loss)


def test_coupled_loss_breaks_the_clip_bound():
    # Examples 1..7 are one text repeated (datasets hold duplicates; DP must
    # hold for every dataset). Example 0 is removed as the Poisson sampler
    # removes one: its row becomes padding (other tokens, mask False). C is
    # below every per-example norm, so every example is clipped: a per-example
    # loss changes the clipped sum by example 0's clipped gradient alone (norm
    # C); the coupled loss also turns the 7 others' clipped gradients.
    V = 31
    model, batch = Bigram(V, 16, nnx.Rngs(0)), lm_batch(3, B=8, T=6, vocab_size=V, num_masked=0)
    batch["tokens"] = batch["tokens"].at[2:].set(batch["tokens"][1])
    padding = jax.random.randint(jax.random.key(4), batch["tokens"].shape[1:], 0, V)
    without_0 = {"tokens": batch["tokens"].at[0].set(padding), "mask": batch["mask"].at[0].set(False)}
    per_example, coupled = contributions(model, batch, without_0, 1e-4)
    np.testing.assert_allclose(per_example, 1.0, rtol=1e-5)
    assert coupled > 2.0, coupled
