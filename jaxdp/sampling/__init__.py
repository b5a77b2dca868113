"""Host-side Poisson sampling (`poisson`: `PoissonSampler`, overflow slack) and the exact Binomial
draw of batch sizes (`binomial`). NumPy only.

Submodules and names load on first use (PEP 562). The package's own names are those of
`jaxdp.sampling.poisson` (the module it replaced), so that code written against the old module keeps working.
"""

from jaxdp._lazy import lazy_names

_SUBMODULES = ('binomial', 'cyclic', 'poisson')

__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(_SUBMODULES), replaced='jaxdp.sampling.poisson')
