"""The README is the front door and docs/ holds the task pages: the README stays short, every
relative link lands on a file (and heading) that exists, the README's usage example runs, every
`python -m experiments.X` the docs name is a module, and every shell command in the README is run
(the jobs, on tiny settings) or checked (install extras, the test line .ci/run reads) or excused."""

import pathlib
import re
import shlex
import subprocess

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


# ------------------------------------------------------------------ the README's shell commands
# Every command line of README.md, from its code blocks (fenced ```/```bash/```sh/```shell/```console, or
# indented four spaces) and its inline `python ...`, `pip ...`, `bash ...` and `.ci/...` spans, is checked:
# a `python -m experiments.X` line runs, with its flags, to success (tiny overrides appended so that it takes
# seconds); a `pip install` names only extras pyproject.toml defines; the test line is the one .ci/run runs.
# A command that cannot run here is listed with the reason, so a new command is never silently untested.

NOT_RUN = {
    'pip install -U "jax[cuda12]"': "JAX's CUDA build: needs a GPU and the package index",
    ".ci/run": "a fresh virtualenv from the package index (~11 min); the test line it runs is checked below",
}
SHELL_FENCES = ("", "bash", "sh", "shell", "console")
COMMAND_SPAN = re.compile(r"`((?:python3? |pip |bash |\./|\.ci/)[^`]*)`")
# The README's placeholders: each names the run the tiny pretraining command below writes.
PLACEHOLDERS = ("<run>", "<pretrain run or local HF GPT-2 / Llama>")
# The jobs in the order they run (a later one reads the run an earlier one wrote).
JOB_ORDER = ("experiments.pretrain_gpt2", "experiments.generate", "experiments.finetune", "experiments.audit",
             "experiments.delete_token_cache")


def readme_commands():
    """[(command text, where)]: each `&&`-separated command of README.md's shell lines, comments dropped."""
    text = README.read_text(encoding="utf-8")
    lines, found, in_fence, shell_fence, previous = text.splitlines(), [], False, False, ""
    for number, line in enumerate(lines, 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence:
            in_fence, shell_fence = not in_fence, not in_fence and fence.group(1) in SHELL_FENCES
        elif in_fence:
            if shell_fence and line.strip():
                found.append((line.strip(), f"README.md:{number} (```)"))
        elif line.startswith("    ") and line.strip() and (not previous.strip() or previous.startswith("    ")):
            found.append((line.strip(), f"README.md:{number} (indented block)"))
        else:
            found += [(span, f"README.md:{number} (inline)") for span in COMMAND_SPAN.findall(line)]
        previous = line if not in_fence else ""
    commands = []
    for line, where in found:
        line = re.sub(r"\s+#.*$", "", line)
        commands += [(part.strip(), where) for part in line.split("&&")]
    return commands


def _tokens(command):
    """shlex tokens, `python3` read as this interpreter, each placeholder as one token."""
    for i, placeholder in enumerate(PLACEHOLDERS):
        command = command.replace(placeholder, f"@PLACEHOLDER{i}@")
    tokens = shlex.split(command)
    tokens = [re.sub(r"@PLACEHOLDER(\d+)@", lambda m: PLACEHOLDERS[int(m.group(1))], t) for t in tokens]
    leftover = [t for t in tokens if "<" in t and not any(p in t for p in PLACEHOLDERS)]
    assert not leftover, f"{command}: a placeholder this test does not know ({leftover}): add it to PLACEHOLDERS"
    return ["python" if t == "python3" and i == 0 else t for i, t in enumerate(tokens)]


def _kind(tokens):
    if tokens[:3] == ["python", "-m", "pip"] or tokens[:1] == ["pip"]:
        return "pip"
    if tokens[:3] == ["python", "-m", "pytest"]:
        return "pytest"
    if tokens[:2] == ["python", "-m"] and tokens[2].startswith("experiments."):
        return "job"
    return None


def test_every_readme_command_is_checked_or_excused():
    commands = readme_commands()
    texts = {c for c, _ in commands}
    assert {"python3 -m pip install -e .", "python3 -m experiments.pretrain_gpt2"} <= texts, \
        f"the setup lines were not found: the extraction no longer matches README.md ({sorted(texts)})"
    unchecked = [f"{where}: {c}" for c, where in commands if c not in NOT_RUN and _kind(_tokens(c)) is None]
    assert not unchecked, "README commands this test neither checks nor excuses (NOT_RUN):\n" + "\n".join(unchecked)
    stale = sorted(set(NOT_RUN) - texts)
    assert not stale, f"NOT_RUN names commands README.md no longer has: {stale}"
    jobs = {_tokens(c)[2] for c in texts if c not in NOT_RUN and _kind(_tokens(c)) == "job"}
    assert not jobs - set(JOB_ORDER), f"README runs jobs this test does not run: {sorted(jobs - set(JOB_ORDER))}"


def test_readme_install_lines_name_extras_that_exist():
    import tomllib
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    checked = 0
    for command, where in readme_commands():
        if command in NOT_RUN or _kind(_tokens(command)) != "pip":
            continue
        tokens = _tokens(command)
        assert "install" in tokens, f"{where}: {command}: only `pip install` lines are checked"
        targets = [t for t in tokens[tokens.index("install") + 1:] if not t.startswith("-")]
        for target in targets:
            path, _, named = target.partition("[")
            assert path == ".", f"{where}: {command}: installs {target!r}, not this checkout (or add to NOT_RUN)"
            wanted = set(filter(None, named.rstrip("]").split(",")))
            assert wanted <= extras, f"{where}: {command}: extras {sorted(wanted - extras)} not in pyproject.toml"
            checked += 1
    assert checked >= 2, "the install lines were not found"


def test_readme_test_line_is_the_one_ci_runs():
    """.ci/run reads its test line from README.md: that line exists, and its pytest runs the suite's folder."""
    ci = (ROOT / ".ci" / "run").read_text()
    (assignment,) = [line for line in ci.splitlines() if line.startswith("line=$(")]
    ci_line = subprocess.run(["bash", "-c", f'set -euo pipefail; {assignment}; printf %s "$line"'], cwd=ROOT,
                             capture_output=True, text=True, timeout=30).stdout
    readme_lines = {re.sub(r"\s+#.*$", "", line).strip() for line in README.read_text().splitlines()
                    if "-m pytest" in line}
    assert ci_line and readme_lines == {ci_line}, (ci_line, readme_lines)
    pytest_part = _tokens(ci_line.split("&&")[-1].strip())
    assert _kind(pytest_part) == "pytest" and all((ROOT / t).is_dir() for t in pytest_part[3:] if not t.startswith("-"))


def _tiny_flags(corpus, tmp):
    """{job: the flags appended to the README's}: the TINY settings the suite's job tests use, 2 steps."""
    from job_testing import TINY, cli_args, tiny_cli_overrides
    short = dict(steps=2, checkpoint_every=2, eval_every=2)
    # fine-tuning takes the model and the tokenizer from its init: TINY without them, windows <= its 16 positions
    finetune = {k: v for k, v in tiny_cli_overrides(corpus, tmp / "finetune", **short).items()
                if not k.startswith("model.") and k != "data.tokenizer"}
    finetune.update({"finetune.rank": 4, "finetune.loss_after": "", "finetune.accuracy_examples": 0,
                     "eval_windows": 8})
    audit = dict(tiny_cli_overrides(corpus, tmp / "audit", **short), **{"audit.num_canaries": 16,
                                                                        "audit.max_windows": 64})
    assert TINY["model.max_seq_len"] >= finetune["seq_len"]
    return {"experiments.pretrain_gpt2": cli_args(tiny_cli_overrides(corpus, tmp / "pretrain", **short)),
            "experiments.generate": [],  # the README's flags: 40 tokens of the tiny model, ~4 s
            "experiments.finetune": cli_args(finetune),
            "experiments.audit": cli_args(audit),
            "experiments.delete_token_cache": []}


def test_readme_job_commands_run(corpus, tmp_path):
    """Each `python -m experiments.X` of the README runs with its flags (a placeholder or the default run directory
    read as the tiny pretraining run), tiny overrides appended; one whose flags another one's include is that run."""
    from job_testing import run_cli

    from experiments.configs import default
    run = str(tmp_path / "pretrain")
    flags = _tiny_flags(corpus, tmp_path)
    jobs = {}
    for command, where in readme_commands():
        tokens = _tokens(command)
        if command in NOT_RUN or _kind(tokens) != "job":
            continue
        args = tuple(a.replace(default.get_config().workdir, run) for a in tokens[3:])
        for placeholder in PLACEHOLDERS:
            args = tuple(a.replace(placeholder, run) for a in args)
        jobs.setdefault(tokens[2], {}).setdefault(args, where)
    assert set(jobs) <= set(JOB_ORDER) and "experiments.pretrain_gpt2" in jobs, sorted(jobs)
    for module in (m for m in JOB_ORDER if m in jobs):
        ran = []
        for args in sorted(jobs[module], key=len, reverse=True):
            if any(set(args) <= set(done) for done in ran):
                continue  # its flags are a subset of a command that ran
            out = run_cli([*args, *flags[module]], module=module)
            assert out.returncode == 0, \
                f"{jobs[module][args]}: python -m {module} {' '.join(args)}\n{out.stderr[-3000:]}"
            ran.append(args)
        if module == "experiments.generate":
            assert "The Congress" in out.stdout, out.stdout[-2000:]
        if module == "experiments.finetune":
            assert (tmp_path / "finetune" / "summary.json").is_file()
