"""The command line: `rollstore ...` (the console script `rollstore.cli:app`), `python -m rollstore`
and `python -m rollstore.cli`.

`commands` declares every command (typer) and turns each failure into one line; `options` checks
its numbers; `curate`, `info`, `explain` and `demo` print what their commands print. The command
line is a client of the Python front door: `curate`, `train` and `generate` call the methods of
`rollstore.open(BUF)` (rollstore/handle.py), whose defaults live in `rollstore/rules/defaults.py`.
The rest of the work is done below: `rollstore.loop` (eval, the loop, the learner's torchrun
entry), `rollstore.report` (report, audit), `rollstore.output` (export, result formats), the layers.

`app` and `main` are imported on first use, so importing `rollstore.cli` loads no command.
"""

from __future__ import annotations

from rollstore.storage.lazy import lazy_exports

_PUBLIC = {"app": "rollstore.cli.commands", "main": "rollstore.cli.commands"}

__all__ = sorted(_PUBLIC)


__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
