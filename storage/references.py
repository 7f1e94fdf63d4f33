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
- A curated shard written before references (schema version 1: token lists inside) reads as it is.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .errors import RollstoreError
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
    """The loss masks (list<bool>, row i of length tokens[i]) of kept runs [s0, e0, s1, e1, ...]."""
    runs = runs.combine_chunks() if isinstance(runs, pa.ChunkedArray) else runs
    tokens = np.asarray(tokens, np.int64)
    offsets = np.zeros(len(tokens) + 1, np.int64)
    np.cumsum(tokens, out=offsets[1:])
    bounds = runs.values.to_numpy(zero_copy_only=False).astype(np.int64)
    run_offsets = runs.offsets.to_numpy().astype(np.int64)
    n, n_bounds = len(tokens), len(bounds)
    row_of = np.repeat(np.arange(n), np.diff(run_offsets))
    # Every row as segments between [row start, its run bounds..., row end] (global positions), kept
    # after an even-numbered bound (a run's start); the mask repeats each segment's value over its
    # length: O(bounds) work plus one pass writing the mask, no token-sized counting arrays.
    points = np.empty(n_bounds + 2 * n, np.int64)
    at_bounds = np.arange(n_bounds) + 2 * row_of + 1
    points[at_bounds] = bounds + offsets[row_of]
    points[run_offsets[:-1] + 2 * np.arange(n)] = offsets[:-1]
    points[run_offsets[1:] + 2 * np.arange(n) + 1] = offsets[1:]
    kept = np.zeros(len(points), np.bool_)
    kept[at_bounds] = (np.arange(n_bounds) - run_offsets[row_of]) % 2 == 0
    mask = np.repeat(kept[:-1], np.diff(points))
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(mask, pa.bool_()))


def _rows_of(path: str, positions: np.ndarray, source: str, columns=RESOLVED_COLUMNS) -> pa.Table:
    """Rows `positions` of one rollouts shard (`columns`), reading only their row groups."""
    with reading(path):
        return _read_rows(path, positions, source, columns)


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


def resolve(refs: pa.Table, root: str, live: Iterable[str] | None = None, source: str = "curated") -> pa.Table:
    """The `CURATED` rows of references `refs` (CURATED_REFS columns), in their order.

    `root`: the buffer root the shard paths are under. `live`: the rollouts shard paths (relative,
    as the manifest records them) the caller's snapshot holds; a reference to any other shard (for
    example one quarantined after the curation) is refused. `source` names the refs in errors."""
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
        full = os.path.join(root, rel)
        if (live_set is not None and rel not in live_set) or not os.path.exists(full):
            raise UnresolvedReference(
                f"{source}: refers to rollouts shard {rel}, which is not live in the buffer (quarantined "
                f"or removed); this curation cannot be trained or exported: curate again")
        where = np.flatnonzero(codes == k)
        pieces.append(_rows_of(full, positions[where], source))
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


def read_curated_file(path: str, root: str | None = None, live: Iterable[str] | None = None) -> pa.Table:
    """One curated shard's rows with the `CURATED` columns: a thin shard resolved (under `root`,
    default the buffer the path lies in), a materialised one as stored."""
    with reading(path):
        table = pq.read_table(path)
    if not is_thin(table.schema):
        return table.select(CURATED.names).cast(CURATED)
    return resolve(table.select(CURATED_REFS.names).cast(CURATED_REFS), root or buffer_root_of(path), live,
                   str(path))


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


def check_references(root: str, refs: pa.Table, live: Iterable[str], source: str) -> str | None:
    """The first problem of references `refs` (a shard not live, a row out of range, another
    rollout_id at the position), or None. Reads only the rollout_id column of the row groups that
    hold a referenced row."""
    live_set = set(live)
    shards = refs.column("rollouts_shard").combine_chunks().dictionary_encode()
    codes = shards.indices.to_numpy(zero_copy_only=False)
    positions = refs.column("rollouts_row").to_numpy().astype(np.int64)
    wanted = refs.column("rollout_id").combine_chunks()
    for k, rel in enumerate(shards.dictionary.to_pylist()):
        if rel not in live_set or not os.path.exists(os.path.join(root, rel)):
            return f"{source}: refers to rollouts shard {rel}, which is not live (quarantined or removed)"
        where = np.flatnonzero(codes == k)
        try:
            found = _rows_of(os.path.join(root, rel), positions[where], source, ("rollout_id",)).column("rollout_id")
        except UnresolvedReference as exc:
            return str(exc)
        bad = pc.invert(pc.equal(wanted.take(pa.array(where)), found))
        if pc.any(bad).as_py():
            i = int(np.flatnonzero(bad.to_numpy(zero_copy_only=False))[0])
            return (f"{source}: row {int(positions[where[i]])} of rollouts shard {rel} holds rollout_id="
                    f"{found[i].as_py()!r}, the reference says {wanted[int(where[i])].as_py()!r}")
    return None


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


def logprob_lists(files: pa.ChunkedArray | pa.Array, rows: np.ndarray, rollout_ids: pa.ChunkedArray | pa.Array
                  ) -> tuple[np.ndarray, tuple[str, str, str] | None]:
    """What a curation needs of the referenced rows' log-probs, in one read of them: whether
    `old_logprobs` is null at each (file, row position) (the `fallback` flag, as `null_lists`), and
    the first referenced row (smallest rollout_id) whose `old_logprobs` or `gen_logprobs` hold a NaN
    or an infinity, as (rollout_id, file, column), else None. Only the row groups holding a
    referenced row are read, and only those two columns; rows of them that are not referenced are
    not looked at. Parquet statistics cannot rule out a NaN (writers leave NaN out of min/max), so
    the columns are decoded."""
    files = files.combine_chunks() if isinstance(files, pa.ChunkedArray) else files
    ids = rollout_ids.combine_chunks() if isinstance(rollout_ids, pa.ChunkedArray) else rollout_ids
    encoded = files.dictionary_encode()
    codes = encoded.indices.to_numpy(zero_copy_only=False)
    rows = np.asarray(rows, np.int64)
    nulls = np.zeros(len(rows), np.bool_)
    bad: list[tuple[str, str, str]] = []
    for k, path in enumerate(encoded.dictionary.to_pylist()):
        where = np.flatnonzero(codes == k)
        pf = pq.ParquetFile(path)
        md = pf.metadata
        sizes = np.array([md.row_group(g).num_rows for g in range(md.num_row_groups)], np.int64)
        ends = np.cumsum(sizes)
        groups = np.searchsorted(ends, rows[where], side="right")
        for g in np.unique(groups):
            mine = where[groups == g]
            local = pa.array(rows[mine] - (ends[g] - sizes[g]), pa.int64())
            read = pf.read_row_group(int(g), columns=list(LOGPROB_COLUMNS), use_threads=False)
            for name in LOGPROB_COLUMNS:
                lists = read.column(name).combine_chunks().take(local)
                if name == "old_logprobs":
                    nulls[mine] = lists.is_null().to_numpy(zero_copy_only=False)
                values = pc.list_flatten(lists)
                if len(values) and not pc.all(pc.is_finite(values)).as_py():
                    faulty = np.unique(pc.list_parent_indices(lists).to_numpy(zero_copy_only=False)[
                        pc.invert(pc.is_finite(values)).to_numpy(zero_copy_only=False)])
                    bad.append(min((str(ids[int(mine[j])].as_py()), path, name) for j in faulty))
    return nulls, (min(bad) if bad else None)
