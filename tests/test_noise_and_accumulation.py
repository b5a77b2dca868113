"""Noise: calibrated std, fresh per step, reproducible; the floating-point attack on one draw per value and
`secure_noise`. Accumulation: k micro-batches = their union."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_testing import by_path, clip_between, lm_batch, lm_loss, max_rel_err, reference_grads, tiny_gpt2
from flax import nnx

import jaxdp
from jaxdp.noise.privatizer import GaussianPrivatizer
from jaxdp.clipping.settings import ClipSpec, DPSpec

SIGMA = 1.3
EBS = 5.0


# Per-example gradients for every test here: one compile per batch shape (full batch, micro-batch).
grads_fn = nnx.jit(jaxdp.per_example_grads(lm_loss))


@functools.lru_cache(maxsize=None)
def setup():
    model = tiny_gpt2(seed=21)
    batch = lm_batch(seed=22)
    C = clip_between(reference_grads(lm_loss, model, batch)[1])
    _, grads = grads_fn(model, batch)
    return model, batch, C, grads


def flat(updates):
    return jnp.concatenate([jnp.ravel(v) for v in by_path(updates).values()])


def by_block(path):
    return path[:2] if path[0] == "blocks" else "rest"


@pytest.mark.parametrize("clipping", ["flat", "per_layer", by_block], ids=["flat", "per_layer", "by_block"])
def test_noise_std_is_sigma_c(clipping):
    model, _, C, grads = setup()
    params = nnx.state(model, nnx.Param)
    noisy = jaxdp.fused_clip(C, SIGMA, expected_batch_size=EBS, key=jax.random.key(5),
                             clip=ClipSpec(clipping=clipping))
    clean = jaxdp.fused_clip(C, 0.0, expected_batch_size=EBS, clip=ClipSpec(clipping=clipping))
    other = jaxdp.fused_clip(C, SIGMA, expected_batch_size=EBS, key=jax.random.key(6),
                             clip=ClipSpec(clipping=clipping))
    clean_state, other_state = clean.init(params), other.init(params)

    @jax.jit
    def updates(grads, noisy_state, clean_state, other_state, params):
        """(noisy update, its next state, the clean update, the update of `other`): one compile."""
        u_noisy, state = noisy.update(grads, noisy_state, params)
        u_clean, _ = clean.update(grads, clean_state, params)
        u_other, _ = other.update(grads, other_state, params)
        return u_noisy, state, u_clean, u_other

    def update(grads, state, params):  # noisy.update, jitted
        u_noisy, state, _, _ = updates(grads, state, clean_state, other_state, params)
        return u_noisy, state

    u_noisy, state, u_clean, u_other = updates(grads, noisy.init(params), clean_state, other_state, params)
    noise1 = (flat(u_noisy) - flat(u_clean)) * EBS
    n = noise1.size
    # The sample std of n normals has relative sd 1/sqrt(2n) (~0.2% here); 3% is the spec.
    assert n > 50_000
    assert abs(float(jnp.std(noise1)) / (SIGMA * C) - 1) < 0.03
    assert abs(float(jnp.mean(noise1))) < 5 * SIGMA * C / np.sqrt(n)
    # The next step draws fresh, independent noise.
    u_noisy2, _ = update(grads, state, params)
    noise2 = (flat(u_noisy2) - flat(u_clean)) * EBS
    corr = float(jnp.corrcoef(noise1, noise2)[0, 1])
    assert abs(corr) < 5 / np.sqrt(n)
    # The same key reproduces; another key does not.
    again, _ = update(grads, noisy.init(params), params)
    np.testing.assert_array_equal(flat(again), flat(u_noisy))
    assert not np.array_equal(flat(u_other), flat(u_noisy))


def micro_batches(batch, k):
    return [jax.tree.map(lambda a: a[i::k], batch) for i in range(k)]


def test_accumulation_equals_union_and_optimizer_waits():
    model, batch, C, _ = setup()
    k = 3
    params = nnx.state(model, nnx.Param)
    adam = optax.adam(1e-2)
    tx_union = optax.chain(jaxdp.fused_clip(C, 0.0, expected_batch_size=EBS, clip=ClipSpec(clipping="per_layer")), adam)
    tx_accum = optax.chain(
        jaxdp.fused_clip(C, 0.0, expected_batch_size=EBS, accumulation_steps=k, clip=ClipSpec(clipping="per_layer")),
        optax.MultiSteps(adam, every_k_schedule=k, use_grad_mean=False).gradient_transformation())

    _, grads = grads_fn(model, batch)
    _, s_union = jax.jit(tx_union.update)(grads, tx_union.init(params), params)

    state = tx_accum.init(params)
    update = jax.jit(tx_accum.update)
    for i, micro in enumerate(micro_batches(batch, k)):
        _, grads = grads_fn(model, micro)
        before = state
        u, state = update(grads, state, params)
        adam_state = lambda s: s[1].inner_opt_state  # noqa: E731
        if i < k - 1:
            assert all(float(jnp.max(jnp.abs(v))) == 0.0 for v in by_path(u).values())
            for a, b in zip(jax.tree.leaves(adam_state(before)), jax.tree.leaves(adam_state(state))):
                np.testing.assert_array_equal(a, b)  # the optimizer does not move
    # Adam's first moment is linear in the gradient it saw: (1 - b1) * g.
    assert max_rel_err(adam_state(state)[0].mu, s_union[1][0].mu) <= 1e-5
    assert int(adam_state(state)[0].count) == 1
    # And the fused_clip accumulator starts over for the next logical batch.
    assert int(state[0].micro_step) == 0
    assert all(float(jnp.max(jnp.abs(v))) == 0.0 for v in jax.tree.leaves(state[0].accumulated))


def test_accumulation_adds_noise_once():
    model, batch, C, _ = setup()
    k = 3
    params = nnx.state(model, nnx.Param)
    noisy = jaxdp.fused_clip(C, SIGMA, expected_batch_size=EBS, accumulation_steps=k)
    clean = jaxdp.fused_clip(C, 0.0, expected_batch_size=EBS, accumulation_steps=k)
    s_noisy, s_clean = noisy.init(params), clean.init(params)

    @jax.jit
    def both_updates(grads, s_noisy, s_clean, params):  # one compile for the two transforms
        return noisy.update(grads, s_noisy, params), clean.update(grads, s_clean, params)

    for micro in micro_batches(batch, k):
        _, grads = grads_fn(model, micro)
        (u_noisy, s_noisy), (u_clean, s_clean) = both_updates(grads, s_noisy, s_clean, params)
    noise = (flat(u_noisy) - flat(u_clean)) * EBS
    assert abs(float(jnp.std(noise)) / (SIGMA * C) - 1) < 0.03  # not sqrt(k) sigma C


def test_each_leaf_reads_its_own_row_of_its_group_draw():
    """Leaves of one shape draw in one vmapped call, and each gets its row through
    `jaxdp.core.rows.rows_apart` (a barrier per row: XLA:GPU would otherwise merge all their updates into
    one kernel): the rows are the draw's, in order, eager and jitted; groups of other shapes draw apart."""
    keys = list(jax.random.split(fresh_key(), 4))
    leaves = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((16, 8), (8,), (16, 8), (16, 8))]
    std = 0.7
    square = std * jax.vmap(lambda k: jax.random.normal(k, (16, 8)))(jnp.stack([keys[0], keys[2], keys[3]]))
    want = [square[0], std * jax.random.normal(keys[1], (8,)), square[1], square[2]]
    eager = jaxdp.noise.draws.gaussians(keys, leaves, std)
    jitted = jax.jit(lambda k: jaxdp.noise.draws.gaussians(k, leaves, std))(keys)
    ulps = 4 * float(jnp.finfo(jnp.float32).eps)  # XLA may fuse the scaling into the transform differently
    for got in (eager, jitted):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=ulps, atol=ulps)
    assert not np.array_equal(got[0], want[2])  # rows that differ: a swapped row would be caught

    stacked = jax.random.normal(fresh_key(), (5, 3, 2))
    rows = jax.jit(jaxdp.core.rows.rows_apart)(stacked)
    assert [r.shape for r in rows] == [(3, 2)] * 5
    for j, r in enumerate(rows):
        np.testing.assert_array_equal(r, stacked[j])

    # bench_throughput's `auto_merged` (its GPU A/B): the same values, without the barriers
    from jaxdp.analysis.rows_merged import rows_merged
    program = lambda: str(jax.make_jaxpr(lambda k: jaxdp.noise.draws.gaussians(k, leaves, std))(keys))
    with rows_merged():
        merged, merged_program = jax.jit(lambda k: jaxdp.noise.draws.gaussians(k, leaves, std))(keys), program()
    for g, w in zip(merged, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=ulps, atol=ulps)
    assert "optimization_barrier" not in merged_program and "optimization_barrier" in program()


def test_default_noise_key_is_secret():
    """Without a key, fused_clip draws one from the OS: two transforms add different noise, and the
    key of issue 1/6's replay (jax.random.key(0 + 1), the old default seed's) is not the one used."""
    model, _, C, grads = setup()
    params = nnx.state(model, nnx.Param)
    keys = [jaxdp.fused_clip(C, SIGMA, expected_batch_size=EBS).init(params).noise_key for _ in range(2)]
    data = [np.asarray(jax.random.key_data(k)) for k in keys]
    assert not np.array_equal(data[0], data[1])
    replay = np.asarray(jax.random.key_data(jaxdp.noise.draws.check_key(jax.random.key(1), "replay")))
    assert not any(np.array_equal(d, replay) for d in data)
    with pytest.raises(TypeError, match="key"):
        jaxdp.fused_clip(C, SIGMA, expected_batch_size=EBS, key=5)


def test_every_init_draws_its_own_noise_key():
    """Attacker review 12: `fused_clip(key=None)` drew its key once, when built, and every `init` returned it:
    two optimizers (or a re-init, or vmap(init)) of one transform shared their noise, and the difference of
    two releases on neighbouring data recovered the example to 7e-8 (noise std 1). Now each init draws a
    fresh key, also under jit (per call, not once at tracing) and vmap (per member), and a pinned key stays
    pinned; so for ShardedDPStep."""
    model, _, C, _ = setup()
    params = nnx.state(model, nnx.Param)
    tx = jaxdp.fused_clip(C, SIGMA, expected_batch_size=EBS)
    keys = [np.asarray(jax.random.key_data(tx.init(params).noise_key)) for _ in range(2)]
    assert not np.array_equal(*keys)
    pinned = jaxdp.fused_clip(C, SIGMA, expected_batch_size=EBS, key=jax.random.key(7))
    assert np.array_equal(*[np.asarray(jax.random.key_data(pinned.init(params).noise_key)) for _ in range(2)])
    def key_words(state):
        return np.asarray(jax.random.key_data(state.noise_key))
    jitted, closed_over = jax.jit(tx.init), jax.jit(lambda: tx.init(params))  # review 13: the closure too
    assert not np.array_equal(key_words(jitted(params)), key_words(jitted(params)))
    assert not np.array_equal(key_words(closed_over()), key_words(closed_over()))
    members = key_words(jax.vmap(tx.init)(jax.tree.map(lambda p: jnp.stack([p, p + 1, p + 2]), params)))
    assert len({w.tobytes() for w in members}) == 3
    assert jax.eval_shape(tx.init, params).noise_key.shape == ()
    mesh = jax.make_mesh((1, 1), ("data", "seq"), devices=jax.devices()[:1])
    step = jaxdp.sharding.ShardedDPStep(lm_loss, optax.sgd(0.1), mesh,
                                        DPSpec(l2_norm_clip=C, noise_multiplier=SIGMA, expected_batch_size=EBS))
    keys = [np.asarray(jax.random.key_data(step.init(model).noise_key)) for _ in range(2)]
    assert not np.array_equal(*keys)


@pytest.mark.parametrize("make, match", [
    (lambda C: jaxdp.sharding.ShardedDPStep(lm_loss, optax.sgd(0.1), jax.make_mesh((1, 1), ("data", "seq")),
                                            DPSpec(l2_norm_clip=C, noise_multiplier=float("nan"),
                                                   expected_batch_size=EBS)),
     "noise_multiplier must be >= 0, got nan"),  # NaN passed `< 0` and then skipped the noise
    (lambda C: jaxdp.fused_clip(C, SIGMA, expected_batch_size=EBS, clip=ClipSpec(clip_fn="automatic", gamma=1e-30)),
     r"gamma must be >= 2\*\*-20"),  # an underflowed norm of 0 passed at C * norm / gamma (3e11 C)
    (lambda C: jaxdp.sharding.ShardedDPStep(lm_loss, optax.sgd(0.1), jax.make_mesh((1, 1), ("data", "seq")),
                                            DPSpec(l2_norm_clip=C, noise_multiplier=SIGMA,
                                                   expected_batch_size=EBS,
 clip=ClipSpec(clip_fn="automatic", gamma=0.0))),
     "gamma must be > 0"),
], ids=["sharded_nan_sigma", "tiny_gamma", "sharded_zero_gamma"])
def test_arguments_that_voided_the_noise_or_the_bound_are_refused(make, match):
    _, _, C, _ = setup()
    with pytest.raises(ValueError, match=match):
        make(C)


def test_update_refuses_gradients_that_are_not_per_example():
    """Attacker review 12: `nnx.grad` of the summed loss passed to fused_clip was read as per-example
    gradients (a square kernel's rows as examples: 11 C). With `params` (nnx.Optimizer passes them) a
    gradient whose per-example shape is not its parameter's is refused; so are group weights that are NaN
    or miss a group.

    Every check is on shapes and Python values, made while the update traces: the accepted update is
    traced (`jax.eval_shape`), not run, and the summed gradient is computed jitted (eagerly each of its
    ops would compile a program of its own)."""
    model, batch, C, grads = setup()
    params = nnx.state(model, nnx.Param)
    tx = jaxdp.fused_clip(C, SIGMA, expected_batch_size=EBS, key=jax.random.key(0))
    summed = nnx.jit(nnx.grad(lambda m: lm_loss(m, batch).sum()))(model)
    with pytest.raises(ValueError, match="per-example shape .* not their sum"):
        tx.update(summed, tx.init(params), params)
    with pytest.raises(ValueError, match="plain-array gradients without params"):  # review 13: 16 C without
        tx.update(summed, tx.init(params))
    accepted, _ = jax.eval_shape(tx.update, grads, tx.init(params))  # FactoredGrads carry their own shapes
    assert {p: u.shape for p, u in by_path(accepted).items()} == {p: v.shape for p, v in by_path(params).items()}
    for weights, match in (({"rest": float("nan")}, "finite and > 0"), ({}, "no weight for clipping group")):
        tx = jaxdp.fused_clip(C, SIGMA, expected_batch_size=EBS, key=jax.random.key(0),
                              clip=ClipSpec(clipping=lambda path: "rest", group_weights=weights))
        with pytest.raises(ValueError, match=match):
            tx.update(grads, tx.init(params), params)


# ------------------------------------------------------------------ floating-point noise (Mironov 2012)


@functools.lru_cache(maxsize=None)
def single_draw_values(std: float) -> np.ndarray:
    """Every value `std * jax.random.normal(key, dtype=float32)` can take on this backend, sorted: the
    normal maps 23 random mantissa bits to a uniform u in (-1, 1), then sqrt(2) erfinv(u). Both
    roundings of std * sqrt(2) * erfinv(u) (under jit XLA folds std * sqrt(2) into one constant)."""
    mantissas = jnp.arange(2**23, dtype=jnp.uint32) | jnp.uint32(0x3F800000)
    floats = jax.lax.bitcast_convert_type(mantissas, jnp.float32) - 1.0
    lo, hi = jnp.nextafter(jnp.float32(-1), jnp.float32(0)), jnp.float32(1)
    u = jnp.maximum(lo, floats * (hi - lo) + lo)
    e = np.asarray(jax.scipy.special.erfinv(u))
    std, sqrt2 = np.float32(std), np.float32(np.sqrt(np.float32(2)))
    return np.union1d(std * (sqrt2 * e), (std * sqrt2) * e)


def attainable(noise, values) -> float:
    """The fraction of `noise` (float32) that lies among `values` (sorted): an attacker's membership test."""
    noise = np.asarray(noise, np.float32).ravel()
    at = np.minimum(np.searchsorted(values, noise), values.size - 1)
    return float((values[at] == noise).mean())


def fresh_key():
    return jaxdp.noise.draws.noise_key_from_seed(int(np.random.SeedSequence().entropy))


def test_floating_point_noise_attack():
    """An attacker who sees the noisy sum y = s + n exactly and knows s up to one example tests which
    candidate leaves y - s among the single draw's 2^23 values. With one draw per value the true candidate
    wins on most coordinates (the example's presence is read off with certainty); with `secure=True` (sum
    of 4 draws / 2) both candidates fall among them at the rate of ideal float32 normals, and its noise is
    N(0, std^2)."""
    std = jaxdp.clipping.rules.noise_std(1.0, 1.0)
    values = single_draw_values(std)
    d = 1 << 18
    rng = np.random.default_rng()
    others = (rng.standard_normal(d) * std).astype(np.float32)   # the other examples' sum, known, noise-sized
    target = rng.standard_normal(d)
    target = (target / np.linalg.norm(target)).astype(np.float32)  # the attacked example, norm C = 1
    ideal = attainable(rng.standard_normal(d) * std, values)   # float64 normals rounded to float32
    def add_noise(tree, key, std, secure):  # the privatizer's release at an expected batch of 1: s + noise
        return jax.jit(GaussianPrivatizer(std, 1.0, secure).update)(tree, key)[::-1]
    rates = {}
    for secure in (False, True):
        key = fresh_key()
        _, noise = add_noise(jnp.zeros(d, jnp.float32), key, std, secure)
        _, released = add_noise(jnp.asarray(others), key, std, secure)  # the example is absent
        released = np.asarray(released)
        rates[secure] = (attainable(noise, values), attainable(released - others, values),
                         attainable(released - (others + target), values))
        if secure:
            assert abs(float(noise.std()) / std - 1) < 0.01 and abs(float(noise.mean())) < 5 * std / np.sqrt(d)
    drawn, true, false = rates[False]
    assert drawn == 1.0 and true > 0.5 and false < ideal + 0.02, rates   # the attack works on one draw
    drawn, true, false = rates[True]
    assert max(abs(drawn - ideal), abs(true - ideal), abs(false - ideal)) < 0.01, (rates, ideal)


def excluded(y, s, release) -> np.ndarray:
    """Per coordinate: no float32 noise n near y - s gives release(s, n) == y, so the candidate sum s is ruled
    out, whatever the noise's distribution (float32 arithmetic alone)."""
    n = (y.astype(np.float64) - s.astype(np.float64)).astype(np.float32)
    for _ in range(4):
        n = np.nextafter(n, np.float32(-np.inf))
    consistent = np.zeros(y.shape, bool)
    for _ in range(9):
        consistent |= np.asarray(release(s, n)) == y
        n = np.nextafter(n, np.float32(np.inf))
    return ~consistent


@pytest.mark.parametrize("sigma", [1.0, 1.4])
def test_secure_noise_survives_the_exclusion_attacks(sigma):
    """Attacker review 9 broke the first secure noise twice: where s and n cancel, fl32(s + n) is exact, so a
    candidate sum for which no float32 n gives y is ruled out (any float32 noise added in float32); and
    std / 2 applied after the sum of the draws left gaps of its mantissa (15% of values at sigma = 1.4).
    Released through `jaxdp.noise.draws.release(secure=True)` (snapped to a grid of ~std / 2^8, the draws scaled
    before the sum) neither candidate is ever ruled out; unsnapped, the wrong one is."""
    std = jaxdp.clipping.rules.noise_std(1.0, sigma)
    d = 1 << 18
    rng = np.random.default_rng()
    others = (rng.standard_normal(d) * std).astype(np.float32)
    target = rng.standard_normal(d)
    other_candidate = (others + (target / np.linalg.norm(target)).astype(np.float32)).astype(np.float32)
    gaussians = jax.jit(lambda key: jaxdp.noise.draws.gaussians([key], [jax.ShapeDtypeStruct((d,), jnp.float32)], std,
                                                          secure=True)[0])
    noise = np.asarray(gaussians(fresh_key()))
    assert abs(noise.std() / std - 1) < 0.01 and abs(noise.mean()) < 5 * std / np.sqrt(d)
    for secure in (False, True):
        release = jax.jit(functools.partial(jaxdp.noise.draws.release, std=std, secure=secure))
        y = np.asarray(release(others, noise))   # the example is absent: `others` is the truth
        true, false = excluded(y, others, release).mean(), excluded(y, other_candidate, release).mean()
        if secure:
            assert true == 0 and false == 0, (true, false)
            assert np.abs(y - (others + noise)).max() <= jaxdp.noise.draws.snap_grid(std) / 2 * (1 + 1e-6)
        else:  # the planted error: the secure draws added without the grid
            assert true == 0 and false > 0.01, (true, false)
    # The draws are scaled before their sum: as many of the values lie in the image of x -> fl32(x * c),
    # c = fl32(std / 2), as of ideal float32 normals (every one did when c multiplied the sum).
    ideal = (rng.standard_normal(d) * std).astype(np.float32)
    assert abs(in_image(noise, np.float32(std / 2)).mean() - in_image(ideal, np.float32(std / 2)).mean()) < 0.01


def in_image(v, c) -> np.ndarray:
    """Per value: v == fl32(x * c) for some float32 x."""
    x = (v / c).astype(np.float32)
    hit = np.zeros(v.shape, bool)
    for candidate in (np.nextafter(x, np.float32(-np.inf)), x, np.nextafter(x, np.float32(np.inf))):
        hit |= (candidate * c).astype(np.float32) == v
    return hit


def test_secure_noise_reaches_the_noise():
    """fused_clip(secure_noise=True), ShardedDPStep(secure_noise=True) and the job's config.dp.secure_noise
    draw the secure noise (off the single draw's values); the default draws one normal per value; a
    non-bool flag is refused, naming it."""
    C, sigma = 1.0, 1.0
    values = single_draw_values(jaxdp.clipping.rules.noise_std(C, sigma))
    grads = {"w": jax.random.normal(jax.random.key(np.random.SeedSequence().entropy % 2**31), (2, 256, 512))}
    params = {"w": jnp.zeros((256, 512))}
    updates = {}
    for secure in (False, True):
        tx = jaxdp.fused_clip(C, sigma, expected_batch_size=1.0, key=fresh_key(), secure_noise=secure)
        updates[secure] = np.asarray(jax.jit(tx.update)(grads, tx.init(params), params)[0]["w"])
    clean = jaxdp.fused_clip(C, 0.0, expected_batch_size=1.0)
    clean = np.asarray(jax.jit(clean.update)(grads, clean.init(params), params)[0]["w"])
    assert attainable(updates[False] - clean, values) > 0.6
    assert attainable(updates[True] - clean, values) < 0.3
    with pytest.raises(TypeError, match="secure_noise"):
        jaxdp.fused_clip(C, sigma, expected_batch_size=1.0, secure_noise="yes")
    # A bf16 leaf (attacker review 10): drawn, added and snapped in float32, then cast; a std whose grid
    # would overflow float32 is refused.
    bf16 = jax.ShapeDtypeStruct((1 << 16,), jnp.bfloat16)
    (drawn,) = jaxdp.noise.draws.gaussians([fresh_key()], [bf16], 1.0, secure=True)
    assert drawn.dtype == jnp.float32 and np.unique(np.asarray(drawn)).size > 60_000
    released, _ = GaussianPrivatizer(1.0, 1.0, True).update(jnp.ones(bf16.shape, jnp.bfloat16), fresh_key())
    assert released.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"secure noise needs a noise std >= 2\*\*-100"):
        GaussianPrivatizer(1e-37, 1.0, True).update(jnp.ones(4), fresh_key())

    class One(nnx.Module):
        def __init__(self):
            self.lin = jaxdp.core.nn.Linear(64, 512, rngs=nnx.Rngs(0))

    def loss_fn(model, batch):
        return jnp.where(batch["mask"], model.lin(batch["x"]).sum((1, 2)), 0.0)

    step = jaxdp.sharding.ShardedDPStep(loss_fn, optax.sgd(1.0), jaxdp.sharding.make_mesh(1),
                                        DPSpec(l2_norm_clip=C, noise_multiplier=sigma,
                                               expected_batch_size=1.0, secure_noise=True),
                                        key=fresh_key())
    batch = {"x": jnp.ones((2, 3, 64)), "mask": jnp.zeros((2,), bool)}  # every example masked: y is the noise
    _, out = step(step.init(One()), batch)
    noise = np.asarray(out["grads"]["lin"]["kernel"])
    assert attainable(noise, values) < 0.3
    assert abs(noise.std() / jaxdp.clipping.rules.noise_std(C, sigma) - 1) < 0.03

    from experiments.configs import default
    from jaxdp.training import steps
    config = default.get_config()
    config.dp.secure_noise = True
    seen = {}
    real = steps.fused_clip

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    steps.fused_clip = spy
    steps._make_tx.cache_clear()  # cached per argument tuple: build this one afresh
    try:
        steps._tx_of(config, 1.0, 4.0, 1)
    finally:
        steps.fused_clip = real
    assert seen["secure_noise"] is True


def test_several_processes_share_one_noise_key_and_seed(monkeypatch):
    """`key=None` (and `PoissonSampler(seed=None)`) on several processes drew a different secret on each:
    every process added its own noise to the same psum'd gradient (the replicas diverged) and sampled its
    own batches. Secrets are now process 0's, broadcast; a traced init cannot broadcast and is refused.
    (Two processes simulated: the broadcast returns 'process 0's words'.)"""
    from jax.experimental import multihost_utils
    model, _, C, _ = setup()
    params = nnx.state(model, nnx.Param)
    sent = []

    def broadcast(words):
        sent.append(np.asarray(words))
        return np.full_like(words, 0x01020304)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", broadcast)
    process_0 = sum(0x01020304 << (32 * i) for i in range(8))
    key = jaxdp.fused_clip(C, SIGMA, expected_batch_size=EBS).init(params).noise_key
    assert np.array_equal(np.asarray(jax.random.key_data(key)),
                          np.asarray(jax.random.key_data(jaxdp.noise.draws.noise_key_from_seed(process_0))))
    assert jaxdp.sampling.poisson.PoissonSampler(100, 10, max_batch_size=32).seed == process_0 % 2**128
    assert [w.shape for w in sent] == [(8,), (4,)] and all((w != 0x01020304).any() for w in sent)
    with pytest.raises(ValueError, match="several processes"):
        jax.jit(jaxdp.fused_clip(C, SIGMA, expected_batch_size=EBS).init)(params)
    pinned = jaxdp.fused_clip(C, SIGMA, expected_batch_size=EBS, key=jax.random.key(3))
    assert pinned.init(params).noise_key is not None and len(sent) == 2  # a pinned key is the user's
    # review 15: 100 bits were broadcast as 3 words (96 bits)
    assert jaxdp.noise.seeds.secret_seed(100) == process_0 % 2**100 and sent[-1].shape == (4,)
    # review 15: without jax.distributed, process_count() (which starts JAX's backends) is not asked
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    assert not jaxdp.noise.seeds.several_processes() and len(sent) == 3
