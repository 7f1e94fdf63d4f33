"""`rollstore loop --learner-ranks N`: the loop with a learner of N torch.distributed ranks.

The loop becomes the two-process mode with no staleness: this process generates, judges, appends
and curates step i once the learner has published version ≥ i (`max_policy_lag` 0, so it
alternates with the learner exactly as the one-process loop does), and the learner is
the named entry `rollstore.loop.learner_main` (following, DDP) under torchrun with N ranks.

Invariants:
- The buffer is the only channel between the two sides; every curation is trained exactly once
  (the learner leases curated shards and acks them in the commit that publishes the checkpoint;
  rank 0 publishes), so a crash of either side loses nothing and reruns resume.
- Generation of step i uses the newest published version, which is ≥ i.
- When the generator has curated its last step, the learner is stopped once the checkpoint of that
  curation is published (or after `timeout` seconds, an error); the learner is stopped on any error.
"""

from __future__ import annotations

import dataclasses
import subprocess
import tempfile
import time

from rich.console import Console

from rollstore.loop import learner_main
from rollstore.loop.driver import LoopConfig


def learner_command(cfg: LoopConfig, model_dir: str, run_id: str, ranks: int) -> list[str]:
    """torchrun starting the learner's named entry (`rollstore.loop.learner_main`) on `ranks` ranks,
    with the loop's whole training configuration."""
    return learner_main.command(ranks, learner_main.spec(cfg.buffer, model_dir, cfg.effective_train(), run_id,
                                                         follow=True, poll=0.2, parallel="ddp"))


def run_loop_with_ranks(cfg: LoopConfig, ranks: int, err: Console, timeout: float = 3600.0) -> int:
    """Run cfg.iterations steps with an N-rank learner; return the last published version."""
    from rollstore.curate.params import load_recipe, resolve
    from rollstore.curate.prompts import refuse

    refuse(resolve(load_recipe(cfg.recipe), {k: v for k, v in cfg.sets.items() if k != "progress"}),
           "a loop with --learner-ranks > 1")
    import os

    from rollstore.learner.checkpoint import latest_checkpoint
    from rollstore.loop.generator import Follow, PromptSource, run_generate
    from rollstore.builtin.resolve import resolve_model
    from rollstore.storage.buffer import Buffer

    run_id = cfg.run_name
    model_dir = resolve_model(cfg.model)
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg.threads or 1))
    log = tempfile.TemporaryFile(mode="w+")  # the learner's output: its publish lines, or why it failed
    learner = subprocess.Popen(learner_command(cfg, model_dir, f"{run_id}-learner", ranks), env=env,
                               stdout=log, stderr=subprocess.STDOUT, text=True)
    ok = False
    try:
        run_generate(cfg.buffer, model_dir, PromptSource(cfg.prompts, cfg.prompts_per_iter),
                     dataclasses.replace(cfg.generation, seed=cfg.seed), run_id, cfg.iterations, err,
                     follow=Follow(0, cfg.recipe, cfg.sets))
        deadline = time.monotonic() + timeout
        with Buffer.open(cfg.buffer) as buf:
            while True:
                ck = latest_checkpoint(buf)
                if ck is not None and ck.version >= cfg.iterations:
                    ok = True
                    return ck.version
                if learner.poll() is not None:
                    raise RuntimeError(f"the learner exited with status {learner.returncode} before "
                                       f"publishing v{cfg.iterations}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no checkpoint v{cfg.iterations} after {timeout:.0f} s")
                time.sleep(0.2)
    finally:
        if learner.poll() is None:  # done (or failed): stop it; exactly-once holds at any point
            learner.terminate()
            try:
                learner.wait(timeout=60)
            except subprocess.TimeoutExpired:
                learner.kill()
                learner.wait()
        log.seek(0)
        lines = log.read().splitlines()
        log.close()
        shown = [ln for ln in lines if ln.startswith("v") and ": trained" in ln] if ok else lines[-20:]
        for line in shown:
            err.print(("learner: " if ok else "learner output: ") + line, highlight=False, markup=False)
