"""Kernel steps: the registered Python/numpy functions a plan runs beside its SQL steps.

A kernel turns a relation (an Arrow table holding at least the columns it `reads`) into the same
rows with the columns it `adds` (and without those it `drops`). A plan step names a kernel and its
arguments (`curate.plan`, `Step.kernel`, `Step.args`); `rollstore recipes --explain` shows it, and
the curation id hashes its name, version and arguments, as it hashes an SQL step's text.

A kernel is registered with `@register_kernel(name, version, reads, adds, ...)` on its function (or
`register_kernel(...)(fn)` for a function defined in curate/tokens.py or curate/selection.py), as a
loss is with `register_loss`. A session kernel (`source` set: the token stage's `missing_entropies`,
`token_histogram`, `token_heads`, `tokens_kept`) reads a view of the session instead
(`selected_rows`: the selected rows with each one's input shard and position), whose entropies
`curate.entropies` reads from those shards with pyarrow, once per session or task, decoded into
float64 scores (`scored_chunks`; past SCORED_CACHE_TOKENS from a spill file the run removes); it returns a table
of its declared columns: a GLOBAL step's partial result, handed to the step's merge, or the temp
table `into` (`kept_counts`). The runner runs it (`curate.steps.Runner.run` / `partial`), in
whichever task holds the rows. No entropies pass through DuckDB: the materialisation reads its
rows' entropies the same way (kernel `entropies`). A session kernel with `scores=False`
(`max_variance`, the cross-group selection) reads its source's rows as Arrow instead and writes
its temp table (`picked`); it runs where its step is placed (on the Dask client, for a `whole`
merge).

Invariants:
- `KERNELS` names every kernel a plan may use; both engines run a kernel step through `apply`
  (a session kernel through `run_session`) and nothing else (the embedded engine in its process, the Dask engine in the task that holds
  the rows), so both write the same bytes.
- `apply` checks the relation on the way in (every column the kernel reads is there) and on the
  way out (exactly the declared columns, of the declared types, one value per input row): a
  kernel that returns another shape stops the run with one line naming the step, and nothing is
  committed (the engines commit after every kernel step has run).
- The entropies a kernel reads are the rows' own: each selected row's (input shard, position) is
  the one the candidates' scan read (`work.filename`, `work.rollouts_row`), in the pinned snapshot.
- A change to what a kernel computes bumps its `version` (so every curation id that used it
  changes); a faster kernel with the same results keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pyarrow as pa

from rollstore.storage.references import logprob_lists

from .entropies import ENTROPIES, entropies_at, scored_chunks
from .params import CurationError
from .selection import PICKED_SCHEMA, max_variance
from .tokens import HEADS_SCHEMA, MISSING_SCHEMA, first_missing, heads, histogram, keep_runs, kept_counts


@dataclass(frozen=True)
class Kernel:
    name: str
    version: str
    fn: Callable[[pa.Table, dict, dict], dict]  # (rows with `reads`, run values, step args) -> {column: array}
    reads: tuple[str, ...]
    adds: tuple[tuple[str, pa.DataType], ...]
    drops: tuple[str, ...] = ()
    doc: str = ""  # one line for --explain
    source: str | None = None  # a session kernel: the table or view of the session it reads (else the rows handed to `apply`)
    into: str | None = None  # a session kernel: the temp table it writes (None: its result is a GLOBAL step's partial)
    shard_columns: tuple[str, ...] = ()  # columns it reads from the rows' input shards itself (pyarrow, not SQL)
    scores: bool = True  # a session kernel over the token scores of its source's rows (False: over its rows as Arrow)
    values: tuple[str, ...] = ()  # the run's $values it uses (--explain shows them)


KERNELS: dict[str, Kernel] = {}


def register_kernel(name: str, version: str, reads: tuple[str, ...], adds: tuple[tuple[str, pa.DataType], ...],
                    **declared) -> Callable[[Callable], Callable]:
    """Register a kernel under `name` (its `Kernel` fields: version, the columns it reads and adds,
    and `declared`'s); the decorated function is returned unchanged. A name registered twice is an error."""

    def decorate(fn: Callable) -> Callable:
        if name in KERNELS:
            raise ValueError(f"kernel {name!r} registered twice")
        KERNELS[name] = Kernel(name, version, fn, reads, adds, **declared)
        return fn

    return decorate


# What the token stage's session kernels read: the selected rows, each with its input shard and
# position there (queries/curate_selected_rows.sql, a view of `work`); their entropies come from
# the shards (`curate.entropies.scored_chunks`).
SELECTED = ("rollout_id", "advantage_final", "filename", "rollouts_row")


@register_kernel("entropies", "1", ("shard_file", "rollouts_row"), (("entropies", ENTROPIES),),
                 drops=("entropies",), shard_columns=("entropies",),
                 doc="each row's entropies, read from its input shard at its position (only the row groups holding "
                     "a row, only that column; storage/references.py column_at)")
def _entropies(rows: pa.Table, values: dict, args: dict) -> dict:
    """Each row's `entropies` at its input shard and position (`curate.entropies.entropies_at`; from
    the token stage's spill file when it spilled, `values["entropies_spill"]`)."""
    return {"entropies": entropies_at(rows, values.get("entropies_spill"))}


@register_kernel("keep_runs", "1", ("rollout_id", "advantage", "tokens", "entropies"),
                 (("keep_runs", pa.list_(pa.int32())),), drops=("entropies",),
                 doc="the loss mask as kept runs [s0, e0, s1, e1, …] from the entropies and $thr, $thr_rollout, "
                     "$thr_pos (curate/tokens.py keep_runs; the predicate of tokens_kept)")
def _keep_runs(rows: pa.Table, values: dict, args: dict) -> dict:
    return {"keep_runs": keep_runs(rows, args["token"], values)}


@register_kernel("fallback", "1", ("shard_file", "rollouts_row", "rollout_id"), (("fallback", pa.bool_()),),
                 shard_columns=("old_logprobs", "gen_logprobs"),
                 doc="whether the row has no old_logprobs (the rollouts shards' column statistics; the column is "
                     "decoded only in row groups that may hold a null), and refuses NaN/inf log-probs "
                     "(storage/references.py logprob_lists)")
def _fallback(rows: pa.Table, values: dict, args: dict) -> dict:
    flags, bad = logprob_lists(rows.column("shard_file"), rows.column("rollouts_row").to_numpy(),
                               rows.column("rollout_id"), values.get("finite_files", frozenset()))
    if bad is not None:
        rid, file, column = bad
        raise CurationError(f"{file}: row rollout_id={rid!r}: column {column!r} holds NaN or infinity; import "
                            "refuses such rows, so this shard reached the buffer another way: re-import it from its "
                            "source, or quarantine it")
    return {"fallback": pa.array(flags, pa.bool_())}


# A session kernel of the selection (its function in curate/selection.py): reads `work` as Arrow, writes `picked`.
register_kernel(
    "max_variance", "1", ("rollout_id", "reason", "advantage_final"), tuple((f.name, f.type) for f in PICKED_SCHEMA),
    source="work", into="picked", scores=False, values=("f_num", "f_den"),
    doc="cross-group selection: the maximum-variance subset of the whole pool, S_j = first j ∪ last m − j "
        "rows in (v desc, rollout_id asc) order, ties within V*·(1 − 1e-9) − 1e-12 to the smallest "
        "|2j − m| (curate/selection.py; queries/curate_select.sql for per-group pools)")(max_variance)
# Session kernels of the token stage (their functions in curate/tokens.py): they read the selected
# rows (`selected_rows`) with their entropies, read from the shards and decoded once per session or
# task (`curate.entropies.scored_chunks`), and return a GLOBAL step's partial or a temp table.
_TOKEN_STAGE = dict(source="selected_rows", shard_columns=("entropies",))
register_kernel(
    "missing_entropies", "1", SELECTED, tuple((f.name, f.type) for f in MISSING_SCHEMA), **_TOKEN_STAGE,
    doc="the input check: the first selected row (by rollout_id) whose entropies are null or hold NaN or "
        "infinity, with its input shard (curate/tokens.py first_missing)")(first_missing)
register_kernel(
    "token_histogram", "1", SELECTED, (("bucket", pa.int64()), ("n", pa.int64())), **_TOKEN_STAGE,
    doc="threshold pass 1: tokens per bucket of the float64 score |A|·H or H (64 per octave, from the "
        "score's bits: monotone), highest first (curate/tokens.py histogram)")(histogram)
register_kernel(
    "token_heads", "1", SELECTED, tuple((f.name, f.type) for f in HEADS_SCHEMA), **_TOKEN_STAGE,
    doc="threshold pass 2: the first $n tokens of bucket $bucket in (score desc, rollout_id asc, position "
        "asc) order (curate/tokens.py heads)")(heads)
register_kernel(
    "tokens_kept", "1", SELECTED, (("rollout_id", pa.string()), ("tokens_kept", pa.int32())), **_TOKEN_STAGE,
    into="kept_counts",
    doc="tokens kept per selected row: score > $thr, or = $thr and (rollout_id, position) not after "
        "($thr_rollout, $thr_pos) (curate/tokens.py kept_counts; kept_expression's predicate)")(kept_counts)


def signature(name: str, args: tuple[tuple[str, object], ...]) -> str:
    """What the curation id hashes of a kernel step: its name, version and arguments."""
    k = KERNELS[name]
    return f"kernel {k.name} version {k.version} " + " ".join(f"{a}={v!r}" for a, v in args)


def apply(step, table: pa.Table, values: dict) -> pa.Table:
    """`table` after kernel step `step`: its declared columns added (and dropped), checked."""
    k = KERNELS[step.kernel]
    where = f"kernel step {k.name} (version {k.version})"
    missing = [c for c in k.reads if c not in table.column_names]
    if missing:
        raise CurationError(f"{where}: its input has no column {missing[0]!r} "
                            f"(columns: {', '.join(table.column_names)}); nothing was committed (please report this)")
    out = k.fn(table.select(list(k.reads)), values, dict(step.args))
    got = sorted(out) if isinstance(out, dict) else None
    want = sorted(name for name, _ in k.adds)
    if got != want:
        shape = "columns " + ", ".join(got) if got is not None else type(out).__name__
        raise CurationError(f"{where}: returned {shape}, declared {', '.join(want)}; nothing was committed")
    table = table.drop_columns(list(k.drops))
    for name, dtype in k.adds:
        col = out[name]
        if not isinstance(col, (pa.Array, pa.ChunkedArray)) or len(col) != table.num_rows or col.type != dtype:
            arrow = isinstance(col, (pa.Array, pa.ChunkedArray))
            shape = f"{len(col)} values of {col.type}" if arrow else type(col).__name__
            raise CurationError(f"{where}: column {name!r}: returned {shape}, declared {table.num_rows} values of "
                                f"{dtype}; nothing was committed")
        table = table.append_column(name, col)
    return table


def run_session(step, session, values: dict, cache: dict) -> pa.Table:
    """Session kernel step `step` over its source table: its result (declared columns and types,
    checked), which the engine loads as `into` or hands to the step's merge."""
    k = KERNELS[step.kernel]
    where = f"kernel step {k.name} (version {k.version})"
    columns = session.relation(k.source).columns
    missing = [c for c in k.reads if c not in columns]
    if missing:
        raise CurationError(f"{where}: its input {k.source} has no column {missing[0]!r} "
                            f"(columns: {', '.join(columns)}); nothing was committed (please report this)")
    args = dict(step.args)
    if k.scores:
        out = k.fn(scored_chunks(session, k.source, args["token"], cache), values, args)
        spilled = cache.get((k.source, args["token"]))
        if isinstance(spilled, str):  # the materialisation reads the rows' entropies from it (`_entropies`)
            values["entropies_spill"] = spilled
    else:
        out = k.fn(session.relation(k.source).project(", ".join(f'"{c}"' for c in k.reads)).to_arrow_table(),
                   values, args)
    want = pa.schema(list(k.adds))
    if not isinstance(out, pa.Table) or not out.schema.equals(want):
        shape = str(out.schema).replace("\n", ", ") if isinstance(out, pa.Table) else type(out).__name__
        raise CurationError(f"{where}: returned {shape}, declared {want.to_string().replace(chr(10), ', ')}; "
                            "nothing was committed")
    return out
