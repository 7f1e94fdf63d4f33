"""The Python front door's buffer handle: `rollstore.open(path)` → `Buffer`.

One object a user holds, as DuckDB's connection or TorchRL's replay buffer: `sql`, `generate`,
`curate`, `train`, and `curation(id)` for a curation handle (rollstore/curation.py). A thin layer
over the packages below, with the defaults of `rollstore/rules/defaults.py`. The command line is a
client of this door: `rollstore curate`, `train` and `generate` call these methods (with a console
to print to), so both doors assemble a curation, a training run or a generation in one place.

Invariants:
- Nothing prints to stdout (unless the handle was made with a console: the command line's);
  every method returns a value (Polars / Arrow, or a handle). The first
  build of `builtin:tiny` writes one progress line to stderr (as the command line does).
- Every failure is one typed `RollstoreError` (`NotABuffer`, `UnknownRecipe`, `UnknownParameter`,
  `UnknownCuration`, `SqlRefused`, `OptionError`, ...) whose text is the command line's line for the
  same mistake, with a did-you-mean where a known name is close.
- Every keyword the command line checks is checked here by the same rule object
  (`rollstore.rules`: ranges, types, NaN, zero) before a buffer is opened: a refused value writes
  nothing (`buf.train(cur, epochs=0)` is an `OptionError`, not a checkpoint trained 0 steps).
- The handle holds no open connection between calls: each call opens the manifest, reads or
  commits, and closes it, so a handle can live in a notebook for hours beside other writers.
- `sql` runs in this process under the command line's sandbox (read-only, the buffer's files only),
  its views and macros (queries/views.sql), a DuckDB memory limit and a timeout.
"""

from __future__ import annotations

import io
import os
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from rollstore import rules
from rollstore.rules.defaults import CURATE, GENERATE, SQL, TRAIN
from rollstore.storage.buffer import Buffer as _StorageBuffer
from rollstore.storage.errors import RollstoreError, unknown_curation

if TYPE_CHECKING:
    import polars as pl
    from rich.console import Console

    from rollstore.curation import Curation
    from rollstore.sqlresult import SqlResult


def open(path: str | os.PathLike, create: bool = False) -> "Buffer":  # noqa: A001 - the front door's verb
    """The buffer at `path` as a handle; with `create=True` the buffer is created when missing.

    A path without a buffer raises `NotABuffer` (one line, the command line's); `create=True` on a
    file or on a folder of other files is refused as `rollstore init` refuses it."""
    path = rules.text("open", "path", path)
    if not path:
        raise rules.OptionError("open: path: an empty path names no folder")
    if rules.flag("open", "create", create):
        _StorageBuffer.init(path).close()
    with _StorageBuffer.open(path) as buf:
        return Buffer(buf.root)


def _quiet():
    """A console that swallows what the command line would print (also inside Jupyter, where rich
    would otherwise render to the notebook whatever its file), and the command line's quiet
    settings for transformers' own progress bars and notices (set only where the user set none)."""
    from rich.console import Console

    for name, value in (("TRANSFORMERS_VERBOSITY", "error"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
                        ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")):
        os.environ.setdefault(name, value)
    return Console(file=io.StringIO(), soft_wrap=True, force_jupyter=False, force_terminal=False)


def _param_values(sets: Mapping[str, Any] | None, **more: Any) -> dict[str, Any]:
    """Recipe parameter overrides: `sets` (the command line's `--set name=value`, any name) and the
    keyword parameters, None meaning the parameter's "none"; a name given twice is refused."""
    if sets is not None and not isinstance(sets, Mapping):
        raise rules.OptionError(f"sets: {sets!r} is not a mapping of parameter names to values")
    values = {}
    for name, value in [*(sets or {}).items(), *more.items()]:
        name = rules.text("curate", "parameter name", name)
        if name in values:
            raise RollstoreError(f"parameter {name!r} given twice")
        values[name] = "none" if value is None else value
    return values


class Buffer:
    """A handle to one buffer directory (see `rollstore.open`)."""

    def __init__(self, root: str, console: "Console | None" = None):
        self.root = os.path.abspath(root)
        self._console = console  # where progress goes (the command line's); None: nowhere

    def _out(self) -> "Console":
        return self._console if self._console is not None else _quiet()

    @contextmanager
    def _open(self) -> Iterator[_StorageBuffer]:
        with _StorageBuffer.open(self.root) as buf:
            yield buf

    def __repr__(self) -> str:
        try:
            with self._open() as buf:
                m = buf.manifest
                seq = m.latest_seq()
                rows = sum(s.rows for s in m.shards("rollouts"))
                cur, ck = len(m.shards("curations")), len(m.shards("checkpoints"))
            return (f"<rollstore.Buffer {self.root!r}: {rows} rollouts, {cur} curations, {ck} checkpoints, "
                    f"snapshot {seq}>")
        except RollstoreError as exc:
            return f"<rollstore.Buffer {self.root!r}: unreadable ({exc})>"

    def __eq__(self, other) -> bool:
        return isinstance(other, Buffer) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    # ---- reading --------------------------------------------------------------------------

    def sql(self, query: str, *, snapshot: int | None = None, timeout: float = SQL.timeout,
            memory_limit: str = SQL.memory_limit) -> "SqlResult":
        """Run read-only SQL over a snapshot (default: the latest) with the tables and views of
        `rollstore sql` (docs/usage.md): `rollouts`, `curated`, `selections`, `curations`, `groups`,
        `prompts`, ... and the macros of queries/views.sql. Returns a `SqlResult` (`.pl()`,
        `.arrow()`, `.df()`). A refused or mistyped query raises one line (`SqlRefused`, ...)."""
        from rollstore.queries.session import Session, names_commits, parse_memory_limit
        from rollstore.sqlresult import SqlResult

        query = rules.text("sql", "query", query)
        rules.check("sql", rules.SQL, {"snapshot": snapshot, "timeout": timeout}, optional={"snapshot"})
        parse_memory_limit(rules.text("sql", "memory_limit", memory_limit))
        with self._open() as buf, buf.snapshot(snapshot, pin=True) as snap:
            snap.check_present()
            commits = snap.commits() if names_commits(query) else None
            with Session(snap, memory_limit) as session:
                table = session.run_user_sql(query, timeout=timeout or None, commits=commits)
            return SqlResult(table, query, snap.seq)

    def curations(self) -> "pl.DataFrame":
        """Every curation of the buffer, oldest first: id, recipe, when, progress, candidates, kept."""
        return self.sql("SELECT curation_id, recipe, created_at, snapshot_seq, progress, n_candidates, n_selected, "
                        "tokens_kept FROM curations ORDER BY created_at, curation_id").pl()

    def curation(self, curation_id: str | None = None) -> "Curation":
        """The handle of curation `curation_id` (default: the latest); an id this buffer does not
        hold raises `UnknownCuration` (with a did-you-mean when one is close)."""
        from rollstore.curation import Curation

        curation_id = rules.text("curation", "curation_id", curation_id, optional=True)
        with self._open() as buf:
            shards = buf.manifest.shards("curations")
            known = [s.key for s in shards]
        if curation_id is None:
            if not known:
                raise RollstoreError("the buffer has no curations yet: run `rollstore curate` first")
            return Curation(self, self.sql("SELECT curation_id FROM curations ORDER BY created_at DESC, "
                                           "curation_id DESC LIMIT 1").fetchall()[0][0])
        if curation_id not in known:
            raise unknown_curation(self.root, curation_id, known)
        return Curation(self, curation_id)

    # ---- the three jobs of the command line -----------------------------------------------

    def generate(self, *, prompts: str = GENERATE.prompts, model: str = GENERATE.model,
                 num_prompts: int | None = GENERATE.num_prompts, group_size: int = GENERATE.group_size,
                 steps: int = GENERATE.steps, max_new_tokens: int = GENERATE.max_new_tokens,
                 temperature: float = GENERATE.temperature, top_p: float = GENERATE.top_p, seed: int = GENERATE.seed,
                 run_id: str = GENERATE.run_id, policy_version: int | None = None, backend: str = GENERATE.backend,
                 template: str | None = None, compact_entropies: bool = False, follow: bool = False,
                 max_policy_lag: int = GENERATE.max_policy_lag, recipe: str = GENERATE.recipe,
                 sets: Mapping[str, Any] | None = None) -> "pl.DataFrame":
        """Sample `group_size` responses for each of `num_prompts` prompts per step, judge and score
        them, append one shard per step (as `rollstore generate`). With `follow`, the generator of the
        two-process loop: it loads each newly published checkpoint, waits while the learner is more
        than `max_policy_lag` versions behind, and curates each step with `recipe` and `sets`. `policy_version` defaults to the
        model's checkpoint version (a `BUFFER/checkpoints/vN` directory), else 0. Returns one row per
        written shard: step, policy_version, rows, tokens, path."""
        import polars as pl
        import pyarrow.parquet as pq

        from rollstore.loop.generate import GenerationConfig
        from rollstore.loop.generator import Follow, PromptSource, run_generate

        rules.check("generate", rules.GENERATE, {
            "num_prompts": num_prompts, "group_size": group_size, "steps": steps, "max_new_tokens": max_new_tokens,
            "temperature": temperature, "top_p": top_p, "seed": seed, "policy_version": policy_version},
            optional={"num_prompts", "policy_version"})
        for name, value in (("prompts", prompts), ("model", model), ("run_id", run_id)):
            rules.text("generate", name, value)
        rules.text("generate", "template", template, optional=True)
        rules.one_of("generate", "backend", backend, ("hf", "vllm"))
        rules.flag("generate", "compact_entropies", compact_entropies)
        rules.check("generate", rules.GENERATE, {"max_policy_lag": max_policy_lag})
        rules.text("generate", "recipe", recipe)
        if rules.flag("generate", "follow", follow):
            follow = Follow(max_policy_lag, recipe, _param_values(sets))
        elif sets:
            raise rules.OptionError("generate: sets: curation parameters go with follow=True")
        else:
            _param_values(sets)
            follow = None
        prompts, model = os.fspath(prompts), os.fspath(model)
        config = GenerationConfig(backend=backend, group_size=group_size, max_new_tokens=max_new_tokens,
                                  temperature=temperature, top_p=top_p, seed=seed)
        paths = run_generate(self.root, model, PromptSource(prompts, num_prompts, template), config, run_id, steps,
                             self._out(), policy_version=policy_version, compact=compact_entropies,
                             follow=follow)
        rows = []
        with self._open() as buf:
            by_path = {os.path.join(buf.root, s.path): s for s in buf.manifest.shards("rollouts")}
        for path in paths:
            shard = by_path.get(path) or by_path.get(os.path.join(self.root, path))
            meta = pq.read_table(path if os.path.isabs(path) else os.path.join(self.root, path),
                                 columns=["step", "policy_version"]).slice(0, 1).to_pylist()
            rows.append({"step": meta[0]["step"] if meta else None,
                         "policy_version": meta[0]["policy_version"] if meta else None,
                         "rows": shard.rows if shard else None, "tokens": shard.tokens if shard else None,
                         "path": path})
        return pl.DataFrame(rows, schema={"step": pl.Int64, "policy_version": pl.Int64, "rows": pl.Int64,
                                          "tokens": pl.Int64, "path": pl.Utf8})

    def curate(self, recipe: str, progress: float | None = None, *, snapshot: int | None = None,
               dry_run: bool = False, memory_limit: str = CURATE.memory_limit, timeout: float = CURATE.timeout,
               engine: str = CURATE.engine, scheduler: str | None = CURATE.scheduler,
               partitions: int | None = CURATE.partitions, sets: Mapping[str, Any] | None = None,
               **params) -> "Curation":
        """Run a recipe (a built-in name, a .toml or a .sql file) over a snapshot (default: the
        latest), as `rollstore curate`: `progress` is the schedule position t, every other keyword
        a recipe parameter (`sample_fraction=0.5`, `where="step > 2"`); `sets` gives parameters by
        name (`{"progress": "0.3"}`, any name, as `--set`). `engine="dask"` runs it on
        dask.distributed (`scheduler`: an address or `local:N`; `partitions` of the batch), with the
        same result. Returns the curation's handle. An unknown recipe or parameter raises
        `UnknownRecipe` / `UnknownParameter`."""
        from rollstore.curate.options import Limits, engine_option
        from rollstore.curate.params import load_recipe
        from rollstore.curate.run import curate
        from rollstore.curation import Curation
        from rollstore.queries.session import parse_memory_limit

        recipe = rules.text("curate", "recipe", recipe)
        rules.check("curate", rules.CURATE, {"snapshot": snapshot, "timeout": timeout, "partitions": partitions},
                    optional={"snapshot", "partitions"})
        rules.flag("curate", "dry_run", dry_run)
        parse_memory_limit(rules.text("curate", "memory_limit", memory_limit))
        rules.one_of("curate", "engine", engine, ("embedded", "dask"))
        rules.text("curate", "scheduler", scheduler, optional=True)
        values = _param_values(sets, **params, **({} if progress is None else {"progress": progress}))
        chosen = engine_option(engine, scheduler, partitions)
        loaded = load_recipe(os.fspath(recipe))
        with self._open() as buf:
            result = curate(buf, loaded, values, snapshot, dry_run=dry_run,
                            limits=Limits(memory_limit, timeout=timeout or None), engine=chosen)
        return Curation(self, result.curation_id, result=result)

    def train(self, curation: "Curation | str | list | None" = None, *, model: str = TRAIN.model,
              loss: str = TRAIN.loss, lr: float = TRAIN.lr, epochs: int = TRAIN.epochs,
              micro_batch_size: int = TRAIN.micro_batch_size, grad_accum: int = TRAIN.grad_accum,
              run_id: str = TRAIN.run_id, keep_checkpoints: int | None = TRAIN.keep_checkpoints,
              follow: bool = False, poll: float = TRAIN.poll, max_idle: float = TRAIN.max_idle,
              parallel: str = TRAIN.parallel) -> "pl.DataFrame":
        """Train `model` on the curated shards of `curation` (a handle, an id, a list of them; default:
        every pending curation) exactly once each, publishing one checkpoint per curation, as
        `rollstore train`; only the newest `keep_checkpoints` versions of the run keep their files
        (None: all). With `follow`, the learner of the two-process loop: it leases curations as they
        appear, polling every `poll` seconds, until `max_idle` idle seconds (0: never). `parallel`:
        "ddp" / "fsdp" under torchrun. Returns one row per published checkpoint: version,
        curations, loss, tokens, path. Nothing curated raises one line."""
        import polars as pl

        from rollstore.learner.losses import LOSSES
        from rollstore.loop.learner_loop import check_curations, run_train
        from rollstore.rules.defaults import train_config

        rules.check("train", rules.TRAIN, {"lr": lr, "epochs": epochs, "micro_batch_size": micro_batch_size,
                                           "grad_accum": grad_accum, "keep_checkpoints": keep_checkpoints,
                                           "poll": poll, "max_idle": max_idle}, optional={"keep_checkpoints"})
        rules.one_of("train", "loss", loss, sorted(LOSSES))
        rules.one_of("train", "parallel", parallel, ("none", "ddp", "fsdp"))
        rules.flag("train", "follow", follow)
        rules.text("train", "model", model)
        rules.text("train", "run_id", run_id)
        ids = [self._curation_id(c) for c in (curation if isinstance(curation, (list, tuple)) else
                                              ([] if curation is None else [curation]))]
        if ids and "LOCAL_RANK" not in os.environ:  # (under torchrun: rank 0 of the launcher checked them)
            check_curations(self.root, ids)
        config = train_config(loss=loss, lr=lr, epochs=epochs, micro_batch_size=micro_batch_size,
                              grad_accum=grad_accum)
        cks = run_train(self.root, model, config, run_id, ids, self._out(), follow=follow, poll=poll,
                        max_idle=max_idle, parallel=parallel, keep_checkpoints=keep_checkpoints)
        return pl.DataFrame(
            [{"version": ck.version, "curation_ids": sorted({c["curation_id"] for c in ck.consumed}),
              "loss": ck.metrics.get("loss"), "tokens": ck.metrics.get("tokens"),
              "path": os.path.join(self.root, ck.path)} for ck in cks],
            schema={"version": pl.Int64, "curation_ids": pl.List(pl.Utf8), "loss": pl.Float64,
                    "tokens": pl.Int64, "path": pl.Utf8})

    def compare_runs(self, a: str, b: str, *, snapshot: int | None = None):
        """Runs `a` and `b` side by side (`rollstore compare`): a `Comparison` with `.runs`,
        `.heldout`, `.phases`, `.differ` (setting -> (a, b)) and `.text()`, the command's output."""
        from rollstore.report.compare import compare_runs

        with self._open() as buf:
            return compare_runs(buf, a, b, snapshot)

    def _curation_id(self, curation, command: str = "train", name: str = "curation") -> str:
        from rollstore.curation import Curation

        if isinstance(curation, Curation):
            if curation.buffer != self:
                raise RollstoreError(f"curation {curation.id} belongs to the buffer {curation.buffer.root}, "
                                     f"not {self.root}")
            return curation.id
        return rules.text(command, name, curation)


__all__ = ["Buffer", "open"]
