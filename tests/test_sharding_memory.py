"""Memory and communication of the sharded step, read from its compiled programs (8 fake CPU devices).

- Parameter + optimizer-state bytes per device fall as 1/N under ZeRO-3 as
  the `data` degree N goes 1, 2, 4, 8; activation (temporary) bytes per
  device fall as 1/S with the `seq` degree S (context parallelism).
- The non-DP step on the same layout (`ShardedDPStep(..., NonPrivate(expected_batch_size))`)
  equals the single-device non-DP Adam step.
- `jaxdp.analysis.collectives` counts a hand-built program's collectives
  by its ring formulas, and the DP - non-DP difference of the sharded steps
  is exactly what DP adds: nothing over `data`; under context parallelism
  the per-example reduce-scatter, the B-float norm psums and the embedding
  all-gather of `jaxdp.sharding.context_parallel`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_testing import by_path, max_rel_err
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdp import sharding
from jaxdp.analysis import collectives
from jaxdp.clipping.settings import DPSpec
from jaxdp.core import sequence_shards
from jaxdp.models.gpt2 import GPT2, GPT2Config
from jaxdp.models.llama import Llama, LlamaConfig

RTOL = 1e-5
C, EBS, LR = 0.05, 7.0, 1e-2
B, T, V = 8, 16, 97


def adam():
    # The first Adam step g / (|g| + eps) amplifies float32 rounding of g by up to max|g| / eps; the
    # non-DP (unclipped) gradients here reach 0.2, so eps = 0.1 keeps the step well-conditioned.
    return optax.adam(LR, eps=0.1)


def cp_loss(model, batch, seq_axis=None):
    """Per-example mean NLL over the GLOBAL sequence; this shard's share on a sequence shard."""
    logits = model(batch["inputs"], seq_axis=seq_axis)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.where(batch["mask"], sequence_shards.sequence_mean(nll, seq_axis), 0.0)


def make_batch(batch_size, seq_len, seed=3):
    tokens = jax.random.randint(jax.random.key(seed), (batch_size, seq_len + 1), 0, V)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.arange(batch_size) < batch_size - 1}


@functools.cache
def setup(name):
    """One-block tiny models (compile time), with every kind of leaf of the full ones."""
    if name == "gpt2":
        model = GPT2(GPT2Config(vocab_size=V, seq_len=32, n_layer=1, n_head=2, d_model=64), rngs=nnx.Rngs(1))
    else:
        model = Llama(LlamaConfig.preset("tiny", vocab_size=V, seq_len=32, n_layer=1), rngs=nnx.Rngs(2))
    return model, make_batch(B, T)


@functools.cache
def compiled_step(name, mesh_shape, zero_stage, private):
    """(step, state, compiled program) on the (data, seq) mesh; compiled once, run by the caller if needed."""
    model, batch = setup(name)
    release = DPSpec(C, 0.0, EBS) if private else sharding.NonPrivate(EBS)
    step = sharding.ShardedDPStep(cp_loss, adam(), sharding.make_mesh(*mesh_shape), release, key=jax.random.key(7),
                                  zero_stage=zero_stage)
    state = step.init(model)
    return step, state, step.lower(state, batch).compile()


def state_bytes(tree, mesh_size):
    """{'sharded': bytes of the leaves sharded over `data`, 'replicated': the rest}, global (unsharded) sizes."""
    out = {"sharded": 0, "replicated": 0}
    for leaf in jax.tree.leaves(tree):
        sharded = sharding.DATA in leaf.sharding.spec and mesh_size > 1
        out["sharded" if sharded else "replicated"] += leaf.nbytes
    return out


# 1. Memory per device.

def test_zero3_state_bytes_per_device_fall_as_one_over_data_degree():
    """ZeRO-3, one-block GPT-2 tiny, data degree N = 1, 2, 4, 8: compiled argument bytes per device minus the
    batch's share (B/N examples) are the state, total / N + replicated (1 - 1/N), to 1%.

    total: parameters, Adam's moments and count, the noise key (bytes on one device, N = 1); replicated:
    what stays whole on every device (biases, LayerNorm scales, Adam's count, the noise key; under 2% of
    total): every kernel and embedding divides by 8, hence by 1, 2 and 4, and is sharded.
    """
    _, batch = setup("gpt2")
    batch_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(batch))  # every leaf split over `data`
    measured = {}
    for N in (1, 2, 4, 8):
        _, _, compiled = compiled_step("gpt2", (N, 1), 3, True)
        measured[N] = compiled.memory_analysis().argument_size_in_bytes - batch_bytes / N
    _, state, _ = compiled_step("gpt2", (8, 1), 3, True)
    parts = state_bytes(state, 8)
    total, replicated = parts["sharded"] + parts["replicated"], parts["replicated"]
    print({N: int(m) for N, m in measured.items()}, f"total {total}, replicated {replicated}")
    assert replicated < 0.02 * total, parts
    for N in (1, 2, 4, 8):
        expected = total / N + replicated * (1 - 1 / N)
        assert abs(measured[N] - expected) <= 0.01 * expected, (N, measured, expected)
    assert measured[1] > measured[2] > measured[4] > measured[8]


# Context parallelism at a sequence long enough that the T x T attention tensors dominate.
MEM_B, MEM_T = 1, 512


def test_activation_bytes_per_device_fall_with_seq_degree():
    """A one-layer tiny Llama, one example of T = 512 tokens, meshes (1, S) for S = 1, 2, 4, 8: the DP
    step's compiled temporary bytes per device fall strictly, and temp(S) <= temp(1) / S + K.

    Derivation. A device holds T/S queries of every example; what it stores splits into
    (i) T/S-proportional activations and the (T/S) x T attention scores / probabilities and their
    gradients: together A/S, with A <= temp(1); and (ii) S-independent buffers, bounded by K:
      - the gathered keys and values (full T) of every layer and their cotangents: 2 x 2 L B T (K H) floats;
      - the embedding's ids and output gradients, all-gathered for its exact norm: B T (D + 1) floats;
      - parameter-sized buffers: the summed gradient, Adam's two moment updates and the updates
        (4 Psi; sigma = 0 here, so no noise tensor), and the per-example partials reduce-scattered
        over `seq` (B Psi).
    So temp(S) <= temp(1) / S + K with K = 4 bytes x (4 L B T K H + B T (D + 1) + (4 + B) Psi).
    """
    config = LlamaConfig.preset("tiny", vocab_size=V, seq_len=MEM_T, n_layer=1)
    model = Llama(config, rngs=nnx.Rngs(2))
    batch = make_batch(MEM_B, MEM_T)
    psi = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    kv = config.n_kv_head * config.head_dim
    K = 4 * (4 * config.n_layer * MEM_B * MEM_T * kv + MEM_B * MEM_T * (config.d_model + 1) + (4 + MEM_B) * psi)
    temp = {}
    for S in (1, 2, 4, 8):
        step = sharding.ShardedDPStep(cp_loss, adam(), sharding.make_mesh(1, S),
                                      DPSpec(l2_norm_clip=C, noise_multiplier=0.0, expected_batch_size=EBS))
        temp[S] = step.lower(step.init(model), batch).compile().memory_analysis().temp_size_in_bytes
    print({S: f"{t:,}" for S, t in temp.items()}, f"K = {K:,}")
    assert temp[1] > 10 * K  # activations dominate: the bound says something
    assert temp[1] > temp[2] > temp[4] > temp[8], temp
    for S in (2, 4, 8):
        assert temp[S] <= temp[1] / S + K, (S, temp, K)


# 2. The non-DP step on the same layout.

@functools.cache
def single_device_non_private(name):
    """(gradient of sum(losses) / EBS, params after one Adam step, losses) on one device, one compile."""
    model, batch = setup(name)

    @nnx.jit
    def step(model, batch):
        params = nnx.state(model, nnx.Param)
        grads = nnx.grad(lambda m: cp_loss(m, batch).sum() / EBS)(model)
        updates, _ = adam().update(grads, adam().init(params), params)
        return by_path(grads), by_path(optax.apply_updates(params, updates)), cp_loss(model, batch)

    return step(model, batch)


NON_PRIVATE_CASES = [("gpt2", (8, 1), 3), ("llama", (4, 2), 3)]


@pytest.mark.parametrize("name, mesh_shape, zero_stage", NON_PRIVATE_CASES,
                         ids=[f"{n}-{d}x{s}-zero{z}" for n, (d, s), z in NON_PRIVATE_CASES])
def test_non_private_sharded_step_equals_single_device(name, mesh_shape, zero_stage):
    expected_grads, expected_params, expected_losses = single_device_non_private(name)
    _, batch = setup(name)
    _, state, compiled = compiled_step(name, mesh_shape, zero_stage, False)
    new_state, out = compiled(state, batch)
    assert max_rel_err(out["grads"], expected_grads) <= RTOL
    assert max_rel_err(new_state.params, expected_params) <= RTOL
    np.testing.assert_allclose(out["losses"], expected_losses, rtol=RTOL, atol=1e-6)
    # The layout of the DP step: ZeRO-3 keeps kernels and their gradients and Adam moments sharded.
    for tree in (new_state.params, out["grads"], new_state.opt_state[0].mu):
        assert all(sharding.DATA in v.sharding.spec for p, v in by_path(tree).items() if p[-1] == "kernel")


# 3. Collectives.

def test_collective_bytes_of_a_hand_built_program():
    """Each kind over `data` (n = 4) on a (4, 2) mesh, and a psum over `seq` (n = 2) in a fori_loop of 3:
    bytes per device = the ring formulas of `collectives` x executions."""
    mesh = sharding.make_mesh(4, 2)
    n, size = 4, 16 * 4  # x_D: (16,) float32 per device

    def body(x_D):
        return (jax.lax.psum(x_D, sharding.DATA),                                  # all-reduce
                jax.lax.all_gather(x_D, sharding.DATA, tiled=True),                # all-gather -> (64,)
                jax.lax.psum_scatter(x_D, sharding.DATA, tiled=True),              # reduce-scatter -> (4,)
                jax.lax.all_to_all(x_D, sharding.DATA, 0, 0, tiled=True),          # all-to-all
                jax.lax.ppermute(x_D, sharding.DATA, [(i, (i + 1) % n) for i in range(n)]),
                jax.lax.fori_loop(0, 3, lambda i, y: jax.lax.psum(y, sharding.SEQ) * 0.5, x_D))

    spec = P((sharding.DATA, sharding.SEQ))
    fn = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec,) * 6, check_vma=False)
    got = collectives.bytes_by_kind(jax.jit(fn).lower(jnp.ones(8 * 16)).compile())
    assert got["all-gather"] == (n - 1) / n * (n * size)
    assert got["reduce-scatter"] == (n - 1) * (size / n)
    assert got["all-to-all"] == (n - 1) / n * size
    assert got["collective-permute"] == size
    assert got["all-reduce"] == 2 * (n - 1) / n * size + 3 * (2 * (2 - 1) / 2 * size), got


def dp_minus_non_private(name, mesh_shape, zero_stage):
    dp = collectives.bytes_by_kind(compiled_step(name, mesh_shape, zero_stage, True)[2])
    non_dp = collectives.bytes_by_kind(compiled_step(name, mesh_shape, zero_stage, False)[2])
    assert non_dp["all-reduce"] + non_dp["reduce-scatter"] > 0  # the baseline reduces its gradient
    return {k: dp[k] - non_dp[k] for k in collectives.KINDS}


def test_dp_adds_no_communication_over_data():
    """One-block GPT-2 tiny on (8, 1), ZeRO-3: per-example norms are local to the device holding the example, so
    DP adds at most the B-float reductions (one all-reduce of B floats: 2 (n-1)/n x 4B bytes) to the
    non-DP program's parameter all-gathers and gradient reduce-scatters. (Measured: 0 for every kind.)"""
    diff = dp_minus_non_private("gpt2", (8, 1), 3)
    bound = 2 * 7 / 8 * 4 * B
    assert all(abs(d) <= bound for d in diff.values()), diff


def test_dp_adds_under_context_parallelism_exactly_its_norm_traffic():
    """One-block Llama tiny on (data, seq) = (4, 2), ZeRO-3: DP - non-DP bytes per device, by kind, are what
    `context_parallel.squared_norms` adds (B_loc = B / data examples per device, S = 2):

      reduce-scatter  (S-1)/S x 4 B_loc x sum_l P_l   the per-example partials of every non-embedding
                                                      leaf l (P_l entries, padded to a multiple of S)
      all-reduce      2 (S-1)/S x 4 B_loc x 3 n_l     one psum of B_loc squared norms, magnitudes (the rounding
                                                      bound's sum_t |x_t| |g_t|) and underflow scales per leaf
      all-gather      (S-1)/S x 4 B_loc x T (D + 1)   the embedding's ids and output gradients
      others          0

    The non-DP program has the same K/V gathers, loss psum and ZeRO-3 collectives; they cancel.
    The per-example reduce-scatter is independent of T (input-stationary, DESIGN.md)."""
    model, _ = setup("llama")
    data, S = 4, 2
    b_loc = B // data
    params = by_path(nnx.state(model, nnx.Param))
    linear = [p for p in params if p[0] != "embed_tokens"]
    padded = sum(-(-params[p].size // S) * S for p in linear)
    expected = dict.fromkeys(collectives.KINDS, 0.0)
    expected["reduce-scatter"] = (S - 1) / S * 4 * b_loc * padded
    expected["all-reduce"] = 2 * (S - 1) / S * 4 * b_loc * 3 * len(linear)
    expected["all-gather"] = (S - 1) / S * 4 * b_loc * T * (model.config.d_model + 1)
    diff = dp_minus_non_private("llama", (data, S), 3)
    for kind in collectives.KINDS:
        assert diff[kind] == pytest.approx(expected[kind], rel=1e-9, abs=0), (kind, diff, expected)
