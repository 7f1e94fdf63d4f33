"""The cut of a curation's selected rows into curated shards, and the rows each shard holds.

Invariants:
- Curated rows are cut input shard after input shard (the snapshot's order), each shard's rows
  sorted by rollout_id, into shards of `rows_per_shard` rows (`part_layout`): both engines cut the
  same way, so they write the same bytes.
- A curated row refers to its rollouts row (the shard's manifest path, its position in the file,
  its rollout_id) and copies no token list (schema `CURATED_REFS`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from rollstore.storage.schema import CURATED_REFS
from rollstore.storage.shardio import ROW_GROUP_BYTES

from .plan import Plan
from .tokens import run_lengths

CURATED_SHARD_BYTES = ROW_GROUP_BYTES


def rows_per_shard(summary: dict) -> int:
    """Rows per curated shard: about CURATED_SHARD_BYTES of learner input each."""
    n_selected = summary["n_selected"]
    per_row = max(1, (summary["tokens_selected"] * 14 + n_selected * 64) // max(1, n_selected))
    return max(1, CURATED_SHARD_BYTES // per_row)


def part_layout(rows_per_input: list[int], per_shard: int) -> list[list[tuple[int, int, int]]]:
    """The cut of the curated rows (input shard after input shard) into curated shards of
    `per_shard` rows: per output shard, its (input shard, first row, rows) slices."""
    parts, current, filled = [], [], 0
    for i, n in enumerate(rows_per_input):
        start = 0
        while start < n:
            take = min(n - start, per_shard - filled)
            current.append((i, start, take))
            filled, start = filled + take, start + take
            if filled == per_shard:
                parts.append(current)
                current, filled = [], 0
    if filled:
        parts.append(current)
    return parts


def part_name(curation_id: str, k: int) -> tuple[str, str]:
    """(name, relative path) of curated shard k."""
    name = f"part-{k:05d}"
    return name, f"curated/{curation_id}/{name}.parquet"


def audit_path(curation_id: str) -> str:
    return f"audit/{curation_id}/audit.parquet"


def sorted_by_rollout(table: pa.Table) -> pa.Table:
    return table.take(pc.sort_indices(table, [("rollout_id", "ascending")]))


def materialised(runner, plan: Plan, table: pa.Table) -> pa.Table:
    """Rows of `curate_materialise.sql` after the plan's kernel steps of the materialisation (the
    loss mask as kept runs in place of the entropies, the fallback flag), in the plan's order;
    done before the rows are sorted, so a sort moves no token list."""
    for step in plan.phase("materialise"):
        if step.kernel is not None:
            table = runner.kernel(step, table)
    return table


class PartCounts(NamedTuple):
    """What one curated shard adds to the record: rows that fell back to gen_logprobs, tokens kept."""

    fallback: int
    kept: int


def curated_table(pieces: list[pa.Table], curation_id: str, root: str) -> tuple[pa.Table, PartCounts]:
    """One curated shard's table (references, schema CURATED_REFS) from consecutive slices of
    materialised input shards (`materialised`: with their kept runs and fallback flags), and how
    many of its rows fell back to gen_logprobs and the tokens its masks keep. `root`: the buffer
    root; each row's input shard is stored as the manifest's path under it."""
    table = pa.concat_tables(pieces)
    fallback = int(pc.sum(table.column("fallback")).as_py() or 0)
    table = table.add_column(0, "curation_id", pa.array([curation_id] * table.num_rows, pa.string()))
    table = table.append_column("rollouts_shard", manifest_paths(table.column("shard_file"), root))
    kept = int(run_lengths(table.column("keep_runs").combine_chunks()).sum())
    return table.select(CURATED_REFS.names).cast(CURATED_REFS), PartCounts(fallback, kept)


def manifest_paths(files: pa.ChunkedArray, root: str) -> pa.Array:
    """Full paths of shards under `root` → their paths as the manifest records them."""
    encoded = files.combine_chunks().dictionary_encode()
    prefix = os.path.join(root, "")
    names = []
    for name in encoded.dictionary.to_pylist():
        if not name.startswith(prefix):
            raise ValueError(f"{name}: a curated row refers to a shard outside the buffer {root}")
        names.append(name[len(prefix):])
    return pa.array(names, pa.string()).take(encoded.indices)


def referenced_paths(files: list[str], root: str) -> list[str]:
    """The manifest paths of the input shards a curation's rows refer to."""
    return manifest_paths(pa.chunked_array([pa.array(files, pa.string())]), root).to_pylist()
