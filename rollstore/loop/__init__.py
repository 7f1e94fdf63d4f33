"""Orchestration: the jobs that generate, train and evaluate, and the near-on-policy loop that runs
them through one buffer.

`generate` samples one step (prompts → scored rows); `step` appends and curates it; `generator` is
`rollstore generate` (and, with --follow, the generator process of the two-process loop);
`trainer` is `rollstore train` (and the learner process); `evaluate` is `rollstore eval`; `run` is
the one-process loop (`LoopConfig`, `run_loop`), `ranks` the loop with an N-rank learner, `view`
its progress table. The command line and the Python front door both call these.

`LoopConfig` and `run_loop` are imported on first use (`from rollstore.loop import run_loop`).
"""

from __future__ import annotations

from rollstore.storage.lazy import lazy_exports

_PUBLIC = {"LoopConfig": "rollstore.loop.driver", "run_loop": "rollstore.loop.driver"}

__all__ = sorted(_PUBLIC)


__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
