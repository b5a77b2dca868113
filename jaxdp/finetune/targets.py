"""Which projections LoRA wraps and adapters follow, named per model family.

A model's family is `model.config.family` (the HF `model_type`: "llama", "mistral", "qwen2", "qwen3", and
whatever a new model's config names), or "gpt2" for `jaxdp.models.gpt2.GPT2`. `FAMILY_TARGETS` holds, per
family, the projections a target may name and the defaults used when the user names none:

  gpt2                          LoRA: attn/c_attn (q, k, v fused); adapters: attn/c_proj, mlp/c_proj;
                                names: attn/c_attn, attn/c_proj, mlp/c_fc, mlp/c_proj
  llama, mistral, qwen2, qwen3, LoRA: attn/q_proj, attn/v_proj; adapters: attn/o_proj, mlp/down_proj;
  gemma2, gemma3_text           names: attn/{q,k,v,o}_proj, mlp/{gate,up,down}_proj, lm_head (untied heads)

The LoRA defaults are Hugging Face PEFT's (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`: c_attn for
GPT-2, q_proj and v_proj for the Llama-style families; Hu et al. 2021 adapt W_q and W_v), so a DP-LoRA run
here trains the parameters a PEFT run with default settings trains. Every linear of a block ("all-linear",
QLoRA's choice) is `LLAMA_STYLE.block_names`: pass it as the targets. The adapter defaults are Houlsby's (after
attention and after the MLP).

A target is a path suffix ("q_proj", "attn/q_proj", "blocks/0/attn/q_proj"); one that names no projection of
the family is refused in one line listing the family's names (`check_targets`). A model whose family has no
row (a user's own module tree) takes any suffix that matches one of its `jaxdp.core.nn.Linear`s, and has no
default.

A new family registers its row, nothing else: `register_family("myfamily", LLAMA_STYLE)` (a family that names
its projections like Llama: attn/{q,k,v,o}_proj, mlp/{gate,up,down}_proj, as Gemma 2 / 3 do).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class FamilyTargets:
    """One family's projections (path suffixes of `jaxdp.core.nn.Linear`s inside a block).

    Attributes:
      lora: LoRA's default targets.
      adapter: the adapters' default targets.
      names: every projection a target may name.
    """
    lora: tuple[str, ...]
    adapter: tuple[str, ...]
    names: tuple[str, ...]

    @property
    def block_names(self) -> tuple[str, ...]:
        """The names inside a block (all but the head): PEFT's "all-linear"."""
        return tuple(n for n in self.names if "/" in n)

    def __post_init__(self):
        for field in ("lora", "adapter"):
            unknown = [t for t in getattr(self, field) if t not in self.names]
            if unknown:
                raise ValueError(f"FamilyTargets.{field}: {unknown} are not among names {self.names}")


GPT2_STYLE = FamilyTargets(lora=("attn/c_attn",), adapter=("attn/c_proj", "mlp/c_proj"),
                           names=("attn/c_attn", "attn/c_proj", "mlp/c_fc", "mlp/c_proj"))
LLAMA_STYLE = FamilyTargets(lora=("attn/q_proj", "attn/v_proj"), adapter=("attn/o_proj", "mlp/down_proj"),
                            names=("attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj", "mlp/gate_proj",
                                   "mlp/up_proj", "mlp/down_proj", "lm_head"))
# family -> its targets; `register_family` adds a row
FAMILY_TARGETS: dict[str, FamilyTargets] = {"gpt2": GPT2_STYLE, "llama": LLAMA_STYLE, "mistral": LLAMA_STYLE,
                                            "qwen2": LLAMA_STYLE, "qwen3": LLAMA_STYLE,
                                            "gemma2": LLAMA_STYLE, "gemma3_text": LLAMA_STYLE}


def register_family(family: str, targets: FamilyTargets) -> None:
    """Adds (or replaces) `family`'s row of `FAMILY_TARGETS`."""
    if not isinstance(family, str) or not family:
        raise ValueError(f"family must be a non-empty string, got {family!r}")
    if not isinstance(targets, FamilyTargets):
        raise TypeError(f"targets must be a FamilyTargets, got {type(targets).__name__}")
    FAMILY_TARGETS[family] = targets


def family_of(model) -> str | None:
    """`model.config.family`, "gpt2" for a GPT-2 (its config names no family), else None."""
    family = getattr(getattr(model, "config", None), "family", None)
    if isinstance(family, str):
        return family
    return "gpt2" if type(model).__name__ == "GPT2" else None


def _matches(target: str, name: str) -> bool:
    """Whether target and name are the same projection: one is a path suffix of the other."""
    t, n = "/" + target.strip("/"), "/" + name
    return t.endswith(n) or n.endswith(t)


def check_targets(family: str | None, targets, argument: str = "targets") -> tuple[str, ...]:
    """`targets` as a tuple; ValueError (one line, the family's names) for one that names no projection of
    `family`. A family without a row accepts any (its model's linears decide)."""
    if isinstance(targets, str) or not targets or not all(isinstance(t, str) and t.strip("/") for t in targets):
        raise ValueError(f"{argument} must be a non-empty sequence of module path suffixes like 'attn/q_proj', "
                         f"got {targets!r}")
    row = FAMILY_TARGETS.get(family)
    if row is not None:
        for target in targets:
            if not any(_matches(target, name) for name in row.names):
                raise ValueError(f"{argument}: {target!r} names no projection of a {family} model; its names are "
                                 f"{', '.join(row.names)} (or a suffix, e.g. '{row.names[0].split('/')[-1]}')")
    return tuple(targets)


def default_targets(family: str | None, method: str, argument: str = "targets") -> tuple[str, ...]:
    """The default targets of `method` ("lora" or "adapter") for `family`; ValueError without a row."""
    row = FAMILY_TARGETS.get(family)
    if row is None:
        raise ValueError(f"{argument} has no default for a model of family {family!r} (families with defaults: "
                         f"{', '.join(sorted(FAMILY_TARGETS))}): name the projections (path suffixes like "
                         "'attn/q_proj')")
    return row.lora if method == "lora" else row.adapter
