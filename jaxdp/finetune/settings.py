"""The named settings of the fine-tuning methods (`jaxdp.finetune.methods.prepare(model, method, options=...)`).

One frozen value per method that has settings, validated where it is built (a bad field is refused by
name): `LoRA` ("lora"), `Adapters` ("adapter"), `Prompt` ("prompt"), `Side` ("side"), `Reversible`
("reversible": LoRA in its F stream, adapters in G). "full" and "bitfit" take none.

`from_flat` builds a method's value from the flat names the config (`config.finetune`) and `prepare`'s
keywords before these values use (`rank`, `lora_targets`, `rev_alpha`, ...); `prepare` still takes those
keywords for one release, with a DeprecationWarning.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

from jaxdp._keywords import warn_moved


def _check_count(name: str, value) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _targets(targets: Sequence[str] | None) -> tuple[str, ...] | None:
    """`targets` as a tuple (hashable); None is the model family's default."""
    if targets is None:
        return None
    if isinstance(targets, str) or not targets:
        raise ValueError(f"targets must be a non-empty sequence of module path suffixes like 'attn/c_attn', "
                         f"got {targets!r}")
    return tuple(targets)


@dataclasses.dataclass(frozen=True)
class LoRA:
    """LoRA: the chosen projections W become `W x + (alpha / rank) B A x`; only A and B train.

    Attributes:
      rank: r (>= 1).
      alpha: the scale's numerator; None: `rank` (scale 1).
      targets: the projections wrapped (path suffixes like "attn/c_attn"); None: the model family's
        `jaxdp.finetune.targets.FAMILY_TARGETS`.
    """
    rank: int = 8
    alpha: float | None = None
    targets: Sequence[str] | None = None

    def __post_init__(self):
        _check_count("rank", self.rank)
        object.__setattr__(self, "targets", _targets(self.targets))


@dataclasses.dataclass(frozen=True)
class Adapters:
    """Houlsby adapters after the chosen projections; they (and, by default, the layer norms) train.

    Attributes:
      bottleneck: the adapters' width m (>= 1).
      targets: the projections they follow; None: the family's, `jaxdp.finetune.targets.FAMILY_TARGETS`.
      train_layer_norms: whether the layer norms train with them.
    """
    bottleneck: int = 64
    targets: Sequence[str] | None = None
    train_layer_norms: bool = True

    def __post_init__(self):
        _check_count("bottleneck", self.bottleneck)
        object.__setattr__(self, "targets", _targets(self.targets))


@dataclasses.dataclass(frozen=True)
class Prompt:
    """Prompt tuning: `length` learned embeddings before the tokens (GPT-2)."""
    length: int = 20

    def __post_init__(self):
        _check_count("length", self.length)


@dataclasses.dataclass(frozen=True)
class Side:
    """MemDPT-side: a ladder side network of width d_model / `reduction` (which must divide d_model)."""
    reduction: int = 8

    def __post_init__(self):
        _check_count("reduction", self.reduction)


@dataclasses.dataclass(frozen=True)
class Reversible:
    """MemDPT-rev: GPT-2 with LoRA made reversible (MEFT).

    Attributes:
      lora: the LoRA of its F stream.
      bottleneck: the width of its G stream's adapters.
      alpha, beta: the stream scales (MEFT's 0.1, 0.1; > 0: the layers are inverted by dividing by them).
      keep_streams_every: keep the two streams at every k-th layer's input and invert only between them;
        None: invert every layer (`jaxdp.models.reversible`).
    """
    lora: LoRA = LoRA()
    bottleneck: int = 64
    alpha: float = 0.1
    beta: float = 0.1
    keep_streams_every: int | None = None

    def __post_init__(self):
        if not isinstance(self.lora, LoRA):
            raise TypeError(f"lora must be a LoRA, got {type(self.lora).__name__}: {self.lora!r}")
        _check_count("bottleneck", self.bottleneck)
        if not (self.alpha > 0 and self.beta > 0):
            raise ValueError(f"alpha and beta must be > 0 (the layers are inverted by dividing by them), "
                             f"got alpha={self.alpha!r}, beta={self.beta!r}")
        if self.keep_streams_every is not None:
            _check_count("keep_streams_every", self.keep_streams_every)


# method -> the type of its options (methods not here take none)
OPTIONS = {"lora": LoRA, "adapter": Adapters, "prompt": Prompt, "side": Side, "reversible": Reversible}
# The flat names (config.finetune's fields, `prepare`'s keywords before `options`) -> each method's fields.
_LORA = {"rank": "rank", "alpha": "alpha", "lora_targets": "targets"}
_FLAT = {
    "lora": _LORA,
    "adapter": {"bottleneck": "bottleneck", "adapter_targets": "targets", "train_layer_norms": "train_layer_norms"},
    "prompt": {"prompt_length": "length"},
    "side": {"side_reduction": "reduction"},
    "reversible": {"bottleneck": "bottleneck", "rev_alpha": "alpha", "rev_beta": "beta",
                   "rev_keep_streams_every": "keep_streams_every"},
}
FLAT_NAMES = ("rank", "alpha", "lora_targets", "bottleneck", "adapter_targets", "train_layer_norms",
              "prompt_length", "side_reduction", "rev_alpha", "rev_beta", "rev_keep_streams_every")


def from_flat(method: str, flat: Mapping):
    """`method`'s options from flat names (`FLAT_NAMES`: `rank=`, `lora_targets=`, `rev_alpha=`, ...); the
    names another method reads are ignored. None for a method without options."""
    if method not in OPTIONS:
        return None
    fields = {field: flat[name] for name, field in _FLAT[method].items() if name in flat}
    if method == "reversible":
        fields["lora"] = LoRA(**{field: flat[name] for name, field in _LORA.items() if name in flat})
    return OPTIONS[method](**fields)


def check_options(method: str, options):
    """`options` for `method`, its defaults for None; TypeError naming the expected type otherwise."""
    cls = OPTIONS.get(method)
    if cls is None:
        if options is not None:
            raise TypeError(f"method {method!r} takes no options, got {options!r}")
        return None
    if options is None:
        return cls()
    if not isinstance(options, cls):
        raise TypeError(f"method {method!r} takes options=jaxdp.finetune.settings.{cls.__name__}(...), "
                        f"got {type(options).__name__}: {options!r}")
    return options


def fold_flat(method: str, kwargs: dict, what: str) -> str | None:
    """Moves the flat names in `kwargs` into `kwargs["options"] = from_flat(method, ...)`; returns the new
    form's text for the DeprecationWarning, None when none was given."""
    flat = {k: kwargs.pop(k) for k in FLAT_NAMES if k in kwargs}
    if not flat:
        return None
    if "options" in kwargs:
        raise TypeError(f"{what}: {', '.join(f'{k}=' for k in flat)} and options= given together; put them in "
                        "options=")
    kwargs["options"] = options = from_flat(method, flat)
    return "options=None" if options is None else f"options={type(options).__name__}(...)"


def accepts_flat_keywords(fn: Callable) -> Callable:
    """`fn(model, method, ..., rank=4, lora_targets=...)` as `fn(model, method, ..., options=LoRA(4, ...))`,
    with a DeprecationWarning; for one release."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        method = args[1] if len(args) > 1 else kwargs.get("method")
        moved = fold_flat(method, kwargs, fn.__name__)
        warn_moved(fn.__name__, [] if moved is None else [moved])
        return fn(*args, **kwargs)

    return wrapper
