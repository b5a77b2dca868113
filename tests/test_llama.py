"""Llama model: published sizes, causality, config validation, per-example gradients vs the vmap reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_testing import (
    clip_between,
    first_updates_fn,
    lm_batch,
    lm_loss,
    max_rel_err,
    reference_grads,
    tiny_llama,
)
from flax import nnx

import jaxdp
import jaxdp.core.reference  # the vmap oracle: not exported by jaxdp
from jaxdp.models.llama import Llama, LlamaConfig, rope_frequencies
from jaxdp.clipping.settings import ClipSpec, NormPlan

# Published parameter counts: Llama 3.2 1B / 3B (tied head), Llama 3.1 8B (untied).
PUBLISHED = {"1B": 1_235_814_400, "3B": 3_212_749_824, "8B": 8_030_261_248}
RTOL = 1e-5  # float32, highest matmul precision
EXPECTED_BATCH_SIZE = 5.0


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_match_published_sizes(name):
    config = LlamaConfig.preset(name)
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert count == config.num_params == PUBLISHED[name]


def test_logits_shape_and_causality():
    model = tiny_llama(seed=1)
    tokens = jax.random.randint(jax.random.key(2), (3, 12), 0, 97)
    changed = tokens.at[:, 8:].set((tokens[:, 8:] + 1) % 97)
    logits, logits_changed = nnx.jit(lambda m, a, b: (m(a), m(b)))(model, tokens, changed)
    assert logits.shape == (3, 12, 97) and logits.dtype == jnp.float32
    np.testing.assert_allclose(logits_changed[:, :8], logits[:, :8], rtol=1e-6, atol=1e-6)
    assert not np.allclose(logits_changed[:, 8:], logits[:, 8:])


def test_rope_scaling_only_slows_low_frequencies():
    plain = rope_frequencies(LlamaConfig.preset("8B", rope_scaling=None))
    scaled = rope_frequencies(LlamaConfig.preset("8B"))
    np.testing.assert_allclose(scaled[:8], plain[:8])           # short wavelengths untouched
    np.testing.assert_allclose(scaled[-4:], plain[-4:] / 8.0, rtol=1e-6)  # long ones / factor


def test_bf16_compute_float32_params():
    model32, model16 = tiny_llama(seed=5), tiny_llama(seed=5, dtype="bfloat16")
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model16, nnx.Param)))
    tokens = jax.random.randint(jax.random.key(6), (2, 16), 0, 97)
    logits16, logits32 = nnx.jit(lambda a, b, t: (a(t), b(t)))(model16, model32, tokens)
    assert logits16.dtype == jnp.float32
    np.testing.assert_allclose(logits16, logits32, atol=5e-2)


def test_too_long_sequence_is_rejected():
    with pytest.raises(ValueError, match="seq_len"):
        tiny_llama(seq_len=16)(jnp.zeros((1, 17), jnp.int32))


@pytest.mark.parametrize("kwargs, name", [
    (dict(n_layer=0), "n_layer"), (dict(n_kv_head=0), "n_kv_head"), (dict(d_model=30, n_head=4), "n_head"),
    (dict(n_head=4, n_kv_head=3, d_model=64), "n_kv_head"), (dict(dtype="fp8"), "dtype"),
    (dict(rope_theta=0.0), "rope_theta"), (dict(rope_scaling=0.5), "rope_scaling"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"), (dict(head_dim=7), "head_dim"), (dict(qk_norm=1), "qk_norm"),
    (dict(sliding_window=0), "sliding_window")])
def test_bad_config(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LlamaConfig(**kwargs)
    with pytest.raises(ValueError, match="preset"):
        LlamaConfig.preset("70B")


CONFIGS = [("flat", "abadi", "ghost"), ("flat", "automatic", "instantiate"),
           ("per_layer", "automatic", "ghost"), ("per_layer", "abadi", "instantiate")]


# remat "none" spelled as the default, so that the untied model's jitted reference is the one of
# test_two_pass / test_remat (one compile); True is "full".
@pytest.mark.parametrize("tied, remat", [(False, "none"), (True, True)], ids=["untied", "tied_remat"])
def test_fused_clip_equals_reference(tied, remat):
    """per_example_grads + fused_clip (sigma = 0) equals the vmap reference; all configs in one jit."""
    model = tiny_llama(seed=11, tie_embeddings=tied, remat=remat)
    batch = lm_batch(seed=12)
    _, ref_grads = reference_grads(lm_loss, model, batch)
    C = clip_between(ref_grads)  # strictly between the norms: some examples clipped, some not
    txs = [jaxdp.fused_clip(C, 0.0, expected_batch_size=EXPECTED_BATCH_SIZE, clip=ClipSpec(clipping=c, clip_fn=f),
                            norms=NormPlan(strategy=s))
           for c, f, s in CONFIGS]
    all_updates = first_updates_fn(lm_loss, txs, fallback=False)

    for (clipping, clip_fn, strategy), updates in zip(CONFIGS, all_updates(model, batch)):
        sums, _ = jaxdp.core.reference.clipped_sum(ref_grads, C, clipping=clipping, clip_fn=clip_fn)
        expected = {p: s / EXPECTED_BATCH_SIZE for p, s in sums.items()}
        err = max_rel_err(updates, expected)
        assert err <= RTOL, (clipping, clip_fn, strategy, err)
