"""One way from a model config to its model: `build(config, rngs)`.

`FAMILIES` lists each family's module with its config and model class, so code that only holds a config (the
jobs, the memory plan) builds the right model without a chain of isinstance checks that every new family
would have to find and extend. A family's module is imported on first use only.
"""

from __future__ import annotations

import importlib

from flax import nnx

# (module, config class, model class)
FAMILIES = (
    ("jaxdp.models.gpt2", "GPT2Config", "GPT2"),
    ("jaxdp.models.llama", "LlamaConfig", "Llama"),
    ("jaxdp.models.gemma", "GemmaConfig", "Gemma"),
)


def model_class(config) -> type:
    """The model class for `config`'s type; a TypeError naming the known config types otherwise."""
    for module, config_name, model_name in FAMILIES:
        if type(config).__name__ == config_name and type(config).__module__ == module:
            return getattr(importlib.import_module(module), model_name)
    known = ", ".join(f"{m}.{c}" for m, c, _ in FAMILIES)
    raise TypeError(f"no model is registered for {type(config).__module__}.{type(config).__name__}; "
                    f"known configs: {known}")


def build(config, rngs: nnx.Rngs) -> nnx.Module:
    """`model_class(config)(config, rngs=rngs)`."""
    return model_class(config)(config, rngs=rngs)
