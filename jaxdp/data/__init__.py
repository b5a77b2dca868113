"""Data: documents and unit ids (`corpus`), tokenizers (`tokenizer`), the train / validation split and
token windows (`windows`), the sentiment task (`tasks`); `corpora/` is the bundled corpus.

Submodules and names load on first use (PEP 562). The package's own names are those of
`jaxdp.data.windows` (the module it replaced), so that code written against the old module keeps working.
"""

from jaxdp._lazy import lazy_names

_SUBMODULES = ('corpus', 'tasks', 'tokenizer', 'windows')

__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(_SUBMODULES), replaced='jaxdp.data.windows')
