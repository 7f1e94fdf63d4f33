"""The `rollstore` command line (typer + rich), assembled: the app (`rollstore/cli/app.py`) with the
commands of the store, of curation and of the loop registered on it, in the order `--help` lists them.

Invariants: see `rollstore/cli/app.py`.
"""

from __future__ import annotations

import sys

# (registered in this order, the order `--help` lists them in)
from rollstore.cli import store_commands  # noqa: F401,I001 - init, import, export, sql, info, gc, verify, compact, migrate
from rollstore.cli import curation_commands  # noqa: F401 - curate, audit, report, compare, recipes
from rollstore.cli import loop_commands  # noqa: F401 - generate, train, loop, eval, demo
from rollstore.cli.app import app, one_line  # noqa: F401 - the console script's and the tests' names

def _one_line_summaries() -> None:
    """`rollstore --help` lists each command with its docstring's first paragraph as one sentence
    (a docstring wrapped at 110 columns would otherwise break mid-sentence in the list)."""
    for info in app.registered_commands:
        if info.short_help is None and info.callback is not None and info.callback.__doc__:
            first = info.callback.__doc__.strip().split("\n\n", 1)[0]
            info.short_help = " ".join(first.split())


_one_line_summaries()


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
