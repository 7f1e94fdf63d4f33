"""The command line: `rollstore ...` (the console script `rollstore.cli:app`), `python -m rollstore`
and `python -m rollstore.cli`.

`commands` declares every command (typer) and turns each failure into one line; `options` checks
its numbers; `defaults` holds the defaults of the everyday commands, which the Python front door
(`rollstore.open`) reads too; `curate`, `info`, `explain` and `demo` print what their commands
print. The work itself is done below: `rollstore.loop` (generate, train, eval, the loop),
`rollstore.report` (report, audit), `rollstore.output` (export, result formats), the layers.

`app` and `main` are imported on first use, so reading `rollstore.cli.defaults` loads no command.
"""

from __future__ import annotations

from rollstore.storage.lazy import lazy_exports

_PUBLIC = {"app": "rollstore.cli.commands", "main": "rollstore.cli.commands"}

__all__ = sorted(_PUBLIC)


__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
