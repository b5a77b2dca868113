"""jaxdp: differentially private training of language models in JAX."""

from jaxdp import accounting
from jaxdp import audit_runs
from jaxdp import auditing
from jaxdp import calibration
from jaxdp import data
from jaxdp import finetune
from jaxdp import models
from jaxdp import nn
from jaxdp import noise
from jaxdp import pallas
from jaxdp import privacy_budget
from jaxdp import reference
from jaxdp import sampling
from jaxdp import sharding
from jaxdp import training
from jaxdp.clipping import group_thresholds
from jaxdp.fused_clip import FusedClipState
from jaxdp.fused_clip import clipped_aggregate
from jaxdp.fused_clip import fused_clip
from jaxdp.loss_check import check_per_example_loss
from jaxdp.models.hf_gpt2 import load_hf_gpt2
from jaxdp.models.hf_gpt2 import save_hf_gpt2
from jaxdp.models.hf_llama import load_hf_llama
from jaxdp.models.hf_llama import save_hf_llama
from jaxdp.norms import squared_norms
from jaxdp.per_example import per_example_grads
from jaxdp.terms import DenseTerm
from jaxdp.terms import EmbedTerm
from jaxdp.terms import FactoredGrad
from jaxdp.terms import LinearTerm
from jaxdp.two_pass import two_pass_clipped_sums

__version__ = "0.1.0"

__all__ = [
    "DenseTerm",
    "EmbedTerm",
    "FactoredGrad",
    "FusedClipState",
    "LinearTerm",
    "accounting",
    "audit_runs",
    "auditing",
    "calibration",
    "check_per_example_loss",
    "clipped_aggregate",
    "data",
    "finetune",
    "fused_clip",
    "group_thresholds",
    "load_hf_gpt2",
    "load_hf_llama",
    "models",
    "nn",
    "noise",
    "pallas",
    "per_example_grads",
    "privacy_budget",
    "reference",
    "sampling",
    "save_hf_gpt2",
    "save_hf_llama",
    "sharding",
    "squared_norms",
    "training",
    "two_pass_clipped_sums",
]
