"""Host-side accounting, NumPy only: epsilon of a run (`accountant`), the inverse questions
(`calibration`: sigma for a budget, steps a budget allows) and the budget stop (`budget`).

Submodules and names load on first use (PEP 562). The package's own names are those of
`jaxdp.accounting.accountant` (the module it replaced), so that code written against the old module keeps working.
"""

from jaxdp._lazy import lazy_names

_SUBMODULES = ('accountant', 'budget', 'calibration', 'mechanisms')

__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(_SUBMODULES), replaced='jaxdp.accounting.accountant')
