"""Old module names, kept for one release: `import jaxdp.norms` gives the module now at
`jaxdp.clipping.norms` (the same object, so a patch through either name is seen by both), with a
DeprecationWarning naming the new home. WORKSPACE.md ("Layout") lists what moved where."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old name -> new home. Packages that took over a module's name (`jaxdp.clipping`, `jaxdp.noise`, ...) answer
# for its names themselves (`jaxdp._lazy.lazy_names(replaced=...)`).
MOVED = {
    "jaxdp._tape": "jaxdp.core._tape",
    "jaxdp.aggregation": "jaxdp.clipping.aggregation",
    "jaxdp.audit_runs": "jaxdp.auditing.runs",
    "jaxdp.binomial": "jaxdp.sampling.binomial",
    "jaxdp.calibration": "jaxdp.accounting.calibration",
    "jaxdp.chacha": "jaxdp.noise.chacha",
    "jaxdp.corpus": "jaxdp.data.corpus",
    "jaxdp.device_rates": "jaxdp.clipping.device_rates",
    "jaxdp.finetune_memory": "jaxdp.finetune.memory",
    "jaxdp.hlo_cost": "jaxdp.analysis.hlo_cost",
    "jaxdp.loss_check": "jaxdp.core.loss_check",
    "jaxdp.losses": "jaxdp.core.losses",
    "jaxdp.nn": "jaxdp.core.nn",
    "jaxdp.norm_costs": "jaxdp.clipping.norm_costs",
    "jaxdp.norms": "jaxdp.clipping.norms",
    "jaxdp.per_example": "jaxdp.core.per_example",
    "jaxdp.privacy_budget": "jaxdp.accounting.budget",
    "jaxdp.privatizer": "jaxdp.noise.privatizer",
    "jaxdp.reference": "jaxdp.core.reference",
    "jaxdp.seeds": "jaxdp.noise.seeds",
    "jaxdp.models.sequence_shards": "jaxdp.core.sequence_shards",
    "jaxdp.sharding.collectives": "jaxdp.analysis.collectives",
    "jaxdp.sharding.context": "jaxdp.core.sequence_shards",
    "jaxdp.single_pass_clipping": "jaxdp.clipping.single_pass",
    "jaxdp.tasks": "jaxdp.data.tasks",
    "jaxdp.terms": "jaxdp.core.terms",
    "jaxdp.tokenizer": "jaxdp.data.tokenizer",
    "jaxdp.two_pass": "jaxdp.clipping.two_pass",
}


def moved_module(old: str):
    """The module now at `MOVED[old]`, with a DeprecationWarning naming it."""
    warnings.warn(f"{old} moved to {MOVED[old]}; the old name goes in the next release", DeprecationWarning,
                  stacklevel=3)
    return importlib.import_module(MOVED[old])


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name and loads it as the module at its new home (no second copy)."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        return moved_module(spec.name)

    def exec_module(self, module):
        pass


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Alias())  # before any finder that could find a stale copy of an old file
