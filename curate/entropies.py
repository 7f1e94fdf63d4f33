"""The selected rows' entropies, read from their input shards for the curation's kernels: decoded
once per session or task into score chunks (`scored_chunks`), past a size spilled to one Arrow file
the run removes (`spill`, `release`), and read at the rows' positions for the materialisation
(`entropies_at`). `curate.kernels` registers the kernels that use them.

Invariants:
- Only the `entropies` column is read, only in the row groups holding a selected row
  (`storage.references.column_at`); no entropies pass through DuckDB.
- The entropies are the rows' own: each selected row's (input shard, position) is the one the
  candidates' scan read (`work.filename`, `work.rollouts_row`), in the pinned snapshot; a spill file
  holds the same values read from the same rows, so a spilled run gives the same bytes.
- Memory holds at most SCORED_CACHE_TOKENS decoded tokens, or one chunk (SCORED_ROWS rows) of a spill
  file, or one shard's rows of it; `release` closes and removes a run's spill files.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from rollstore.storage.references import column_at

from .tokens import SCORED_CACHE_TOKENS, SCORED_ROWS, scored

ENTROPIES = pa.list_(pa.float32())


def entropies_at(rows: pa.Table, spilled: str | None) -> pa.Array:
    """Each row's `entropies`, read from its input shard at its position (`shard_file`,
    `rollouts_row`): only the row groups holding a row, and only that column — or, when the run's
    token stage spilled (`values["entropies_spill"]`, `spill`), from that file, which holds the
    same values read from the same rows."""
    files = rows.column("shard_file").combine_chunks().dictionary_encode()
    codes = files.indices.to_numpy(zero_copy_only=False)
    positions = rows.column("rollouts_row").to_numpy(zero_copy_only=False)
    parts, order = [], []
    for k, path in enumerate(files.dictionary.to_pylist()):
        where = np.flatnonzero(codes == k)
        got = from_spill(spilled, path, positions[where]) if spilled else None
        parts.append(got if got is not None else
                     column_at(path, positions[where], "entropies", "the curation's materialisation"))
        order.append(where)
    if not parts:
        return pa.array([], ENTROPIES)
    column = pa.concat_arrays(parts).cast(ENTROPIES)
    if len(parts) > 1 or not np.array_equal(order[0], np.arange(rows.num_rows)):
        column = column.take(pa.array(np.argsort(np.concatenate(order), kind="stable")))
    return column


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


def from_spill(path: str, shard: str, positions: np.ndarray) -> pa.Array | None:
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
