"""The learner as a process of its own: `python -m rollstore.loop.learner_main SPEC`, the named
entry that torchrun starts once per rank (`rollstore train --nproc N`, `rollstore loop
--learner-ranks N`). A separate process is the point there (torchrun owns the ranks); everywhere
else the learner is a library call (`rollstore.loop.learner_loop.run_train`).

Invariants:
- SPEC is one JSON object (`spec`/`command` build it): the buffer, the model, the run id, the
  curations, the whole `TrainConfig` (loss settings and warm-up included, so a learner of N ranks
  trains as the one-process loop does) and the follow settings. Nothing else is read from the
  command line, so the entry does not depend on the command line's parser.
- Each rank prints what `run_train` prints (rank 0: one `vN: trained ...` line per checkpoint) to
  stdout; a `RollstoreError` is one `error: ...` line on stderr and exit status 1.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from rollstore.learner.config import LossConfig, TrainConfig


def spec(buffer: str, model: str, config: TrainConfig, run_id: str, curations: list[str] | tuple = (), *,
         follow: bool = False, poll: float = 1.0, max_idle: float = 0.0, parallel: str = "ddp",
         keep_checkpoints: int | None = None) -> dict[str, Any]:
    """The SPEC of one learner (every rank gets the same)."""
    return {"buffer": buffer, "model": model, "run_id": run_id, "curations": list(curations),
            "config": dataclasses.asdict(config), "follow": follow, "poll": poll, "max_idle": max_idle,
            "parallel": parallel, "keep_checkpoints": keep_checkpoints}


def command(nproc: int, learner: dict[str, Any]) -> list[str]:
    """The torchrun command line that runs `learner` (a `spec`) on `nproc` ranks of this host."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "rollstore.loop.learner_main", json.dumps(learner)]


def config_of(learner: dict[str, Any]) -> TrainConfig:
    raw = dict(learner["config"])
    return TrainConfig(**{**raw, "loss_config": LossConfig(**raw["loss_config"])})


def main(argv: list[str]) -> int:
    from rich.console import Console

    from rollstore.loop.learner_loop import run_train
    from rollstore.storage.errors import RollstoreError

    if len(argv) != 1:
        print("usage: python -m rollstore.loop.learner_main SPEC (one JSON object)", file=sys.stderr)
        return 2
    learner = json.loads(argv[0])
    try:
        run_train(learner["buffer"], learner["model"], config_of(learner), learner["run_id"], learner["curations"],
                  Console(soft_wrap=True), follow=learner["follow"], poll=learner["poll"],
                  max_idle=learner["max_idle"], parallel=learner["parallel"],
                  keep_checkpoints=learner["keep_checkpoints"])
    except RollstoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
