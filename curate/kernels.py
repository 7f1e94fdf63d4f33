"""Kernel steps: the registered Python/numpy functions a plan runs beside its SQL steps.

A kernel turns a relation (an Arrow table holding at least the columns it `reads`) into the same
rows with the columns it `adds` (and without those it `drops`). A plan step names a kernel and its
arguments (`curate.plan`, `Step.kernel`, `Step.args`); `rollstore recipes --explain` shows it, and
the curation id hashes its name, version and arguments, as it hashes an SQL step's text.

A session kernel (`source` set: the token stage's `missing_entropies`, `token_histogram`,
`token_heads`, `tokens_kept`) reads a view of the session instead (`selected_rows`: the selected
rows with each one's input shard and position), whose entropies it reads from those shards with
pyarrow, once per session or task, decoded into float64 scores (`scored_chunks`; past
SCORED_CACHE_TOKENS from a spill file the run removes, `spill`, `release`); it returns a table
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

import contextlib
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa

from rollstore.storage.references import column_at, logprob_lists

from .params import CurationError
from .selection import PICKED_SCHEMA, max_variance
from .tokens import (
    HEADS_SCHEMA,
    MISSING_SCHEMA,
    SCORED_CACHE_TOKENS,
    SCORED_ROWS,
    first_missing,
    heads,
    histogram,
    keep_runs,
    kept_counts,
    scored,
)


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


def _keep_runs(rows: pa.Table, values: dict, args: dict) -> dict:
    return {"keep_runs": keep_runs(rows, args["token"], values)}


def _entropies(rows: pa.Table, values: dict, args: dict) -> dict:
    """Each row's `entropies`, read from its input shard at its position (`shard_file`,
    `rollouts_row`): only the row groups holding a row, and only that column — or, when the run's
    token stage spilled (`values["entropies_spill"]`, `spill`), from that file, which holds the
    same values read from the same rows."""
    files = rows.column("shard_file").combine_chunks().dictionary_encode()
    codes = files.indices.to_numpy(zero_copy_only=False)
    positions = rows.column("rollouts_row").to_numpy(zero_copy_only=False)
    spilled = values.get("entropies_spill")
    parts, order = [], []
    for k, path in enumerate(files.dictionary.to_pylist()):
        where = np.flatnonzero(codes == k)
        got = _from_spill(spilled, path, positions[where]) if spilled else None
        parts.append(got if got is not None else
                     column_at(path, positions[where], "entropies", "the curation's materialisation"))
        order.append(where)
    if not parts:
        return {"entropies": pa.array([], ENTROPIES)}
    column = pa.concat_arrays(parts).cast(ENTROPIES)
    if len(parts) > 1 or not np.array_equal(order[0], np.arange(rows.num_rows)):
        column = column.take(pa.array(np.argsort(np.concatenate(order), kind="stable")))
    return {"entropies": column}


def _fallback(rows: pa.Table, values: dict, args: dict) -> dict:
    flags, bad = logprob_lists(rows.column("shard_file"), rows.column("rollouts_row").to_numpy(),
                               rows.column("rollout_id"), values.get("finite_files", frozenset()))
    if bad is not None:
        rid, file, column = bad
        raise CurationError(f"{file}: row rollout_id={rid!r}: column {column!r} holds NaN or infinity; import "
                            "refuses such rows, so this shard reached the buffer another way: re-import it from its "
                            "source, or quarantine it")
    return {"fallback": pa.array(flags, pa.bool_())}


ENTROPIES = pa.list_(pa.float32())
# What the token stage's session kernels read: the selected rows, each with its input shard and
# position there (queries/curate_selected_rows.sql, a view of `work`); their entropies come from
# the shards (`scored_chunks`).
SELECTED = ("rollout_id", "advantage_final", "filename", "rollouts_row")

KERNELS: dict[str, Kernel] = {
    "entropies": Kernel(
        "entropies", "1", _entropies, ("shard_file", "rollouts_row"), (("entropies", ENTROPIES),),
        drops=("entropies",), shard_columns=("entropies",),
        doc="each row's entropies, read from its input shard at its position (only the row groups holding a "
            "row, only that column; storage/references.py column_at)"),
    "keep_runs": Kernel(
        "keep_runs", "1", _keep_runs, ("rollout_id", "advantage", "tokens", "entropies"),
        (("keep_runs", pa.list_(pa.int32())),), drops=("entropies",),
        doc="the loss mask as kept runs [s0, e0, s1, e1, …] from the entropies and $thr, $thr_rollout, $thr_pos "
            "(curate/tokens.py keep_runs; the predicate of tokens_kept)"),
    "fallback": Kernel(
        "fallback", "1", _fallback, ("shard_file", "rollouts_row", "rollout_id"),
        (("fallback", pa.bool_()),), shard_columns=("old_logprobs", "gen_logprobs"),
        doc="whether the row has no old_logprobs (the rollouts shards' column statistics; the column is decoded "
            "only in row groups that may hold a null), and refuses NaN/inf log-probs "
            "(storage/references.py logprob_lists)"),
    # A session kernel of the selection: reads `work` as Arrow, writes `picked`.
    "max_variance": Kernel(
        "max_variance", "1", max_variance, ("rollout_id", "reason", "advantage_final"),
        tuple((f.name, f.type) for f in PICKED_SCHEMA), source="work", into="picked", scores=False,
        values=("f_num", "f_den"),
        doc="cross-group selection: the maximum-variance subset of the whole pool, S_j = first j ∪ last m − j "
            "rows in (v desc, rollout_id asc) order, ties within V*·(1 − 1e-9) − 1e-12 to the smallest "
            "|2j − m| (curate/selection.py; queries/curate_select.sql for per-group pools)"),
    # Session kernels of the token stage: they read the selected rows (`selected_rows`) with their
    # entropies, read from the shards and decoded once per session or task (`scored_chunks`), and
    # return a GLOBAL step's partial or a temp table.
    "missing_entropies": Kernel(
        "missing_entropies", "1", first_missing, SELECTED, tuple((f.name, f.type) for f in MISSING_SCHEMA),
        source="selected_rows", shard_columns=("entropies",),
        doc="the input check: the first selected row (by rollout_id) whose entropies are null or hold NaN or "
            "infinity, with its input shard (curate/tokens.py first_missing)"),
    "token_histogram": Kernel(
        "token_histogram", "1", histogram, SELECTED,
        (("bucket", pa.int64()), ("n", pa.int64())), source="selected_rows", shard_columns=("entropies",),
        doc="threshold pass 1: tokens per bucket of the float64 score |A|·H or H (64 per octave, from the "
            "score's bits: monotone), highest first (curate/tokens.py histogram)"),
    "token_heads": Kernel(
        "token_heads", "1", heads, SELECTED,
        tuple((f.name, f.type) for f in HEADS_SCHEMA), source="selected_rows", shard_columns=("entropies",),
        doc="threshold pass 2: the first $n tokens of bucket $bucket in (score desc, rollout_id asc, position "
            "asc) order (curate/tokens.py heads)"),
    "tokens_kept": Kernel(
        "tokens_kept", "1", kept_counts, SELECTED,
        (("rollout_id", pa.string()), ("tokens_kept", pa.int32())), source="selected_rows",
        shard_columns=("entropies",), into="kept_counts",
        doc="tokens kept per selected row: score > $thr, or = $thr and (rollout_id, position) not after "
            "($thr_rollout, $thr_pos) (curate/tokens.py kept_counts; kept_expression's predicate)"),
}


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


def scored_chunks(session, relation: str, token: str, cache: dict):
    """The selected rows of `relation` (a view of the session: rollout_id, advantage_final and each
    row's input shard and position) with their entropies read from the shards (`read_scored`),
    decoded into score chunks (`curate.tokens.scored`); kept in `cache` for the next kernel of the
    same run while they hold at most SCORED_CACHE_TOKENS tokens. Past that, the rows' entropies are
    read from the shards once more, written uncompressed to an Arrow file in the session's spill
    folder (`spill`), and every pass of the run reads them from there, one chunk at a time (memory
    stays one chunk's; the shards' Parquet is decoded twice in all, not once per pass); the
    materialisation's kernel `entropies` reads its rows from it too. `release` removes the file
    when the curation ends (`drop_chunks`, at the run's next SQL step, keeps it)."""
    key = (relation, token)
    if key in cache:
        got = cache[key]
        return _replayed(got, token) if isinstance(got, str) else got
    rows = session.relation(relation).to_arrow_table()
    chunks, tokens = [], 0
    for chunk in read_scored(rows, token):
        tokens += len(chunk.score)
        if tokens > SCORED_CACHE_TOKENS:
            chunks.clear()
            cache[key] = spill(rows, session.spill_dir)
            return _replayed(cache[key], token)
        chunks.append(chunk)
    cache[key] = chunks
    return chunks


SPILL_COLUMNS = ("rollout_id", "advantage_final", "entropies")
_spills: dict[str, tuple] = {}  # an open spill file: (the file, its IPC reader, {input shard: its record batches})


def _from_spill(path: str, shard: str, positions: np.ndarray) -> pa.Array | None:
    """`entropies` of input shard `shard` at `positions` from spill file `path`, or None when it
    does not hold every one of them (the caller reads the shard instead). Only that shard's record
    batches are read (the file holds each shard's rows in batches of their own), not mapped: the
    process's memory holds one shard's rows at a time, whatever the file's size."""
    if path not in _spills:
        if not os.path.exists(path):
            return None
        source = pa.OSFile(path)  # open until `release`
        reader = pa.ipc.open_file(source)
        batches: dict[str, list[int]] = {}
        for i in range(reader.num_record_batches):
            name = reader.get_batch(i).column("filename")[0].as_py()
            batches.setdefault(name, []).append(i)
        _spills[path] = (source, reader, batches)
    _, reader, batches = _spills[path]
    if shard not in batches:
        return None
    table = pa.Table.from_batches([reader.get_batch(i) for i in batches[shard]])
    rows_at = table.column("rollouts_row").to_numpy(zero_copy_only=False)
    order = np.argsort(rows_at, kind="stable")
    have = rows_at[order]
    at = np.searchsorted(have, positions)
    if len(positions) and (at.max() >= len(have) or not np.array_equal(have[at], positions)):
        return None
    return table.column("entropies").take(pa.array(order[at])).combine_chunks()


def spill(rows: pa.Table, folder: str) -> str:
    """The selected rows' (rollout_id, advantage_final, entropies, filename), entropies read from
    the shards (`read_entropies`), written to a new Arrow IPC file in `folder`; returns its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"selected-entropies-{uuid.uuid4().hex[:12]}.arrow")
    schema = pa.schema([("rollout_id", pa.string()), rows.schema.field("advantage_final"),
                        ("entropies", pa.list_(pa.float32())), ("filename", pa.string()),
                        ("rollouts_row", pa.int64())])
    try:
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for filename, batch in read_entropies(rows):  # values as read: the same scores as without a spill
                writer.write_table(pa.table({
                    "rollout_id": batch.column("rollout_id").cast(pa.string()),
                    "advantage_final": batch.column("advantage_final"),
                    "entropies": batch.column("entropies").cast(pa.list_(pa.float32())),
                    "filename": pa.array([filename] * batch.num_rows, pa.string()),
                    "rollouts_row": batch.column("rollouts_row").cast(pa.int64())}, schema=schema))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return path


def _replayed(path: str, token: str):
    """Score chunks of a `spill` file, SCORED_ROWS rows at a time (read batch by batch, not mapped:
    memory holds one batch, however large the file)."""
    with pa.OSFile(path) as source:
        reader = pa.ipc.open_file(source)
        for i in range(reader.num_record_batches):
            batch = reader.get_batch(i)
            for start in range(0, batch.num_rows, SCORED_ROWS):
                part = batch.slice(start, SCORED_ROWS)
                yield scored(part.select(list(SPILL_COLUMNS)), token, part.column("filename")[0].as_py())


def drop_chunks(cache: dict) -> None:
    """Forget a run's decoded chunks (memory), keeping its spill file for the materialisation."""
    for key in [k for k, v in cache.items() if not isinstance(v, str)]:
        del cache[key]


def release(cache: dict) -> None:
    """Forget a run's decoded input; remove its spill files (at the end of the run)."""
    for value in cache.values():
        if isinstance(value, str):
            opened = _spills.pop(value, None)
            if opened is not None:
                opened[0].close()
            with contextlib.suppress(OSError):
                os.unlink(value)
    cache.clear()


def read_entropies(rows: pa.Table):
    """(input shard, rows of it with their `entropies`) for `rows` (SELECTED columns), shard by
    shard, SCORED_ROWS rows at a time: each shard's `entropies` at the rows' positions (only the row
    groups holding one, only that column: `storage.references.column_at`)."""
    if rows.num_rows == 0:
        return
    files = rows.column("filename").combine_chunks().dictionary_encode()
    codes = files.indices.to_numpy(zero_copy_only=False)

    def read(k: int, path: str):
        part = rows.take(pa.array(np.flatnonzero(codes == k)))
        return path, part, column_at(path, part.column("rollouts_row").to_numpy(zero_copy_only=False), "entropies",
                                     "the curation's token stage")

    for path, part, ents in _ahead(read, list(enumerate(files.dictionary.to_pylist()))):
        for start in range(0, part.num_rows, SCORED_ROWS):
            n = min(SCORED_ROWS, part.num_rows - start)
            yield path, pa.table({"rollout_id": part.column("rollout_id").slice(start, n),
                                  "advantage_final": part.column("advantage_final").slice(start, n),
                                  "entropies": ents.slice(start, n),
                                  "rollouts_row": part.column("rollouts_row").slice(start, n)})


READ_AHEAD = 2  # shards whose entropies are decoded on threads while the caller handles the current one


def _ahead(fn, items: list):
    """`fn(*item)` for each item, in order, up to READ_AHEAD of them computed ahead on threads
    (pyarrow decodes without the GIL): a one-shard read at a time left a core idle."""
    if len(items) <= 1:
        yield from (fn(*item) for item in items)
        return
    with ThreadPoolExecutor(max_workers=READ_AHEAD, thread_name_prefix="rollstore-entropies") as pool:
        pending = [pool.submit(fn, *item) for item in items[:READ_AHEAD]]
        for i in range(len(items)):
            result = pending.pop(0).result()
            if i + READ_AHEAD < len(items):
                pending.append(pool.submit(fn, *items[i + READ_AHEAD]))
            yield result


def read_scored(rows: pa.Table, token: str):
    """Score chunks of `rows` (SELECTED columns), input shard by input shard (`read_entropies`)."""
    for path, batch in read_entropies(rows):
        yield scored(batch, token, path)


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
