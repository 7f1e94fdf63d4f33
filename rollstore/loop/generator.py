"""`rollstore generate`: generation steps into a buffer; with --follow, the generator process of
the two-process loop (it loads each newly published checkpoint and curates each step it writes).
Rows are stamped with the policy version given, else the checkpoint's (a `BUFFER/checkpoints/vN`
model directory), else 0.

Invariants: one shard per step (a step's groups arrive in one append); with --follow, step i is
generated only once the learner has published version ≥ i − max_policy_lag, so no curated row is
more than max_policy_lag versions older than the weights it trains. On a shared catalog one writer
at a time generates a run (an intent on the run id, taken before any model is loaded); a run that
would sample a step with the seed another run used is warned of on the first line.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import Progress

from rollstore.loop.generate import GenerationConfig, StepStamp
from rollstore.rules.defaults import RECIPE
from rollstore.storage.buffer import Buffer
from rollstore.storage.errors import RollstoreError


def _next_step(buf: Buffer, run_id: str) -> int:
    from rollstore.queries.session import Session

    with buf.snapshot() as snap, Session(snap) as s:
        row = s.one("SELECT max(step) FROM rollouts WHERE run_id = $r", {"r": run_id})
    return 0 if row[0] is None else int(row[0]) + 1


CHECKPOINT = "checkpoint:"


def _checkpoint_dir(buf: Buffer, model: str) -> str:
    """`checkpoint:latest` or `checkpoint:N`: that checkpoint of this buffer (on a store's buffer,
    fetched into this host's cache, verified), so a generator on any host names it the same way."""
    from rollstore.learner.checkpoint import get_checkpoint, latest_checkpoint

    which = model[len(CHECKPOINT):]
    if which == "latest":
        ck = latest_checkpoint(buf)
    elif which.isdigit():
        ck = get_checkpoint(buf, int(which))
    else:
        raise RollstoreError(f"--model {model}: give checkpoint:latest or checkpoint:N (a published version)")
    if ck is None:
        raise RollstoreError(f"--model {model}: {buf.root} has no such checkpoint")
    if ck.pruned_seq is not None:
        raise RollstoreError(f"--model {model}: v{ck.version}'s files were pruned (--keep-checkpoints); its row "
                             "remains; name a newer version")
    return ck.dir


def checkpoint_version(model_dir: str) -> int:
    """The policy version of a learner checkpoint directory (`BUFFER/checkpoints/vN`, its ledger),
    else 0 (a model that no learner of rollstore published)."""
    import json
    import os

    from rollstore.learner.checkpoint import LEDGER

    path = os.path.join(model_dir, LEDGER)
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8") as fh:
        return int(json.load(fh)["version"])


@dataclass(frozen=True)
class PromptSource:
    """Where each step's prompts come from: `count` prompts of `ref` (a file or builtin:...),
    seeded by the step, in the chat `template` (a format string with {prompt}) when given."""

    ref: str
    count: int | None
    template: str | None = None


@dataclass(frozen=True)
class Follow:
    """--follow: wait while the learner is more than `max_policy_lag` versions behind, load each
    newly published checkpoint, and curate each step with `recipe` and the overrides `sets`."""

    max_policy_lag: int = 1
    recipe: str = RECIPE
    sets: dict = field(default_factory=dict)

    def __post_init__(self):
        """Refuses, in one line, settings it cannot honour: pre-rollout prompt selection (`prompt_skip`)."""
        from rollstore.curate.params import load_recipe, resolve
        from rollstore.curate.prompts import refuse

        refuse(resolve(load_recipe(self.recipe), {k: v for k, v in self.sets.items() if k != "progress"}),
               "generate --follow")


def run_generate(buffer: str, model: str, prompts: PromptSource, config: GenerationConfig, run_id: str, steps: int,
                 err: Console, *, policy_version: int | None = None, compact: bool = False,
                 follow: Follow | None = None) -> list[str]:
    """Generate `steps` steps (one shard each) after the run's last; return the shards' paths."""
    from rollstore.builtin.resolve import check_refs

    check_refs(model, prompts.ref)  # before anything slow or written
    buf = Buffer.open(buffer)
    with contextlib.ExitStack() as stack:
        stack.callback(buf.close)
        _claim_run(buf, run_id, stack)  # before anything slow: a second writer of the run is refused at once
        first = _next_step(buf, run_id)
        other = _same_seed(buf, run_id, first, config.seed * 7919 + first)
        if other is not None:
            err.print(f"warning: run {run_id!r} samples step {first} with the seed run {other!r} used (--seed "
                      f"{config.seed}): the same prompts and, from the same model, the same samples; pass another "
                      "--seed to differ", highlight=False, markup=False, soft_wrap=True)
        return _generate(buf, model, prompts, config, run_id, steps, err, first, policy_version, compact, follow)


def _claim_run(buf: Buffer, run_id: str, stack) -> None:
    """An intent on the run in a shared catalog (PostgreSQL), held while this process generates: a
    second writer of the same run id is refused with one line instead of failing at its first append
    (`rollout_id already in the buffer`). The embedded manifest has one host and takes no intent."""
    from urllib.parse import quote

    from rollstore.storage.catalog import holding

    try:
        stack.enter_context(holding(buf.manifest, f"tmp/runs/{quote(run_id, safe='')}"))
    except FileExistsError:
        raise RollstoreError(f"run {run_id!r} is being generated into this buffer by another writer right now "
                             "(another host or process): give each host its own --run-id NAME and --seed N (the "
                             "same seed samples the same data); nothing was written") from None


def _same_seed(buf: Buffer, run_id: str, step: int, seed: int) -> str | None:
    """Another run that sampled `step` with the derived seed `seed` (queries/generate_same_seed.sql)."""
    from rollstore.queries import load_sql
    from rollstore.queries.session import Session

    with buf.snapshot() as snap, Session(snap) as s:
        row = s.one(load_sql("generate_same_seed"), {"run_id": run_id, "step": step, "seed": seed})
    return None if row is None else str(row[0])


def _generate(buf: Buffer, model: str, prompts: PromptSource, config: GenerationConfig, run_id: str, steps: int,
              err: Console, first: int, policy_version: int | None, compact: bool, follow: Follow | None) -> list[str]:
    """run_generate's body, with the run claimed."""
    from rollstore.learner.checkpoint import latest_checkpoint
    from rollstore.rollout.backends import get_backend
    from rollstore.rollout.reward import RewardPool
    from rollstore.builtin.resolve import resolve_model, resolve_prompts
    from rollstore.loop.step import StepWriter

    model_dir = _checkpoint_dir(buf, model) if model.startswith(CHECKPOINT) else resolve_model(model)
    version = checkpoint_version(model_dir) if policy_version is None else policy_version
    if follow:
        ck = latest_checkpoint(buf)
        if ck is not None:
            model_dir, version = ck.dir, ck.version
    backend = get_backend(config.backend, model_dir)
    written = []
    with RewardPool() as pool, Progress(console=err, transient=True) as bar:
        lag = follow.max_policy_lag if follow else 0
        writer = StepWriter(buf, backend, pool, config, run_id, compact=compact, recipe=follow.recipe if follow else RECIPE,
                            sets={**follow.sets, "max_policy_lag": str(lag)} if follow else None)
        task = bar.add_task(f"generate {run_id}", total=steps)
        for i in range(steps):
            step = first + i
            if follow:
                version = _wait_for_learner(buf, backend, version, i, lag)
            batch = resolve_prompts(prompts.ref, prompts.count, seed=config.seed + step, split="train",
                                    template=prompts.template)
            _, shard = writer.generate(batch, StepStamp(run_id, step, version), config.seed * 7919 + step,
                                       f"{run_id}/step-{step}")
            written.append(shard.path)
            err.print(f"step {step}: {shard.rows} rollouts, {shard.tokens} tokens, policy v{version} -> {shard.path}",
                      highlight=False)
            if follow:
                cur = writer.curate(step, i / steps)
                err.print(f"step {step}: curation {cur.curation_id} kept {cur.record['n_selected']} samples",
                          highlight=False)
            bar.advance(task)
    return written


def _wait_for_learner(buf, backend, version, i, lag, poll=0.5, timeout=3600.0):
    """Block until the newest checkpoint is ≥ i − lag; load it whenever a newer one appears."""
    from rollstore.learner.checkpoint import latest_checkpoint

    deadline = time.monotonic() + timeout
    while True:
        ck = latest_checkpoint(buf)
        if ck is not None and ck.version > version:
            backend.load_weights(ck.dir)
            version = ck.version
        if version >= i - lag:
            return version
        if time.monotonic() > deadline:
            raise TimeoutError(f"no checkpoint ≥ v{i - lag} after {timeout:.0f} s")
        time.sleep(poll)
