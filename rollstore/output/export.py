"""`rollstore export`: a snapshot's tables as a plain Parquet dataset with a dataset card.

Layout of DIR: `<table>/data-00000.parquet` for every table with rows at the snapshot (one file
per table, default Parquet encodings and zstd, the rollstore schema's column names and types),
and `README.md`: a Hugging Face dataset card whose YAML front matter names one config per table,
so DuckDB (`read_parquet('DIR/rollouts/*.parquet')`), Polars, pandas and `datasets` open it with
nothing of rollstore installed.

Invariants:
- Reads one pinned, verified snapshot (every shard's size and sha256 checked first): the export is
  exactly that snapshot, whatever commits meanwhile.
- DIR must not exist or be an empty directory (never a symbolic link or another kind of file), and
  must not lie in a buffer's managed files (`rollstore.output.outfile`). Everything is written under a
  sibling partial folder `.<DIR>.partial-<host>-<pid>-<hex>` and renamed into place at the end: a
  failed export leaves no DIR (or the empty one it found); a killed one's partial folder is removed
  by the next export to the same DIR.
- Rows stream shard by shard (memory bounded by one record batch; a curated shard: its rows), in
  manifest order.
- The export is self-contained: curated rows are materialised (references resolved against the
  snapshot's live rollouts shards, token lists written out; schema `CURATED`), so nothing outside
  rollstore resolves references. A reference that does not resolve fails the export (one line).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from rollstore.output.outfile import check_output_dir, partial_dir
from rollstore.storage.errors import RollstoreError
from rollstore.storage.buffer import Buffer
from rollstore.storage.references import read_curated_file
from rollstore.storage.schema import READ_SCHEMAS, SCHEMA_VERSION, TABLES


@dataclass
class ExportInfo:
    path: str
    snapshot_seq: int
    rows: dict[str, int]


def export_snapshot(buf: Buffer, to: str, seq: int | None = None) -> ExportInfo:
    target = check_output_dir(to, "--to")
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = partial_dir(target)
    except OSError as exc:  # the error names the user's path, not the partial folder beside it
        raise RollstoreError(f"--to {to}: cannot write there ({exc.strerror or exc}); nothing was written") from None
    try:
        with buf.snapshot(seq, pin=True) as snap:
            snap.verify()
            rows = {}
            live = [s.path for s in snap.shards("rollouts")]
            for name in TABLES:
                if not snap.rows(name):
                    continue
                if name == "curated":  # materialised: references resolved, token lists written out
                    batches = (read_curated_file(f, snap.root, live, snap.moves()) for f in snap.files(name))
                else:
                    batches = snap.arrow(name).to_batches()
                rows[name] = _write_table(batches, name, os.path.join(tmp, name))
            with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as fh:
                fh.write(dataset_card(os.path.basename(buf.root.rstrip(os.sep)), snap.seq, rows))
            seq_done = snap.seq
        check_output_dir(to, "--to")  # still absent or empty (nothing appeared meanwhile)
        if os.path.lexists(target):
            os.rmdir(target)  # the empty directory we were given (checked above)
        os.rename(tmp, target)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and str(getattr(exc, "filename", "") or "").startswith(tmp):
            raise RollstoreError(f"--to {to}: writing the export failed ({exc.strerror or exc}); nothing was "
                                 "written") from None
        raise
    return ExportInfo(target, seq_done, rows)


def exported_schema(name: str) -> pa.Schema:
    """The schema of an exported table: curated rows materialised (`CURATED`), others as stored."""
    return READ_SCHEMAS[name]


def _write_table(batches, name: str, folder: str) -> int:
    os.makedirs(folder)
    path = os.path.join(folder, "data-00000.parquet")
    n = 0
    with pq.ParquetWriter(path, exported_schema(name), compression="zstd") as writer:
        for batch in batches:
            if batch.num_rows:
                writer.write(batch) if isinstance(batch, pa.Table) else writer.write_batch(batch)
                n += batch.num_rows
    return n


def _type_text(t: pa.DataType) -> str:
    return str(t).replace("timestamp[us, tz=UTC]", "timestamp[us, UTC]")


def dataset_card(buffer_name: str, seq: int, rows: dict[str, int]) -> str:
    """The README.md of an export: YAML front matter (`configs`, one per table) then a short text."""
    names = list(rows)
    lines = ["---", "configs:"]
    for i, name in enumerate(names):
        lines += [f"- config_name: {name}", "  data_files:", "  - split: train", f"    path: {name}/*.parquet"]
        if i == 0:
            lines.append("  default: true")
    lines += ["tags:", "- rollstore", "- reinforcement-learning", "- grpo", "---", ""]
    lines += [f"# {buffer_name}: rollstore snapshot {seq}", "",
              f"An export of snapshot {seq} of the rollstore buffer `{buffer_name}` "
              f"(schema version {SCHEMA_VERSION}). Each folder is one table as plain Parquet; column "
              "names and types are rollstore's public schema. No rollstore is needed to read it.", "",
              "| table | rows |", "|---|---|"]
    lines += [f"| {name} | {n} |" for name, n in rows.items()]
    empty = [name for name in TABLES if name not in rows]
    if empty:
        lines += ["", f"Empty at this snapshot (no folder): {', '.join(empty)}."]
    first = names[0] if names else "rollouts"
    lines += ["", "## Read it", "", "```python",
              "import duckdb; duckdb.sql(\"SELECT * FROM read_parquet('" + first + "/*.parquet')\")",
              f"import polars as pl; pl.read_parquet('{first}/*.parquet')",
              f"import pandas as pd; pd.read_parquet('{first}')",
              "from datasets import load_dataset",
              f"load_dataset('parquet', data_files='{first}/*.parquet', split='train')",
              "```", ""]
    for name in names:
        lines += [f"## `{name}` columns", "", "| column | type |", "|---|---|"]
        lines += [f"| {f.name} | {_type_text(f.type)} |" for f in exported_schema(name)]
        lines.append("")
    lines += ["Per-token lists (`gen_logprobs`, `old_logprobs`, `entropies`) have the length of "
              "`response_token_ids`. `meta` is JSON text; rows imported from another framework say "
              "there what the conversion lost (`meta.import.lossy`).", ""]
    lines.append(f"<!-- rollstore export: {json.dumps({'snapshot': seq, 'rows': rows}, sort_keys=True)} -->")
    return "\n".join(lines) + "\n"
