"""The run directory: orbax checkpoints, `metrics.jsonl`, plots, and the progress line.

    <workdir>/config.json      the run's config (a rerun with another config is refused); its
                              `seed` is null or "pinned (kept in the checkpoint)", never the seed
             metrics.jsonl    one JSON line per logged step: step, train_loss, epsilon[, val_loss]
             tokenizer/       the tokenizer (trained BPE or GPT-2), reloaded on resume
             checkpoints/<s>/ parameters, optimizer state (with the noise PRNG key), and a JSON
                              meta: step, accountant state, the run's root seed; only the latest
                              is kept. PRIVATE: the root seed and the key reproduce the noise.
             model/params.npz the final parameters alone (no optimizer state, no key): the model
                              to share; written when the run ends
             privacy.json     the privacy receipt (`jaxdp.training.receipt`)
             token_cache.json the token-cache files (outside the run directory) this run wrote or read:
                              paths and sizes. PRIVATE: they hold the private text's tokens
             summary.json     written last: a run with it at its latest checkpoint's step has finished
             loss.png, epsilon.png, samples.txt

README.md ("What is protected") says which of these may be shared.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdp.models import layers

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
SAMPLES_FILE = "samples.txt"
TOKENIZER_DIR = "tokenizer"
CHECKPOINT_DIR = "checkpoints"
MODEL_DIR = "model"
PARAMS_FILE = "params.npz"
TOKEN_CACHE_FILE = "token_cache.json"


# ------------------------------------------------------------------ checkpoints


def _to_saveable(leaf):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(leaf))
    return np.asarray(leaf)


@contextlib.contextmanager
def _orbax_errors_only():
    """orbax logs through absl; its warnings (e.g. on a checkpoint a kill left half written, which
    resume ignores by design) would land in the middle of the progress line."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(level)


class Checkpointer:
    """Orbax checkpoints of (model, optimizer) state plus a JSON of host state; the latest is kept."""

    def __init__(self, directory: pathlib.Path):
        import orbax.checkpoint as ocp
        self._ocp = ocp
        self._manager = ocp.CheckpointManager(
            directory.absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True,
                                                 enable_async_checkpointing=False),
            item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore_meta(self, step: int) -> dict:
        """The JSON meta of checkpoint `step` alone (step, accountant state, root seed)."""
        ocp = self._ocp
        return dict(self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])

    def save(self, step: int, model, optimizer, meta: dict) -> None:
        ocp = self._ocp
        leaves = [_to_saveable(x) for x in jax.tree.leaves(nnx.state((model, optimizer)))]
        with _orbax_errors_only():
            self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave({"leaves": leaves}), meta=ocp.args.JsonSave(meta)), force=True)
            self._manager.wait_until_finished()

    def restore(self, step: int, model, optimizer) -> dict:
        ocp = self._ocp
        state = nnx.state((model, optimizer))
        leaves, treedef = jax.tree.flatten(state)
        target = {"leaves": [_to_saveable(x) for x in leaves]}
        with _orbax_errors_only():
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        new = []
        for old, value in zip(leaves, restored["state"]["leaves"]):
            if jax.dtypes.issubdtype(old.dtype, jax.dtypes.prng_key):
                new.append(jax.random.wrap_key_data(jnp.asarray(value), impl=jax.random.key_impl(old)))
            else:
                new.append(jnp.asarray(value, dtype=old.dtype))
        nnx.update((model, optimizer), jax.tree.unflatten(treedef, new))
        return dict(restored["meta"])

    def saved_leaves(self, step: int) -> list[np.ndarray]:
        """The saved (model, optimizer) state leaves of checkpoint `step` as stored (keys as their data)."""
        ocp = self._ocp
        return self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]["leaves"]

    def restore_model(self, step: int, model) -> None:
        """Restores only the parameters: the first leaves of the saved (model, optimizer) state are the model's."""
        leaves, treedef = jax.tree.flatten(nnx.state(model))
        saved = self.saved_leaves(step)
        new = [jnp.asarray(v, dtype=o.dtype) for o, v in zip(leaves, saved[:len(leaves)])]
        nnx.update(model, jax.tree.unflatten(treedef, new))

    def close(self):
        self._manager.close()


# ------------------------------------------------------------------ the shareable model


def _param_names(model) -> list[tuple[str, nnx.Variable]]:
    return [("/".join(map(str, path)), var) for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def write_model(directory: pathlib.Path, model) -> None:
    """`<directory>/params.npz`: the model's parameters by path, nothing else (atomic replace); a scanned
    model's in the unrolled layout (`jaxdp.models.layers`), so the file does not depend on scan_layers."""
    model = layers.unrolled(model)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (PARAMS_FILE + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **{name: np.asarray(var.get_value()) for name, var in _param_names(model)})
    os.replace(tmp, directory / PARAMS_FILE)


def read_model(directory: pathlib.Path, model) -> bool:
    """Loads `write_model`'s parameters into `model`; False when there are none."""
    path = directory / PARAMS_FILE
    if not path.is_file():
        return False
    target = layers.unrolled(model)  # the file's layout
    with np.load(path) as saved:
        for name, var in _param_names(target):
            var.set_value(jnp.asarray(saved[name], dtype=var.get_value().dtype))
    if target is not model:
        nnx.update(model, nnx.state(layers.scanned(target)))
    return True


def read_trained(workdir, model) -> bool:
    """Loads a run's trained parameters into `model`: from `model/` (the shareable model a finished run
    writes), else from the latest checkpoint (an interrupted run); False when the run has neither."""
    workdir = pathlib.Path(workdir)
    if read_model(workdir / MODEL_DIR, model):
        return True
    checkpointer = Checkpointer(workdir / CHECKPOINT_DIR)
    try:
        step = checkpointer.latest_step()
        if step is not None:
            checkpointer.restore_model(step, model)
        return step is not None
    finally:
        checkpointer.close()


# ------------------------------------------------------------------ metrics and plots


def read_metrics(workdir) -> list[dict]:
    path = pathlib.Path(workdir) / METRICS_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by a kill: everything after it is dropped too
    return rows


def write_text_atomic(path, text: str) -> None:
    """`text` into `path` through a temporary file and a rename: a crash or a full disk leaves the old file
    whole. A symlink at `path` is refused (it would write into another run's file)."""
    path = pathlib.Path(path)
    if path.is_symlink():
        raise ValueError(f"{path} is a symlink: refusing to write through it")
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_metrics(workdir: pathlib.Path, rows: list[dict]) -> None:
    """Replaces `metrics.jsonl` by `rows` atomically."""
    write_text_atomic(workdir / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in rows))


def latest_checkpoint_meta(directory: pathlib.Path) -> dict | None:
    """The meta of the latest checkpoint under `directory`, or None; creates nothing."""
    if not directory.is_dir():
        return None
    checkpointer = Checkpointer(directory)
    try:
        step = checkpointer.latest_step()
        return None if step is None else checkpointer.restore_meta(step)
    finally:
        checkpointer.close()


def tree_sha256(directory, exclude=None) -> str:
    """SHA-256 (hex) of every regular file under `directory`, symlinked folders followed (once each): relative
    paths and contents, in sorted order; `exclude` (a path, e.g. a run directory inside it) is skipped."""
    import hashlib
    root = pathlib.Path(directory)
    skip = None if exclude is None else os.path.realpath(exclude)
    files, seen = [], set()
    for here, dirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(here)
        if real in seen or (skip is not None and (real == skip or real.startswith(skip + os.sep))):
            dirs[:] = []
            continue
        seen.add(real)
        files += [pathlib.Path(here) / n for n in names if (pathlib.Path(here) / n).is_file()]
    digest = hashlib.sha256(b"jaxdp.run_dir.tree_sha256/v1")
    for path in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        name = path.relative_to(root).as_posix().encode()
        digest.update(len(name).to_bytes(8, "little") + name + path.stat().st_size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


# ------------------------------------------------------------------ the token cache


def record_token_cache(workdir: pathlib.Path, windows) -> list[dict]:
    """Adds the cache files of `windows` (`jaxdp.data.windows.TokenWindows`, one per split) to
    `<workdir>/token_cache.json` and returns its entries: {"path" (absolute), "bytes", "split", "wrote" (this
    run wrote the file, in this process or one it resumed), "exists"}. Entries of earlier processes of the run
    are kept, so the file names every cache file the run has used."""
    path = workdir / TOKEN_CACHE_FILE
    entries = {e["path"]: e for e in (read_json(path) or {}).get("files", [])}
    for w in windows:
        for f in w.cache_files:
            key = str(pathlib.Path(f).absolute())
            wrote = entries.get(key, {}).get("wrote", False) or not w.from_cache
            entries[key] = {"path": key, "bytes": f.stat().st_size, "split": w.split, "wrote": wrote}
    files = [entries[k] for k in sorted(entries)]
    write_text_atomic(path, json.dumps({
        "about": "The token-cache files this run wrote or read, outside the run directory: they hold the private "
                 "text's tokens. Do not share this file or them; delete them with the run: "
                 f"python -m experiments.delete_token_cache --workdir={workdir}",
        "files": files}, indent=2) + "\n")
    return files


def token_cache_files(workdir) -> list[dict]:
    """The entries of `<workdir>/token_cache.json` (`record_token_cache`). ValueError when there is none."""
    record = read_json(pathlib.Path(workdir) / TOKEN_CACHE_FILE)
    if record is None:
        raise ValueError(f"{workdir} has no {TOKEN_CACHE_FILE}: not a run directory, or a run from before runs "
                         "recorded their token cache")
    return record.get("files", [])


def delete_token_cache(workdir) -> list[dict]:
    """Deletes the token-cache files `<workdir>/token_cache.json` names (those that still exist) and returns
    their entries; nothing else. ValueError when the run directory has no such file."""
    deleted = []
    for entry in token_cache_files(workdir):
        f = pathlib.Path(entry["path"])
        if f.is_file() and not f.is_symlink():
            f.unlink()
            deleted.append(entry)
    return deleted


def read_json(path) -> dict | None:
    """The JSON object in `path`; None when it is missing, unreadable or not an object."""
    try:
        value = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_plots(workdir, rows: list[dict], *, target_epsilon: float | None = None,
                accountant: str | None = None) -> list[str]:
    """loss.png (train / validation loss) and epsilon.png (spent, with the target as a line) against
    step; [] without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    workdir = pathlib.Path(workdir)
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    tr = [(r["step"], r["train_loss"]) for r in rows if r.get("train_loss") is not None]
    va = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if tr:
        ax.plot(*zip(*tr), label="train")
    if va:
        ax.plot(*zip(*va), marker="o", label="validation")
    ax.set_title("loss"); ax.set_xlabel("step"); ax.set_ylabel("loss (nats / token)"); ax.legend(); ax.grid(alpha=0.3)
    fig.tight_layout(); fig.savefig(workdir / "loss.png", dpi=100); plt.close(fig)
    written.append("loss.png")
    eps = [(r["step"], r["epsilon"]) for r in rows if r.get("epsilon") is not None]
    if eps:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(*zip(*eps), label="spent")
        if target_epsilon is not None:
            ax.axhline(target_epsilon, color="tab:red", linestyle="--", label=f"target {target_epsilon:g}")
        ax.set_title(f"privacy spent ({accountant or 'unknown'} accountant)")
        ax.set_xlabel("step"); ax.set_ylabel("epsilon"); ax.legend(); ax.grid(alpha=0.3)
        fig.tight_layout(); fig.savefig(workdir / "epsilon.png", dpi=100); plt.close(fig)
        written.append("epsilon.png")
    return written


# ------------------------------------------------------------------ stderr


class Progress:
    """One stderr line, redrawn at every step, that never runs ahead of the work: the last step whose
    computation has finished (`done`; the loop keeps at most one more in flight), the last checkpoint (a kill
    loses the steps after it), the last logged loss and epsilon, and the elapsed time."""

    def __init__(self, total: int, enabled: bool, *, accountant: str | None = None):
        self.total, self.enabled, self.accountant = total, enabled, accountant
        self.started = time.perf_counter()

    def update(self, done: int, row: dict, tokens_per_s: float | None, *, saved: int | None = None):
        """`done`: the last finished step; `row`: the latest metrics.jsonl line (train_loss None before the
        first logged step); `saved`: the step of the latest checkpoint (None: none yet)."""
        if not self.enabled:
            return
        width = 24
        filled = int(width * done / max(self.total, 1))
        loss, eps = row.get("train_loss"), row.get("epsilon")
        eps_s = "inf (non-DP)" if self.accountant is None else f"{eps:.3f} ({self.accountant})"
        tok_s = '-' if not tokens_per_s else format(tokens_per_s, ',.0f')
        _redraw(f"[{'#' * filled}{'.' * (width - filled)}] step {done}/{self.total} done, "
                f"saved at {'-' if saved is None else saved} | loss {'-' if loss is None else format(loss, '.4f')} "
                f"(step {row.get('step', 0)}) eps {eps_s} | tok/s {tok_s} | "
                f"{_elapsed(time.perf_counter() - self.started)}")

    def close(self):
        if self.enabled:
            print(file=sys.stderr, flush=True)
            _line_width[0] = 0


class Ticker:
    """A stderr line that moves while slow work runs (compiling, training a tokenizer, tokenising): the
    message, a status the work may set (`set`), and the elapsed time, redrawn every `interval` seconds by a
    thread; on exit the line ends with the time taken. Disabled: prints nothing.

        with Ticker("compiling the DP step", enabled=verbose):
            step(...)
    """

    def __init__(self, message: str, enabled: bool = True, *, interval: float = 1.0):
        self.message, self.enabled, self.interval = message, enabled, interval
        self.status, self._stop, self._thread = "", threading.Event(), None

    def set(self, status: str) -> None:
        """Shown after the message, e.g. ': 40/233 documents'."""
        self.status = status
        self._draw()

    def _draw(self) -> None:
        if self.enabled:
            _redraw(f"{self.message}{self.status} ... {_elapsed(time.perf_counter() - self._t0)}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._draw()

    def __enter__(self) -> "Ticker":
        self._t0 = time.perf_counter()
        if self.enabled:
            self._draw()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        if self.enabled:
            _redraw(f"{self.message}{self.status}: {'failed after' if exc[0] else 'done in'} "
                    f"{time.perf_counter() - self._t0:.1f} s", end="\n")


_line_width = [0]  # characters of the stderr line being redrawn


def _redraw(text: str, end: str = "") -> None:
    """Redraws the current stderr line with `text`, blanking what a longer previous text left."""
    print("\r" + text.ljust(_line_width[0]), end=end, file=sys.stderr, flush=True)
    _line_width[0] = 0 if end else len(text)


def _elapsed(seconds: float) -> str:
    """'0:07', '12:34', '1:02:03'."""
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def log(msg: str, enabled: bool = True) -> None:
    if enabled:
        print(msg, file=sys.stderr, flush=True)
