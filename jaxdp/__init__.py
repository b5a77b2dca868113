"""jaxdp: differentially private training of language models in JAX.

The public names below load on first use (PEP 562), so `import jaxdp.models.gpt2` does not import the DP
stack, Pallas or the training job. The test oracle `jaxdp.reference` (vmap per-example gradients) is not
exported: import it as `from jaxdp import reference`.
"""

from jaxdp._lazy import lazy_names

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


__getattr__, __dir__ = lazy_names(__name__, _PUBLIC)

__all__ = sorted(_PUBLIC)
