"""jaxdp: differentially private training of language models in JAX.

The public names below load on first use (PEP 562), so `import jaxdp.models.gpt2` does not import the DP
stack, Pallas or the training job. The test oracle `jaxdp.core.reference` (vmap per-example gradients) is not
exported: import it as `from jaxdp.core import reference`.

The package is laid out by concept (WORKSPACE.md, "Layout"): `core` (tape, terms, layers, per-example
gradients, losses, the reference), `clipping`, `noise`, `sampling`, `accounting`, `auditing`, `data`,
`models`, `finetune`, `pallas`, `sharding`, `training`, `analysis`. Old module names (`jaxdp.norms`,
`jaxdp.calibration`, ...) still import, with a DeprecationWarning, for one release (`jaxdp._moved`).
"""

from jaxdp import _moved
from jaxdp._lazy import lazy_names

__version__ = "0.1.0"

# name -> the module that defines it (a submodule: the name itself).
_PUBLIC = {
    "ClipSpec": "jaxdp.clipping.settings",
    "DPSpec": "jaxdp.clipping.settings",
    "DenseTerm": "jaxdp.core.terms",
    "EmbedTerm": "jaxdp.core.terms",
    "FactoredGrad": "jaxdp.core.terms",
    "FusedClipState": "jaxdp.clipping.aggregation",
    "GaussianPrivatizer": "jaxdp.noise.privatizer",
    "LinearTerm": "jaxdp.core.terms",
    "NormPlan": "jaxdp.clipping.settings",
    "accounting": None,
    "analysis": None,
    "auditing": None,
    "check_per_example_loss": "jaxdp.core.loss_check",
    "clipping": None,
    "clipped_aggregate": "jaxdp.clipping.aggregation",
    "core": None,
    "data": None,
    "finetune": None,
    "fused_clip": "jaxdp.clipping.aggregation",
    "group_thresholds": "jaxdp.clipping.rules",
    "load_hf": "jaxdp.models.hf",
    "load_hf_gpt2": "jaxdp.models.hf_gpt2",
    "load_hf_llama": "jaxdp.models.hf_llama",
    "models": None,
    "noise": None,
    "pallas": None,
    "per_example_grads": "jaxdp.core.per_example",
    "sampling": None,
    "save_hf": "jaxdp.models.hf",
    "save_hf_gpt2": "jaxdp.models.hf_gpt2",
    "save_hf_llama": "jaxdp.models.hf_llama",
    "sharding": None,
    "squared_norms": "jaxdp.clipping.norms",
    "training": None,
    "two_pass_clipped_sums": "jaxdp.clipping.two_pass",
}


_moved.install()
# old top-level module names as attributes (`jaxdp.calibration.calibrate_noise_multiplier`), one release
# (through the old name's import, so that attribute access warns as `import jaxdp.norms` does)
_OLD = {old.removeprefix("jaxdp."): old for old in _moved.MOVED if old.count(".") == 1}

__getattr__, __dir__ = lazy_names(__name__, _PUBLIC, _OLD)

__all__ = sorted(_PUBLIC)
