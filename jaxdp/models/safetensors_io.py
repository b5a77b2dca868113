"""Reading and writing `.safetensors` files with NumPy alone.

The format (https://github.com/huggingface/safetensors): an 8-byte
little-endian unsigned header length N, N bytes of JSON
`{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]},
"__metadata__": {str: str}}` (padded with spaces), then the raw little-endian
tensor bytes, offsets relative to the end of the header. The `safetensors`
package does the same; this avoids the dependency (and torch) for the one
thing jaxdp needs: importing and exporting Hugging Face checkpoints.

Reading memory-maps the file, so a large checkpoint is paged in tensor by
tensor as the caller copies it.
"""

from __future__ import annotations

import json
import math
import os
import struct

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit


def _map(path: str) -> np.ndarray:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"safetensors file not found: {path}")
    if os.path.getsize(path) < 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
    return np.memmap(path, dtype=np.uint8, mode="r")


def _header(path: str, data) -> tuple[dict, int]:
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > min(_MAX_HEADER_BYTES, len(data) - 8):
        raise ValueError(f"{path}: not a safetensors file (header length {n} exceeds the file)")
    try:
        header = json.loads(bytes(data[8:8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (header is not a JSON object)")
    return header, 8 + n


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """`{name: array}` of a safetensors file; arrays are read-only views of a memory map.

    Raises:
      FileNotFoundError: `path` does not exist.
      ValueError: the file is not a well-formed safetensors file (the message
        names the file and, where one is at fault, the tensor).
    """
    path = os.fspath(path)
    data = _map(path)
    header, start = _header(path, data)
    body = data[start:]
    tensors, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape, offsets = tuple(info["shape"]), tuple(info["data_offsets"])
            if len(offsets) != 2 or not all(_natural(v) for v in shape + offsets):
                raise ValueError
            begin, end = offsets
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} has a malformed header entry {info!r} (dtype one of "
                             f"{sorted(DTYPES)}, shape and data_offsets integers >= 0)") from None
        size = math.prod(shape) * dtype.itemsize  # Python ints: a huge shape cannot wrap around to 0 bytes
        if not begin <= end <= len(body) or end - begin != size:
            raise ValueError(f"{path}: tensor {name!r} has data_offsets [{begin}, {end}] that do not hold "
                             f"{info['dtype']}{list(shape)} ({size} bytes) inside the file's {len(body)} data bytes")
        tensors[name] = body[begin:end].view(dtype).reshape(shape)
        spans.append((begin, end, name))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise ValueError(f"{path}: tensors {first!r} and {second!r} share bytes (overlapping data_offsets)")
    return tensors


def _natural(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """Writes `{name: array}` (names sorted, contiguous little-endian data) to `path`."""
    path = os.fspath(path)
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    arrays, offset = [], 0
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        dtype = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
        if dtype not in _NAMES:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} cannot be written to safetensors; "
                             f"allowed: {sorted(str(d) for d in _NAMES)}")
        a = np.ascontiguousarray(a, dtype=dtype)
        header[name] = {"dtype": _NAMES[dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        arrays.append(a)
        offset += a.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for a in arrays:
            f.write(a.tobytes())
