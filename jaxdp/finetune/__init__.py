"""Fine-tuning: trainable subsets and their modules (`methods`: freeze, LoRA, adapters, prompts,
`prepare`), each method's settings (`settings`: `LoRA`, `Adapters`, `Prompt`, `Side`, `Reversible`) and the
compiled step's memory per method (`memory`), the LoRA / adapter targets per family (`targets`) and the
checks every fine-tuning run ends with (`tripwires`). The job is `jaxdp.training.finetune_job`.

Submodules and names load on first use (PEP 562). The package's own names are those of
`jaxdp.finetune.methods` (the module it replaced), so that code written against the old module keeps working.
"""

from jaxdp._lazy import lazy_names

_SUBMODULES = ('memory', 'methods', 'settings', 'targets', 'tripwires')
# the methods' settings, as `jaxdp.finetune.LoRA(...)`
_SETTINGS = {name: 'jaxdp.finetune.settings' for name in ('Adapters', 'LoRA', 'Prompt', 'Reversible', 'Side')}

__getattr__, __dir__ = lazy_names(__name__, {**dict.fromkeys(_SUBMODULES), **_SETTINGS},
                                  replaced='jaxdp.finetune.methods')
