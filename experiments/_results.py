"""Writing benchmark results: rows plus the device, JAX version, date and command that produced them."""

from __future__ import annotations

import datetime
import json
import os
import sys

import jax


def write_results(path: str, rows: list, quiet: bool = False, **meta) -> None:
    """Writes `{"meta": {device, backend, jax, date, command, **meta}, "rows": rows}` as JSON."""
    meta = dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__,
                date=str(datetime.date.today()), command=" ".join(sys.argv), **meta)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    if not quiet:
        print(f"\nwrote {path}")
