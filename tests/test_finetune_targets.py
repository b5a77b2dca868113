"""LoRA / adapter targets named per family (jaxdp.finetune.targets): the defaults each family gets when the
user names none, one line naming the family's projections for an unknown name, any projection of the family
(all-linear) accepted, and a new family added by registering its row alone."""

import dataclasses

import pytest
from dp_testing import tiny_gpt2, tiny_llama
from flax import nnx

from jaxdp.finetune import methods, targets
from jaxdp.finetune.settings import Adapters, LoRA
from jaxdp.models.llama import FAMILIES


def wrapped(model, method, options=None):
    """The projection kinds (last two path names) the method wrapped."""
    methods.prepare(model, method, rngs=nnx.Rngs(0), options=options)
    inner = "lora_a" if method == "lora" else "adapter"
    return sorted({"/".join(map(str, p[p.index(inner) - 2:p.index(inner)])) for p in methods.trainable_paths(model)
                   if inner in p})


def llama_of(family):
    model = tiny_llama(0)
    model.config = dataclasses.replace(model.config, family=family)  # names only: no math changes
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_style_families_default_to_q_and_v(family):
    assert targets.family_of(llama_of(family)) == family
    assert wrapped(llama_of(family), "lora") == ["attn/q_proj", "attn/v_proj"]  # PEFT's default
    assert wrapped(llama_of(family), "adapter") == ["attn/o_proj", "mlp/down_proj"]
    everything = LoRA(rank=2, targets=targets.LLAMA_STYLE.block_names)  # all-linear
    assert wrapped(llama_of(family), "lora", everything) == sorted(targets.LLAMA_STYLE.block_names)


def test_gpt2_defaults_and_names():
    assert targets.family_of(tiny_gpt2(0)) == "gpt2"
    assert wrapped(tiny_gpt2(0), "lora") == ["attn/c_attn"]
    assert wrapped(tiny_gpt2(0), "adapter", Adapters(bottleneck=4)) == ["attn/c_proj", "mlp/c_proj"]
    assert wrapped(tiny_gpt2(0), "lora", LoRA(targets=("c_fc", "blocks/0/mlp/c_proj"))) == ["mlp/c_fc",
                                                                                              "mlp/c_proj"]


def test_an_unknown_target_is_one_line_naming_the_familys_names():
    with pytest.raises(ValueError) as e:
        methods.prepare(tiny_llama(0), "lora", rngs=nnx.Rngs(0), options=LoRA(targets=("q_proj", "c_attn")))
    message = str(e.value)
    assert "\n" not in message and "'c_attn' names no projection of a llama model" in message
    assert all(name in message for name in targets.LLAMA_STYLE.names) and "lm_head" in message
    with pytest.raises(ValueError, match="'q_proj' names no projection of a gpt2 model; its names are attn/c_attn"):
        methods.prepare(tiny_gpt2(0), "adapter", rngs=nnx.Rngs(0), options=Adapters(targets=("q_proj",)))


def test_a_new_family_registers_its_row_only(monkeypatch):
    model = llama_of("llama")
    object.__setattr__(model.config, "family", "newfam")  # a family with no row yet: no default
    with pytest.raises(ValueError, match="no default for a model of family 'newfam'"):
        methods.prepare(model, "lora", rngs=nnx.Rngs(0))
    monkeypatch.setitem(targets.FAMILY_TARGETS, "newfam", targets.FamilyTargets(
        lora=("mlp/up_proj",), adapter=("mlp/down_proj",), names=("mlp/up_proj", "mlp/down_proj")))
    model = llama_of("llama")
    object.__setattr__(model.config, "family", "newfam")
    assert wrapped(model, "lora") == ["mlp/up_proj"]
    with pytest.raises(ValueError, match="FamilyTargets.lora"):
        targets.FamilyTargets(lora=("attn/q_proj",), adapter=(), names=("mlp/up_proj",))
