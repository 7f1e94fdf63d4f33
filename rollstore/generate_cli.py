"""`rollstore generate`: generation steps into a buffer; with --follow, the generator process of
the two-process loop (it loads each newly published checkpoint and curates each step it writes).

Invariants: one shard per step (a step's groups arrive in one append); with --follow, step i is
generated only once the learner has published version ≥ i − max_policy_lag, so no curated row is
more than max_policy_lag versions older than the weights it trains.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import Progress

from storage.buffer import Buffer


def _next_step(buf: Buffer, run_id: str) -> int:
    from queries.session import Session

    with buf.snapshot() as snap, Session(snap) as s:
        row = s.one("SELECT max(step) FROM rollouts WHERE run_id = $r", {"r": run_id})
    return 0 if row[0] is None else int(row[0]) + 1


def run_generate(buffer, prompts_ref, model, backend_name, group_size, num_prompts, policy_version, seed, steps,
                 run_id, max_new_tokens, temperature, top_p, template, follow, max_policy_lag, compact, err: Console,
                 recipe: str = "d3s", sets: dict | None = None) -> list[str]:
    from learner.checkpoint import latest_checkpoint
    from rollout.backends import get_backend
    from rollout.reward import RewardPool
    from rollstore.generate import generate_step
    from rollstore.models import resolve_model, resolve_prompts

    buf = Buffer.open(buffer)
    model_dir = resolve_model(model)
    version = 0 if policy_version is None else policy_version
    if follow:
        ck = latest_checkpoint(buf)
        if ck is not None:
            model_dir, version = ck.dir, ck.version
    backend = get_backend(backend_name, model_dir)
    first = _next_step(buf, run_id)
    written = []
    with RewardPool() as pool, Progress(console=err, transient=True) as bar:
        task = bar.add_task(f"generate {run_id}", total=steps)
        for i in range(steps):
            step = first + i
            if follow:
                version, model_dir = _wait_for_learner(buf, backend, version, model_dir, i, max_policy_lag)
            prompts = resolve_prompts(prompts_ref, num_prompts, seed=seed + step, split="train", template=template)
            table = generate_step(model_dir, prompts, run_id=run_id, step=step, backend=backend, group_size=group_size,
                                  policy_version=version, seed=seed * 7919 + step, max_new_tokens=max_new_tokens,
                                  temperature=temperature, top_p=top_p, reward_pool=pool)
            shard = buf.append_rollouts(table, source=f"{run_id}/step-{step}", compact=compact)
            written.append(shard.path)
            err.print(f"step {step}: {shard.rows} rollouts, {shard.tokens} tokens, policy v{version} -> {shard.path}",
                      highlight=False)
            if follow:
                from curate.params import load_recipe, step_where
                from curate.run import curate

                cur = curate(buf, load_recipe(recipe), {**(sets or {}), "where": step_where(run_id, step),
                                                        "progress": str(i / steps),
                                                        "max_policy_lag": str(max_policy_lag)})
                err.print(f"step {step}: curation {cur.curation_id} kept {cur.record['n_selected']} samples",
                          highlight=False)
            bar.advance(task)
    buf.close()
    return written


def _wait_for_learner(buf, backend, version, model_dir, i, lag, poll=0.5, timeout=3600.0):
    """Block until the newest checkpoint is ≥ i − lag; load it whenever a newer one appears."""
    from learner.checkpoint import latest_checkpoint

    deadline = time.monotonic() + timeout
    while True:
        ck = latest_checkpoint(buf)
        if ck is not None and ck.version > version:
            backend.load_weights(ck.dir)
            version, model_dir = ck.version, ck.dir
        if version >= i - lag:
            return version, model_dir
        if time.monotonic() > deadline:
            raise TimeoutError(f"no checkpoint ≥ v{i - lag} after {timeout:.0f} s")
        time.sleep(poll)
