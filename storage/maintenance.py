"""Maintenance: garbage collection of unreferenced files, and compaction of small shards.

Invariants:
- `gc` never removes a file that is, or may become, committed:
  - under the data folders (rollouts/, curated/, audit/, meta/) it removes `.parquet` files that no
    manifest row names and that are older than the grace period, and only while it holds the
    writers' lock exclusively (`writelock`): a writer holds it shared from its first file to the
    end of its commit, so a linked, not yet committed file is never taken for an orphan;
  - under tmp/ every entry a writer makes is named for its owner (`storage.owners`:
    `<kind>-<host>-<pid>-<hex>`). An entry of this host is never removed while its process lives;
    once it is gone, the entry is removed when its whole tree is older than the grace period (a
    DuckDB spill folder whatever its age). An entry of another host (but its spill folders, left to
    that host) or of an older version's naming is judged by the grace period alone;
  - files of shards retired by compaction or quarantine are removed once no pinned snapshot can
    read them: the manifest rows go first, all in one transaction (recording the highest
    `removed_seq` collected; snapshots older than that are refused from then on), then the files;
  - the folders of checkpoint versions that retention pruned (`learner.retention`) are removed
    once no pinned snapshot is older than the commit that pruned them; their index rows stay.
- A buffer cataloged in PostgreSQL is judged by its catalog alone, on every host alike: a file of
  the data folders or an entry of tmp/ is removed only when no shard row names it and no live
  intent holds it (writers take one before a file's first byte and renew it by a heartbeat on the
  database's clock), older than the grace period, and only while gc holds an intent on it itself;
  an expired intent is taken over, which fences its writer's commit. No writers' lock, no pids
  (but DuckDB spill folders, judged as above).
- Concurrent gcs (and a file vanishing under one) are fine: a file already gone is skipped.
- `compact` replaces small shards of a table by one merged shard in ONE manifest transaction: the
  merged rows are the old rows in commit order, so every query's result is unchanged; the old
  files stay on disk until `gc` finds no snapshot that needs them. Shards that any consumer has
  leased are never merged (a lease names a shard id).
- Rollouts shards that curated shards refer to (by shard path and row position) are merged like
  any other: the same transaction records, per retired shard, where its rows went (`moved`: the
  new shard and the position of its first row there; `storage.manifest`), and every reader of a
  reference follows it (`storage.references.locate`). No curated shard, checkpoint, consumed
  ledger, lease, pin or curation record is rewritten, so nothing that names a curated shard
  changes: a trained curated shard stays trained, a curation's audit and `why` answer as before.
  A curation committing meanwhile needs no rollback either (its references are moved with the
  rest); `migrate` rewrites referenced shards the same way (one shard into one).
- Killed at any point before its commit, compaction leaves the manifest as it was (the old shards
  live and readable; what it wrote is an orphan for `gc`); after it, the merged shard is live and
  the moves are recorded: there is no state in between.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import time
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from .buffer import TABLE_DIRS, Buffer, Part
from .schema import RESPONSE_LENGTH
from .errors import ManifestError, RollstoreError
from .owners import host, owner_gone, owner_prefix, parse
from .verify import verify_shards
from .writelock import collecting

DATA_DIRS = ("rollouts", "curated", "audit", "meta")  # where committed shards (and orphans) live
DEFAULT_GRACE_S = 3600.0
GC_LOCK_WAIT_S = 30.0  # how long gc waits for writers to let it scan the data folders
COMPACT_TARGET_BYTES = 128 * 1024 * 1024
COMPACTABLE = ("rollouts", "prompt_selections", "selections")


@dataclass
class GcReport:
    orphans_removed: int = 0
    retired_removed: int = 0
    bytes_freed: int = 0
    spill_dirs_removed: int = 0
    data_dirs_skipped: bool = False  # writers held the writers' lock past GC_LOCK_WAIT_S
    retired_skipped: str | None = None  # why retired shards were left (the manifest could not be written)
    checkpoints_removed: int = 0  # folders of pruned checkpoint versions (`learner.retention`)


def _read_only_mount(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def spill_prefix() -> str:
    """The name prefix of this process's DuckDB spill folders under tmp/: `duckdb-<host>-<pid>-`."""
    return owner_prefix("duckdb")


def _size_and_age(path: str, now: float) -> tuple[int, float]:
    """(bytes, seconds since the newest modification) of a file, or of a folder's whole tree."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0, 0.0
    if not os.path.isdir(path) or os.path.islink(path):
        return st.st_size, now - st.st_mtime
    size, newest = 0, st.st_mtime
    for dirpath, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                sub = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            newest = max(newest, sub.st_mtime)
            size += sub.st_size if name in files else 0
    return size, now - newest


def _remove(path: str) -> bool:
    """Remove a file or a folder tree; False when it was already gone (a concurrent gc)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def collect_tmp(tmp: str, grace_s: float, now: float | None = None, only: list[str] | None = None) -> GcReport:
    """Remove the entries of `tmp/` that no live writer owns (see the module invariants). `only`:
    judge these names alone."""
    report = GcReport()
    now = time.time() if now is None else now
    try:
        names = os.listdir(tmp) if only is None else only
    except FileNotFoundError:
        return report
    for name in names:
        owner = parse(name)
        mine = owner is not None and owner[1] == host()
        if mine and not owner_gone(name):
            continue  # its writer lives: work in progress, whatever its age
        if owner is not None and not mine and owner[0] == "duckdb":
            continue  # another host's spill folder: only that host can tell
        path = os.path.join(tmp, name)
        size, age = _size_and_age(path, now)
        spill = owner is not None and owner[0] == "duckdb"
        if age < grace_s and not (mine and spill):
            continue  # the grace period applies to all but this host's dead spill folders
        if _remove(path):
            if owner is not None and owner[0] == "duckdb":
                report.spill_dirs_removed += 1
            else:
                report.orphans_removed += 1
                report.bytes_freed += size
    return report


def _collect_held(buf: Buffer, candidates: list[tuple[str, str]], grace_s: float, now: float,
                  report: GcReport) -> None:
    """A catalog with write intents (PostgreSQL): of `candidates` ((relative path, kind): "file", a
    .parquet of the data folders; "tmp", an entry of tmp/), listed BEFORE this reads the catalog,
    remove those no shard row names and no live intent holds, older than the grace period, each
    only while gc holds an intent on it itself (`owning`). A writer takes its intent before a
    file's first byte, so a file listed without one is no live writer's; one whose intent expired
    is taken over, which fences that writer's commit."""
    man = buf.manifest
    held = man.protected([rel for rel, _ in candidates])
    for rel, kind in candidates:
        if rel in held:
            continue
        full = os.path.join(buf.root, rel)
        size, age = _size_and_age(full, now)
        if age < grace_s or not os.path.lexists(full):
            continue
        with man.owning(rel) as mine:
            if mine and _remove(full):
                report.orphans_removed += 1
                report.bytes_freed += size
    man.drop_expired_intents()


def _collect_cataloged(buf: Buffer, grace_s: float, now: float, report: GcReport) -> None:
    """`collect_tmp` and `_collect_data` for a catalog with write intents: the same files, judged by
    the catalog's rows and intents instead of pids and the writers' flock (DuckDB spill folders,
    which are no writer's, are still judged as `collect_tmp` judges them)."""
    tmp = os.path.join(buf.root, "tmp")
    candidates: list[tuple[str, str]] = []
    try:
        names = os.listdir(tmp)
    except FileNotFoundError:
        names = []
    spills = []
    for name in names:
        owner = parse(name)
        if owner is not None and owner[0] == "duckdb":
            spills.append(name)
        else:
            candidates.append((os.path.join("tmp", name), "tmp"))
    for top in DATA_DIRS:
        for dirpath, _dirs, files in os.walk(os.path.join(buf.root, top)):
            candidates += [(os.path.relpath(os.path.join(dirpath, n), buf.root), "file")
                           for n in files if n.endswith(".parquet")]
    _collect_held(buf, candidates, grace_s, now, report)
    spill = collect_tmp(tmp, grace_s, now, only=spills)
    report.spill_dirs_removed += spill.spill_dirs_removed
    if buf.manifest.store is not None:
        _collect_objects(buf, buf.manifest.store, grace_s, now, report)


def _collect_objects(buf: Buffer, store, grace_s: float, now: float, report: GcReport) -> None:
    """The store's objects under the data folders (and the files of checkpoint folders) that no row
    names and no live intent holds
    (listed before the catalog is read), older than the grace period: deleted, each while gc
    holds an intent on its key (a writer takes one before its put-if-absent)."""
    objects = [(rel, modified, size) for rel, modified, size in store.list()
               if (rel.split("/", 1)[0] in DATA_DIRS and rel.endswith(".parquet")) or rel.startswith("checkpoints/")]
    held = buf.manifest.protected([rel for rel, _, _ in objects])
    for rel, modified, size in objects:
        if rel in held or now - modified < grace_s:
            continue
        with buf.manifest.owning(rel) as mine:
            if mine:
                store.delete(rel)
                report.orphans_removed += 1
                report.bytes_freed += size


def _collect_data(buf: Buffer, grace_s: float, now: float, report: GcReport) -> None:
    """Under the writers' lock held exclusively: remove unnamed .parquet files of the data folders."""
    with collecting(buf.root, GC_LOCK_WAIT_S, buf.manifest) as held:
        if not held:
            report.data_dirs_skipped = True
            return
        known = buf.manifest.all_paths()  # read under the lock: no commit is half-way now
        for top in DATA_DIRS:
            for dirpath, _dirs, files in os.walk(os.path.join(buf.root, top)):
                for name in files:
                    full = os.path.join(dirpath, name)
                    rel = os.path.relpath(full, buf.root)
                    if rel in known or not name.endswith(".parquet"):
                        continue
                    try:
                        st = os.lstat(full)
                    except FileNotFoundError:
                        continue
                    if now - st.st_mtime >= grace_s and _remove(full):
                        report.orphans_removed += 1
                        report.bytes_freed += st.st_size


def gc(buf: Buffer, grace_s: float = DEFAULT_GRACE_S) -> GcReport:
    """Collect orphans under tmp/ and the data folders, then the files of retired shards that no
    pinned snapshot needs (see the module invariants)."""
    if not (grace_s >= 0 and math.isfinite(grace_s)):
        raise RollstoreError(f"gc: grace {grace_s!r} must be a finite number of seconds ≥ 0")
    man = buf.manifest
    if man.read_only is not None and (_read_only_mount(buf.root) or not os.access(buf.root, os.W_OK)):
        man.require_writable()  # nothing can be removed from a read-only buffer: one line
    now = time.time()
    if man.multi_host:  # writers on other hosts: their intents, not this host's locks and pids, guard them
        report = GcReport()
        _collect_cataloged(buf, grace_s, now, report)
    else:
        report = collect_tmp(os.path.join(buf.root, "tmp"), grace_s, now)
        _collect_data(buf, grace_s, now, report)
    if man.read_only is not None:  # a full disk: orphans are gone (space freed), the manifest waits
        report.retired_skipped = man.read_only
        return report
    collect_pruned(buf, report)
    oldest_pin = man.oldest_pinned_seq()
    due = [(i, p, r) for i, p, r in man.retired_rows() if oldest_pin is None or oldest_pin >= r]  # no pinned snapshot reads them
    if due:
        with man.transaction() as con:  # the rows first, all in ONE commit: a file left behind is an orphan, never a shard
            man.forget_retired(con, [i for i, _p, _r in due], max(r for _i, _p, r in due))
    store = man.store
    for _shard_id, path, _removed_seq in due:
        full = os.path.join(buf.root, path)
        size, _ = _size_and_age(full, now)
        if store is not None:  # the object (the local file, if any, is this host's cached copy)
            store.delete(path)
            _remove(full)
            report.bytes_freed += size
            report.retired_removed += 1
            continue
        if _remove(full):
            report.bytes_freed += size
            report.retired_removed += 1
    return report


def collect_pruned(buf: Buffer, report: GcReport | None = None) -> GcReport:
    """Remove the folders (a store's buffer: the objects too) of checkpoint versions whose files were
    pruned (`learner.retention`: `pruned_seq` on their index row, which stays), once no pinned
    snapshot is older than the commit that pruned them; each is then marked `collected`."""
    report = GcReport() if report is None else report
    man = buf.manifest
    rows = man.pruned_uncollected()
    if not rows:
        return report
    # (a DuckDB session's pin keeps shards' files, never a checkpoint's: `Catalog.pin_shards`)
    oldest_pin = man.oldest_checkpoint_pin()
    store = man.store
    done = []
    for shard_id, path, pruned_seq in rows:
        if oldest_pin is not None and oldest_pin < int(pruned_seq):
            continue  # a pinned snapshot may still load it
        done.append(int(shard_id))
        if store is not None:
            for key, _digest, nbytes in man.objects_under(path + "/"):
                store.delete(key)
                report.bytes_freed += nbytes
        full = os.path.join(buf.root, path)
        if os.path.lexists(full):
            size, _ = _size_and_age(full, time.time())
            if _remove(full):
                report.checkpoints_removed += 1
                report.bytes_freed += size if store is None else 0
    if done and man.read_only is None:  # the files are gone whatever this records: a pin's kind of transaction
        man.mark_collected(done)
    return report


@dataclass
class TrimReport:
    files_removed: int = 0
    bytes_freed: int = 0
    bytes_left: int = 0


def trim_cache(buf: Buffer, max_bytes: int, grace_s: float = DEFAULT_GRACE_S) -> TrimReport:
    """A store's buffer: remove this host's cached copies (of shards and checkpoint files, which the
    store keeps), least recently used first (the later of access and modification time), until the
    cache holds at most `max_bytes`; a copy used within `grace_s` is kept whatever the size (a reader
    of this host may be about to open it). A removed copy is fetched again, verified, when next read.
    Files no row names are gc's, never this function's."""
    store = buf.manifest.store
    if store is None:
        raise RollstoreError(f"{buf.root}: its shards live in its folder, not in object storage: there is no "
                             "cache to trim")
    if not (max_bytes >= 0 and math.isfinite(max_bytes) and grace_s >= 0 and math.isfinite(grace_s)):
        raise RollstoreError(f"trim: {max_bytes!r} bytes and a grace of {grace_s!r} s must be finite numbers ≥ 0")
    now = time.time()
    cached: list[tuple[float, int, str]] = []
    for top in (*DATA_DIRS, "checkpoints"):
        for dirpath, _dirs, files in os.walk(os.path.join(buf.root, top)):
            for name in files:
                full = os.path.join(dirpath, name)
                try:
                    st = os.lstat(full)
                except FileNotFoundError:
                    continue
                cached.append((max(st.st_atime, st.st_mtime), st.st_size, os.path.relpath(full, buf.root)))
    named = buf.manifest.protected([rel for _, _, rel in cached])  # rows (or live intents): copies of the store's
    report = TrimReport(bytes_left=sum(size for _, size, rel in cached if rel in named))
    for used, size, rel in sorted(cached):
        if report.bytes_left <= max_bytes:
            break
        if rel not in named or now - used < grace_s:
            continue
        if _remove(os.path.join(buf.root, rel)):
            report.files_removed += 1
            report.bytes_freed += size
        report.bytes_left -= size
    return report


@dataclass
class CompactReport:
    merged_shards: int = 0
    new_shards: int = 0
    rows: int = 0
    written: list = field(default_factory=list)  # the merged shards' ids


def compact(
    buf: Buffer, table: str = "rollouts", small_bytes: int = 16 * 1024 * 1024,
    target_bytes: int = COMPACT_TARGET_BYTES, leave: frozenset = frozenset(),
) -> CompactReport:
    """Merge runs of consecutive small, never-leased shards of `table` into shards of ~target_bytes.

    References into merged rollouts shards follow them (`moved`, in the same commit).

    Only shards with the same key in the same folder (e.g. one curation's) are merged together.
    `leave`: shard ids not to merge (a loop's periodic compaction leaves the shards its earlier
    compactions wrote, so each one merges the steps since the last: its cost and memory stay those of
    N steps, not of a merged tail that grows towards `small_bytes`)."""
    if table not in COMPACTABLE:
        raise RollstoreError(f"table {table!r} cannot be compacted (only {', '.join(COMPACTABLE)})")
    man = buf.manifest
    man.require_writable()  # a write command: refused up front, also when nothing is left to merge
    leased = man.leased_ids()
    shards = [s for s in man.shards(table) if s.bytes < small_bytes and s.shard_id not in leased
              and s.shard_id not in leave]
    keys: list[list[str]] | None = None
    if table == "selections":  # audits: runs of committed curations' shards, merged across curations
        batches, keys = _audit_batches(man, shards, target_bytes)
    else:  # a merged shard keeps its key and folder (e.g. a curation's)
        batches = _runs(shards, target_bytes, lambda s: (s.key, os.path.dirname(s.path)))
    report = CompactReport()
    if not batches:
        return report
    report.rows, report.written = _rewrite(buf, table, batches, f"compact:{table}", keys=keys)
    report.merged_shards = sum(len(b) for b in batches)
    report.new_shards = len(batches)
    return report


def _runs(shards: list, target_bytes: int, home) -> list[list]:
    """Runs of consecutive shards with the same `home`, each up to ~target_bytes; runs of one left out."""
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
    batches.append(current)
    return [b for b in batches if len(b) > 1]


def _audit_batches(man, shards: list, target_bytes: int) -> tuple[list[list], list[list[str]]]:
    """Runs of consecutive (commit order: a loop's steps in order) audit shards that may merge, and the
    curation ids each run holds (none: shards written without a key, which merge among themselves). A
    shard may merge when every curation it holds is committed (its record live) and it was added at or
    before every live pin: a curation in flight looks for the
    audits committed after its snapshot by their key (`Catalog.committed_since`), so none of those is
    merged under it. Rows are never rewritten: each keeps its `curation_id`."""
    committed = {s.key for s in man.shards("curations")}
    pinned = man.oldest_pinned_seq()
    merged = man.shard_keys([s.shard_id for s in shards if s.key is None])
    keys_of = {s.shard_id: merged.get(s.shard_id, [] if s.key is None else [s.key]) for s in shards}

    def home(s) -> str | None:  # shards without any key (written without a curation) merge among themselves
        keys = keys_of[s.shard_id]
        if not keys:
            return "unkeyed"
        return "committed" if all(k in committed for k in keys) and (pinned is None or s.added_seq <= pinned) else None

    batches = [b for b in _runs(shards, target_bytes, home) if home(b[0]) is not None]
    return batches, [sorted({k for s in b for k in keys_of[s.shard_id]}) for b in batches]


def _read_shard(root: str, shard) -> pa.Table:
    """A shard's rows as stored, without the rollouts' stored length (`Buffer.commit` writes it
    again): shards of schema versions 2 and 3 then concatenate."""
    table = pq.read_table(os.path.join(root, shard.path))
    return table.drop_columns([RESPONSE_LENGTH]) if RESPONSE_LENGTH in table.column_names else table


def _rewrite(buf: Buffer, table: str, batches: list[list], kind: str, what: str = "compaction",
             keys: list[list[str]] | None = None) -> int:
    """Replace each batch of shards by one new shard holding their rows in order, in ONE manifest
    commit that retires the old shards, moves their rollout and group ids and (rollouts) records
    where each old shard's rows now are (`moved`); returns the rows written. The old shards are
    verified first; the commit refuses when one changed or was leased. Until the commit, the old
    files are the live ones. `keys`: each batch's keys (audits of several curations), recorded for
    its merged shard (`Catalog.record_shard_keys`), whose own key is null, under `audit/merged/`."""
    store = buf.manifest.store
    if store is not None:  # shards in object storage: into this host's cache first, verified
        for sh in (sh for b in batches for sh in b):
            store.fetch(buf.root, sh.path, sh.sha256, sh.bytes, buf.manifest.holding)
    verify_shards(buf.root, [s for b in batches for s in b])  # never merge a corrupted file into a new one
    parts = []
    rows = 0
    for batch in batches:
        merged = pa.concat_tables((_read_shard(buf.root, s) for s in batch), promote_options="default")
        subdir = os.path.relpath(os.path.dirname(batch[0].path), TABLE_DIRS[table])
        # one shard rewritten alone (a migration) keeps its footer's notes (e.g. an import's lossy conversions)
        notes = {k.decode(): v.decode() for k, v in (merged.schema.metadata or {}).items()
                 if k != b"ARROW:schema"} if len(batch) == 1 else None
        if keys is not None:
            parts.append(Part(table, merged, key=None, subdir="merged"))
        else:
            parts.append(Part(table, merged, key=batch[0].key, subdir=None if subdir == "." else subdir,
                              metadata=notes or None))
        rows += merged.num_rows
    old = [s for b in batches for s in b]

    def retire(con, seq: int, new_ids: list[int]) -> None:
        if keys is not None:
            buf.manifest.record_shard_keys(con, [(i, k) for i, ks in zip(new_ids, keys) for k in ks])
        for batch, new_id in zip(batches, new_ids):
            ids = [s.shard_id for s in batch]
            if buf.manifest.retire_shards(con, seq, ids, release_ids=False) != len(ids):
                raise ManifestError(f"a shard changed during {what}; nothing was committed")
            if buf.manifest.leased_ids(con) & set(ids):
                raise ManifestError(f"a shard was leased during {what}; nothing was committed")
            if table == "rollouts":
                buf.manifest.move_ids(con, ids, new_id)
                to_path = buf.manifest.shards_by_id([new_id], con)[0].path
                offsets = [0, *itertools.accumulate(s.rows for s in batch)][:-1]
                buf.manifest.record_moves(con, seq, [(s.path, to_path, o) for s, o in zip(batch, offsets)])

    _seq, written = buf.commit(parts, kind, {"merged": [s.shard_id for s in old]}, retire, rewritten=True)
    return rows, [s.shard_id for s in written]


@dataclass
class MigrateReport:
    rewritten: int = 0  # rollouts shards rewritten with `response_length`
    rows: int = 0
    leased: int = 0  # left as they are: leased by a consumer


def migrate(buf: Buffer) -> MigrateReport:
    """Bring the buffer's rollouts shards to schema version 3: every live rollouts shard without
    `response_length` is rewritten with it (same rows, same order, same key and folder), all in ONE
    manifest commit that retires the old shards, as compaction does (references into them follow,
    `moved`). Leased shards are left as they are (readers compute their lengths), and counted. An interrupted migration commits nothing: the old shards stay live and readable; the
    files it wrote are orphans for `gc`. Running it again after a completed one does nothing."""
    from .snapshot import stores_response_length

    man = buf.manifest
    man.require_writable()
    leased = man.leased_ids()
    report = MigrateReport()
    batches = []
    store = man.store
    for s in man.shards("rollouts"):
        if store is not None:  # shards in object storage: the footer is read from this host's verified cache
            store.fetch(buf.root, s.path, s.sha256, s.bytes)
        if stores_response_length(os.path.join(buf.root, s.path)):
            continue
        if s.shard_id in leased:
            report.leased += 1
        else:
            batches.append([s])
    if batches:
        report.rows, _written = _rewrite(buf, "rollouts", batches, "migrate:rollouts", "migration")
        report.rewritten = len(batches)
    return report
