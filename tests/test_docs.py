"""The README is the front door and docs/ holds the task pages: the README stays short, every
relative link lands on a file (and heading) that exists, the README's usage example runs, and
every `python -m experiments.X` the docs name is a module."""

import pathlib
import re

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _text_outside_code_blocks(path):
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(path):
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", _text_outside_code_blocks(path), re.M)}


def test_readme_is_short():
    size = len(README.read_text(encoding="utf-8"))
    assert size < 12_000, f"README.md is {size} characters; move detail to a page under docs/"


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in LINK.findall(_text_outside_code_blocks(page)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):          # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no file {dest}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_experiment_modules_exist():
    named = set()
    for page in PAGES:
        named |= set(re.findall(r"python3? -m experiments\.(\w+)", page.read_text(encoding="utf-8")))
    assert named, "no `python -m experiments.X` found: the pattern no longer matches the docs"
    missing = sorted(m for m in named if not (ROOT / "experiments" / f"{m}.py").exists())
    assert not missing, f"named in the docs, no experiments/<name>.py: {missing}"


def test_readme_usage_example_runs():
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)
    assert blocks, "README.md has no ```python block"
    code = blocks[0]
    assert 'GPT2Config.preset("small")' in code, "the example's model line changed: update this test"
    namespace = {}
    exec(compile(code.replace('GPT2Config.preset("small")', 'GPT2Config.preset("tiny")'),
                 "README.md usage example", "exec"), namespace)
    model, optimizer, train_step = namespace["model"], namespace["optimizer"], namespace["train_step"]
    vocab, seq_len = model.config.vocab_size, model.config.seq_len
    assert seq_len >= 16, model.config
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, vocab, size=(4, 17), dtype=np.int32),
             "mask": np.array([True, True, True, False])}
    before = [np.asarray(x).copy() for x in _params(model)]
    loss = float(train_step(model, optimizer, batch))
    assert np.isfinite(loss) and loss > 0
    after = [np.asarray(x) for x in _params(model)]
    assert any(not np.array_equal(a, b) for a, b in zip(before, after)), "train_step left the model unchanged"


def _params(model):
    import jax
    from flax import nnx
    return jax.tree.leaves(nnx.state(model, nnx.Param))
