"""Maintenance: garbage collection of unreferenced files, and compaction of small shards.

Invariants:
- `gc` deletes only (a) files that no manifest row names and that are older than the grace period
  (orphans of crashed writes), and (b) files of shards retired by compaction that no pinned
  snapshot can still read. It never touches a live shard. It records the highest `removed_seq` it
  collected, and snapshots older than that are refused from then on (they would miss shards).
  It also removes DuckDB spill folders (`tmp/duckdb-<host>-<pid>-*`) of this host whose process is
  gone, whatever the grace period.
- `compact` replaces small shards of a table by one merged shard in ONE manifest transaction: the
  merged rows are the old rows in commit order, so every query's result is unchanged; the old
  files stay on disk until `gc` finds no snapshot that needs them. Shards that any consumer has
  leased are never merged (a consumer's ledger refers to shard ids), nor are rollouts shards that a
  live curated shard refers to (by shard path and row position): a referenced rollouts shard is
  never rewritten or retired by compaction, so `gc` never deletes one either.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from .buffer import TABLE_DIRS, Buffer, Part
from .errors import ManifestError, RollstoreError
from .references import referenced_shards
from .verify import verify_shards

SHARD_DIRS = ("rollouts", "curated", "audit", "meta", "tmp")
DEFAULT_GRACE_S = 3600.0
COMPACT_TARGET_BYTES = 128 * 1024 * 1024
COMPACTABLE = ("rollouts", "selections")


@dataclass
class GcReport:
    orphans_removed: int = 0
    retired_removed: int = 0
    bytes_freed: int = 0
    spill_dirs_removed: int = 0


_SPILL = re.compile(r"duckdb-(?P<host>.+)-(?P<pid>[0-9]+)-[0-9a-f]+")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def spill_prefix() -> str:
    """The name prefix of this process's DuckDB spill folders under tmp/: `duckdb-<host>-<pid>-`."""
    return f"duckdb-{_host()}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_spill_dirs(tmp: str) -> int:
    """Remove `tmp/duckdb-<host>-<pid>-*` spill folders of this host whose process is gone (a killed
    query leaves them). Folders of other hosts or of live processes are kept."""
    removed = 0
    try:
        names = os.listdir(tmp)
    except FileNotFoundError:
        return 0
    for name in names:
        m = _SPILL.fullmatch(name)
        if m is None or not os.path.isdir(os.path.join(tmp, name)):
            continue
        if m.group("host") != _host() or _alive(int(m.group("pid"))):
            continue
        shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
        removed += 1
    return removed


def gc(buf: Buffer, grace_s: float = DEFAULT_GRACE_S) -> GcReport:
    report = GcReport()
    man = buf.manifest
    known = man.all_paths()
    now = time.time()
    for top in SHARD_DIRS:
        base = os.path.join(buf.root, top)
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, buf.root)
                if rel in known:
                    continue
                if not (name.endswith(".parquet") or top == "tmp"):
                    continue
                if top == "tmp" and "duckdb-" in rel:
                    continue  # spill directories: whole, below
                try:
                    st = os.stat(full)
                except FileNotFoundError:
                    continue
                if now - st.st_mtime >= grace_s:
                    os.unlink(full)
                    report.orphans_removed += 1
                    report.bytes_freed += st.st_size
    report.spill_dirs_removed = remove_dead_spill_dirs(os.path.join(buf.root, "tmp"))
    oldest_pin = man.oldest_pinned_seq()
    rows = man.con.execute("SELECT shard_id, path, removed_seq FROM shards WHERE removed_seq IS NOT NULL").fetchall()
    for shard_id, path, removed_seq in rows:
        if oldest_pin is not None and oldest_pin < removed_seq:
            continue  # a pinned snapshot still reads it
        full = os.path.join(buf.root, path)
        if os.path.exists(full):
            report.bytes_freed += os.path.getsize(full)
            os.unlink(full)
            report.retired_removed += 1
        with man.transaction() as con:
            con.execute("DELETE FROM shards WHERE shard_id = ?", (shard_id,))
            con.execute(
                "INSERT INTO meta VALUES ('collected_seq', ?) ON CONFLICT (key) DO UPDATE "
                "SET value = max(CAST(value AS INTEGER), CAST(excluded.value AS INTEGER))",
                (str(removed_seq),),
            )
    return report


@dataclass
class CompactReport:
    merged_shards: int = 0
    new_shards: int = 0
    rows: int = 0


def _referenced(buf: Buffer) -> set[str]:
    """Rollouts shard paths that live curated shards refer to."""
    return referenced_shards([os.path.join(buf.root, s.path) for s in buf.manifest.shards("curated")])


def compact(
    buf: Buffer, table: str = "rollouts", small_bytes: int = 16 * 1024 * 1024,
    target_bytes: int = COMPACT_TARGET_BYTES,
) -> CompactReport:
    """Merge runs of consecutive small, never-leased shards of `table` into shards of ~target_bytes.

    A rollouts shard that a live curated shard refers to is never merged (its rows' positions are
    what the references name); a curation that commits meanwhile makes the compaction roll back.

    Only shards with the same key in the same folder (e.g. one curation's) are merged together."""
    if table not in COMPACTABLE:
        raise RollstoreError(f"table {table!r} cannot be compacted (only {', '.join(COMPACTABLE)})")
    man = buf.manifest
    leased = {r[0] for r in man.con.execute("SELECT DISTINCT shard_id FROM leases")}
    seen_seq = man.latest_seq()
    referenced = _referenced(buf) if table == "rollouts" else set()
    shards = [s for s in man.shards(table)
              if s.bytes < small_bytes and s.shard_id not in leased and s.path not in referenced]

    def home(s) -> tuple:  # a merged shard keeps its key and folder (e.g. a curation's)
        return s.key, os.path.dirname(s.path)

    batches, current, size = [], [], 0
    for s in shards:
        if current and home(s) != home(current[0]):
            batches.append(current)
            current, size = [], 0
        current.append(s)
        size += s.bytes
        if size >= target_bytes:
            batches.append(current)
            current, size = [], 0
    if len(current) > 1:
        batches.append(current)
    report = CompactReport()
    batches = [b for b in batches if len(b) > 1]
    if not batches:
        return report
    verify_shards(buf.root, [s for b in batches for s in b])  # never merge a corrupted file into a new one
    parts = []
    for batch in batches:
        merged = pa.concat_tables(pq.read_table(os.path.join(buf.root, s.path)) for s in batch)
        subdir = os.path.relpath(os.path.dirname(batch[0].path), TABLE_DIRS[table])
        parts.append(Part(table, merged, key=batch[0].key, subdir=None if subdir == "." else subdir))
        report.rows += merged.num_rows
    old = [s for b in batches for s in b]

    def retire(con, seq: int, new_ids: list[int]) -> None:
        for batch, new_id in zip(batches, new_ids):
            ids = [s.shard_id for s in batch]
            marks = ",".join("?" * len(ids))
            cur = con.execute(
                f"UPDATE shards SET removed_seq = ? WHERE removed_seq IS NULL AND shard_id IN ({marks})",
                [seq, *ids],
            )
            if cur.rowcount != len(ids):
                raise ManifestError("a shard changed during compaction; nothing was committed")
            if con.execute(f"SELECT 1 FROM leases WHERE shard_id IN ({marks}) LIMIT 1", ids).fetchone():
                raise ManifestError("a shard was leased during compaction; nothing was committed")
            if table == "rollouts" and con.execute(
                    "SELECT 1 FROM shards WHERE table_name = 'curated' AND added_seq > ? LIMIT 1",
                    (seen_seq,)).fetchone():
                raise ManifestError("a curation committed during compaction (its rows may refer to these "
                                    "shards); nothing was committed: run compact again")
            if table == "rollouts":
                con.execute(f"UPDATE rollout_ids SET shard_id = ? WHERE shard_id IN ({marks})", [new_id, *ids])
                con.execute(f"UPDATE group_ids SET shard_id = ? WHERE shard_id IN ({marks})", [new_id, *ids])

    buf.commit(parts, f"compact:{table}", {"merged": [s.shard_id for s in old]}, retire)
    report.merged_shards = len(old)
    report.new_shards = len(parts)
    return report
