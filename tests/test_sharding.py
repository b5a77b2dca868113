"""Sharded DP steps on 8 fake CPU devices equal the single-device step.

Every (data, seq) mesh, ZeRO stage and clipping style is compared with the
single-device `optax.chain(jaxdp.fused_clip(...), adam)` step on the same
batch: the privatised gradient and the parameters after one DP-Adam step
(sigma = 0: relative error <= 1e-5). With sigma > 0 a replicated gradient
gets the single-device noise exactly; a reduce-scattered one (ZeRO 2/3) has
per-coordinate std sigma * C within 3%.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_testing import by_path, lm_loss, max_rel_err, tiny_gpt2
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxdp
from jaxdp import sharding
from jaxdp.models.llama import Llama, LlamaConfig

RTOL = 1e-5
C, EBS, LR = 0.05, 6.0, 1e-2
B, T, V = 8, 16, 97


def adam():
    # eps well above float32 noise in the gradients: the first Adam step g / (|g| + eps)
    # is ill-conditioned where |g| << eps, which would test Adam, not the sharding.
    return optax.adam(LR, eps=1e-3)


def cp_loss(model, batch):
    """Per-example mean NLL over the GLOBAL sequence; correct on a sequence shard too."""
    logits = model(batch["inputs"])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.where(batch["mask"], sharding.context.sequence_mean(nll), 0.0)


@functools.cache
def setup(name):
    tokens = jax.random.randint(jax.random.key(3), (B, T + 1), 0, V)
    mask = jnp.arange(B) < B - 1
    if name == "gpt2":
        return tiny_gpt2(seed=1), lm_loss, {"tokens": tokens, "mask": mask}
    if name == "gpt2cp":  # GPT-2 with inputs / targets split, so that the sequence can be sharded
        return tiny_gpt2(seed=1), cp_loss, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}
    model = Llama(LlamaConfig.preset("tiny", vocab_size=V, seq_len=32), rngs=nnx.Rngs(2))
    return model, cp_loss, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


SIGMA = 2.0
REFERENCE_CONFIGS = (("flat", 0.0), ("per_layer", 0.0), ("flat", SIGMA))


@functools.cache
def single_device(name):
    """{(clipping, sigma): (privatised gradient, params after one DP-Adam step)} on one device, one jit."""
    model, loss_fn, batch = setup(name)
    dps = [jaxdp.fused_clip(C, sigma, expected_batch_size=EBS, clipping=clipping, seed=7)
           for clipping, sigma in REFERENCE_CONFIGS]

    @nnx.jit
    def steps(model, batch):
        params = nnx.state(model, nnx.Param)
        _, grads = jaxdp.per_example_grads(loss_fn)(model, batch)
        results = []
        for dp in dps:
            tx = optax.chain(dp, adam())
            state = tx.init(params)
            updates, _ = tx.update(grads, state, params)
            private, _ = dp.update(grads, state[0], params)
            results.append((by_path(private), by_path(optax.apply_updates(params, updates))))
        return results

    return dict(zip(REFERENCE_CONFIGS, steps(model, batch)))


@functools.cache
def sharded(name, mesh_shape, zero_stage, clipping, sigma):
    model, loss_fn, batch = setup(name)
    mesh = sharding.make_mesh(*mesh_shape)
    step = sharding.ShardedDPStep(loss_fn, adam(), mesh, l2_norm_clip=C, noise_multiplier=sigma,
                                  expected_batch_size=EBS, seed=7, zero_stage=zero_stage, clipping=clipping)
    state = step.init(model)
    new_state, out = step(state, batch)
    return step, state, new_state, out


CASES = [
    # (model, (data, seq), zero_stage, clipping, sigma); sigma > 0 only where the gradient is replicated
    ("gpt2", (8, 1), 0, "flat", 0.0),
    ("gpt2", (8, 1), 3, "per_layer", 0.0),
    ("gpt2cp", (4, 2), 1, "flat", SIGMA),
    ("gpt2cp", (2, 4), 3, "per_layer", 0.0),
    ("llama", (8, 1), 2, "per_layer", 0.0),
    ("llama", (4, 2), 1, "flat", SIGMA),
    ("llama", (4, 2), 3, "per_layer", 0.0),
    ("llama", (2, 4), 2, "flat", 0.0),
    ("llama", (1, 8), 0, "per_layer", 0.0),
]


@pytest.mark.parametrize("name, mesh_shape, zero_stage, clipping, sigma", CASES,
                         ids=[f"{n}-{d}x{s}-zero{z}-{c}-sigma{g:g}" for n, (d, s), z, c, g in CASES])
def test_sharded_step_equals_single_device(name, mesh_shape, zero_stage, clipping, sigma):
    # gpt2cp is gpt2 on the same tokens with the loss written per sequence shard: same reference.
    expected_grads, expected_params = single_device("gpt2" if name == "gpt2cp" else name)[(clipping, sigma)]
    step, _, new_state, out = sharded(name, mesh_shape, zero_stage, clipping, sigma)
    assert max_rel_err(out["grads"], expected_grads) <= RTOL
    assert max_rel_err(new_state.params, expected_params) <= RTOL
    assert out["losses"].shape == (B,) and float(out["losses"][-1]) == 0.0
    # The layout the ZeRO stage promises.
    kernel_specs = [s for p, s in by_path(step.param_specs).items() if p[-1] == "kernel"]
    mu_specs = [v.sharding.spec for p, v in by_path(new_state.opt_state[0].mu).items() if p[-1] == "kernel"]
    grad_specs = [v.sharding.spec for p, v in by_path(out["grads"]).items() if p[-1] == "kernel"]
    data = sharding.DATA
    assert all((data in s) == (zero_stage >= 1) for s in mu_specs)
    assert all((data in s) == (zero_stage >= 2) for s in grad_specs)
    assert all((data in s) == (zero_stage >= 3) for s in kernel_specs)


def test_per_shard_noise_has_the_right_std():
    """ZeRO 2: sharded leaves draw fold_in(key, shard) noise with std sigma * C; replicated ones match one device."""
    clean, _ = single_device("gpt2")[("flat", 0.0)]
    noisy_one_device, _ = single_device("gpt2")[("flat", SIGMA)]
    step, _, _, out = sharded("gpt2", (8, 1), 2, "flat", SIGMA)
    grads = by_path(out["grads"])
    dims = by_path(step.grad_dims)
    sharded_noise = []
    for path, g in grads.items():
        if dims[path] < 0:
            np.testing.assert_allclose(g, noisy_one_device[path], rtol=RTOL, atol=RTOL * SIGMA * C / EBS)
        else:
            noise = np.asarray((g - clean[path]) * EBS)
            sharded_noise.append(noise.ravel())
            # Shards draw different noise: two shards' blocks are not equal.
            blocks = np.split(noise, 8, axis=dims[path])
            assert not np.allclose(blocks[0], blocks[1])
    noise = np.concatenate(sharded_noise)
    assert noise.size > 50_000
    assert abs(noise.std() / (SIGMA * C) - 1) < 0.03
    assert abs(noise.mean()) < 0.03 * SIGMA * C


def test_partition_rules_cover_every_matrix():
    """Every kernel and embedding of GPT-2 and Llama is sharded by a named rule at production sizes."""
    from jaxdp.models.gpt2 import GPT2, GPT2Config
    for make in (lambda: GPT2(GPT2Config.preset("small"), rngs=nnx.Rngs(0)),
                 lambda: Llama(LlamaConfig.preset("1B", tie_embeddings=False), rngs=nnx.Rngs(0))):
        params = nnx.state(nnx.eval_shape(make), nnx.Param)
        for path, leaf in by_path(params).items():
            dim = sharding.shard_dim(path, leaf.shape, 8)
            if path[-1] in ("kernel", "embedding"):
                assert dim is not None and leaf.shape[dim] % 8 == 0, path
            else:
                assert dim is None, path


def test_zero3_memory_falls_with_data_shards():
    """Compiled per-device argument bytes (params + Adam state dominate) fall ~1/N under ZeRO-3."""
    _, _, batch = setup("gpt2")
    sizes = {}
    for zero_stage, clipping in ((0, "flat"), (3, "per_layer")):
        step, state, _, _ = sharded("gpt2", (8, 1), zero_stage, clipping, 0.0)
        sizes[zero_stage] = step.lower(state, batch).compile().memory_analysis().argument_size_in_bytes
    assert sizes[3] < 0.2 * sizes[0], sizes


def test_bad_zero_stage():
    _, loss_fn, _ = setup("gpt2")
    with pytest.raises(ValueError, match="zero_stage"):
        sharding.ShardedDPStep(loss_fn, adam(), sharding.make_mesh(8, 1), l2_norm_clip=C,
                               noise_multiplier=0.0, expected_batch_size=EBS, zero_stage=4)
    with pytest.raises(ValueError, match="devices"):
        sharding.make_mesh(4, 4)


class _LinearAndPlainScale(nnx.Module):
    """A jaxdp Linear (tape rule) and a plain nnx.Param (vmap fallback), shared by every position."""

    def __init__(self, rngs):
        self.linear = jaxdp.nn.Linear(6, 5, rngs=rngs)
        self.scale = nnx.Param(jnp.linspace(0.5, 1.5, 5))

    def __call__(self, x_BTP):
        return self.linear(x_BTP) * self.scale[...]


def test_per_example_grads_in_shard_map_with_check_vma():
    """Inside shard_map(check_vma=True) over 8 data shards, per-example gradients (tape and fallback)
    equal one device's: no cotangent comes back summed over the devices (the DESIGN.md pitfall)."""
    model = _LinearAndPlainScale(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (16, 3, 6))
    loss_fn = lambda m, x: jnp.sum(m(x) ** 2, axis=(1, 2))
    graphdef, params = nnx.split(model)

    def per_example(params, x):
        _, grads = jaxdp.per_example_grads(loss_fn)(nnx.merge(graphdef, params), x)
        return {p: sum(jaxdp.terms.instantiate(t) for t in g.terms) for p, g in by_path(grads).items()}

    expected = jax.jit(per_example)(params, x)
    mesh = sharding.make_mesh(8, 1)
    sharded_fn = jax.jit(jax.shard_map(per_example, mesh=mesh, in_specs=(P(), P(sharding.DATA)),
                                       out_specs=P(sharding.DATA), check_vma=True))
    got = sharded_fn(params, x)
    assert got.keys() == expected.keys() == {("linear", "kernel"), ("linear", "bias"), ("scale",)}
    assert max_rel_err(got, expected) <= RTOL
