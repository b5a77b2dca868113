"""Privacy per document or per user (issue 15 item 1): each unit's summed gradient is clipped.

A batch of units is U blocks of K consecutive windows; `jaxdp.core.terms.group_examples` turns the K windows'
factored gradients into one unit's, exactly and without vmap. Checked against the vmap reference over
units (the gradient of the unit's summed window losses, clipped), with a planted error (clipping each
window instead of its unit) caught; the bound holds where per-window clipping would let K * C through;
and the job samples units, accounts at the unit rate and says so in its receipt.
"""

import json

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import pld
from dp_testing import by_path, max_rel_err, tiny_gpt2
from flax import nnx

import jaxdp
import jaxdp.core.reference  # the vmap oracle: not exported by jaxdp
from jaxdp.clipping.aggregation import clipped_aggregate
from jaxdp.clipping.rules import SENSITIVITY_FACTOR
from jaxdp.core.losses import lm_losses
from jaxdp.core.terms import group_examples
from jaxdp.data import windows as data
from jaxdp.clipping.settings import ClipSpec, NormPlan

U, K, T, V = 3, 2, 12, 97
RTOL = 1e-5  # float32 at the highest matmul precision (as tests/test_fused_clip_reference.py)
STRATEGIES = ("ghost", "instantiate")  # grouping acts on the terms before any strategy sees them


def unit_batch(seed):
    """U units of K windows: fresh random tokens, one window ending in PAD, one masked slot (a unit with
    fewer windows than K)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, (U * K, T + 1)).astype(np.int32)
    tokens[1, 7:] = data.PAD
    mask = np.ones(U * K, bool)
    mask[5] = False
    return {"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask)}


def unit_losses(model, batch):
    """The loss of each unit (U,): the sum of its windows' losses; `batch` holds (U, K, ...) arrays."""
    flat = {"tokens": batch["tokens"].reshape(-1, T + 1), "mask": batch["mask"].reshape(-1)}
    return lm_losses(model, flat).reshape(-1, K).sum(axis=1)


def by_units(batch):
    return jax.tree.map(lambda a: a.reshape((U, K) + a.shape[1:]), batch)


@nnx.jit(static_argnums=(3, 4, 5))
def _fast_sums(model, batch, C, clipping, windows_per_unit, strategies):
    _, grads = jaxdp.per_example_grads(lm_losses)(model, batch)
    grads = group_examples(grads, windows_per_unit)
    return [clipped_aggregate(grads, C,
                              clip=ClipSpec(clipping=clipping), norms=NormPlan(strategy=s))[0] for s in strategies]


def fast_sums(model, batch, C, clipping, windows_per_unit):
    """Clipped sums of every strategy (one, for the planted per-window error), from the factored
    per-window gradients grouped into units; C traced, so both tests share the compiles."""
    strategies = STRATEGIES if windows_per_unit == K else STRATEGIES[:1]
    return _fast_sums(model, batch, jnp.float32(C), clipping, windows_per_unit, strategies)


@nnx.jit
def reference_unit_grads(model, batch):
    return jaxdp.core.reference.per_example_grads(unit_losses, model, by_units(batch))[1]


@pytest.fixture(scope="module")
def setup():
    model, batch = tiny_gpt2(seed=3, seq_len=32), unit_batch(4)
    grads = reference_unit_grads(model, batch)
    norms = np.sqrt(sum(np.sum(np.reshape(g, (U, -1)) ** 2, axis=1) for g in grads.values()))
    C = float(np.sqrt(norms.min() * norms.max()))  # some units clipped, some not
    return model, batch, grads, C


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_unit_clipping_equals_vmap_reference_over_units(setup, clipping):
    model, batch, grads, C = setup
    expected, _ = jaxdp.core.reference.clipped_sum(grads, C, clipping=clipping)
    for strategy, sums in zip(STRATEGIES, fast_sums(model, batch, C, clipping, K)):
        assert max_rel_err(by_path(sums), expected) <= RTOL, strategy
    # Planted error: clipping each window rather than its unit is caught.
    planted = fast_sums(model, batch, C, clipping, 1)[0]
    assert max_rel_err(by_path(planted), expected) > 100 * RTOL


def test_a_units_contribution_is_bounded_where_windows_are_not():
    """K copies of one window: each window's gradient is under C, their sum 2x over. Clipped per window the
    unit would give K * min(n, C) > C; clipped as a unit it gives <= C (float32 rounding allowance)."""
    model = tiny_gpt2(seed=5, seq_len=32)
    one = unit_batch(6)
    tokens = jnp.repeat(one["tokens"][:1], U * K, axis=0)
    batch = {"tokens": tokens, "mask": jnp.ones(U * K, bool)}
    g = reference_unit_grads(model, batch)
    unit_norm = float(np.sqrt(sum(np.sum(np.asarray(v[0]) ** 2) for v in g.values())))
    C = 0.75 * unit_norm  # each window's norm is unit_norm / K = 0.5 unit_norm < C
    for clipping in ("flat", "per_layer"):
        sums = fast_sums(model, batch, C, clipping, K)
        for strategy, s in zip(STRATEGIES, sums):
            total = float(np.sqrt(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in by_path(s).values())))
            assert total <= U * C * (1 + 1e-6), (clipping, strategy, total / (U * C))  # U equal units
        per_window = fast_sums(model, batch, C, clipping, 1)[0]
        total = float(np.sqrt(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in by_path(per_window).values())))
        assert total > 1.2 * U * C  # what per-window clipping lets through
    assert SENSITIVITY_FACTOR > 1 + 1e-6  # the noise covers the bound asserted above


def test_group_examples_rejects_a_batch_that_does_not_split():
    with pytest.raises(ValueError, match="size must be an integer >= 1"):
        group_examples({}, 0)
    with pytest.raises(ValueError, match="does not split into units of 4"):
        group_examples({"w": jnp.ones((6, 3))}, 4)


# ------------------------------------------------------------------ the job


def user_corpus(directory, num_users=10, docs_per_user=4):
    """A jsonl of real text (State of the Union excerpts), each document tagged with its writer."""
    import gzip

    from job_testing import CORPUS
    with gzip.open(CORPUS, "rt") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(4), f)]
    rows = [{"text": texts[i % 4][600 * i:600 * i + 600], "user_id": f"user{i % num_users}"}
            for i in range(num_users * docs_per_user)]
    path = directory / "notes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, [r["user_id"] for r in rows]


def test_user_level_job_samples_users_and_accounts_at_their_rate(tmp_path):
    from job_testing import tiny_config

    from jaxdp import training
    from jaxdp.training import receipt
    corpus, ids = user_corpus(tmp_path)
    config = tiny_config(corpus, tmp_path / "run", steps=3, checkpoint_every=3, eval_every=3, batch_size=3,
                         sample__num=0, privacy__unit="user", privacy__windows_per_unit=2,
                         data__id_field="user_id", data__validation_fraction=0.2)
    summary = training.train(config, verbose=False)
    keys = [json.dumps(u) for u in ids]  # the split hashes ids as JSON values (load_corpus)
    train_users = {ids[i] for i in data.split_documents(keys, 0.2)[0]}
    assert summary["privacy_unit"] == "user" and summary["windows_per_unit"] == 2
    assert summary["num_train_units"] == len(train_users) < summary["num_train_windows"]
    q = summary["sampling_probability"]
    assert q == 3 / len(train_users)
    # epsilon is dp_accounting's for the users' sampling rate, at the run's sigma, steps and delta
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(summary["noise_multiplier"])), 3)
    expected = pld.PLDAccountant(value_discretization_interval=summary["pld_interval"]).compose(
        event).get_epsilon(summary["delta_mechanism"])
    assert summary["epsilon"] == pytest.approx(expected, rel=1e-9)
    r = json.loads((tmp_path / "run" / receipt.PRIVACY_FILE).read_text())
    assert r["unit"] == "user" and "one training user" in r["guarantee"] and "'user_id'" in r["unit_note"]
    assert "min(2, its windows)" in r["sampling"]["method"] and '"num_units"' not in json.dumps(r)  # N: unpublished
    assert np.isfinite(summary["train_loss"])


def test_a_public_bound_on_n_makes_the_receipt_the_same_for_neighbours(tmp_path):
    """Attacker review 18 (F2): q, sigma, max_batch_size and the default delta followed N, so privacy.json of
    neighbours (N and N - 1 users) differed. With config.privacy.num_units_bound B they come from B: the
    receipts are equal; the sample draws over B and keeps only real units, each with probability q; a bound
    at or below N is refused."""
    from job_testing import tiny_config

    from jaxdp import training
    from jaxdp.training import receipt
    corpus, ids = user_corpus(tmp_path)
    rows = [json.loads(line) for line in corpus.read_text().splitlines()]
    neighbour = tmp_path / "neighbour.jsonl"  # one training user fewer (user0's documents removed)
    neighbour.write_text("".join(json.dumps(r) + "\n" for r in rows if r["user_id"] != "user0"))

    def receipt_of(path, name, **kw):
        config = tiny_config(path, tmp_path / name, steps=3, batch_size=3, privacy__unit="user",
                             data__id_field="user_id", data__validation_fraction=1e-9, **kw)
        p = training.prepare(config)
        r = receipt.privacy_receipt(config, p, steps=3, epsilon=1.0, overflowed_steps=0)
        return p, {k: v for k, v in r.items() if k not in ("unit_note",)}

    (a, ra), (b, rb) = receipt_of(corpus, "a"), receipt_of(neighbour, "b")
    assert a.num_units == b.num_units + 1 and ra != rb and "given the number N" in ra["guarantee"]
    (a, ra), (b, rb) = (receipt_of(c, n, privacy__num_units_bound=50) for c, n in ((corpus, "c"), (neighbour, "d")))
    assert ra == rb and "both data sets of at most 50" in ra["guarantee"] and "given the number N" not in ra["guarantee"]
    assert a.sampler.sampling_probability == 3 / 50 and a.noise_multiplier == b.noise_multiplier
    hits, steps = np.zeros(a.num_units), 3000
    for step in range(steps):
        indices, mask = a.sample(step)
        assert (indices[mask] < a.num_units).all() and (indices[~mask] == 0).all()
        np.add.at(hits, indices[mask], 1)
    q = 3 / 50
    assert np.abs(hits / steps - q).max() < 6 * np.sqrt(q * (1 - q) / steps)
    with pytest.raises(training.ConfigError, match="num_units_bound .* must be at least the N = "):
        receipt_of(corpus, "e", privacy__num_units_bound=a.num_units - 1)
    receipt_of(corpus, "f", privacy__num_units_bound=a.num_units)  # review 20: D and D + 1 both within B + 1
    for huge in (10**17, 2**63):  # review 20: q = 3e-17 accounted as epsilon 0; past 2^63 the sampler broke
        with pytest.raises(training.ConfigError, match="num_units_bound .* is too large"):
            receipt_of(corpus, "g", privacy__num_units_bound=huge)
    summary = training.train(a.config, prepared=a, verbose=False)  # the job runs on it, and says so
    assert summary["num_units_bound"] == 50 and summary["num_train_units"] == a.num_units
    written = json.loads((tmp_path / "c" / receipt.PRIVACY_FILE).read_text())
    assert written["sampling"]["num_units_bound"] == 50 and "at most 50" in written["guarantee"]


@pytest.mark.parametrize("overrides, needle", [
    (dict(privacy__unit="person"), "config.privacy.unit must be one of"),
    (dict(privacy__unit="user"), "config.privacy.unit='user' needs config.data.id_field"),
    (dict(privacy__windows_per_unit=2), "windows_per_unit must be 1 with config.privacy.unit='window'"),
    (dict(privacy__unit="document", privacy__windows_per_unit=0), "config.privacy.windows_per_unit must be"),
    (dict(privacy__unit="document", dp__method="two_pass"), "needs config.privacy.unit='window'"),
    (dict(data__id_field="user_id"), "config.data.path: id_field='user_id' needs a .jsonl"),
])
def test_bad_unit_config_is_rejected(tmp_path, overrides, needle):
    from job_testing import tiny_config

    from jaxdp import training
    corpus = tmp_path / "book.txt"
    corpus.write_text("Some text of a book.\n\nAnother paragraph of it.\n" * 50)
    with pytest.raises(training.ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        training.prepare(tiny_config(corpus, tmp_path / "run", **overrides))
    assert not (tmp_path / "run").exists()
