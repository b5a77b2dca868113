"""jaxdp: differentially private training of language models in JAX.

The public names below load on first use (PEP 562), so `import jaxdp.models.gpt2` does not import the DP
stack, Pallas or the training job. The test oracle `jaxdp.reference` (vmap per-example gradients) is not
exported: import it as `from jaxdp import reference`.
"""

import importlib

__version__ = "0.1.0"

# name -> the module that defines it (a submodule: the name itself).
_PUBLIC = {
    "DenseTerm": "jaxdp.terms",
    "EmbedTerm": "jaxdp.terms",
    "FactoredGrad": "jaxdp.terms",
    "FusedClipState": "jaxdp.aggregation",
    "GaussianPrivatizer": "jaxdp.privatizer",
    "LinearTerm": "jaxdp.terms",
    "accounting": None,
    "audit_runs": None,
    "auditing": None,
    "calibration": None,
    "check_per_example_loss": "jaxdp.loss_check",
    "clipped_aggregate": "jaxdp.aggregation",
    "data": None,
    "finetune": None,
    "fused_clip": "jaxdp.aggregation",
    "group_thresholds": "jaxdp.clipping",
    "load_hf_gpt2": "jaxdp.models.hf_gpt2",
    "load_hf_llama": "jaxdp.models.hf_llama",
    "models": None,
    "nn": None,
    "noise": None,
    "pallas": None,
    "per_example_grads": "jaxdp.per_example",
    "privacy_budget": None,
    "sampling": None,
    "save_hf_gpt2": "jaxdp.models.hf_gpt2",
    "save_hf_llama": "jaxdp.models.hf_llama",
    "sharding": None,
    "squared_norms": "jaxdp.norms",
    "training": None,
    "two_pass_clipped_sums": "jaxdp.two_pass",
}


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'jaxdp' has no attribute {name!r}")
    home = _PUBLIC[name]
    value = importlib.import_module(f"jaxdp.{name}") if home is None else getattr(importlib.import_module(home), name)
    globals()[name] = value  # a function's name may also be its module's (fused_clip): the function wins
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))


__all__ = sorted(_PUBLIC)
