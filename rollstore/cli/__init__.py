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

from importlib import import_module

_PUBLIC = {"app": "rollstore.cli.commands", "main": "rollstore.cli.commands"}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'rollstore.cli' has no attribute {name!r}")
