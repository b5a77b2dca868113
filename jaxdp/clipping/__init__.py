"""Clipping: each example's contribution bounded by C. The rules (`rules`: groups, thresholds, guarded
norms, the sensitivity factor, clip factors, the drop rule), per-example norms with their rounding
bound (`norms`) and the cost model that picks a norm method (`norm_costs`, `device_rates`), the
clipped sums (`aggregation`: `fused_clip`, `clipped_aggregate`; `two_pass`; the per-layer single
pass `single_pass`), and the named settings they take (`settings`: `ClipSpec`, `NormPlan`, `DPSpec`).

Submodules and names load on first use (PEP 562). The package's own names are those of
`jaxdp.clipping.rules` (the module it replaced), so that code written against the old module keeps working.
"""

from jaxdp._lazy import lazy_names

_SUBMODULES = ('aggregation', 'device_rates', 'norm_costs', 'norms', 'rules', 'settings', 'single_pass', 'two_pass')

__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(_SUBMODULES), replaced='jaxdp.clipping.rules')
