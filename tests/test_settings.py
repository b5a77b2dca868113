"""The named settings (`jaxdp.ClipSpec`, `jaxdp.NormPlan`, `jaxdp.DPSpec`): each bad value is refused where the
setting is built, naming it; the keywords they replaced still work for one release and give the same result."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp.clipping.settings import ClipSpec, DPSpec, NormPlan
from jaxdp.sharding import NonPrivate


@pytest.mark.parametrize("build, name", [
    (lambda: ClipSpec(clipping="per_example"), "clipping"),
    (lambda: ClipSpec(clip_fn="tanh"), "clip_fn"),
    (lambda: ClipSpec(clip_fn="automatic", gamma=0.0), "gamma"),
    (lambda: ClipSpec(gamma=math.nan), "gamma"),
    (lambda: NormPlan(strategy="fast"), "strategy"),
    (lambda: NormPlan(chunk_size=0), "chunk_size"),
    (lambda: NormPlan(memory_budget_bytes=-1), "memory_budget_bytes"),
    (lambda: DPSpec(0.0, 1.0, 8.0), "l2_norm_clip"),
    (lambda: DPSpec(math.nan, 1.0, 8.0), "l2_norm_clip"),
    (lambda: DPSpec(math.inf, 1.0, 8.0), "l2_norm_clip"),
    (lambda: DPSpec(1.0, math.nan, 8.0), "noise_multiplier"),
    (lambda: DPSpec(1.0, -0.1, 8.0), "noise_multiplier"),
    (lambda: DPSpec(1.0, 1.0, 0.0), "expected_batch_size"),
    (lambda: DPSpec(1.0, 1.0, 8.0, secure_noise="yes"), "secure_noise"),
    (lambda: DPSpec(1.0, 1.0, 8.0, clip="flat"), "clip"),
    (lambda: NonPrivate(0.0), "expected_batch_size"),
    (lambda: jaxdp.fused_clip(1.0, 1.0, expected_batch_size=8.0, norms="auto"), "norms"),
])
def test_a_bad_setting_is_refused_by_name(build, name):
    with pytest.raises((ValueError, TypeError), match=name):
        build()


def test_settings_are_hashable_values():
    """The training job caches its optimizer on them; group weights given as a dict become a tuple."""
    a = ClipSpec("per_layer", group_weights={"a": 1.0, "b": 2.0})
    assert hash(a) == hash(ClipSpec("per_layer", group_weights={"a": 1.0, "b": 2.0})) and a.weights == {"a": 1.0, "b": 2.0}
    assert {DPSpec(1.0, 0.5, 8.0, a): 1}[DPSpec(1.0, 0.5, 8.0, a)] == 1 and hash(NormPlan("ghost")) == hash(NormPlan("ghost"))
    assert DPSpec(1.0, 0.5, 8.0).noise_std == jaxdp.clipping.rules.noise_std(1.0, 0.5)


def _grads(seed):
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.normal(size=(6, 3, 2)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(6, 2)) * 5, jnp.float32)}


def _params():
    return {"w": jnp.zeros((3, 2)), "b": jnp.zeros((2,))}


def test_the_old_keywords_give_the_same_update_with_a_deprecation_warning():
    grads, key = _grads(np.random.default_rng().integers(2**31)), jax.random.key(3)
    new = jaxdp.fused_clip(0.7, 0.5, expected_batch_size=6.0, key=key,
                           clip=ClipSpec("per_layer", "automatic", gamma=0.05), norms=NormPlan("instantiate"))
    with pytest.warns(DeprecationWarning, match=r"clip=ClipSpec.*norms=NormPlan"):
        old = jaxdp.fused_clip(0.7, 0.5, expected_batch_size=6.0, key=key, clipping="per_layer",
                               clip_fn="automatic", gamma=0.05, strategy="instantiate")
    want, _ = new.update(grads, new.init(_params()), _params())
    got, _ = old.update(grads, old.init(_params()), _params())
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)
    planted, _ = jaxdp.fused_clip(0.7, 0.5, expected_batch_size=6.0, key=key).update(grads, new.init(_params()), _params())
    assert not np.array_equal(np.asarray(planted["b"]), np.asarray(want["b"]))  # the settings do matter
    with pytest.raises(TypeError, match="together"):
        jaxdp.fused_clip(0.7, 0.5, expected_batch_size=6.0, clipping="flat", clip=ClipSpec())


def test_the_sharded_step_takes_the_old_keywords_for_one_release():
    from jaxdp import sharding
    mesh = sharding.make_mesh(1)
    with pytest.warns(DeprecationWarning, match="DPSpec"):
        step = sharding.ShardedDPStep(lambda m, b: b, optax.sgd(1.0), mesh, l2_norm_clip=0.5, noise_multiplier=1.5,
                                      expected_batch_size=4.0, clipping="per_layer", strategy="ghost")
    assert step.dp == DPSpec(0.5, 1.5, 4.0, ClipSpec("per_layer")) and step.norms == NormPlan("ghost")
    with pytest.warns(DeprecationWarning):
        base = sharding.ShardedDPStep(lambda m, b: b, optax.sgd(1.0), mesh, l2_norm_clip=0.5, noise_multiplier=1.5,
                                      expected_batch_size=4.0, private=False)
    assert base.dp == NonPrivate(4.0) and not base.private
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new form warns about nothing
        sharding.ShardedDPStep(lambda m, b: b, optax.sgd(1.0), mesh, DPSpec(0.5, 1.5, 4.0))
    with pytest.raises(TypeError, match="dp must be a jaxdp.DPSpec"):
        sharding.ShardedDPStep(lambda m, b: b, optax.sgd(1.0), mesh, 0.5)


def test_two_pass_refuses_a_clip_it_does_not_implement():
    with pytest.raises(ValueError, match="flat"):
        jaxdp.two_pass_clipped_sums(lambda m, b: b, 1.0, clip=ClipSpec("per_layer"))


def test_the_finetuning_settings_refuse_a_bad_field_by_name():
    from jaxdp.finetune.memory import StepSpec
    from jaxdp.finetune.settings import Adapters, LoRA, Prompt, Reversible, Side
    for build, name in [(lambda: LoRA(rank=0), "rank"), (lambda: LoRA(targets="attn/c_attn"), "targets"),
                        (lambda: Adapters(bottleneck=0), "bottleneck"), (lambda: Adapters(targets=()), "targets"),
                        (lambda: Prompt(length=0), "length"), (lambda: Side(reduction=0), "reduction"),
                        (lambda: Reversible(beta=0.0), "beta"), (lambda: Reversible(lora=4), "lora"),
                        (lambda: Reversible(keep_streams_every=0), "keep_streams_every"),
                        (lambda: StepSpec(0, 8), "batch_size"),
                        (lambda: StepSpec(2, 8, dp_method="ghost"), "dp_method")]:
        with pytest.raises((ValueError, TypeError), match=name):
            build()
    assert LoRA(targets=["attn/c_attn"]) == LoRA(targets=("attn/c_attn",))
    assert hash(Reversible(LoRA(rank=4))) == hash(Reversible(LoRA(rank=4)))


def _tiny_gpt2():
    from jaxdp.models.gpt2 import GPT2Config
    return GPT2Config.preset("tiny", vocab_size=97, seq_len=16, n_layer=1)


def test_finetune_prepare_takes_the_old_keywords_for_one_release():
    """The flat keywords (`rank=`, `bottleneck=`, `rev_keep_streams_every=`, ...) build the same model, bit for
    bit, as the `options` value that replaced them, with a DeprecationWarning; another method's keywords are
    ignored, as they were. A planted option changes the model; the wrong type is refused."""
    from flax import nnx

    from jaxdp.finetune import methods as finetune
    from jaxdp.finetune.settings import Adapters, LoRA, Reversible
    from jaxdp.models.gpt2 import GPT2

    def trainable(method, **kwargs):
        model = finetune.prepare(GPT2(_tiny_gpt2(), rngs=nnx.Rngs(0)), method, rngs=nnx.Rngs(1), **kwargs)
        return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}

    cases = [("lora", LoRA(rank=2, alpha=4.0), dict(rank=2, alpha=4.0, bottleneck=3)),
             ("adapter", Adapters(bottleneck=4, train_layer_norms=False), dict(bottleneck=4, train_layer_norms=False,
                                                                              rank=9)),
             ("reversible", Reversible(LoRA(rank=2), bottleneck=4, keep_streams_every=1),
              dict(rank=2, bottleneck=4, rev_keep_streams_every=1, prompt_length=0))]
    for method, options, flat in cases:
        want = trainable(method, options=options)
        with pytest.warns(DeprecationWarning, match=f"options={type(options).__name__}"):
            got = trainable(method, **flat)
        assert got.keys() == want.keys(), method
        for path in want:
            np.testing.assert_array_equal(got[path], want[path])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new form warns about nothing
        planted = trainable("lora", options=LoRA(rank=3, alpha=4.0))
    assert {v.shape for v in planted.values()} != {v.shape for v in trainable("lora", options=cases[0][1]).values()}
    model = GPT2(_tiny_gpt2(), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="takes options=jaxdp.finetune.settings.LoRA"):
        finetune.prepare(model, "lora", rngs=nnx.Rngs(1), options=Adapters())
    with pytest.raises(TypeError, match="together"):
        finetune.prepare(model, "lora", rngs=nnx.Rngs(1), options=LoRA(), rank=2)
    with pytest.raises(TypeError, match="takes no options"):
        finetune.prepare(model, "bitfit", rngs=nnx.Rngs(1), options=LoRA())


def test_step_memory_takes_the_old_keywords_for_one_release():
    from jaxdp.finetune import memory
    from jaxdp.finetune.settings import LoRA
    new = memory.step_memory(_tiny_gpt2(), "lora", step=memory.StepSpec(2, 8, dp_method="two_pass"),
                             options=LoRA(rank=2))
    with pytest.warns(DeprecationWarning, match=r"step=StepSpec\(.*options=LoRA"):
        old = memory.step_memory(_tiny_gpt2(), "lora", dp=True, batch_size=2, seq_len=8, dp_method="two_pass", rank=2)
    assert old == new
    from flax import nnx
    rank_4 = memory.abstract_model(_tiny_gpt2(), "lora", options=LoRA(rank=4))
    assert 2 * new.trainable_params == sum(v.size for v in jax.tree.leaves(nnx.state(rank_4, nnx.Param)))
