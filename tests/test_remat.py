"""Remat policies ("none" | "dots" | "full") are exact under per_example_grads + fused_clip.

Property: the fused_clip update computed with every block checkpointed under
each policy equals the vmap reference (same parameters, same batch): GPT-2
tiny under every policy and Llama tiny under "dots", in one jitted function.
"""

import functools

import pytest
from dp_testing import (
    clip_between,
    lm_batch,
    lm_loss,
    max_rel_err,
    reference_grads,
    tiny_gpt2,
)
from flax import nnx

import jaxdp
import jaxdp.core.reference  # the vmap oracle: not exported by jaxdp
from jaxdp.models.llama import Llama, LlamaConfig
from jaxdp.models.remat import REMAT_POLICIES, remat_policy
from jaxdp.clipping.settings import ClipSpec

RTOL = 1e-5
EXPECTED_BATCH_SIZE = 6.0


def tiny_llama(seed, remat):
    return Llama(LlamaConfig.preset("tiny", vocab_size=97, seq_len=32, remat=remat), rngs=nnx.Rngs(seed))


MAKERS = {"gpt2": lambda remat: tiny_gpt2(seed=11, remat=remat),
          "llama": lambda remat: tiny_llama(seed=11, remat=remat)}


@functools.cache
def reference(name):
    # Policy "none", spelled as each model's default (GPT-2 remat=False, Llama "none"; test_policy_names): the
    # same model structure as the other files' references, so that the jitted reference compiles once for all.
    model = tiny_gpt2(seed=11) if name == "gpt2" else tiny_llama(seed=11, remat="none")
    batch = lm_batch(seed=12)
    _, ref_grads = reference_grads(lm_loss, model, batch)
    C = clip_between(ref_grads)
    sums, _ = jaxdp.core.reference.clipped_sum(ref_grads, C, clipping="per_layer")
    return C, {p: s / EXPECTED_BATCH_SIZE for p, s in sums.items()}


def test_every_policy_equals_reference():
    batch = lm_batch(seed=12)
    # GPT-2 under every policy; Llama under "dots" ("full" is in test_llama, "none" everywhere).
    models = {("gpt2", policy): MAKERS["gpt2"](policy) for policy in REMAT_POLICIES}
    models[("llama", "dots")] = MAKERS["llama"]("dots")
    txs = {name: jaxdp.fused_clip(reference(name)[0], 0.0, expected_batch_size=EXPECTED_BATCH_SIZE,
                                  clip=ClipSpec(clipping="per_layer")) for name in MAKERS}
    grads_fn = jaxdp.per_example_grads(lm_loss, fallback=False)

    @nnx.jit
    def all_updates(models, batch):
        out = {}
        for (name, policy), model in models.items():
            _, grads = grads_fn(model, batch)
            params = nnx.state(model, nnx.Param)
            out[(name, policy)] = txs[name].update(grads, txs[name].init(params), params)[0]
        return out

    for (name, policy), updates in all_updates(models, batch).items():
        err = max_rel_err(updates, reference(name)[1])
        assert err <= RTOL, (name, policy, err)


def test_policy_names():
    assert remat_policy(True) == "full" and remat_policy(False) == "none"
    assert [remat_policy(p) for p in REMAT_POLICIES] == list(REMAT_POLICIES)
    with pytest.raises(ValueError, match="remat"):
        tiny_gpt2(remat="selective")
    with pytest.raises(ValueError, match="remat"):
        tiny_llama(0, "everything")

