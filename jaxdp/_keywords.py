"""Keyword arguments that a named setting replaced, still accepted for one release.

`fn(..., B=8, T=128)` runs as `fn(..., shape=LayerShape(B=8, T=128))` with a DeprecationWarning naming the
new form; a keyword given both ways is an error.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping


def fold(name: str, kwargs: dict, cls, fields, what: str) -> str | None:
    """Moves the old keywords `fields` ({old: field}, or field names) of `kwargs` into `kwargs[name] =
    cls(...)`; returns the new form's text for the warning, None when none was given."""
    fields = fields if isinstance(fields, Mapping) else {f: f for f in fields}
    old = {k: kwargs.pop(k) for k in fields if k in kwargs}
    if not old:
        return None
    if name in kwargs:
        raise TypeError(f"{what}: {', '.join(f'{k}=' for k in old)} and {name}= given together; put them in "
                        f"{name}={cls.__name__}(...)")
    kwargs[name] = cls(**{fields[k]: v for k, v in old.items()})
    return f"{name}={cls.__name__}({', '.join(f'{fields[k]}=...' for k in old)})"


def warn_moved(what: str, moved: list[str], stacklevel: int = 3) -> None:
    if moved:
        warnings.warn(f"{what}: the keywords are now {' and '.join(moved)}; the old keywords go in the next release",
                      DeprecationWarning, stacklevel=stacklevel)


def old_keywords(**groups: tuple[type, Mapping[str, str] | tuple[str, ...]]) -> Callable:
    """Decorator: `groups[name] = (settings class, its old keywords)`; each old keyword is a field's name, or
    a mapping {old keyword: field}. The old keywords given to the function become `name=cls(...)`."""
    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            moved = [m for name, (cls, fields) in groups.items()
                     if (m := fold(name, kwargs, cls, fields, fn.__name__)) is not None]
            warn_moved(fn.__name__, moved)
            return fn(*args, **kwargs)

        return wrapper

    return decorate
