"""The differentiation core: the tape the layers record on (`_tape`), factored per-example gradient
terms (`terms`), the DP layers (`nn`), `per_example_grads` in one backward pass (`per_example`), the
per-example losses (`losses`), the helpers of one sequence shard (`sequence_shards`), a row reader
(`rows`), the per-example-loss check (`loss_check`) and the vmap oracle every
fast path is tested against (`reference`). Nothing here clips, adds noise or knows a mesh.

Submodules and names load on first use (PEP 562).
"""

from jaxdp._lazy import lazy_names

_SUBMODULES = ('_tape', 'loss_check', 'losses', 'nn', 'per_example', 'reference', 'rows', 'sequence_shards', 'terms')

__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(_SUBMODULES))
