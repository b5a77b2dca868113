"""The fingerprint of a fine-tuning run's init weights: what the run trained from, stable across copies.

`init_sha256(init)` is what config.json's `finetune.init_sha256`, privacy.json's `init_weights` and the
checkpoint's `mechanism.init_weights` record, and what a resume and `untrained_model` check. It hashes the
content the run reads, never a directory's other files:

  HF checkpoint   config.json (as parsed JSON, keys sorted), every tensor of model.safetensors or of the
                  files of its index (name, dtype, shape, bytes; sorted by name: a re-save in another tensor
                  order or with other header metadata is the same weights), and the tokenizer's files
                  (tokenizer.json, tokenizer_config.json, chat_template.jinja: they decide the tokens trained on).
  run directory   the `model` section of its config.json, tokenizer/tokenizer.json and
                  tokenizer/jaxdp_tokenizer.json, and the arrays of model/params.npz (name, dtype, shape,
                  bytes: an .npz's zip headers carry write times, so two saves of the same weights differ as
                  files), or, before the run wrote model/, the files of its latest checkpoint.

So a copy of the init directory, or one that gained a README, a summary.json with new timings or a
token_cache.json, has the same fingerprint; other weights, another config or another tokenizer do not.

Runs written before this fingerprint recorded `jaxdp.training.run_dir.tree_sha256` of the whole directory:
`matches(kept, init)` accepts either, so they still resume.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np

from jaxdp.models import hf_checkpoint
from jaxdp.training.run_dir import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    MODEL_DIR,
    PARAMS_FILE,
    TOKENIZER_DIR,
    tree_sha256,
)

_SALT = b"jaxdp.training.init_weights/v1"
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
RUN_TOKENIZER_FILES = ("tokenizer.json", "jaxdp_tokenizer.json")


def _field(h, name: str, data: bytes) -> None:
    for part in (name.encode(), data):
        h.update(len(part).to_bytes(8, "little") + part)


def _array(h, name: str, array: np.ndarray) -> None:
    array = np.asarray(array)
    _field(h, name, f"{array.dtype.str}{array.shape}".encode())
    h.update(np.ascontiguousarray(array).view(np.uint8).tobytes())


def _json(path: pathlib.Path, section: str | None = None) -> bytes:
    value = json.loads(path.read_text())
    value = value.get(section) if section is not None and isinstance(value, dict) else value
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def init_sha256(init) -> str:
    """SHA-256 (hex) of the init weights at `init` (see the module doc: a run directory inside `init` is never
    read). OSError / ValueError for an unreadable checkpoint."""
    root = pathlib.Path(init).expanduser()
    h = hashlib.sha256(_SALT)
    if (root / TOKENIZER_DIR / "tokenizer.json").is_file() and (root / CONFIG_FILE).is_file():  # a run directory
        _field(h, "run:model", _json(root / CONFIG_FILE, "model"))
        for name in RUN_TOKENIZER_FILES:
            if (root / TOKENIZER_DIR / name).is_file():
                _field(h, f"{TOKENIZER_DIR}/{name}", (root / TOKENIZER_DIR / name).read_bytes())
        params = root / MODEL_DIR / PARAMS_FILE
        if params.is_file():
            with np.load(params) as saved:
                for name in sorted(saved.files):
                    _array(h, f"param:{name}", saved[name])
        else:
            _field(h, "checkpoint", _latest_checkpoint_sha256(root / CHECKPOINT_DIR).encode())
        return h.hexdigest()
    _field(h, "hf:config", _json(root / hf_checkpoint.CONFIG_FILE))
    tensors, _ = hf_checkpoint.read_tensors(str(root), "")
    for name in sorted(tensors):
        _array(h, f"tensor:{name}", tensors[name][0])
    for name in HF_TOKENIZER_FILES:
        if (root / name).is_file():
            _field(h, name, (root / name).read_bytes())
    return h.hexdigest()


def _latest_checkpoint_sha256(checkpoints: pathlib.Path) -> str:
    """`tree_sha256` of the latest step's directory (a name of digits) under `checkpoints`."""
    steps = sorted((int(d.name), d) for d in checkpoints.iterdir() if d.is_dir() and d.name.isdigit()) \
        if checkpoints.is_dir() else []
    if not steps:
        raise ValueError(f"{checkpoints} holds no checkpoint")
    return tree_sha256(steps[-1][1])


def matches(kept: str, init, exclude=None) -> bool:
    """Whether `kept` (a run's recorded fingerprint) is that of `init`: `init_sha256`, or, for a run recorded
    before it, `tree_sha256` of the whole directory."""
    try:
        if init_sha256(init) == kept:
            return True
    except (OSError, ValueError):
        pass
    return tree_sha256(pathlib.Path(init).expanduser(), exclude=exclude) == kept
