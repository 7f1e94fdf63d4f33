"""The near-on-policy loop: generate → score → append → curate → train → publish v+1 → repeat.

Invariants:
- The buffer is the only channel: every iteration appends its rollouts, commits one curation of
  exactly that step's rows (`where run_id = … AND step = i`, `progress = i / K`) and publishes one
  checkpoint whose ledger is that curation's shards; the generator then loads that checkpoint.
- Generation always uses the newest published version, so with `max_policy_lag` the curation's
  staleness rule only ever drops rows of older versions (two-process mode shares this code).
- With a filtering recipe (`filter=dynamic`) the loop over-generates (`overgen`× the prompts per
  batch) and keeps generating batches of the same step until enough groups survive or
  `max_gen_batches` is reached, and then says so; with group replay (`replay=groups`) it does not:
  the curation replaces the filtered groups with stored ones.
- Replay recipes train rows of earlier steps again; the learner corrects their loss with the
  decoupled objective (learner.losses), on by default, which changes nothing for rows with no lag.
- With `pool_size` the prompts come from a finite pool, revisited once per epoch, so a prompt's
  pooled accuracy (DA3PO's q̂) has history from earlier visits.
- With pre-rollout prompt selection (`prompt_skip=greso`, curate.prompts) batch 0 of a step is the
  next prompts of the pool's stream that the selection generates, from where the previous step's
  selection stopped; every prompt examined is recorded in `prompt_selections`, in the same commit
  as the rollouts of the prompts it chose (a step killed before that commit leaves neither, and its
  re-run draws the same seeded decisions); a resumed step reuses its recorded decisions. Without it, batch 0 of step i is positions
  [i·P, (i+1)·P) of the stream, as before.
- Each curated batch is trained `train.epochs` passes (μ); the recipe's `epochs` and `lr` apply
  unless the caller set them (`LoopConfig.epochs`, `LoopConfig.lr`).
- Rerunning an interrupted loop resumes from the run's latest checkpoint (learner.consume):
  no curated shard is trained twice, and a step whose curation was committed before the
  interruption trains that curation, never a second one of the same rows (StepWriter.committed).
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa

from rollstore import rules
from rollstore.rules.defaults import RECIPE
from rollstore.curate.params import CurationError, ParamError, load_recipe, resolve
from rollstore.curate.prompts import prompt_plan
from rollstore.curate.run import CurationResult
from rollstore.learner.config import TrainConfig
from rollstore.queries.session import Session
from rollstore.loop.generate import GenerationConfig, StepStamp
from rollstore.storage.buffer import Buffer
from rollstore.storage.timing import Stopwatch


def _loop_generation(prompts: str) -> GenerationConfig:
    """The loop's sampling: up to 8 new tokens, or what a built-in task's responses need (builtin:chains: 40)."""
    from rollstore.builtin.resolve import task_max_new_tokens

    return GenerationConfig(max_new_tokens=task_max_new_tokens(prompts, 8))


def _loop_training() -> TrainConfig:
    return TrainConfig(lr=5e-5, warmup_steps=5, micro_batch_size=512)  # optimiser steps of 512 kept samples


@dataclass
class LoopConfig:
    """The loop: the sampling (`generation`; the loop derives each batch's seed from `seed` and
    scores in batches of `train.micro_batch_size`), the training (`train`), the curation
    (`recipe`, `sets`; replay recipes included), the prompts, the staleness bound and the
    evaluations."""

    buffer: str
    model: str = "builtin:tiny"
    prompts: str = "builtin:arith"
    iterations: int = 40
    recipe: str = RECIPE
    sets: dict = field(default_factory=dict)
    generation: GenerationConfig | None = None  # None: _loop_generation(prompts)
    train: TrainConfig = field(default_factory=_loop_training)
    prompts_per_iter: int = 128
    pool_size: int = 2048  # > 0: train on a fixed pool of this many prompts, in epochs (see _batch_prompts)
    max_policy_lag: int | None = None
    max_gen_batches: int = 8
    overgen: int = 2
    eval_every: int = 5
    eval_prompts: int = 500  # distinct held-out prompts
    eval_split: str = "heldout"
    eval_samples: int = 0  # > 0: each evaluation also samples this many responses per prompt (pass@k)
    eval_ks: tuple[int, ...] = (1, 8)
    seed: int = 0
    run_id: str | None = None
    threads: int | None = 1  # torch intra-op threads and the curations' DuckDB threads (None: either's default)
    epochs: int | None = None  # μ, passes per curated batch (None: the recipe's `epochs`, else train.epochs)
    lr: float | None = None  # None: the recipe's `lr`, else train.lr
    keep_checkpoints: int | None = None  # K: only the newest K versions keep their files (None: all; CLI default 3)
    compact_every: int = 100  # every N iterations, compact the small shards of the run so far (0: never; docs/loop.md)

    def retention(self) -> tuple[int, int] | None:
        """(K, replay window) for `learner.retention`: the window the recipe replays from, else 0."""
        if self.keep_checkpoints is None:
            return None
        from rollstore.learner.retention import Retention

        values = {**load_recipe(self.recipe).presets, **self.sets}
        window = int(values.get("replay_window", 2)) if str(values.get("replay", "none")) != "none" else 0
        Retention(self.keep_checkpoints, window)  # K < 1: one line, before anything runs
        return self.keep_checkpoints, window

    def __post_init__(self):
        if self.generation is None:
            self.generation = _loop_generation(self.prompts)

    def effective_train(self) -> TrainConfig:
        """`train` with μ and the learning rate this run uses: the caller's, else the recipe's."""
        recipe = load_recipe(self.recipe)
        epochs = self.epochs if self.epochs is not None else recipe.epochs
        lr = self.lr if self.lr is not None else recipe.lr
        changes = {k: v for k, v in (("epochs", epochs), ("lr", lr)) if v is not None}
        return dataclasses.replace(self.train, **changes) if changes else self.train

    @property
    def run_name(self) -> str:
        return self.run_id or f"loop-{self.recipe}-s{self.seed}"

    def check(self) -> None:
        """Every setting that can be checked without loading or writing anything: the model and
        prompts references (a did-you-mean for built-in names), the recipe and its parameters, and
        that greso has a pool to skip in. `rollstore loop` calls it before it creates the buffer."""
        from rollstore.builtin.resolve import check_refs

        check_refs(self.model, self.prompts)
        rules.check("loop", rules.LOOP, {"compact_every": self.compact_every})
        params = resolve(load_recipe(self.recipe), {k: v for k, v in self.sets.items() if k != "progress"})
        if params["prompt_skip"] == "greso" and not self.pool_size:
            raise ParamError("prompt_skip=greso needs a prompt pool (pool_size > 0): prompts seen once have no "
                             "history to skip by")

    def settings(self) -> dict:
        """What this run trains with, as `rollstore compare` and the loop's first lines show it: the
        recipe, μ and the learning rate in effect (and where each came from), the loss, the batch and
        the prompt pool."""
        recipe, train = load_recipe(self.recipe), self.effective_train()

        def origin(given, from_recipe) -> str:
            return "given" if given is not None else "recipe" if from_recipe is not None else "default"

        return {"run_id": self.run_name, "recipe": self.recipe, "sets": dict(self.sets),
                "epochs": train.epochs, "epochs_from": origin(self.epochs, recipe.epochs),
                "lr": train.lr, "lr_from": origin(self.lr, recipe.lr), "loss": train.loss,
                "prompts_per_iter": self.prompts_per_iter, "group_size": self.generation.group_size,
                "pool_size": self.pool_size, "iterations": self.iterations, "seed": self.seed,
                "max_policy_lag": self.max_policy_lag, "model": self.model, "prompts": self.prompts}

    def warnings(self) -> list[str]:
        """What the settings make pointless, in one line each: greso's skipped prompts come back only
        when the pool's stream passes them again, which a run shorter than one pass never does."""
        params = resolve(load_recipe(self.recipe), {k: v for k, v in self.sets.items() if k != "progress"})
        out = []
        if params["prompt_skip"] == "greso" and self.pool_size and \
                self.pool_size / self.prompts_per_iter >= self.iterations:
            out.append(f"prompt_skip=greso: the pool of {self.pool_size} prompts at {self.prompts_per_iter} an "
                       f"iteration takes {self.pool_size / self.prompts_per_iter:g} iterations to go round once, and "
                       f"the run has {self.iterations}: no prompt comes back, so nothing can be skipped (pass a "
                       "smaller --pool-size or more --iterations)")
        return out


@dataclass
class IterationReport:
    iteration: int
    version: int
    batch_accuracy: float
    rollouts: int
    gen_batches: int
    samples_kept: int
    tokens_kept: int
    tokens_candidate: int
    loss: float | None
    heldout: float | None
    seconds: float
    curation_id: str
    note: str = ""
    phases: dict = field(default_factory=dict)  # seconds per phase (see PHASES)
    positions: int = 0  # learner positions forwarded and backwarded (training.positions, summed over the steps)


# The phases of one iteration, in order, as `IterationReport.phases` and the loop profile name them.
PHASES = ("selection", "generation", "reward", "scoring", "append", "curation", "optimiser", "publish", "compaction",
          "evaluation", "other")


def _batch_prompts(cfg: LoopConfig, iteration: int, batch: int, n: int):
    """The n prompts of one generation batch.

    Without a pool, fresh prompts seeded by (seed, iteration, batch). With `pool_size` N, the run
    trains on a fixed pool of N prompts in epochs: batch 0 of iteration i takes positions
    [i·P, i·P + n) of an endless stream of seeded permutations of the pool (P = prompts_per_iter),
    so every prompt comes back once per epoch and recipes get the same batch 0 at every
    iteration; extra batches of a filtering recipe draw n prompts of the pool seeded by
    (seed, iteration, batch).
    """
    from rollstore.builtin.resolve import resolve_prompts

    if not cfg.pool_size:
        return resolve_prompts(cfg.prompts, n, seed=cfg.seed * 1_000_003 + iteration * 101 + batch, split="train")
    pool = _prompt_pool(cfg.prompts, cfg.pool_size, cfg.seed)
    if batch:
        rng = random.Random(f"pool-extra:{cfg.seed}:{iteration}:{batch}")
        return [pool[rng.randrange(len(pool))] for _ in range(n)]
    start = iteration * cfg.prompts_per_iter
    return [pool_prompt(cfg, pos) for pos in range(start, start + n)]


def pool_prompt(cfg: LoopConfig, position: int):
    """The prompt at `position` of the run's endless stream of seeded permutations of the pool."""
    pool = _prompt_pool(cfg.prompts, cfg.pool_size, cfg.seed)
    epoch, k = divmod(position, len(pool))
    return pool[_epoch_order(len(pool), cfg.seed, epoch)[k]]


@functools.lru_cache(maxsize=8)
def _prompt_pool(ref: str, size: int, seed: int) -> tuple:
    from rollstore.builtin.resolve import resolve_prompts

    return tuple(resolve_prompts(ref, size, seed=seed, split="train"))


@functools.lru_cache(maxsize=64)
def _epoch_order(size: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(size))
    random.Random(f"pool-epoch:{seed}:{epoch}").shuffle(order)
    return tuple(order)


def heldout_prompts(cfg: LoopConfig):
    from rollstore.builtin.resolve import resolve_prompts

    return resolve_prompts(cfg.prompts, cfg.eval_prompts, seed=cfg.seed, split=cfg.eval_split)


def greedy_accuracy(backend, prompts, reward_pool, max_new_tokens: int) -> float:
    """Greedy (temperature 0) accuracy judged by math-verify."""
    gens = backend.generate([p.prompt for p in prompts], 1, max_new_tokens, temperature=0.0, seed=0)
    verdicts = reward_pool.rewards([p.gold_answer for p in prompts], [g[0].text for g in gens],
                                   [len(g[0].response_token_ids) for g in gens], None)
    return sum(1 for v in verdicts if v.correct) / len(prompts)


def sampled_metrics(backend, prompts, reward_pool, cfg: "LoopConfig") -> dict[str, float]:
    """pass@k (unbiased) and avg@n from cfg.eval_samples samples per prompt at the sampling temperature."""
    from rollstore.learner.passk import summarize

    n = cfg.eval_samples
    g = cfg.generation
    gens = backend.generate([p.prompt for p in prompts], n, g.max_new_tokens, temperature=g.temperature,
                            seed=cfg.seed * 7919 + 104729)  # the same draws at every evaluation: differences are the model's
    flat = [x for g in gens for x in g]
    verdicts = reward_pool.rewards([p.gold_answer for p, g in zip(prompts, gens) for _ in g], [x.text for x in flat],
                                   [len(x.response_token_ids) for x in flat], None)
    correct = [[v.correct for v in verdicts[i * n:(i + 1) * n]] for i in range(len(prompts))]
    return summarize(correct, [k for k in cfg.eval_ks if k <= n])


def record_eval(buf: Buffer, run_id: str, version: int, iteration: int, split: str, metrics: dict,
                n_problems: int, n_samples: int) -> None:
    import datetime as dt

    now = dt.datetime.now(dt.timezone.utc)
    rows = [{"eval_id": uuid.uuid4().hex, "created_at": now, "run_id": run_id, "policy_version": version,
             "iteration": iteration, "split": split, "metric": k, "value": float(v),
             "n_problems": n_problems, "n_samples": n_samples} for k, v in metrics.items()]
    from rollstore.storage.schema import EVALUATIONS

    buf.append("evaluations", pa.Table.from_pylist(rows, schema=EVALUATIONS))


def _step_rollouts(buf: Buffer, run_id: str, step: int) -> int:
    from rollstore.queries.session import Session

    with buf.snapshot() as snap, Session(snap) as s:
        return int(s.one("SELECT count(*) FROM rollouts WHERE run_id = $r AND step = $s", {"r": run_id, "s": step})[0])


def _accuracy_of(tables: list[pa.Table]) -> tuple[float, int]:
    """(mean of `correct`, unjudged counted wrong; rows) over freshly generated tables."""
    n = sum(t.num_rows for t in tables)
    right = sum(sum(1 for c in t.column("correct").to_pylist() if c) for t in tables)
    return (right / n if n else 0.0), n


def _surviving_groups(table: pa.Table) -> int:
    """Groups whose judged accuracy is strictly between 0 and 1 (what dynamic sampling keeps)."""
    stats: dict[str, list[int]] = {}
    for gid, correct in zip(table.column("group_id").to_pylist(), table.column("correct").to_pylist()):
        s = stats.setdefault(gid, [0, 0])
        if correct is not None:
            s[0] += 1
            s[1] += bool(correct)
    return sum(1 for n, k in stats.values() if 0 < k < n)


def run_loop(cfg: LoopConfig, on_iteration: Callable[[IterationReport], None] | None = None,
             on_eval: Callable[[int, int, float], None] | None = None) -> dict:
    """Run cfg.iterations iterations (resuming a run that already has checkpoints). Returns a summary."""
    import torch

    previous_threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, on_iteration, on_eval)
    finally:
        torch.set_num_threads(previous_threads)


def _run(cfg: LoopConfig, on_iteration, on_eval) -> dict:
    """run_loop's body, under the chosen thread count."""
    from rollstore.learner.checkpoint import latest_checkpoint
    from rollstore.learner.consume import resume
    from rollstore.learner.policy_loading import load_policy
    from rollstore.learner.trainer import make_optimizer
    from rollstore.rollout.backends import get_backend
    from rollstore.rollout.reward import RewardPool
    from rollstore.builtin.resolve import resolve_model
    from rollstore.loop.step import StepWriter

    run = _Run(cfg, on_iteration, on_eval)
    buf = Buffer.open(cfg.buffer)
    base_dir = resolve_model(cfg.model)
    model, run.tokenizer = load_policy(base_dir)
    optimizer, scheduler = make_optimizer(model, lr=run.train_config.lr, warmup_steps=run.train_config.warmup_steps)
    run.version, run.step = resume(buf, model, optimizer, scheduler, run.run_id)
    run.learner = (model, optimizer, scheduler)
    ck = latest_checkpoint(buf, run.run_id)
    start_iteration = ck.metrics.get("iteration", -1) + 1 if ck else 0
    # loaded once; later versions are synced in memory
    backend = get_backend(cfg.generation.backend, ck.dir if ck else base_dir)
    pool = RewardPool()
    # One DuckDB connection for the run's curations, with the run's thread count: at a demo batch (1k rows)
    # DuckDB's second thread only schedules, ~5 ms of a 70 ms curation (bench/RESULTS.md, issue 37's fifth session).
    session = Session(buf.snapshot(), threads=cfg.threads, long_lived=True)
    run.session = session
    generation = dataclasses.replace(cfg.generation, score_batch_size=run.train_config.micro_batch_size)
    run.writer = StepWriter(buf, backend, pool, generation, run.run_id, recipe=cfg.recipe, sets=run.sets,
                            session=session)
    run.heldout = heldout_prompts(cfg) if cfg.eval_every else []
    try:
        if run.heldout and start_iteration == 0:
            run.evaluate(0)
        for it in range(start_iteration, cfg.iterations):
            run.iteration(it, resumed=it == start_iteration)
    finally:
        session.close()
        pool.close()
        buf.close()
    return {"run_id": run.run_id, "iterations": [dataclasses.asdict(r) for r in run.reports], "evals": run.evals,
            "eval_metrics": run.eval_metrics, "version": run.version, "skips": run.skips,
            "epochs": run.train_config.epochs, "lr": run.train_config.lr}


class _Run:
    """The state of one run_loop call across iterations (the learner, the writer, the reports)."""

    def __init__(self, cfg: LoopConfig, on_iteration, on_eval):
        self.cfg, self.on_iteration, self.on_eval = cfg, on_iteration, on_eval
        self.run_id = cfg.run_name
        self.sets = dict(cfg.sets)
        if cfg.max_policy_lag is not None:
            self.sets.setdefault("max_policy_lag", str(cfg.max_policy_lag))
        effective = resolve(load_recipe(cfg.recipe), {k: v for k, v in self.sets.items() if k != "progress"})
        self.params = effective
        self.train_config = cfg.effective_train()
        self.retention = cfg.retention()
        self.merged: set[int] = set()  # the shards this process's compactions wrote (`compact_history`)
        self.settings = cfg.settings()
        # Group replay fills the filter's gaps from the buffer instead of generating more (docs/replay.md).
        self.filtering = effective["filter"] == "dynamic" and effective["replay"] != "groups"
        self.skipping = prompt_plan(effective)  # pre-rollout prompt selection's plan, or None
        if self.skipping and not cfg.pool_size:
            raise ParamError("prompt_skip=greso needs a prompt pool (pool_size > 0): prompts seen once have no "
                             "history to skip by")
        cfg.check()
        self.reports: list[IterationReport] = []
        self.evals: list[tuple[int, int, float]] = []
        self.eval_metrics: list[dict] = []
        self.skips: list[tuple[int, int, int]] = []  # (step, prompts skipped, prompts examined)

    def evaluate(self, iteration: int) -> float:
        cfg, backend, pool, heldout = self.cfg, self.writer.backend, self.writer.pool, self.heldout
        acc = greedy_accuracy(backend, heldout, pool, cfg.generation.max_new_tokens)
        metrics = {"greedy_accuracy": acc}
        if cfg.eval_samples:
            metrics.update(sampled_metrics(backend, heldout, pool, cfg))
        record_eval(self.writer.buf, self.run_id, self.version, iteration, cfg.eval_split, metrics, len(heldout),
                    max(1, cfg.eval_samples))
        self.evals.append((iteration, self.version, acc))
        self.eval_metrics.append({"iteration": iteration, "version": self.version, **metrics})
        if self.on_eval:
            self.on_eval(iteration, self.version, acc)
        return acc

    def select_prompts(self, it: int, n: int, phases: dict) -> tuple[list, pa.Table | None]:
        """Batch 0 of step `it` under pre-rollout prompt selection, and the decisions to commit with its
        rollouts: the step's recorded decisions if it has some (a resumed step: nothing new to
        commit), else a new selection. Decisions and rollouts share one commit, so a step killed
        before it leaves neither, and its re-run draws the same decisions (they are seeded)."""
        from rollstore.curate.prompts import select, state

        clock = Stopwatch(phases)
        cfg = self.cfg
        # The session reads a snapshot that holds every earlier step: the run's start, or the snapshot
        # the previous step's curation was bound to (taken after that step's rows and selection).
        now = state(self.session, self.run_id, it, self.skipping)
        if now.recorded:
            clock.lap("selection")
            return [pool_prompt(cfg, pos) for pos in now.recorded], None
        start = it * cfg.prompts_per_iter if now.last_position is None else now.last_position + 1
        sel = select(self.session, self.skipping, run_id=self.run_id, step=it, seed=cfg.seed,
                     stream=lambda pos: pool_prompt(cfg, pos), start=start, need=n, limit=cfg.pool_size,
                     rates=now.rates)
        self.skips.append((it, sel.skipped, len(sel.rows)))
        clock.lap("selection")
        return sel.chosen, sel.table()

    def generate(self, it: int, phases: dict) -> tuple[list[pa.Table], str]:
        """Step `it`'s batches (more than one only with a filtering recipe), appended; and a note."""
        cfg, generated = self.cfg, []
        n = cfg.prompts_per_iter * (cfg.overgen if self.filtering else 1)
        while True:
            batch = len(generated)
            decisions = None
            if self.skipping and batch == 0:
                prompts, decisions = self.select_prompts(it, n, phases)
            else:
                prompts = _batch_prompts(cfg, it, batch, n)
            table, _ = self.writer.generate(
                prompts, StepStamp(self.run_id, it, self.version, prompt_offset=batch * n),
                cfg.seed * 7919 + it * 31 + batch, f"{self.run_id}/step-{it}/batch-{batch}", phases,
                also={"prompt_selections": decisions} if decisions is not None else None)
            generated.append(table)
            if not self.filtering:
                return generated, ""
            survived = sum(_surviving_groups(t) for t in generated)
            if survived >= cfg.prompts_per_iter:
                return generated, ""
            if len(generated) >= cfg.max_gen_batches:
                return generated, f"only {survived} groups survived after {len(generated)} batches"

    def train(self, it: int, cur: CurationResult, phases: dict) -> tuple[float | None, int]:
        """Train the curation once, publish it, load its weights into the sampler; its mean loss and
        learner positions."""
        from rollstore.learner.config import Pending, RunPosition, TrainContext
        from rollstore.learner.consume import train_pending

        model, optimizer, scheduler = self.learner
        published = train_pending(
            self.writer.buf, model, optimizer, scheduler, self.train_config,
            at=RunPosition(self.run_id, self.version, self.step), pending=Pending([cur.curation_id], per="curation"),
            tokenizer=self.tokenizer, context=TrainContext(timings=phases), retention=self.retention,
            # the iteration's seconds per phase so far (the optimiser's included: the metrics are written
            # after it) and the run's settings: what `rollstore compare` reads back
            extra_metrics={"iteration": it, "phases": phases, "settings": self.settings},
        )
        if not published:
            return None, 0
        clock = Stopwatch(phases)
        ck = published[-1]
        self.version, self.step = ck.version, ck.step
        backend = self.writer.backend
        if hasattr(backend, "sync_weights"):  # in-process sampler: the trained weights, no reload
            backend.sync_weights(model, ck.dir)
        else:
            backend.load_weights(ck.dir)
        clock.lap("other")
        return ck.metrics.get("loss"), sum(int(c.metrics.get("positions") or 0) for c in published)

    def resumed_curation(self, it: int) -> CurationResult | None:
        """Step `it`'s curation committed before an interruption and not yet trained into the run
        (StepWriter.committed): trained as it is, never curated again."""
        from rollstore.learner.checkpoint import consumed_ledger, latest_checkpoint

        buf = self.writer.buf
        ck = latest_checkpoint(buf, self.run_id)
        trained = {e["shard"] for e in consumed_ledger(buf, ck.version)} if ck else set()
        return self.writer.committed(it, trained)

    def iteration(self, it: int, resumed: bool) -> None:
        cfg, buf = self.cfg, self.writer.buf
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        generated, note = [], ""
        # Only the first iteration of a resumed run can find its rollouts already appended.
        if not resumed or _step_rollouts(buf, self.run_id, it) == 0:
            generated, note = self.generate(it, phases)
        cur = self.resumed_curation(it) if resumed else None
        if cur is None:
            cur = self.writer.curate(it, it / cfg.iterations, phases)
        refused = cur.refusal()
        if refused:  # nothing of the step can be trained: stop rather than publish an untrained version
            raise CurationError(f"run {self.run_id}, iteration {it} (curation {cur.curation_id}): {refused}; "
                                "the loop stopped")
        loss, positions = self.train(it, cur, phases)
        clock = Stopwatch(phases)
        if cfg.compact_every and (it + 1) % cfg.compact_every == 0:
            compact_history(buf, self.merged)
            clock.lap("compaction")
        batch_acc = _accuracy_of(generated) if generated else _batch_accuracy(buf, self.run_id, it)
        clock.lap("other")
        held = None
        if self.heldout and ((it + 1) % cfg.eval_every == 0 or it + 1 == cfg.iterations):
            held = self.evaluate(it + 1)
            clock.lap("evaluation")
        rep = IterationReport(
            iteration=it, version=self.version, batch_accuracy=batch_acc[0], rollouts=batch_acc[1],
            gen_batches=len(generated), samples_kept=cur.record["n_selected"], tokens_kept=cur.record["tokens_kept"],
            tokens_candidate=cur.record["tokens_candidate"], loss=loss, heldout=held,
            seconds=time.perf_counter() - t0, curation_id=cur.curation_id, note=note, phases=phases,
            positions=positions,
        )
        self.reports.append(rep)
        if self.on_iteration:
            self.on_iteration(rep)


def compact_history(buf: Buffer, merged: set[int]) -> None:
    """Merge the small shards the steps left (rollouts, audits, prompt selections:
    `storage.maintenance.COMPACTABLE`), as `rollstore compact` does, leaving the shards of `merged`
    (this process's earlier compactions wrote them) and adding the ones it writes: a long run's
    commands (`report`, `info`, `verify`) then open a shard per table per N steps, not one per step,
    and each compaction rewrites about N steps' rows, never a merged tail again and again. The retired
    files stay until `gc` (readers pinned to older snapshots may still read them)."""
    from rollstore.storage.maintenance import COMPACTABLE, compact

    for table in COMPACTABLE:
        merged.update(compact(buf, table, leave=frozenset(merged)).written)


def _batch_accuracy(buf: Buffer, run_id: str, step: int) -> tuple[float, int]:
    from rollstore.queries.session import Session

    with buf.snapshot() as snap, Session(snap) as s:
        acc, n = s.one("SELECT avg(coalesce(correct, false)::DOUBLE), count(*) FROM rollouts "
                       "WHERE run_id = $r AND step = $s", {"r": run_id, "s": step})
    return float(acc or 0.0), int(n)
