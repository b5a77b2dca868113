"""Command-line entry for the jobs: one-line errors for bad flags, exit status 2.

`run(main)` is `absl.app.run(main)` whose flag parsing turns an unknown or
mistyped `--config.<key>` (ml_collections' "Did you mean ...?" hint kept), a
value of the wrong type, or an unknown flag into one line on stderr,
`error: ...`, and exit status 2, the status `ConfigError` gets in the jobs.
"""

from __future__ import annotations

import sys
import warnings
from typing import Callable

from absl import app, flags, logging
from ml_collections import config_flags


def flag_error_message(error: BaseException, argv: list[str] = ()) -> str:
    """The one-line message for an error raised while parsing the command line."""
    text = str(error)
    if isinstance(error, (AttributeError, KeyError)):
        # ml_collections: AttributeError("'stepz'\nDid you mean \"steps\" instead of \"stepz\"?")
        text = text.replace("\\n", "\n").replace("\\'", "'").strip("'\"")
        key, _, hint = text.partition("\n")
        key = key.strip("'\"")
        flag = next((a.split("=")[0] for a in argv if a.startswith("--") and key in a.split("=")[0].split(".")), None)
        if not hint.strip() and flag:  # the key exists elsewhere (--config.accountant for --config.dp.accountant)
            hint = "".join(f"did you mean --{flag[2:].split('.')[0]}.{path}?" for path in _paths_named(flag, argv)[:1])
        text = (f"unknown config key {flag[2:] if flag else key!r}"
                + (f" ({hint.strip()})" if hint.strip() else ""))
    return "error: " + " ".join(text.split())


_DEFAULT_CONFIGS: dict[str, str] = {}  # flag name -> its default config file (`define_config`)


def _paths_named(flag: str, argv) -> list[str]:
    """The dotted paths in the flag's config (its --<name>=FILE, else the default) whose last key is the
    flag's last key; [] when the config does not load."""
    name, *_, leaf = flag[2:].split(".")
    file = next((a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")), _DEFAULT_CONFIGS.get(name))
    try:
        import importlib.util
        spec = importlib.util.spec_from_file_location("_jaxdp_cli_config", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        flat = _flatten(module.get_config())
    except Exception:  # noqa: BLE001 -- only a hint: a config that does not load gives none
        return []
    return sorted(p for p in flat if p.split(".")[-1] == leaf)


def _flatten(config, prefix: str = "") -> list[str]:
    paths = []
    for key, value in config.items():
        path = f"{prefix}{key}"
        paths += _flatten(value, path + ".") if hasattr(value, "items") else [path]
    return paths


def define_config(name: str, default: str, help_string: str):
    """`config_flags.DEFINE_config_file`, locked; a bad `--<name>.<key>` override (it is read from
    sys.argv right here) prints one `error: ...` line and exits 2."""
    _DEFAULT_CONFIGS[name] = default
    try:
        return config_flags.DEFINE_config_file(name, default, help_string, lock_config=True)
    except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
        print(flag_error_message(e, sys.argv), file=sys.stderr, flush=True)
        sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing; a bad flag, or a --config file that does not load (missing, failing on import, no
    get_config), prints one `error: ...` line and exits 2."""
    try:
        return flags.FLAGS(argv)
    except Exception as e:  # noqa: BLE001 -- the config file is user code: anything it raises is a bad flag
        if isinstance(e, AttributeError) and "get_config" in str(e):
            line = "error: the --config file defines no get_config()"
        elif isinstance(e, (flags.Error, AttributeError, KeyError, TypeError, ValueError)):
            line = flag_error_message(e, argv)
        else:
            line = _config_file_error(e)
        print(line, file=sys.stderr, flush=True)
        sys.exit(2)


def _config_file_error(error: BaseException) -> str:
    """The one line for a --config file that did not load: ml_collections' own error (its last line names the
    cause), or what the file raised on import."""
    text = str(error).strip()
    if "Failed loading config file" in text:
        return "error: the --config file could not be loaded: " + " ".join(text.splitlines()[-1].split())
    return f"error: the --config file could not be loaded: {type(error).__name__}: " + " ".join(text.split())


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A library warning as the jobs print it: `warning: ...`, one line, no source location."""
    print("warning: " + " ".join(str(message).split()), file=file or sys.stderr, flush=True)


def run(main: Callable[[list[str]], int | None]) -> None:
    """`app.run(main, flags_parser=parse_flags)`; main's return value is the exit status. A --config file
    that does not load (missing, or raising on import) is one `error: ...` line and status 2 too; a library
    warning (e.g. files a corpus directory did not read) is one `warning: ...` line; absl logs below WARNING
    are not shown."""
    def checked(argv):
        warnings.showwarning = _one_line_warning
        logging.set_verbosity(logging.WARNING)  # absl INFO: jax's backend probing (libtpu.so), orbax's every save
        try:
            return main(argv)
        except OSError as e:
            if "Failed loading config file" not in str(e):
                raise
            print(_config_file_error(e), file=sys.stderr, flush=True)
            return 2
    app.run(lambda argv: sys.exit(checked(argv)), flags_parser=parse_flags)
