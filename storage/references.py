"""Resolving thin curated shards: references to rollouts rows → the learner's rows (schema `CURATED`).

A curated shard (`CURATED_REFS`) holds, per selected row, the rollouts shard (its manifest path),
the row's position in that file and its rollout_id, plus the curation's numbers and the loss mask as
kept runs. This module turns such rows back into the columns a learner reads, by reading only the
row groups of the referenced shards that hold a referenced row.

Invariants:
- A reference resolves only when its rollouts shard is readable (live in the caller's snapshot,
  when the caller gives the live set; present on disk otherwise) AND the row at that position has
  the referenced rollout_id AND its response has `tokens` tokens; anything else is one
  `UnresolvedReference` line naming the curated shard, the rollouts shard and what to do. Nothing is
  ever resolved to a different row.
- Resolved rows come back in the order of the references; each referenced shard is opened once
  per call, and only its row groups that hold a referenced row are read.
- A reference to a rollouts shard that compaction (or migration) retired follows the manifest's
  `moved` chain (`storage.manifest`: row i of the old shard is row `row_offset + i` of the new
  one) to the shard that is live in the caller's snapshot (present on disk, without one), and is
  checked there as any other; a shard retired without a move (quarantined) does not resolve.
- A curated shard written before references (schema version 1: token lists inside) reads as it is.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .errors import NotABuffer, RollstoreError
from .schema import CURATED, CURATED_REFS

# The rollouts columns a reference brings back.
RESOLVED_COLUMNS = ("rollout_id", "prompt_token_ids", "response_token_ids", "gen_logprobs", "old_logprobs")


class UnresolvedReference(RollstoreError):
    """A curated row's reference does not resolve to its rollouts row."""


class UnreadableShard(RollstoreError):
    """A shard file that cannot be decoded (truncated, corrupt): one line naming the file."""


@contextlib.contextmanager
def reading(path: str):
    """Turn a decoding error of `path` (Arrow's "Parquet magic bytes not found", "ZSTD decompression
    failed", ...; an OSError) into one `UnreadableShard` line naming the file."""
    try:
        yield
    except (pa.ArrowException, OSError) as exc:
        root = _buffer_of(path)
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise UnreadableShard(f"{path}: shard cannot be read ({detail}); restore the file from a backup, or run "
                              f"`rollstore verify {root} --quarantine` to retire it") from None


def _buffer_of(path: str) -> str:
    """The buffer folder above `path` (the first one holding a manifest or a descriptor), else BUFFER."""
    folder = os.path.dirname(os.path.abspath(path))
    while True:
        if os.path.exists(os.path.join(folder, "manifest.sqlite")) or os.path.exists(os.path.join(folder, "catalog.json")):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return "BUFFER"
        folder = parent


def is_thin(schema: pa.Schema) -> bool:
    """Whether a curated shard's schema holds references (else: a materialised, version-1 shard)."""
    return "rollouts_row" in schema.names


def buffer_root_of(curated_path: str) -> str:
    """The buffer root of a curated shard at `<root>/curated/<curation_id>/<part>.parquet`."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(curated_path))))


def runs_to_mask(runs: pa.ChunkedArray | pa.Array, tokens: np.ndarray) -> pa.Array:
    """The loss masks (list<bool>, row i of length tokens[i]) of kept runs [s0, e0, s1, e1, ...]
    (each row's runs in order, disjoint, 0 ≤ s < e ≤ tokens[i]; an empty run keeps nothing)."""
    runs = runs.combine_chunks() if isinstance(runs, pa.ChunkedArray) else runs
    tokens = np.asarray(tokens, np.int64)
    offsets = np.zeros(len(tokens) + 1, np.int64)
    np.cumsum(tokens, out=offsets[1:])
    run_offsets = runs.offsets.to_numpy().astype(np.int64)  # of a slice: into the whole child array
    local = runs.values.to_numpy(zero_copy_only=False)[run_offsets[0]:run_offsets[-1]].astype(np.int64)
    run_offsets -= run_offsets[0]
    counts = np.diff(run_offsets)
    last = run_offsets[1:][counts > 0] - 1  # each row's last bound, its largest (runs in order)
    if np.any(counts % 2) or (len(local) and (local.min() < 0 or np.any(local[last] > tokens[counts > 0]))):
        raise ValueError("keep_runs: a row's runs are not pairs of bounds within its response tokens")
    bounds = local + np.repeat(offsets[:-1], counts)  # positions in the concatenated mask
    starts, ends = bounds[0::2], bounds[1::2]
    if np.any(ends < starts):
        raise ValueError("keep_runs: a run ends before it starts")
    if np.any(ends == starts):  # empty runs keep nothing (and would repeat a start)
        starts, ends = starts[ends > starts], ends[ends > starts]
    # +1 where a run starts, -1 where it ends: the running sum is 1 inside a run, 0 outside. With
    # runs in order and disjoint, starts are distinct and ends are distinct (a run may end where the
    # next begins: both apply). One byte per token; about twice as fast as repeating the segments
    # between bounds (bench/RESULTS.md, front door).
    delta = np.zeros(int(offsets[-1]) + 1, np.int8)
    delta[starts] += 1
    delta[ends] -= 1
    mask = np.cumsum(delta[:-1], dtype=np.int8).view(np.bool_)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(mask, pa.bool_()))


Moves = dict[str, tuple[str, int]]
_moves_seen: dict[str, Moves] = {}  # per buffer root: the `moved` rows last read (rows are only added)


def buffer_moves(root: str, fresh: bool = False) -> Moves:
    """The `moved` rows of the buffer at `root` (read once per process, again when `fresh`); none
    for a folder that is not a buffer (references read outside one)."""
    if fresh or root not in _moves_seen:
        from .catalog import open_manifest

        try:
            man = open_manifest(root)
        except NotABuffer:
            return {}
        try:
            _moves_seen[root] = man.moves()
        finally:
            man.close()
    return _moves_seen[root]


def locate(rel: str, root: str, live: set[str] | None, moves: Moves | None) -> tuple[str, int] | None:
    """(the rollouts shard to read the rows of `rel` from, the offset of its row 0 there), or None.

    With `live` (a snapshot's live rollouts paths): `rel` itself when live, else the first shard of
    its `moved` chain that is. Without: the last shard of the chain whose file is present (a
    compacted shard's file may still be on disk until gc; its rows are read where they are now).
    `moves`: the buffer's `moved` rows; when None, read from its manifest (again, fresh, when the
    process's copy finds nothing)."""
    def here(path: str) -> bool:
        return path in live if live is not None else os.path.exists(os.path.join(root, path))

    if live is not None and rel in live:
        return rel, 0
    for fresh in (None,) if moves is not None else (False, True):  # the cached rows, then the manifest's
        table = moves if fresh is None else buffer_moves(root, fresh)
        found = (rel, 0) if live is None and here(rel) else None
        path, offset = rel, 0
        for _ in range(len(table)):  # a chain never repeats a path: at most one hop per row
            if path not in table:
                break
            path, step = table[path]
            offset += step
            if here(path):
                found = (path, offset)
                if live is not None:
                    break
        if found is not None:
            return found
    return None


def _rows_of(path: str, positions: np.ndarray, source: str, columns=RESOLVED_COLUMNS) -> pa.Table:
    """Rows `positions` of one rollouts shard (`columns`), reading only their row groups."""
    with reading(path):
        return _read_rows(path, positions, source, columns)


COLUMN_CACHE_BYTES = 64 * 2**20  # the decoded columns `column_at` keeps for a process's next read of the same rows
_columns: "OrderedDict[tuple, tuple[np.ndarray, pa.Array]]" = OrderedDict()
_columns_bytes = 0  # the sum of the cached columns' nbytes
_columns_lock = threading.Lock()


def forget_columns() -> None:
    """Empty `column_at`'s cache. A curation calls it as it starts: the cache is for its own second
    read of the rows its token stage read, and a loop's process, which curates a new step's shards
    every iteration, would otherwise keep the last COLUMN_CACHE_BYTES of earlier steps' columns
    (its resident memory growing for the first thousand steps of a small run)."""
    global _columns_bytes
    with _columns_lock:
        _columns.clear()
        _columns_bytes = 0


def column_at(path: str, positions: np.ndarray, column: str, source: str) -> pa.Array:
    """Column `column` at rows `positions` of one rollouts shard (in that order), reading only the
    row groups that hold them; a decoding error is one `UnreadableShard` line naming the file.
    The token stage reads the selected rows' `entropies` with it (`curate.kernels`), and a full
    curation's materialisation reads the same rows again: the last reads (up to COLUMN_CACHE_BYTES,
    keyed by the file's path, size, times and inode, like the hash cache) are kept and answer any
    request for a subset of their rows, in any order, without decoding the file again."""
    positions = np.asarray(positions, np.int64)
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, column)
    with _columns_lock:
        hit = _columns.get(key)
        if hit is not None:
            _columns.move_to_end(key)
    if hit is not None:
        have, values = hit
        at = np.searchsorted(have, positions)
        if len(positions) == 0 or (at.max() < len(have) and np.array_equal(have[at], positions)):
            return values.take(pa.array(at))
    col = _rows_of(path, positions, source, (column,)).column(0)
    col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    if 0 < col.nbytes <= COLUMN_CACHE_BYTES // 4:
        order = np.argsort(positions, kind="stable")
        global _columns_bytes
        with _columns_lock:
            if not _columns:
                _columns_bytes = 0
            if key in _columns:
                _columns_bytes -= _columns.pop(key)[1].nbytes
            _columns[key] = (positions[order], col.take(pa.array(order)))
            _columns_bytes += _columns[key][1].nbytes
            while _columns_bytes > COLUMN_CACHE_BYTES and len(_columns) > 1:  # (a running total: a long run's cache holds thousands)
                _columns_bytes -= _columns.popitem(last=False)[1][1].nbytes
    return col


def _read_rows(path: str, positions: np.ndarray, source: str, columns) -> pa.Table:
    pf = pq.ParquetFile(path)
    sizes = np.array([pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)], np.int64)
    ends = np.cumsum(sizes)
    if len(positions) and (positions.min() < 0 or positions.max() >= (ends[-1] if len(ends) else 0)):
        raise UnresolvedReference(f"{source}: refers to row {int(positions.max())} of {path}, which has "
                             f"{int(ends[-1]) if len(ends) else 0} rows; curate again")
    groups = np.searchsorted(ends, positions, side="right")
    needed = np.unique(groups)
    starts_in_read = np.zeros(len(sizes), np.int64)
    starts_in_read[needed] = np.concatenate([[0], np.cumsum(sizes[needed])[:-1]])
    local = positions - (ends[groups] - sizes[groups]) + starts_in_read[groups]
    table = pf.read_row_groups([int(g) for g in needed], columns=list(columns))
    return table.take(pa.array(local))


def resolve(refs: pa.Table, root: str, live: Iterable[str] | None = None, source: str = "curated",
            moves: Moves | None = None) -> pa.Table:
    """The `CURATED` rows of references `refs` (CURATED_REFS columns), in their order.

    `root`: the buffer root the shard paths are under. `live`: the rollouts shard paths (relative,
    as the manifest records them) the caller's snapshot holds; a reference to any other shard (for
    example one quarantined after the curation) is refused unless it was moved (`locate`; `moves`:
    the buffer's `moved` rows, read from its manifest when None). `source` names the refs in errors."""
    n = refs.num_rows
    if n == 0:
        return CURATED.empty_table()
    live_set = set(live) if live is not None else None
    shards = refs.column("rollouts_shard").combine_chunks()
    positions = refs.column("rollouts_row").to_numpy().astype(np.int64)
    encoded = shards.dictionary_encode()
    names = encoded.dictionary.to_pylist()
    codes = encoded.indices.to_numpy(zero_copy_only=False)
    pieces, order = [], []
    for k, rel in enumerate(names):
        at = locate(rel, root, live_set, moves)
        if at is None or not os.path.exists(os.path.join(root, at[0])):
            raise UnresolvedReference(
                f"{source}: refers to rollouts shard {rel}, which is not live in the buffer (quarantined "
                f"or removed); this curation cannot be trained or exported: curate again")
        where = np.flatnonzero(codes == k)
        try:
            piece = _rows_of(os.path.join(root, at[0]), positions[where] + at[1], source)
        except UnreadableShard:
            if live_set is not None or os.path.exists(os.path.join(root, at[0])):
                raise
            at = locate(rel, root, None, None)  # gone meanwhile (gc after a compaction): where its rows are now
            if at is None:
                raise
            piece = _rows_of(os.path.join(root, at[0]), positions[where] + at[1], source)
        pieces.append(piece)
        order.append(where)
    fetched = pa.concat_tables(pieces)
    back = np.empty(n, np.int64)
    back[np.concatenate(order)] = np.arange(n)
    if not np.array_equal(back, np.arange(n)):  # references grouped by shard already need no reordering
        fetched = fetched.take(pa.array(back))
    wanted = refs.column("rollout_id")
    found = fetched.column("rollout_id")
    bad = pc.invert(pc.equal(wanted, found))
    if pc.any(bad).as_py():
        i = int(np.flatnonzero(bad.to_numpy(zero_copy_only=False))[0])
        raise UnresolvedReference(
            f"{source}: row {int(positions[i])} of rollouts shard {shards[i].as_py()} holds rollout_id="
            f"{found[i].as_py()!r}, the reference says {wanted[i].as_py()!r}; curate again")
    tokens = refs.column("tokens").to_numpy().astype(np.int64)
    lengths = pc.list_value_length(fetched.column("response_token_ids")).to_numpy(zero_copy_only=False)
    if not np.array_equal(lengths, tokens):
        i = int(np.flatnonzero(lengths != tokens)[0])
        raise UnresolvedReference(f"{source}: rollout_id={wanted[i].as_py()!r} has {int(lengths[i])} response "
                             f"tokens, the reference says {int(tokens[i])}; curate again")
    gen = fetched.column("gen_logprobs")
    columns = {
        "curation_id": refs.column("curation_id"),
        "rollout_id": refs.column("rollout_id"),
        "group_id": refs.column("group_id"),
        "prompt_id": refs.column("prompt_id"),
        "policy_version": refs.column("policy_version"),
        "prompt_token_ids": fetched.column("prompt_token_ids"),
        "response_token_ids": fetched.column("response_token_ids"),
        "old_logprobs": pc.coalesce(fetched.column("old_logprobs"), gen),
        "gen_logprobs": gen,
        "advantage": refs.column("advantage"),
        "loss_mask": runs_to_mask(refs.column("keep_runs"), tokens),
        "weight": refs.column("weight"),
    }
    return pa.table([columns[f.name] for f in CURATED], schema=CURATED)


def read_curated_file(path: str, root: str | None = None, live: Iterable[str] | None = None,
                      moves: Moves | None = None) -> pa.Table:
    """One curated shard's rows with the `CURATED` columns: a thin shard resolved (under `root`,
    default the buffer the path lies in; `live`, `moves` as `resolve`), a materialised one as stored."""
    with reading(path):
        table = pq.read_table(path)
    if not is_thin(table.schema):
        return table.select(CURATED.names).cast(CURATED)
    return resolve(table.select(CURATED_REFS.names).cast(CURATED_REFS), root or buffer_root_of(path), live,
                   str(path), moves)


def read_references(paths: Sequence[str]) -> list[pa.Table]:
    """The stored reference tables of thin curated shards `paths` (materialised ones are skipped)."""
    out = []
    for path in paths:
        pf = pq.ParquetFile(path)
        if is_thin(pf.schema_arrow):
            out.append(pf.read().select(CURATED_REFS.names).cast(CURATED_REFS))
    return out


def referenced_shards(paths: Sequence[str]) -> set[str]:
    """The rollouts shard paths (manifest-relative) that curated shards `paths` refer to."""
    found: set[str] = set()
    for path in paths:
        with reading(path):
            pf = pq.ParquetFile(path)
            if is_thin(pf.schema_arrow):
                found.update(pc.unique(pf.read(columns=["rollouts_shard"]).column("rollouts_shard")).to_pylist())
    return found


def check_references(root: str, refs: pa.Table, live: Iterable[str], source: str,
                     moves: Moves | None = None, ids: "OrderedDict | None" = None) -> str | None:
    """The first problem of references `refs` (a shard not live nor moved to a live one, a row out
    of range, another rollout_id at the position), or None. Reads only the rollout_id column of the
    row groups that hold a referenced row; with `ids` (a pass over many curated shards, e.g.
    `verify`'s), each rollouts shard's whole rollout_id column once, kept there for the next
    references (the last IDS_KEPT shards: a compacted shard is read once, not once per curation)."""
    live_set = set(live)
    shards = refs.column("rollouts_shard").combine_chunks().dictionary_encode()
    codes = shards.indices.to_numpy(zero_copy_only=False)
    positions = refs.column("rollouts_row").to_numpy().astype(np.int64)
    wanted = refs.column("rollout_id").combine_chunks()
    for k, rel in enumerate(shards.dictionary.to_pylist()):
        at = locate(rel, root, live_set, moves)
        if at is None or not os.path.exists(os.path.join(root, at[0])):
            return f"{source}: refers to rollouts shard {rel}, which is not live (quarantined or removed)"
        where = np.flatnonzero(codes == k)
        try:
            if ids is None:
                found = _rows_of(os.path.join(root, at[0]), positions[where] + at[1], source,
                                 ("rollout_id",)).column("rollout_id")
            else:
                found = _ids_at(os.path.join(root, at[0]), positions[where] + at[1], source, ids)
        except UnresolvedReference as exc:
            return str(exc)
        bad = pc.invert(pc.equal(wanted.take(pa.array(where)), found))
        if pc.any(bad).as_py():
            i = int(np.flatnonzero(bad.to_numpy(zero_copy_only=False))[0])
            return (f"{source}: row {int(positions[where[i]])} of rollouts shard {rel} holds rollout_id="
                    f"{found[i].as_py()!r}, the reference says {wanted[int(where[i])].as_py()!r}")
    return None


IDS_KEPT = 4


def _ids_at(path: str, positions: np.ndarray, source: str, ids: "OrderedDict") -> pa.Array:
    """`rollout_id` at `positions` of one rollouts shard, from its whole column, read once per pass (`ids`)."""
    col = ids.get(path)
    if col is None:
        with reading(path):
            col = pq.read_table(path, columns=["rollout_id"]).column(0).combine_chunks()
        ids[path] = col
        while len(ids) > IDS_KEPT:
            ids.popitem(last=False)
    else:
        ids.move_to_end(path)
    if len(positions) and (positions.min() < 0 or positions.max() >= len(col)):
        raise UnresolvedReference(f"{source}: refers to row {int(positions.max())} of {path}, which has "
                                  f"{len(col)} rows; curate again")
    return col.take(pa.array(positions))


def null_lists(files: pa.ChunkedArray | pa.Array, rows: np.ndarray, column: str = "old_logprobs") -> np.ndarray:
    """Whether `column` is null at each (file, row position): from the column statistics of the row
    group holding the row (a null count of 0 there: no row of it is null), reading the column only
    for the row groups whose statistics do not rule nulls out. Exact either way."""
    files = files.combine_chunks() if isinstance(files, pa.ChunkedArray) else files
    encoded = files.dictionary_encode()
    codes = encoded.indices.to_numpy(zero_copy_only=False)
    rows = np.asarray(rows, np.int64)
    out = np.zeros(len(rows), np.bool_)
    for k, path in enumerate(encoded.dictionary.to_pylist()):
        where = np.flatnonzero(codes == k)
        pf = pq.ParquetFile(path)
        md = pf.metadata
        leaf = next(i for i in range(md.num_columns) if md.schema.column(i).path.split(".")[0] == column)
        sizes = np.array([md.row_group(g).num_rows for g in range(md.num_row_groups)], np.int64)
        ends = np.cumsum(sizes)
        groups = np.searchsorted(ends, rows[where], side="right")
        for g in np.unique(groups):
            chunk = md.row_group(int(g)).column(leaf)
            stats = chunk.statistics if chunk.is_stats_set else None
            if stats is not None and stats.has_null_count and stats.null_count == 0:
                continue  # no null value at any level of this row group: no null list
            nulls = pf.read_row_group(int(g), columns=[column]).column(0).is_null().to_numpy(zero_copy_only=False)
            mine = where[groups == g]
            out[mine] = nulls[rows[mine] - (ends[g] - sizes[g])]
    return out


LOGPROB_COLUMNS = ("old_logprobs", "gen_logprobs")
_FACTS_KEPT = 4096  # row groups whose log-prob facts a process keeps (a few bytes per row each)
_facts: dict[tuple, Future] = {}
_facts_lock = threading.Lock()


def _row_group_facts(path: str, group: int, pf: pq.ParquetFile | None = None) -> tuple[np.ndarray, dict]:
    """(whether `old_logprobs` is null at each row, {column: sorted rows holding a NaN or an
    infinity}) of one row group of a rollouts shard: its two log-prob columns decoded once per
    process and file version (path, size, modification and change times, inode). A second caller of the same row
    group waits for the first instead of decoding it again (`prefetch_logprob_facts` runs ahead on
    a thread)."""
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, group)
    with _facts_lock:
        future = _facts.get(key)
        mine = future is None
        if mine:
            future = _facts[key] = Future()
            while len(_facts) > _FACTS_KEPT:
                _facts.pop(next(iter(_facts)))
    if not mine:
        return future.result()
    try:
        read = (pf or pq.ParquetFile(path)).read_row_group(group, columns=list(LOGPROB_COLUMNS))
        bad = {}
        for name in LOGPROB_COLUMNS:
            lists = read.column(name).combine_chunks()
            if name == "old_logprobs":
                nulls = lists.is_null().to_numpy(zero_copy_only=False)
            values = pc.list_flatten(lists)
            if len(values) and not pc.all(pc.is_finite(values)).as_py():
                parents = pc.list_parent_indices(lists).to_numpy(zero_copy_only=False)
                bad[name] = np.unique(parents[pc.invert(pc.is_finite(values)).to_numpy(zero_copy_only=False)])
        future.set_result((nulls, bad))
    except BaseException as exc:
        with _facts_lock:
            _facts.pop(key, None)
        future.set_exception(exc)
        raise
    return nulls, bad


def prefetch_logprob_facts(paths: Iterable[str]) -> None:
    """Decode the log-prob facts of every row group of these shards ahead of `logprob_lists` (a
    curation starts it on a thread once it knows which shards hold a selected row). Errors are left
    for `logprob_lists` to raise."""
    for path in paths:
        try:
            pf = pq.ParquetFile(path)
            for g in range(pf.metadata.num_row_groups):
                _row_group_facts(path, g, pf)
        except Exception:
            continue


def logprob_lists(files: pa.ChunkedArray | pa.Array, rows: np.ndarray, rollout_ids: pa.ChunkedArray | pa.Array,
                  finite: frozenset[str] = frozenset()) -> tuple[np.ndarray, tuple[str, str, str] | None]:
    """What a curation needs of the referenced rows' log-probs: whether `old_logprobs` is null at
    each (file, row position) (the `fallback` flag, as `null_lists`), and the first referenced row
    (smallest rollout_id) whose `old_logprobs` or `gen_logprobs` hold a NaN or an infinity, as
    (rollout_id, file, column), else None. Only the row groups holding a referenced row are read,
    and only those two columns (`_row_group_facts`, once per process); rows that are not
    referenced are not judged. Parquet statistics cannot rule out a NaN (writers leave NaN out of
    min/max), so the columns are decoded — except in `finite` files (`Snapshot.finite_files`:
    checked when committed, and the caller verifies their sha256 before it commits anything),
    whose null flags come from the statistics as in `null_lists`."""
    files = files.combine_chunks() if isinstance(files, pa.ChunkedArray) else files
    ids = rollout_ids.combine_chunks() if isinstance(rollout_ids, pa.ChunkedArray) else rollout_ids
    encoded = files.dictionary_encode()
    codes = encoded.indices.to_numpy(zero_copy_only=False)
    rows = np.asarray(rows, np.int64)
    nulls = np.zeros(len(rows), np.bool_)
    bad: list[tuple[str, str, str]] = []
    for k, path in enumerate(encoded.dictionary.to_pylist()):
        where = np.flatnonzero(codes == k)
        if path in finite:
            nulls[where] = null_lists(pa.array([path] * len(where), pa.string()), rows[where])
            continue
        pf = pq.ParquetFile(path)
        md = pf.metadata
        sizes = np.array([md.row_group(g).num_rows for g in range(md.num_row_groups)], np.int64)
        ends = np.cumsum(sizes)
        groups = np.searchsorted(ends, rows[where], side="right")
        for g in np.unique(groups):
            mine = where[groups == g]
            local = rows[mine] - (ends[g] - sizes[g])
            group_nulls, group_bad = _row_group_facts(path, int(g), pf)
            nulls[mine] = group_nulls[local]
            for name, at in group_bad.items():
                hit = np.isin(local, at)
                if hit.any():
                    bad.append(min((str(ids[int(j)].as_py()), path, name) for j in mine[hit]))
    return nulls, (min(bad) if bad else None)
