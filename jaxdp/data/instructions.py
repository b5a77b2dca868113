"""Instruction data for fine-tuning: a jsonl of prompt / completion or messages records, one window each.

`read_records(path, id_field)` reads and checks the records (`jaxdp.data.chat.check_record`);
`InstructionWindows` tokenises them (`jaxdp.data.chat.segments`: the checkpoint's chat template, or the plain
one) into one window per record and serves them like `jaxdp.data.windows.TokenWindows` (same split, units,
`get`, `units_to_windows`), so the training job samples, splits and accounts for them as for text.

Which tokens the loss counts travels in the window itself: a counted token is its id (>= 0), a context token
(prompt, system and user turns, the chat template's headers) is stored as `-2 - id` (`as_context`), and the
padding after the record is `PAD` (-1). `jaxdp.core.losses.instruction_losses` reads every stored token back as
an input (`-2 - t` for t <= -2, PAD as 0) and counts a target only where it is >= 0: the loss is on the
completion (assistant) tokens only.

Privacy unit: a record is a document; `config.privacy.unit="document"` makes each record one unit, and
`id_field` (with `unit="user"`) groups a person's records into one unit, split by a hash of the unit id as for
text (`split_documents`). Records are never cut: a record of more than `seq_len + 1` tokens is refused, naming
its line (a cut would drop the completion or the context the completion answers without saying so). Bad records
are refused the same way (missing field, empty completion, unknown role, invalid JSON): one error naming the
line, never quoting its text.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import tempfile
from collections.abc import Sequence

import numpy as np

from jaxdp.data.chat import EOT, ChatTemplate, check_record, segments
from jaxdp.data.corpus import canonical_id
from jaxdp.data.tokenizer import Tokenizer, check_name
from jaxdp.data.windows import (
    PAD,
    TokenWindows,
    _offsets_path,
    _try_load,
    default_cache_dir,
    split_documents,
)

FORMATS = ("text", "instruct")  # config.data.format of the fine-tuning job
_CACHE_FORMAT = 1  # bump when the stored layout changes


def as_context(ids: np.ndarray) -> np.ndarray:
    """Token ids as stored for context (never a target): `-2 - id`; `jaxdp.core.losses` reads them back."""
    return -2 - np.asarray(ids, np.int64)


def read_records(path, id_field: str | None = None) -> tuple[list[dict], list[str] | None, list[int]]:
    """(records, their canonical unit ids (`jaxdp.data.corpus.canonical_id`, as JSON strings) or None without
    `id_field`, their line numbers) of a `.jsonl` file; blank lines are skipped. ValueError naming the line for
    a bad record (what is wrong, never its text), and for a file with no record."""
    p = pathlib.Path(path) if path is not None else None
    if p is None or not p.is_file() or not p.name.endswith(".jsonl"):
        raise ValueError(f"instruction data (data.format='instruct') is a .jsonl file of prompt / completion or "
                         f"messages records, got {str(path)!r}")
    records, ids, lines = [], [], []
    with open(p, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                obj = check_record(json.loads(line))
                if id_field is not None:
                    uid = obj.get(id_field)
                    if isinstance(uid, bool) or not isinstance(uid, (str, int)) or not canonical_id(uid):
                        raise ValueError(f"expected a non-empty string or integer field {id_field!r} (the unit id)")
                    ids.append(json.dumps(canonical_id(uid)))
            except UnicodeDecodeError as e:
                raise ValueError(f"{p}:{lineno}: not valid UTF-8 ({e.reason})") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: invalid JSON ({e.msg} column {e.colno})") from None
            except ValueError as e:
                raise ValueError(f"{p}:{lineno}: {e}") from None
            records.append(obj)
            lines.append(lineno)
    if not records:
        raise ValueError(f"{p} holds no record")
    return records, (ids if id_field is not None else None), lines


def encode_records(records: Sequence[dict], tokenizer: Tokenizer, template: ChatTemplate | None, *,
                   max_tokens: int, lines: Sequence[int] | None = None) -> list[np.ndarray]:
    """Each record's stored tokens (int32: counted ids, `as_context` ids).

    The rendered text between end-of-text tokens is tokenised whole (as it would be at inference), and a
    token is counted when any of its characters lies in a counted piece (`jaxdp.data.chat.segments`; a token
    straddling a boundary is rare: templates end a header with a newline or a special token). ValueError
    naming the line (`lines[i]`, else the record's index) for a record longer than `max_tokens` or one whose
    template fails."""
    where = [f"line {n}" for n in lines] if lines is not None else [f"record {i}" for i in range(len(records))]
    runs = []  # per record: [(text, per-character counted flags, eot after it: None / counted)]
    for i, record in enumerate(records):
        try:
            pieces = segments(record, template)
        except ValueError as e:
            raise ValueError(f"{where[i]}: {e}") from None
        record_runs, texts, flags = [], [], []
        for text, counted in pieces + [(None, None)]:
            if text is EOT or text is None:
                record_runs.append(("".join(texts), np.concatenate(flags) if flags else np.zeros(0, bool),
                                    counted if text is EOT else None))
                texts, flags = [], []
            else:
                texts.append(text)
                flags.append(np.full(len(text), counted, bool))
        runs.append(record_runs)
    encoded = iter(tokenizer.encode_batch_offsets([text for record_runs in runs for text, _, _ in record_runs]))
    out = []
    for i, record_runs in enumerate(runs):
        chunks = []
        for text, flags, eot in record_runs:
            ids, offsets = next(encoded)
            counted = np.array([flags[s:e].any() if e > s else bool(flags[min(s, len(flags) - 1)])
                                for s, e in offsets], bool) if ids else np.zeros(0, bool)
            ids = np.asarray(ids, np.int64)
            chunks.append(np.where(counted, ids, as_context(ids)))
            if eot is not None:
                chunks.append(np.asarray([tokenizer.eot_id if eot else -2 - tokenizer.eot_id], np.int64))
        tokens = np.concatenate(chunks).astype(np.int32)
        if tokens.size > max_tokens:
            raise ValueError(f"{where[i]}: the record is {tokens.size} tokens, more than one window of "
                             f"seq_len + 1 = {max_tokens}; records are never cut (the completion or its context "
                             f"would be lost): raise config.seq_len to at least {tokens.size - 1} or shorten it")
        out.append(tokens)
    return out


class InstructionWindows(TokenWindows):
    """One window per record of one split: `TokenWindows`' interface (`get`, `unit_windows`,
    `units_to_windows`, `window_unit`, `data_key`, `cache_files`) over the records' stored tokens.

    The split's stored tokens are cached (0600, written atomically) as `<cache_dir>/<tokenizer.name>-instruct-
    <split>-<key>.npy` with its offsets, like the text windows' cache (they hold the private records' tokens;
    `token_cache.json` names them). The key hashes the stored tokens of every record, the unit ids, the
    tokenizer and the split settings.
    """

    def __init__(self, encoded: Sequence[np.ndarray], tokenizer: Tokenizer, seq_len: int, *,
                 split: str = "train", validation_fraction: float = 0.05, cache_dir=None,
                 ids: Sequence[str] | None = None):
        if split not in ("train", "validation"):
            raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
        if not encoded:
            raise ValueError("no records")
        keys = ids if ids is not None else [hashlib.sha256(t.tobytes()).hexdigest() for t in encoded]
        train_idx, val_idx = split_documents(keys, validation_fraction)
        if split == "validation" and not len(val_idx):
            raise ValueError("split='validation' needs validation_fraction > 0")
        chosen = train_idx if split == "train" else val_idx
        self.split, self.seq_len = split, int(seq_len)
        key = _key(encoded, ids, tokenizer, split, validation_fraction)
        self.data_key = key
        cache = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.cache_path = cache / f"{check_name(tokenizer.name)}-instruct-{split}-{key[:20]}.npy"
        loaded = _try_load(self.cache_path, len(chosen))
        self.from_cache = loaded is not None
        if loaded is None:
            _write(self.cache_path, [encoded[i] for i in chosen])
            loaded = _try_load(self.cache_path, len(chosen))
        self.tokens, offsets = loaded
        self.num_tokens = int(self.tokens.shape[0])
        self._starts, self._lengths = offsets[:-1], np.diff(offsets)
        if self._lengths.max() > self.seq_len + 1:
            raise ValueError(f"a record is longer than seq_len + 1 = {self.seq_len + 1} tokens")
        self.num_windows = len(chosen)
        if ids is None:
            self.window_unit = np.arange(len(chosen), dtype=np.int64)
        else:
            _, unit = np.unique(np.asarray([ids[i] for i in chosen], dtype=object).astype(str), return_inverse=True)
            self.window_unit = unit.reshape(-1).astype(np.int64)
        self.num_units = int(self.window_unit.max()) + 1
        self._unit_order = np.argsort(self.window_unit, kind="stable")
        self._unit_offsets = np.searchsorted(self.window_unit[self._unit_order], np.arange(self.num_units + 1))

    def __repr__(self):
        return (f"InstructionWindows(split={self.split!r}, seq_len={self.seq_len}, num_windows={self.num_windows}, "
                f"num_units={self.num_units}, num_tokens={self.num_tokens})")


def counted_targets(windows_BT1: np.ndarray) -> np.ndarray:
    """(B, T) bool: the targets the loss counts in stored windows (`get`'s rows): a counted token after
    position t."""
    return np.asarray(windows_BT1)[:, 1:] >= 0


def token_ids(windows_BT1: np.ndarray) -> np.ndarray:
    """The token ids of stored windows (context read back, `PAD` kept)."""
    w = np.asarray(windows_BT1)
    return np.where(w <= -2, -2 - w, w)


def _key(encoded, ids, tokenizer, split, validation_fraction) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(["instruct", _CACHE_FORMAT, tokenizer.fingerprint, tokenizer.eot_id, split,
                         float(validation_fraction), len(encoded), PAD]).encode())
    for i, tokens in enumerate(encoded):
        for b in (tokens.astype("<i4").tobytes(), b"\0" if ids is None else ids[i].encode("utf-8")):
            h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()


def _write(path: pathlib.Path, arrays: list[np.ndarray]) -> None:
    """The concatenated tokens and their offsets, each through a 0600 temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    offsets = np.concatenate([[0], np.cumsum([a.size for a in arrays])]).astype(np.int64)
    tokens = np.concatenate(arrays).astype(np.int32) if arrays else np.zeros(0, np.int32)
    for target, array in ((_offsets_path(path), offsets), (path, tokens)):  # offsets first, as TokenWindows
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, array)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def instruction_windows(path, tokenizer: Tokenizer, template: ChatTemplate | None, seq_len: int, *,
                        id_field: str | None = None, validation_fraction: float = 0.05,
                        cache_dir=None) -> tuple[InstructionWindows, InstructionWindows]:
    """(train, validation) windows of the instruction jsonl at `path` (see the module doc)."""
    records, ids, lines = read_records(path, id_field)
    encoded = encode_records(records, tokenizer, template, max_tokens=seq_len + 1, lines=lines)
    kw = dict(validation_fraction=validation_fraction, cache_dir=cache_dir, ids=ids)
    return (InstructionWindows(encoded, tokenizer, seq_len, split="train", **kw),
            InstructionWindows(encoded, tokenizer, seq_len, split="validation", **kw))
