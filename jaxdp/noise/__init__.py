"""Noise: the one place DP noise is added (`privatizer`), the draws it makes (`draws`: keys, Gaussian
leaves, secure ChaCha20 draws and the snapped release), the run's secret seeds (`seeds`) and ChaCha20
(`chacha`). `seeds` and `chacha` import no JAX.

Submodules and names load on first use (PEP 562). The package's own names are those of
`jaxdp.noise.draws` (the module it replaced), so that code written against the old module keeps working.
"""

from jaxdp._lazy import lazy_names

_SUBMODULES = ('chacha', 'draws', 'mechanisms', 'privatizer', 'seeds', 'strategies')

__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(_SUBMODULES), replaced='jaxdp.noise.draws')
