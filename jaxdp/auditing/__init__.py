"""The one-run privacy audit: its bound and scores (`bound`), the training runs it audits (`runs`) and their
named settings (`settings`: `Claim`, `WhiteBoxSettings`, `BlackBoxSettings`).

Submodules and names load on first use (PEP 562). The package's own names are those of
`jaxdp.auditing.bound` (the module it replaced), so that code written against the old module keeps working.
"""

from jaxdp._lazy import lazy_names

_SUBMODULES = ('bound', 'runs', 'settings')

__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(_SUBMODULES), replaced='jaxdp.auditing.bound')
