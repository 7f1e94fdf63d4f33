"""Generate, append, curate a step: written once, for the loop (`rollstore.loop`), the generator
process of the two-process mode (`rollstore generate --follow`) and the loop with an N-rank
learner (`rollstore.loop.ranks`, which runs that generator).

Invariants:
- `generate` samples one batch of a step with the loaded backend and reward pool and appends it
  as one shard, before it returns; the rows are stamped (run, step, policy version, prompt offset).
- `curate` commits one curation of exactly that step's rows (`where run_id = … AND step = i`) at
  schedule position `progress`, with the recipe and parameter overrides given once.
- `committed` finds what a process killed after a step's curation commit and before the checkpoint
  that trains it left: the step's live curation (same `where`) that the run has not trained. A
  resumed step trains that one instead of curating again, and any other untrained curation of the
  step (another recipe's, an older one) is retired first, so a step is trained into its run at most
  once, whichever line the kill landed on — also by a later `rollstore train --run-id` of the run.
- Nothing here loads a model or starts a verifier pool: the caller owns them, and closes them.
"""

from __future__ import annotations

from dataclasses import replace

import pyarrow as pa

from rollstore.curate.params import load_recipe, step_where
from rollstore.rules.defaults import RECIPE
from rollstore.curate.run import CurationResult, curate
from rollstore.queries import load_sql
from rollstore.queries.session import Session
from rollstore.rollout.backends import Backend
from rollstore.rollout.prompt_sources import Prompt
from rollstore.rollout.reward import RewardPool
from rollstore.storage.buffer import Buffer
from rollstore.storage.manifest import Shard
from rollstore.storage.timing import Stopwatch
from rollstore.storage.verify import retire

from .generate import GenerationConfig, StepStamp, generate_step


class StepWriter:
    """One run's steps into `buf`: sampled with `backend` (the caller loads each new version's
    weights into it), judged by `pool`, curated by `recipe` with `sets` (one DuckDB `session`
    for all the run's curations, when given)."""

    def __init__(self, buf: Buffer, backend: Backend, pool: RewardPool, config: GenerationConfig, run_id: str, *,
                 recipe: str = RECIPE, sets: dict | None = None, session=None, compact: bool = False):
        self.buf, self.backend, self.pool, self.config, self.run_id = buf, backend, pool, config, run_id
        self.recipe, self.sets, self.session, self.compact = load_recipe(recipe), dict(sets or {}), session, compact

    def generate(self, prompts: list[Prompt], stamp: StepStamp, seed: int, source: str,
                 phases: dict[str, float] | None = None, also: dict[str, pa.Table] | None = None
                 ) -> tuple[pa.Table, Shard]:
        """Sample, judge and score `prompts` with `seed` (the backend's current weights); append the
        rows as one shard (with `also`'s tables, by table name, in the same commit); return them and
        the rollouts shard."""
        table = generate_step(self.backend.model_dir, prompts, replace(stamp, run_id=self.run_id),
                              replace(self.config, seed=seed), backend=self.backend, reward_pool=self.pool,
                              timings=phases)
        clock = Stopwatch(phases)
        shard = self.buf.append_rollouts(table, source=source, compact=self.compact, also=also)
        clock.lap("append")
        return table, shard

    def curate(self, step: int, progress: float, phases: dict[str, float] | None = None) -> CurationResult:
        """One curation of exactly `step`'s rows at schedule position `progress`."""
        clock = Stopwatch(phases)
        cur = curate(self.buf, self.recipe, {**self.sets, "where": step_where(self.run_id, step),
                                             "progress": str(progress)}, session=self.session)
        clock.lap("curation")
        return cur

    def committed(self, step: int, trained: set[str]) -> CurationResult | None:
        """The step's committed curation that the run has not trained (none of its curated shards in
        `trained`, the run's consumed shard paths), to be trained instead of a new one: the newest of
        this writer's recipe. Every other untrained curation of the step is retired (one commit), so
        nothing of the step is left pending for the run. None when the step has no such curation."""
        from rollstore.learner.consume import shard_curation_id

        buf = self.buf
        with buf.snapshot() as snap, Session(snap) as s:
            rel = s.execute(load_sql("loop_step_curations"), {"where": step_where(self.run_id, step)})
            names = [d[0] for d in rel.description]
            records = [dict(zip(names, row)) for row in rel.fetchall()]
        curated: dict[str, list[Shard]] = {}
        for shard in buf.manifest.shards("curated"):
            curated.setdefault(shard_curation_id(shard), []).append(shard)
        pending = [r for r in records if not any(sh.path in trained for sh in curated.get(r["curation_id"], []))]
        keep = next((r for r in pending if r["recipe"] == self.recipe.name), None)
        stale = [r["curation_id"] for r in pending if r is not keep]
        if stale:
            shards = [sh for sh in buf.manifest.shards("curations") if sh.key in stale]
            shards += [sh for cid in stale for sh in curated.get(cid, [])]
            retire(buf.manifest, shards, "retire", {"curations": stale, "why": f"{self.run_id} step {step} resumed"})
        if keep is None:
            return None
        return CurationResult(keep["curation_id"], keep, {}, int(keep["snapshot_seq"]), committed=True,
                              already_existed=True)
