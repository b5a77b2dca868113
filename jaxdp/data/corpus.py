"""Corpora as documents and unit ids: the bundled corpus, a .txt file, a directory of text files, jsonl.

Everything here runs on the host; nothing needs a network. With no path,
`load_corpus` returns the bundled corpus: the US State of the Union addresses
1790-2021 (233 documents, 10.8M characters, CC0; see `jaxdp/data/corpora/README.md`).
A document's unit id (what `config.privacy.unit` = document / user protects,
and what the train / validation split hashes) is its text, or the value of a
jsonl `id_field` such as "user_id".
"""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import re
import unicodedata
import warnings

BUNDLED_CORPUS = "sotu.jsonl.gz"


def load_documents(path: str | os.PathLike | None = None) -> list[str]:
    """The documents of a corpus, in a deterministic order: `load_corpus(path)[0]`."""
    return load_corpus(path)[0]


def load_corpus(path: str | os.PathLike | None = None, *,
                id_field: str | None = None) -> tuple[list[str], list[str] | None]:
    """Returns the documents of a corpus and each one's unit id, in a deterministic order.

    Args:
      path: None for the bundled State of the Union corpus; a `.txt` file
        (split into sections at blank lines, `split_text_file`); a directory (every file below it, recursively,
        named `*.txt` or without a suffix, one document each, sorted by relative path: see `read_directory`);
        or a `.jsonl` / `.jsonl.gz` file (one JSON object per line with a string field `text`).
        Nothing is skipped silently: files a directory does not read, and jsonl records or files without
        text, are counted by reason in one `UserWarning`.
      id_field: a jsonl field (string or integer) naming each document's unit,
        e.g. "user_id" or "doc_id"; documents with equal ids after
        `canonical_id` (7, "7", " 7", and "José" in either Unicode form, "ANN"
        and "ann" are each one id) are one unit, with a warning when
        differently spelled ids were merged: merging two people costs utility,
        while one person under two spellings would be two units, each clipped
        to C. None: each document is its own unit (two copies of a text are
        two units).

    Returns:
      (documents, ids): the non-empty documents (whitespace-only ones are
      dropped) and, with `id_field`, their canonical unit ids as JSON strings
      (`'"ann"'`, `'"7"'`); None without.

    Raises:
      ValueError: the path does not exist, has an unsupported kind, is not
        UTF-8, is malformed, holds no text, holds text or an id that cannot be
        encoded as UTF-8 (a lone surrogate escape), or id_field is set for a
        corpus that is not jsonl, is missing on a line or is empty.
    """
    if path is None:
        bundled = pathlib.Path(__file__).parent / "corpora" / BUNDLED_CORPUS
        if not bundled.is_file():
            raise ValueError(f"bundled corpus missing: {bundled} (reinstall jaxdp)")
        with gzip.open(bundled, "rb") as f:
            return _read_jsonl(f, str(bundled), id_field, hint_id_fields=False)  # public text
    p = pathlib.Path(path)
    if not p.exists():
        raise ValueError(f"corpus path does not exist: {p}")
    is_jsonl = p.is_file() and (p.name.endswith(".jsonl") or p.name.endswith(".jsonl.gz"))
    if id_field is not None and not is_jsonl:
        raise ValueError(f"id_field={id_field!r} needs a .jsonl / .jsonl.gz corpus (one object per line "
                         f"with 'text' and {id_field!r}); {p} is not one")
    if p.is_dir():
        docs = read_directory(p)
    elif is_jsonl:
        with (gzip.open(p, "rb") if p.name.endswith(".gz") else open(p, "rb")) as f:
            docs, ids = _read_jsonl(f, str(p), id_field)
    elif is_single_text_file(p):
        docs = split_text_file(_read_text(p))
    else:
        raise ValueError(f"unsupported corpus path {p}: expected a .txt file, a directory of text files "
                         "(*.txt or without a suffix), or a .jsonl / .jsonl.gz file")
    if not is_jsonl:
        docs, ids = [d for d in docs if d.strip()], None
    if not docs:
        raise ValueError(f"corpus {p} contains no text")
    return docs, ids


DIRECTORY_SUFFIXES = (".txt", "")  # what a corpus directory reads as text: `*.txt` and files without a suffix


def read_directory(directory: pathlib.Path) -> list[str]:
    """The non-empty documents of a corpus directory: every regular file below it (recursively, sorted by
    relative path) named `*.txt` (any case) or without a suffix, each one document.

    Not read, and counted by reason in one `UserWarning` (with how to include them): hidden files and
    folders (a name starting with "."), files with another suffix, files without a suffix that are not
    UTF-8 text, and empty or whitespace-only files.

    Raises:
      ValueError: a `.txt` file that is not UTF-8, or no document at all (the message counts what was seen).
    """
    read, docs, skipped = {}, [], {}
    for f in sorted(directory.rglob("*"), key=lambda f: f.relative_to(directory).as_posix()):
        if not f.is_file():
            continue
        parts = f.relative_to(directory).parts
        suffix = f.suffix.lower()
        if any(part.startswith(".") for part in parts):
            reason = "hidden (a name starting with '.')"
        elif suffix not in DIRECTORY_SUFFIXES:
            reason = f"with suffix {suffix}"
        elif (text := _read_text(f, binary_ok=suffix == "")) is None:
            reason = "without a suffix and not UTF-8 text"
        elif not text.strip():
            reason = "empty or whitespace only"
        else:
            docs.append(text)
            kind = suffix or "without a suffix"
            read[kind] = read.get(kind, 0) + 1
            continue
        skipped[reason] = skipped.get(reason, 0) + 1
    seen = f"read {_counts(read) or 'no file'}; skipped {_counts(skipped) or 'none'}"
    if not docs:
        raise ValueError(f"corpus directory {directory} holds no text file ({seen}): a directory reads every "
                         "*.txt file and every file without a suffix below it")
    if skipped:
        warnings.warn(f"corpus directory {directory}: {seen}. A directory reads *.txt and files without a "
                      "suffix: rename a file to .txt to include it, or give a .jsonl", stacklevel=3)
    return docs


def _counts(counts: dict[str, int]) -> str:
    """'3 .txt, 1 without a suffix' (largest first)."""
    return ", ".join(f"{n} {what}" for what, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def is_single_text_file(path) -> bool:
    """Whether `load_corpus(path)` reads one .txt file, cut into sections (`split_text_file`)."""
    p = pathlib.Path(str(path))
    return p.suffix.lower() == ".txt" and p.is_file()


TEXT_SECTION_CHARS = 4096  # a single .txt file is cut into documents of at least this many characters


def split_text_file(text: str, min_chars: int = TEXT_SECTION_CHARS) -> list[str]:
    """One long text as documents: consecutive paragraphs (blank-line separated; lines, where the text
    has no blank line) joined until a section holds >= `min_chars` characters; the last, if shorter,
    joins the one before.

    A single file is then split into train / validation by section like any corpus of documents, and
    each section ends with the end-of-text token in the token stream. The text itself is unchanged
    apart from the whitespace between paragraphs.
    """
    parts = [q for q in text.split("\n\n") if q.strip()]
    sep = "\n\n"
    if len(parts) <= 1:
        parts, sep = [q for q in text.splitlines() if q.strip()], "\n"
    sections, current = [], []
    for part in parts:
        current.append(part)
        if sum(map(len, current)) >= min_chars:
            sections.append(sep.join(current))
            current = []
    if current:
        if sections:
            sections[-1] = sep.join([sections[-1], *current])
        else:
            sections.append(sep.join(current))
    return sections


def _read_text(path: pathlib.Path, *, binary_ok: bool = False) -> str | None:
    """The file's UTF-8 text; not UTF-8: None with `binary_ok` (a directory's file without a suffix), else
    ValueError."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        if binary_ok:
            return None
        raise ValueError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None


def canonical_id(uid: str | int) -> str:
    """The unit a jsonl id names: an integer's decimal digits; a string NFKC-normalised, stripped of
    surrounding whitespace and case-folded. Spellings of one id map to one unit."""
    return str(uid) if isinstance(uid, int) else unicodedata.normalize("NFKC", uid).strip().casefold()


def _encodable(value: str, where: str, lineno: int, field: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where}:{lineno}: field {field!r} cannot be encoded as UTF-8 ({e.reason}: "
                         f"{value[e.start:e.end]!r}, a lone surrogate escape)") from None


# A jsonl field that names a person behind a record (a user may leave id_field unset with a user_id
# column). A record's own id ("id", "doc_id") names no one: each document its own unit is then right.
_PERSON_FIELD = re.compile(r"(^|[^a-z])(user|author|patient|person|customer|client|account|email|owner|sender|"
                           r"speaker|member|employee|student)", re.IGNORECASE)


def _read_jsonl(f, where: str, id_field: str | None = None, *,
                hint_id_fields: bool = True) -> tuple[list[str], list[str] | None]:
    docs, ids, spellings, fields, empty = [], [], {}, set(), []
    for lineno, raw in enumerate(f, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}:{lineno}: not valid UTF-8 ({e.reason})") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}:{lineno}: invalid JSON ({e.msg} column {e.colno})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ValueError(f"{where}:{lineno}: expected an object with a string field 'text'")
        _encodable(obj["text"], where, lineno, "text")
        fields.update(k for k in obj if k != "text")
        if id_field is not None:
            uid = obj.get(id_field)
            if isinstance(uid, bool) or not isinstance(uid, (str, int)):
                raise ValueError(f"{where}:{lineno}: expected a string or integer field {id_field!r} "
                                 f"(the unit id), got {uid!r}")
            if isinstance(uid, str):
                _encodable(uid, where, lineno, id_field)
            unit = canonical_id(uid)
            if not unit:
                raise ValueError(f"{where}:{lineno}: field {id_field!r} (the unit id) is empty: {uid!r}")
            spellings.setdefault(unit, set()).add(json.dumps(uid, ensure_ascii=False))
        if obj["text"].strip():
            docs.append(obj["text"])
            if id_field is not None:
                ids.append(json.dumps(unit))
        else:
            empty.append(lineno)
    if not docs:
        raise ValueError(f"corpus {where} contains no text ({len(empty)} record(s), each with an empty or "
                         "whitespace-only 'text')")
    if empty:
        lines = ", ".join(map(str, empty[:5])) + (", ..." if len(empty) > 5 else "")
        warnings.warn(f"{where}: read {len(docs)} record(s); skipped {len(empty)} whose 'text' is empty or "
                      f"whitespace only (line {lines})", stacklevel=3)
    person_fields = sorted(k for k in fields if _PERSON_FIELD.search(k))
    if id_field is None and person_fields and hint_id_fields:
        warnings.warn(f"{where}: records carry {', '.join(map(repr, person_fields[:3]))}, but no id field is set, "
                      "so each document is its own privacy unit and a person with several documents is protected "
                      f"per document only; to protect each person set data.id_field={person_fields[0]!r} and "
                      "privacy.unit='user'", stacklevel=3)
    merged = {u: s for u, s in spellings.items() if len(s) > 1}
    if merged:
        example = sorted(next(iter(merged.values())))
        warnings.warn(f"{where}: {sum(map(len, merged.values()))} differently spelled {id_field!r} values are "
                      f"{len(merged)} unit(s) after canonical_id (case, Unicode form, surrounding spaces, "
                      f"7 vs \"7\"), e.g. {' and '.join(example[:2])}", stacklevel=3)
    return docs, (ids if id_field is not None else None)
