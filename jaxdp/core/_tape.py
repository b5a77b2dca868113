"""The recording context behind `per_example_grads`.

A DP layer calls `tap(layer, use, y, record, terms_fn)` on its output `y`.
Outside `per_example_grads` this is the identity. Inside, two passes run:

1. discover (under `jax.eval_shape`): every tap registers its key
   `(layer path, use, call index)`, the shapes of `y` and `record`, and
   `terms_fn`, which turns `(record, g)` into the layer's factored
   per-example gradient terms.
2. record (under `jax.vjp`): every tap goes through `_tap`, a `custom_vjp`
   identity on `y` whose backward hands out, as the cotangents of two extra
   zero inputs, the output gradient `g = dL/dy` and the recorded input
   `record`. Both therefore come out of the ordinary backward pass, which
   also makes the scheme exact under `jax.checkpoint` / `nnx.remat`: a
   recomputed block recomputes `record` too, and nothing leaks out of a
   transformed function as a side effect.

Integer records (embedding ids) travel as float32; exact below 2**24.

A third mode, "norms" (`jaxdp.clipping.two_pass`), replaces `_tap` by `_norm_tap`,
whose backward turns `(record, g)` into per-example squared norms (B,) at
once, inside the layer's backward, and hands out only those (and, for a
parameter with several uses, the terms themselves): no layer's `(x, g)`
outlives its own backward.

Inside `jax.shard_map(..., check_vma=True)` a custom_vjp's cotangents must
have the manual-axis type of its inputs, so discover also notes over which
manual axes `y` and `record` vary, and the slots are created varying over
the same axes (`varying_like`). A tapped output that does not vary over an
axis the batch varies over (GPT-2's position embedding) is first marked
varying over it: otherwise its cotangent would arrive already psum-ed over
the axis (the transpose of the implicit pvary), i.e. summed over devices.
Outside shard_map there are no such axes and nothing changes.

Scanned layers (`jaxdp.core.layer_scan`): a stack of L layers run by `lax.scan` is traced once, so each tap
inside the body registers one use, marked with its scan (`Use.scan`). Its slots carry a
leading layer axis and enter the scan as its xs (`_Tape.scan_slots`); the scan's transpose stacks the L
layers' cotangents, so `(g, record)` of layer l is slice l. Mode "norms" refuses scanned layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp

TermsFn = Callable[[jax.Array, jax.Array], dict[str, Any]]


def varying_axes(x) -> tuple[str, ...]:
    """The shard_map manual axes over which `x` varies (empty outside shard_map)."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return tuple(sorted(getattr(mat, "varying", ()) or ()))


def varying_like(x, axes: tuple[str, ...]):
    """`x` marked varying over `axes` (the identity when `axes` is empty)."""
    return jax.lax.pcast(x, axes, to="varying") if axes else x


@jax.custom_vjp
def _tap(y, record, g_slot, record_slot):
    del g_slot, record_slot
    return y


def _tap_fwd(y, record, g_slot, record_slot):
    del g_slot, record_slot
    return y, record


def _tap_bwd(record, g):
    return g, jnp.zeros_like(record), g, record


_tap.defvjp(_tap_fwd, _tap_bwd)


def _norm_tap(norms_fn, keep_terms: bool, axes: tuple[str, ...]):
    """Identity on `y` whose backward hands out `norms_fn(record, g)` ({name: (B,)}) as its slots' cotangent.

    `slots` is `{"norms": {name: (B,) zeros}}`, plus `"g"` and `"record"` when
    `keep_terms` (the use also feeds a parameter whose norm needs its terms).
    """

    @jax.custom_vjp
    def norm_tap(y, record, slots):
        del slots
        return y

    def fwd(y, record, slots):
        del slots
        return y, record

    def bwd(record, g):
        norms = {name: varying_like(v, tuple(a for a in axes if a not in varying_axes(v)))
                 for name, v in norms_fn(record, g).items()}
        cts = {"norms": norms}
        if keep_terms:
            cts["g"], cts["record"] = g, record
        return g, jnp.zeros_like(record), cts

    norm_tap.defvjp(fwd, bwd)
    return norm_tap


@dataclasses.dataclass(frozen=True)
class Scan:
    """One `jaxdp.core.layer_scan.scan_layers` call: its key, the stacked module's path, its layers (L)."""

    key: str
    path: tuple[Any, ...]
    layers: int


@dataclasses.dataclass
class Use:
    """One call of a DP layer inside the traced forward pass."""

    path: tuple[Any, ...]
    terms_fn: TermsFn
    y: jax.ShapeDtypeStruct
    record: jax.ShapeDtypeStruct
    record_dtype: Any
    y_axes: tuple[str, ...] = ()        # manual axes y varies over (inside shard_map)
    record_axes: tuple[str, ...] = ()
    scan: Scan | None = None            # the layer scan it runs in (None: not scanned)


class _Tape:
    def __init__(self, mode: str, slots=None, axes: tuple[str, ...] = (), norms_fns=None):
        self.mode = mode
        self.axes = axes
        self.norms_fns = norms_fns
        self.uses: dict[str, Use] = {}
        self.slots = slots
        self._counts: dict[tuple, int] = {}
        self.scans: dict[str, Scan] = {}
        self.scope: Scan | None = None  # the scan whose body is being traced

    def open_scan(self, path, layers: int) -> str:
        """Registers a scan over `layers` stacked layers at `path`; returns its key."""
        if self.mode == "norms":
            raise ValueError(
                f"the two-pass norms (jaxdp.two_pass_clipped_sums) do not support scanned layers ("
                f"{'/'.join(map(str, path))}, scan_layers=True): use per_example_grads with fused_clip, or "
                "scan_layers=False")
        if self.scope is not None:
            raise ValueError("per_example_grads: a layer scan inside another layer scan is not supported")
        n = sum(scan.path == tuple(path) for scan in self.scans.values())
        key = "/".join(map(str, path)) + f":scan:{n}"
        self.scans[key] = Scan(key, tuple(path), layers)
        return key

    def scan_slots(self, scan: str):
        """The slots (leading layer axis) of the uses inside scan `scan`: the scan's xs ({} in discover)."""
        return {} if self.mode == "discover" else self.slots.get(scan, {})

    @contextlib.contextmanager
    def inside(self, scan: str, layer_slots, counts: dict):
        """While one layer of scan `scan` is traced: taps find `layer_slots`; call counts restart at
        `counts` (those at the scan's start), so a retraced body keys its uses the same way."""
        outer = self.slots, self.scope
        self.slots, self.scope, self._counts = layer_slots, self.scans[scan], dict(counts)
        try:
            yield
        finally:
            self.slots, self.scope = outer

    def key(self, path, use) -> str:
        n = self._counts.get((path, use), 0)
        self._counts[(path, use)] = n + 1
        return "/".join(map(str, path)) + f":{use}:{n}"

    def tap(self, layer, use, y, record, terms_fn):
        path = getattr(layer, "dp_path", None)
        if path is None:
            raise ValueError(
                f"{type(layer).__name__} was called inside per_example_grads but is "
                "not part of the model passed to it; DP layers must be attributes "
                "(at any depth) of that model.")
        key = self.key(path, use)
        record_dtype = record.dtype
        if jnp.issubdtype(record_dtype, jnp.integer):
            record = record.astype(jnp.float32)
        y = varying_like(y, tuple(a for a in self.axes if a not in varying_axes(y)))
        if self.mode == "discover":
            if type(y).__name__ == "BatchTracer" or type(record).__name__ == "BatchTracer":
                raise ValueError(  # vmapped examples record no per-example factors: one moves the sum > C
                    f"per_example_grads: layer {'/'.join(map(str, path))} ran inside jax.vmap in the loss: "
                    "apply layers to the whole batch (batch axis first), not inside jax.vmap over examples")
            self.uses[key] = Use(path, terms_fn,
                                 jax.ShapeDtypeStruct(y.shape, y.dtype),
                                 jax.ShapeDtypeStruct(record.shape, record.dtype),
                                 record_dtype, varying_axes(y), varying_axes(record), self.scope)
            return y
        if self.mode == "norms":
            slots = self.slots[key]
            return _norm_tap(self.norms_fns[key], "g" in slots, self.axes)(y, record, slots)
        g_slot, record_slot = self.slots[key]
        return _tap(y, record, g_slot, record_slot)


_state = threading.local()


def current() -> _Tape | None:
    return getattr(_state, "tape", None)


@contextlib.contextmanager
def recording(mode: str, slots=None, axes: tuple[str, ...] = (), norms_fns=None):
    """Records taps; `axes`: the shard_map axes the batch varies over (empty outside shard_map).

    mode: "discover" | "record" | "norms" (with `norms_fns[key](record, g) -> {name: (B,)}`).
    """
    previous = current()
    _state.tape = _Tape(mode, slots, axes, norms_fns)
    try:
        yield _state.tape
    finally:
        _state.tape = previous


def tap(layer, use: str, y, record, terms_fn: TermsFn):
    """Identity on `y`; inside `per_example_grads` it records this use."""
    tape = current()
    if tape is None:
        return y
    return tape.tap(layer, use, y, record, terms_fn)
