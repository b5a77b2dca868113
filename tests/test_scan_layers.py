"""Scan over layers (`scan_layers=True`) is exact: the same model, the same DP-SGD sums.

Properties:
- the scanned model's forward equals the unrolled model's with the same weights (GPT-2, Llama with the
  Qwen switches); the layout converters round-trip; HF export / import and the run directory's shareable
  model keep the unrolled layout, so either layout reads what the other wrote;
- `per_example_grads` + `fused_clip` on the scanned model equal the vmap reference of the unrolled model
  (flat and per-layer clipping; GPT-2's tied embedding; remat "full" and "dots"; LoRA);
- a planted error inside the scan (two layers' slots swapped, one layer's tap dropped) fails that check;
- the two-pass norms refuse a scanned model by name.
"""


import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_testing import (
    RTOL,
    by_path,
    clip_between,
    lm_batch,
    lm_loss,
    max_rel_err,
    reference_grads,
)
from flax import nnx

import jaxdp
import jaxdp.core.reference
from jaxdp.clipping import norms as norms_lib
from jaxdp.clipping.settings import ClipSpec, NormPlan
from jaxdp.core import _tape, sequence_shards
from jaxdp.finetune import methods
from jaxdp.finetune.settings import LoRA
from jaxdp.models import layers
from jaxdp.models.gpt2 import GPT2, GPT2Config
from jaxdp.models.hf import load_hf, save_hf
from jaxdp.models.llama import Llama, LlamaConfig
from jaxdp.training import run_dir

EXPECTED_BATCH_SIZE = 6.0


def gpt2(**overrides):
    return GPT2(GPT2Config.preset("tiny", vocab_size=97, seq_len=32, **overrides), rngs=nnx.Rngs(3))


def llama(**overrides):
    return Llama(LlamaConfig.preset("tiny", vocab_size=97, seq_len=32, **overrides), rngs=nnx.Rngs(3))


def unstacked(tree) -> dict:
    """{unrolled path: array} of a scanned model's parameter-shaped tree ("blocks" leads with the layer axis)."""
    out = {}
    for p, v in by_path(tree).items():
        if p[0] == "blocks" and not isinstance(p[1], int):
            out.update({(p[0], i) + p[1:]: v[i] for i in range(v.shape[0])})
        else:
            out[p] = v
    return out


def assert_same_params(a, b):
    a, b = unstacked(nnx.state(a, nnx.Param)), unstacked(nnx.state(b, nnx.Param))
    assert a.keys() == b.keys()
    for p in a:
        np.testing.assert_array_equal(np.asarray(a[p]), np.asarray(b[p]), err_msg=str(p))


def test_forward_layouts_and_files(tmp_path):
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 97)
    for make in (lambda **o: gpt2(n_layer=3, **o), lambda **o: llama(n_layer=3, family="qwen3", qk_norm=True, **o)):
        flat, stacked = make(), make(scan_layers=True)  # the same seed: the same weights in either layout
        assert_same_params(flat, stacked)
        assert nnx.state(stacked.blocks, nnx.Param)["attn"]["o_proj" if isinstance(flat, Llama) else "c_proj"][
            "kernel"].shape[0] == 3
        expected = flat(tokens)
        for model in (stacked, layers.scanned(flat), layers.unrolled(stacked)):
            np.testing.assert_allclose(model(tokens), expected, rtol=1e-5, atol=1e-5)
        assert_same_params(layers.unrolled(layers.scanned(flat)), flat)
        assert not layers.is_scanned(flat) and layers.is_scanned(stacked)

        save_hf(stacked, tmp_path / "hf")  # HF files hold the unrolled layout
        for scan in (False, True):
            loaded = load_hf(tmp_path / "hf", scan_layers=scan)
            assert layers.is_scanned(loaded) == scan
            assert_same_params(loaded, flat)
        run_dir.write_model(tmp_path / "model", stacked)
        with np.load(tmp_path / "model" / run_dir.PARAMS_FILE) as saved:
            assert "blocks/0/attn/" + ("o_proj" if isinstance(flat, Llama) else "c_proj") + "/kernel" in saved
        fresh = make(scan_layers=True)
        nnx.update(fresh, jax.tree.map(jnp.zeros_like, nnx.state(fresh)))
        assert run_dir.read_model(tmp_path / "model", fresh)
        assert_same_params(fresh, flat)

    with pytest.raises(ValueError, match="scan_layers"):
        GPT2Config.preset("tiny", scan_layers="yes")
    with pytest.raises(ValueError, match="block 1 differs"):  # block 1 frozen apart from block 0
        layers.scanned(methods.freeze(gpt2(), lambda path, owner: path[1] != 1))


def _cases():
    """{name: (unrolled model, scanned model with the same weights, clipping)}."""
    lora = methods.prepare(gpt2(), "lora", rngs=nnx.Rngs(5), options=LoRA(rank=2))  # then scanned (below)
    # LoRA starts with lora_b = 0 (no gradient reaches lora_a): move it off zero so both get one
    for _, node in nnx.iter_graph(lora):
        if isinstance(node, methods.LoRALinear):
            node.lora_b.kernel.set_value(0.1 * jax.random.normal(jax.random.key(7), node.lora_b.kernel.shape))
    cases = {
        "gpt2 flat": (gpt2(), "flat"),
        "gpt2 per_layer remat full": (gpt2(remat="full"), "per_layer"),
        "llama per_layer remat dots": (llama(remat="dots", qkv_bias=True), "per_layer"),
        "gpt2 lora per_layer": (lora, "per_layer"),
    }
    return {name: (model, layers.scanned(model), clipping) for name, (model, clipping) in cases.items()}


def _reference(model, batch, clipping):
    _, ref = reference_grads(lm_loss, model, batch)
    C = clip_between(ref)
    sums, _ = jaxdp.core.reference.clipped_sum(ref, C, clipping=clipping)
    return C, {p: s / EXPECTED_BATCH_SIZE for p, s in sums.items()}


def _scanned_updates(cases, refs, batch):
    """The first fused_clip update of every scanned case, in one jitted function."""
    grads_fn = jaxdp.per_example_grads(lm_loss, fallback=False)
    txs = {name: jaxdp.fused_clip(refs[name][0], 0.0, expected_batch_size=EXPECTED_BATCH_SIZE,
                                  clip=ClipSpec(clipping=clipping)) for name, (_, _, clipping) in cases.items()}

    @nnx.jit
    def updates(models, batch):
        out = {}
        for name, model in models.items():
            _, grads = grads_fn(model, batch)
            params = nnx.state(model, nnx.Param)
            out[name] = txs[name].update(grads, txs[name].init(params), params)[0]
        return out
    return updates({name: scanned for name, (_, scanned, _) in cases.items()}, batch)


def test_scanned_dp_sums_equal_reference(monkeypatch):
    batch = lm_batch(seed=12)
    cases = _cases()
    refs = {name: _reference(model, batch, clipping) for name, (model, _, clipping) in cases.items()}
    for name, updates in _scanned_updates(cases, refs, batch).items():
        err = max_rel_err(unstacked(updates), refs[name][1])
        assert err <= RTOL, (name, err)

    # The split route (a caller's squared_norms_fn, or the Pallas single pass): the stacked parameters
    # clipped layer by layer under the unrolled paths, not by the vmapped rules.
    name = "gpt2 per_layer remat full"
    norms_fn = functools.partial(norms_lib.squared_norms_with_bound, strategy="ghost")

    @nnx.jit
    def split_sums(model, batch):
        _, grads = jaxdp.per_example_grads(lm_loss, fallback=False)(model, batch)
        clip = ClipSpec(clipping="per_layer")
        return [jaxdp.clipped_aggregate(grads, refs[name][0], clip=clip, squared_norms_fn=norms_fn)[0],
                jaxdp.clipped_aggregate(grads, refs[name][0], clip=clip, norms=NormPlan(strategy="pallas"))[0]]
    for sums in split_sums(cases[name][1], batch):  # the second: the single-pass kernel (interpreted on CPU)
        sums = jax.tree.map(lambda s: s / EXPECTED_BATCH_SIZE, sums)
        assert max_rel_err(unstacked(sums), refs[name][1]) <= RTOL

    # Planted errors inside the scan, on the per-layer GPT-2 case: the check above must catch each.
    one = {"gpt2 per_layer remat full": cases["gpt2 per_layer remat full"]}
    scan_slots = _tape._Tape.scan_slots
    plants = {
        "two layers' slots swapped": lambda slots: jax.tree.map(lambda a: a[::-1], slots),
        "layer 0's tap dropped": lambda slots: jax.tree.map(
            lambda a: a.at[0].set(jax.lax.stop_gradient(a[0])), slots),
    }
    for plant, change in plants.items():
        monkeypatch.setattr(_tape._Tape, "scan_slots", lambda self, scan, change=change: change(
            scan_slots(self, scan)))
        updates = _scanned_updates(one, refs, batch)["gpt2 per_layer remat full"]
        err = max_rel_err(unstacked(updates), refs["gpt2 per_layer remat full"][1])
        assert err > 100 * RTOL, (plant, err)
        monkeypatch.setattr(_tape._Tape, "scan_slots", scan_slots)


def test_two_pass_refuses_scanned_model():
    model = gpt2(scan_layers=True)
    fn = jaxdp.two_pass_clipped_sums(lm_loss, 1.0)
    with pytest.raises(ValueError, match="scanned layers"):
        fn(model, lm_batch(seed=1))


def test_job_runs_scanned_and_refuses_the_other_layout(tmp_path):
    """`--config.model.scan_layers=True` trains end to end (interrupted, resumed) to the losses of the unrolled run
    with the same seed; resuming its run directory with the other layout is refused with one line."""
    from job_testing import tiny_config, write_tiny_corpus

    from jaxdp import training
    from jaxdp.training.config import ConfigError

    corpus = write_tiny_corpus(tmp_path)
    kw = {"model.n_layer": 2, "steps": 3, "checkpoint_every": 1, "eval_every": 3}
    scanned = tmp_path / "scanned"
    assert training.train(tiny_config(corpus, scanned, **kw, **{"model.scan_layers": True}), interrupt_after=2,
                          verbose=False) == {"interrupted_at": 2}
    with pytest.raises(ConfigError, match="differs in: model.scan_layers"):
        training.prepare(tiny_config(corpus, scanned, **kw))
    for method, strategy in (("two_pass", "auto"), ("bookkeeping", "reference")):
        with pytest.raises(ConfigError, match="scan_layers=True needs"):
            training.prepare(tiny_config(corpus, tmp_path / method, **kw, **{
                "model.scan_layers": True, "dp.method": method, "dp.strategy": strategy}))
    training.train(tiny_config(corpus, scanned, **kw, **{"model.scan_layers": True}), verbose=False)
    training.train(tiny_config(corpus, tmp_path / "unrolled", **kw), verbose=False)
    got, want = training.read_metrics(scanned), training.read_metrics(tmp_path / "unrolled")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2, 3]
    for g, w in zip(got, want):
        if w["train_loss"] is None:  # a row with no training loss (step 0's evaluation)
            assert g["train_loss"] is None, (g, w)
        else:
            assert g["train_loss"] == pytest.approx(w["train_loss"], rel=1e-4), (g, w)


def test_finetune_reads_a_scanned_run_and_trains_unrolled(tmp_path):
    """A pretraining run with scan_layers=True as fine-tuning's init: its model is read in its layout and handed
    to the methods unrolled (they change blocks one by one), with the same function."""
    import json

    from jaxdp.training import config as config_lib
    from jaxdp.training import finetune_job

    model = {"family": "gpt2", "n_layer": 2, "n_head": 2, "d_model": 32, "mlp_ratio": 4, "max_seq_len": 16,
             "scan_layers": True}
    (tmp_path / "config.json").write_text(json.dumps({"model": model}))
    source = config_lib.build_model(config_lib.model_config(model, 50, dtype="float32", remat="none"), 3)
    run_dir.write_model(tmp_path / "model", source)
    resolved = {k: v for k, v in model.items() if k != "scan_layers"}  # what resolve() takes from the init
    loaded = finetune_job._pretrained(str(tmp_path), "run",
                                      config_lib.model_config(resolved, 50, dtype="float32", remat="none"))
    assert not layers.is_scanned(loaded)
    assert_same_params(loaded, source)


def _cp_loss(model, batch, seq_axis=None):
    """Per-example mean NLL over the global sequence (this shard's share on a sequence shard)."""
    logits = model(batch["inputs"], seq_axis=seq_axis)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.where(batch["mask"], sequence_shards.sequence_mean(nll, seq_axis), 0.0)


def test_sharded_step_on_scanned_model_equals_single_device():
    """ShardedDPStep (8 fake devices: data 4 x seq 2, ZeRO-3, per-layer clipping) on the scanned GPT-2 equals the
    single-device step of the unrolled model: the privatised gradient and the parameters after one DP-Adam step.
    Under seq > 1 the stacked parameters take the layer-by-layer route (its norms come from sequence shards)."""
    from jaxdp import sharding
    from jaxdp.clipping.settings import DPSpec

    C, adam = 0.05, optax.adam(1e-2, eps=1e-3)
    tokens = jax.random.randint(jax.random.key(3), (8, 17), 0, 97)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.arange(8) < 7}
    model = gpt2()
    dp = jaxdp.fused_clip(C, 0.0, expected_batch_size=EXPECTED_BATCH_SIZE, clip=ClipSpec(clipping="per_layer"))

    @nnx.jit
    def single_device(model, batch):
        params = nnx.state(model, nnx.Param)
        _, grads = jaxdp.per_example_grads(_cp_loss)(model, batch)
        private, _ = dp.update(grads, dp.init(params), params)
        tx = optax.chain(dp, adam)
        updates, _ = tx.update(grads, tx.init(params), params)
        return by_path(private), by_path(optax.apply_updates(params, updates))
    expected_grads, expected_params = single_device(model, batch)

    step = sharding.ShardedDPStep(_cp_loss, adam, sharding.make_mesh(4, 2),
                                  DPSpec(l2_norm_clip=C, noise_multiplier=0.0, expected_batch_size=EXPECTED_BATCH_SIZE,
                                         clip=ClipSpec(clipping="per_layer")), key=jax.random.key(7), zero_stage=3)
    new_state, out = step(step.init(layers.scanned(model)), batch)
    assert max_rel_err(unstacked(out["grads"]), expected_grads) <= RTOL
    assert max_rel_err(unstacked(new_state.params), expected_params) <= RTOL
    kernel = by_path(step.layout.param_specs)[("blocks", "attn", "c_attn", "kernel")]
    assert sharding.DATA in kernel  # ZeRO-3: the stacked kernel sharded over data


def test_scanned_step_does_not_grow_with_depth():
    """The compiled DP step (per_example_grads + per-layer fused_clip) of the scanned model has about as many
    instructions at 8 layers as at 2: per-layer groups of a stacked parameter are one (L, B) family, so
    neither the tape nor the clipping unrolls over layers (per group, XLA fused the drop rule's test of all
    groups into each group's factors, O(L^2))."""
    grads_fn = jaxdp.per_example_grads(lm_loss, fallback=False)
    tx = jaxdp.fused_clip(1.0, 0.0, expected_batch_size=EXPECTED_BATCH_SIZE, clip=ClipSpec(clipping="per_layer"))

    def size(n_layer):
        model = gpt2(n_layer=n_layer, scan_layers=True)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def step(params, rest, batch):
            _, grads = grads_fn(nnx.merge(graphdef, params, rest), batch)
            return tx.update(grads, tx.init(params), params)[0]
        return jax.jit(step).lower(params, rest, lm_batch(seed=1)).compile().as_text().count("\n")

    small, deep = size(2), size(8)
    assert deep <= 1.1 * small, (small, deep)
