"""Deletes the token-cache files a run wrote or read: the private text's tokens, kept outside the run directory.

    python -m experiments.delete_token_cache --workdir=runs/pretrain_gpt2            # delete them
    python -m experiments.delete_token_cache --workdir=runs/pretrain_gpt2 --dry_run  # only list them

The files are those `<workdir>/token_cache.json` names (`jaxdp.training.run_dir.delete_token_cache`); nothing
else is touched. A later resume of the run tokenises its corpus again.
"""

import sys

from absl import flags

from jaxdp.training import cli

_WORKDIR = flags.DEFINE_string("workdir", "runs/pretrain_gpt2", "Run directory.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "List the files and delete nothing.")


def main(argv):
    del argv
    from jaxdp.training import run_dir
    try:
        files = run_dir.token_cache_files(_WORKDIR.value)
        if _DRY_RUN.value:
            for entry in files:
                print(f"{entry['path']}  {entry['bytes']:,} bytes  {entry['split']}  "
                      f"{'wrote' if entry['wrote'] else 'read'}")
            return 0
        deleted = run_dir.delete_token_cache(_WORKDIR.value)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for entry in deleted:
        print(f"deleted {entry['path']}  {entry['bytes']:,} bytes")
    print(f"{len(deleted)} of the {len(files)} token-cache files the run named were there and are deleted",
          flush=True)
    return 0


if __name__ == "__main__":
    cli.run(main)
