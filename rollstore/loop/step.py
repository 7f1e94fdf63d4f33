"""Generate, append, curate a step: written once, for the loop (`rollstore.loop`), the generator
process of the two-process mode (`rollstore generate --follow`) and the loop with an N-rank
learner (`rollstore.loop.ranks`, which runs that generator).

Invariants:
- `generate` samples one batch of a step with the loaded backend and reward pool and appends it
  as one shard, before it returns; the rows are stamped (run, step, policy version, prompt offset).
- `curate` commits one curation of exactly that step's rows (`where run_id = … AND step = i`) at
  schedule position `progress`, with the recipe and parameter overrides given once.
- Nothing here loads a model or starts a verifier pool: the caller owns them, and closes them.
"""

from __future__ import annotations

from dataclasses import replace

import pyarrow as pa

from rollstore.curate.params import load_recipe, step_where
from rollstore.curate.run import CurationResult, curate
from rollstore.rollout.backends import Backend
from rollstore.rollout.prompts import Prompt
from rollstore.rollout.reward import RewardPool
from rollstore.storage.buffer import Buffer
from rollstore.storage.manifest import Shard
from rollstore.storage.timing import Stopwatch

from .generate import GenerationConfig, StepStamp, generate_step


class StepWriter:
    """One run's steps into `buf`: sampled with `backend` (the caller loads each new version's
    weights into it), judged by `pool`, curated by `recipe` with `sets` (one DuckDB `session`
    for all the run's curations, when given)."""

    def __init__(self, buf: Buffer, backend: Backend, pool: RewardPool, config: GenerationConfig, run_id: str, *,
                 recipe: str = "d3s", sets: dict | None = None, session=None, compact: bool = False):
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
