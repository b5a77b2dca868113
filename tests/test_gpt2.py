"""GPT-2 model: shapes, presets, causality, bf16 compute, config validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_testing import lm_batch, lm_loss, tiny_gpt2
from flax import nnx

import jaxdp
from jaxdp.models.gpt2 import GPT2, GPT2Config

# Parameter counts of the released GPT-2 checkpoints (tied head, 1024 positions).
RELEASED = {"small": 124_439_808, "medium": 354_823_168, "large": 774_030_080, "xl": 1_557_611_200}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_presets_match_released_sizes(name):
    config = GPT2Config.preset(name)
    model = nnx.eval_shape(lambda: GPT2(config, rngs=nnx.Rngs(0)))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert count == config.num_params == RELEASED[name]


def test_logits_shape_and_causality():
    model = tiny_gpt2(seed=1)
    tokens = jax.random.randint(jax.random.key(2), (3, 12), 0, 97)
    changed = tokens.at[:, 8:].set((tokens[:, 8:] + 1) % 97)
    logits, logits_changed = nnx.jit(lambda m, a, b: (m(a), m(b)))(model, tokens, changed)  # one compile
    assert logits.shape == (3, 12, 97) and logits.dtype == jnp.float32
    np.testing.assert_allclose(logits_changed[:, :8], logits[:, :8], rtol=1e-6, atol=1e-6)
    assert not np.allclose(logits_changed[:, 8:], logits[:, 8:])


def test_bf16_compute_float32_params():
    """bf16 compute keeps float32 parameters; DP norms agree with float32 to bf16 precision."""
    model32 = tiny_gpt2(seed=5)
    model16 = tiny_gpt2(seed=5, dtype="bfloat16")
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model16, nnx.Param)))
    batch = lm_batch(6)
    grads_fn = jaxdp.per_example_grads(lm_loss)
    norms_fn = nnx.jit(lambda m: jaxdp.clipped_aggregate(grads_fn(m, batch)[1], 1.0)[1]["all"])
    norms = [norms_fn(m) for m in (model32, model16)]  # jitted: eagerly the tape is thousands of dispatches
    assert norms[1].dtype == jnp.float32
    np.testing.assert_allclose(norms[1][:-1], norms[0][:-1], rtol=5e-2)


def test_too_long_sequence_is_rejected():
    model = tiny_gpt2(seq_len=16)
    with pytest.raises(ValueError, match="seq_len"):
        model(jnp.zeros((1, 17), jnp.int32))


@pytest.mark.parametrize("kwargs, name", [
    (dict(n_layer=0), "n_layer"), (dict(d_model=30, n_head=4), "divisible"), (dict(dtype="fp8"), "dtype")])
def test_bad_config(kwargs, name):
    with pytest.raises(ValueError, match=name):
        GPT2Config(**kwargs)
    with pytest.raises(ValueError, match="preset"):
        GPT2Config.preset("huge")
    with pytest.raises(ValueError, match=name):  # a preset's own fields can be overridden, and are checked
        GPT2Config.preset("tiny", **kwargs)
    assert GPT2Config.preset("tiny", n_layer=3).n_layer == 3 != GPT2Config.preset("tiny").n_layer


def test_attention_implementation_choice(monkeypatch):
    """"auto" is cuDNN's fused attention on a GPU for bf16 / f16 heads cuDNN takes, XLA otherwise."""
    from jaxdp.models import attention
    assert attention.resolve("auto", jnp.bfloat16, 64) == ("cudnn" if jax.default_backend() == "gpu" else "xla")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert attention.resolve("auto", jnp.bfloat16, 64) == "cudnn"
    assert attention.resolve("auto", jnp.float16, 128) == "cudnn"
    assert attention.resolve("auto", jnp.float32, 64) == "xla"     # cuDNN's kernel takes bf16 / f16 only
    assert attention.resolve("auto", jnp.bfloat16, 256) == "xla"   # head size beyond cuDNN's
    assert attention.resolve("xla", jnp.bfloat16, 64) == "xla"
    with pytest.raises(ValueError, match="attention must be one of"):
        GPT2Config.preset("tiny", attention="flash")
