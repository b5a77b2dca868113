"""A package's public names, loaded on first use (PEP 562): importing the package imports none of them."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_names(package: str, names: dict[str, str | None], modules: dict[str, str] | None = None,
               replaced: str | None = None) -> tuple[Callable, Callable]:
    """(`__getattr__`, `__dir__`) for `package`'s namespace.

    `names[n]`: the module that defines `n` (None: `n` is the submodule `package.n`); `modules[n]`: a module
    published under the name `n` (a moved module under its old name); `replaced`: the module whose content
    the package took over (`jaxdp.clipping` was one module, now `jaxdp.clipping.rules`), whose public names
    are the package's own (`jaxdp.sampling.PoissonSampler` is `jaxdp.sampling.poisson.PoissonSampler`). A loaded value is stored in the package's namespace, so
    later lookups do not come back here.
    """
    modules = modules or {}

    def __getattr__(name: str):
        if name in modules:
            value = importlib.import_module(modules[name])
        elif name in names:
            home = names[name]
            value = (importlib.import_module(f"{package}.{name}") if home is None
                     else getattr(importlib.import_module(home), name))
        elif replaced is not None and not name.startswith("_") and hasattr(importlib.import_module(replaced), name):
            value = getattr(importlib.import_module(replaced), name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names) | set(modules))

    return __getattr__, __dir__
