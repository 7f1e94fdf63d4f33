"""A buffer: one directory with a manifest and immutable Parquet shards.

Invariants:
- `commit` writes every file first (linked into place; the files, their folders and the parents
  of new folders fsynced together, `shardio.Durable`), then records all of them in ONE manifest
  transaction; if anything fails before COMMIT is sent (the transaction rolled back),
  the files are unlinked and nothing becomes visible (a crash leaves only orphans for `gc`). A
  failure of COMMIT itself leaves the outcome unknown: then no file is unlinked, whatever the
  manifest seems to say; unnamed ones are orphans for `gc`. A file found at a part's
  final path that no manifest row names is an orphan of a crashed run: it is replaced, never
  trusted; on failure only files that are still ours (same inode) and still unnamed by the
  manifest are unlinked. From its first file to the end of its transaction a commit holds the
  writers' lock shared (`writelock`), so `gc` never takes a linked, not yet committed file for
  an orphan (a catalog with write intents, PostgreSQL's, takes no lock: an intent in the catalog
  on each file, its temporary name and its final path, before its first byte; the commit's
  transaction deletes them and is refused if they expired: `catalog_pg`). A `WrittenPart` (a file
  another process already wrote and fsynced under `tmp/`) is published by the same steps: linked
  into place before the transaction, unlinked if it fails.
- `append_rollouts` validates the whole table before writing anything; a rejected append changes
  nothing. Every rollouts shard `commit` writes (a compaction's too) is checked finite first; a
  rollouts shard is never published as a `WrittenPart` (a file whose rows `commit` did not see).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .errors import CatalogConflict, CatalogError, ManifestError, RollstoreError, ValidationError
from .catalog import is_cataloged, open_manifest
from .descriptor import DESCRIPTOR
from .catalog_sql import STEP_INDEXED
from .manifest import MANIFEST, Manifest, NewShard, Shard
from .owners import owned_name
from .schema import RESPONSE_LENGTH, stored_schema
from .shardio import Durable, compact_entropies, link_into_place, new_shard_name, publish_file, write_tmp
from .shard_schemas import record_schemas
from .snapshot import Snapshot
from .validate import check_finite, validate_rollouts
from .writelock import writing

SUBDIRS = ("rollouts", "curated", "audit", "meta", "checkpoints", "tmp")
TABLE_DIRS = {
    "rollouts": "rollouts",
    "curated": "curated",
    "selections": "audit",
    "curations": "meta/curations",
    "checkpoints": "meta/checkpoints",
    "training": "meta/training",
    "evaluations": "meta/evaluations",
    "prompt_selections": "meta/prompt_selections",
}


MANAGED_FILES = ("manifest.sqlite", "manifest.sqlite-wal", "manifest.sqlite-shm", "manifest.sqlite-journal",
                 "writers.lock", DESCRIPTOR)


def managed_by(path: str) -> str | None:
    """The root of the buffer whose managed files would contain `path` (its manifest, or anything
    under rollouts/, curated/, audit/, meta/, checkpoints/, tmp/, quarantine/), else None. Output
    files (`--out`) must never go there: writing one could replace the manifest or a shard."""
    full = os.path.realpath(os.path.abspath(path))
    parts = []
    folder = full
    while True:
        parent, name = os.path.split(folder)
        if os.path.exists(os.path.join(parent, "manifest.sqlite")) or os.path.exists(os.path.join(parent, DESCRIPTOR)):
            top = name
            if (not parts and top in MANAGED_FILES) or (parts and top in SUBDIRS + ("quarantine",)):
                return parent
        if parent == folder:
            return None
        parts.append(name)
        folder = parent


def refuse_managed(path: str, option: str = "--out") -> None:
    """Raise one line if `path` lies in a buffer's managed files (see `managed_by`)."""
    root = managed_by(path)
    if root is not None:
        raise RollstoreError(f"{option} {path}: inside the managed files of the buffer {root} "
                             "(its manifest and data folders); write it elsewhere")


@dataclass
class Part:
    """One file of a commit: a table's rows, where they go, and an optional lookup key."""

    table_name: str
    table: pa.Table
    key: str | None = None
    subdir: str | None = None  # under the table's directory, e.g. the curation id
    name: str | None = None  # file stem; a fresh unique one when None
    metadata: dict[str, str] | None = None  # extra key-value metadata of the Parquet file
    checked: bool = False  # rollouts rows already validated (`append_rollouts`): not checked finite again

    def relpath(self) -> str:
        folder = TABLE_DIRS[self.table_name]
        if self.subdir:
            folder = f"{folder}/{self.subdir}"
        return f"{folder}/{self.name or new_shard_name()}.parquet"


@dataclass
class WrittenPart:
    """A file already written complete and fsynced under `tmp/` (by `shardio.write_tmp`, possibly in
    another process or host), to be published by `Buffer.commit` at `relpath`."""

    table_name: str
    tmp_relpath: str  # relative to the buffer root, under tmp/
    relpath: str  # final path relative to the buffer root, inside the table's directory
    rows: int
    tokens: int
    bytes: int
    sha256: str
    key: str | None = None


def stored_table(part: Part) -> pa.Table:
    """`part`'s rows as its shard stores them: the table's stored schema, the part's metadata."""
    schema = stored_schema(part.table_name, part.table.schema)
    table = part.table
    if part.table_name == "rollouts":  # the length is always computed here, never taken from the input
        if RESPONSE_LENGTH in table.column_names:
            table = table.drop_columns([RESPONSE_LENGTH])
        table = table.append_column(RESPONSE_LENGTH,
                                    pc.list_value_length(table.column("response_token_ids")).cast(pa.int32()))
    table = table.select(schema.names).cast(schema)
    if part.metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **part.metadata})
    return table


def write_part(root: str, part: Part, folder: str, relpath: str | None = None,
               threads: int | None = None) -> WrittenPart:
    """`part` written as `Buffer.commit` would write it (same bytes), complete and fsynced under
    `folder` (an existing folder in tmp/), to be published at `relpath` (default: the part's own)
    by a later commit: a Dask worker writes this way for its client, and a curation writes its
    audit beside the materialisation of its curated rows."""
    table = stored_table(part)
    tmp, nbytes, sha = write_tmp(table, root, folder, threads)
    return WrittenPart(part.table_name, tmp, relpath or part.relpath(), table.num_rows, token_count(table), nbytes,
                       sha, part.key)


def step_ranges(table: pa.Table) -> list[tuple]:
    """(run_id, first step, last step) of each run among `table`'s rows (a shard of STEP_INDEXED), in
    run order; one (None, None, None) for a shard without rows, so that it counts as indexed."""
    if table.num_rows == 0:
        return [(None, None, None)]
    agg = table.select(["run_id", "step"]).group_by("run_id").aggregate([("step", "min"), ("step", "max")])
    return sorted(zip(agg.column("run_id").to_pylist(), agg.column("step_min").to_pylist(),
                      agg.column("step_max").to_pylist()), key=lambda r: (r[0] is None, r[0] or ""))


def summarise_new_rows(table_name: str, table: pa.Table, groups: dict, selections: dict) -> None:
    """Add a new part's rows to a commit's prompt state summaries (`storage.prompt_state`): rollouts
    into `groups`, prompt selections into `selections`. Two parts of one commit that hold the same
    prompt's (or run's) rows leave the state to the shards (a summary that cannot be joined: none)."""
    from .prompt_state import group_summaries, selection_summaries

    new = group_summaries(table) if table_name == "rollouts" else selection_summaries(table)
    into = groups if table_name == "rollouts" else selections
    for key, value in new.items():
        into[key] = None if key in into else value


class StepIndexRows:
    """What a commit adds to the step index and the prompt state (`storage.prompt_state`), gathered
    part by part (`add`) and recorded in the commit's transaction (`record`). `rewritten`: the parts
    hold rows already committed (compaction, migration), which change no prompt's state."""

    def __init__(self, rewritten: bool = False):
        self.rewritten = rewritten
        self.steps: dict[int, list[tuple]] = {}  # part index -> its step index rows (`step_ranges`)
        self.times: dict[int, int | None] = {}  # rollouts part index -> its newest created_at (µs; None: no row)
        self.groups: dict = {}
        self.selections: dict = {}
        self.unread = False  # a file of a step-indexed table written elsewhere: its rows are not read here

    def add(self, i: int, table_name: str, table: pa.Table | None) -> None:
        if table_name not in STEP_INDEXED:
            return
        if table is None:
            self.unread = True
            return
        self.steps[i] = step_ranges(table)
        if table_name == "rollouts":
            newest = pc.max(table.column("created_at")).cast(pa.timestamp("us", tz="UTC")).value
            self.times[i] = None if newest is None else int(newest)
        if not self.rewritten:
            summarise_new_rows(table_name, table, self.groups, self.selections)

    def record(self, catalog, con, seq: int, ids: list[int], written: list[NewShard]) -> None:
        if self.steps:  # which shards hold a run's step, for look-ups that read one step
            catalog.index_steps(con, [(ids[i], written[i].table_name, *r)
                                      for i, rows in self.steps.items() for r in rows],
                                [(ids[i], t) for i, t in self.times.items()])
        if self.groups or self.selections:
            catalog.record_prompt_state(con, seq, ids, self.groups, self.selections)
        if self.unread and not self.rewritten:
            catalog.forget_prompt_state(con)


def token_count(table: pa.Table) -> int:
    """Response tokens of a shard's rows (a thin curated shard: those its references name)."""
    if table.num_rows == 0:
        return 0
    if "response_token_ids" not in table.column_names:
        if "rollouts_row" in table.column_names:
            return int(pc.sum(table.column("tokens")).as_py() or 0)
        return 0
    return int(pc.sum(pc.list_value_length(table.column("response_token_ids"))).as_py() or 0)


def _check_new_root(root: str) -> None:
    """Refuse (one line) to make a buffer at `root` unless it is a new or empty folder, or already a
    buffer's: never a file, a link that leads nowhere (or to itself), or a folder of other files."""
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        if os.path.lexists(root):  # a dangling link
            raise ManifestError(f"{root}: a link to nothing, not a folder: choose a new or empty folder") from None
        return
    except NotADirectoryError:
        raise ManifestError(f"{root}: a file, not a folder: a buffer is a folder (choose a new or empty one)") from None
    except OSError as exc:
        raise ManifestError(f"{root}: cannot be used as a buffer's folder ({exc.strerror or exc})") from None
    if entries and MANIFEST not in entries and DESCRIPTOR not in entries:
        raise ManifestError(f"{root}: a folder of other files ({sorted(entries)[0]!r}, ...) that holds no buffer; "
                            "a buffer is made in a new or empty folder")


def _make_folders(root: str) -> None:
    try:
        for sub in SUBDIRS:
            os.makedirs(os.path.join(root, sub), exist_ok=True)
    except OSError as exc:
        raise ManifestError(f"{root}: cannot make the buffer's folders ({exc.strerror or exc})") from None


class Buffer:
    def __init__(self, root: str, manifest: Manifest):
        self.root = root
        self.manifest = manifest

    @classmethod
    def init(cls, root: str, catalog: str | None = None, data: str | None = None) -> "Buffer":
        """Create the buffer at `root` (its folders and manifest) if missing, and open it. `catalog`:
        a PostgreSQL DSN the new buffer is cataloged at instead (`storage/catalog.py`); a folder with
        a descriptor opens its catalog."""
        root = os.path.abspath(root)
        _check_new_root(root)
        if catalog is not None or data is not None or is_cataloged(root):
            manifest = open_manifest(root, create=True, catalog=catalog, data=data)  # checks all before writing
            _make_folders(root)
            return cls(root, manifest)
        _make_folders(root)
        return cls(root, Manifest(root, create=True))

    @classmethod
    def open(cls, root: str) -> "Buffer":
        """Open the buffer at `root`; a folder without one raises `NotABuffer` (one line)."""
        root = os.path.abspath(root)
        buf = cls(root, open_manifest(root))
        try:
            os.makedirs(os.path.join(root, "tmp"), exist_ok=True)
        except OSError:
            pass  # a read-only buffer: reads need no tmp/, and writes refuse with their own line
        return buf

    def close(self) -> None:
        self.manifest.close()

    def __repr__(self) -> str:
        return f"<storage.Buffer {self.root!r}>"

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- reading ---------------------------------------------------------------------------
    def snapshot(self, seq: int | None = None, pin: bool = False) -> Snapshot:
        seq = self.manifest.latest_seq() if seq is None else seq
        return Snapshot(self.root, self.manifest, seq, pin=pin)

    # ---- writing ---------------------------------------------------------------------------
    def commit(
        self,
        parts: Iterable[Part | WrittenPart],
        kind: str,
        detail: dict | None = None,
        on_commit: Callable[[Any, int, list[int]], None] | None = None,
        rewritten: bool = False,
    ) -> tuple[int, list[Shard]]:
        """Write `parts` (consumed lazily) as shards, then publish all in one manifest transaction.

        `rewritten`: the parts hold rows already committed (compaction, migration): the prompt state
        (`storage.prompt_state`) of new rows is not changed by them.

        Returns (seq, shards). On a failure before COMMIT is sent every file written so far is
        removed; never once COMMIT was sent (the outcome is unknown: see the module invariants). A
        manifest opened read-only (full disk, read-only mount) refuses before any file is written.
        """
        self.manifest.require_writable()
        with writing(self.root, self.manifest):  # gc collects no unnamed file while we are between link and commit
            placed: list[tuple[NewShard, int]] = []  # each file written, with its inode
            schemas: list[pa.Schema] = []  # each file's schema as written (`storage.shard_schemas`)
            index = StepIndexRows(rewritten)  # the step index's and the prompt state's rows of the parts
            uploaded: list[str] = []
            sent = False  # True from the moment COMMIT may have reached the manifest
            durable = Durable()  # every file's and folder's fsync, at once, before the transaction
            try:
                for part in parts:
                    new, inode, table = self._place(part, kind, durable)
                    placed.append((new, inode))
                    index.add(len(placed) - 1, new.table_name, table)
                    schemas.append(table.schema if table is not None else
                                   pq.read_schema(os.path.join(self.root, new.path)))
                    if self.manifest.store is not None:  # the local file stays as this host's cached copy
                        self._upload(self.manifest.store, new.path)
                        uploaded.append(new.path)
                durable.flush()
                with self.manifest.transaction() as con:
                    seq = self.manifest.new_commit(con, kind, detail)
                    ids = self.manifest.add_shards(con, seq, [w for w, _ in placed])
                    if on_commit is not None:
                        on_commit(con, seq, ids)
                    index.record(self.manifest, con, seq, ids, [w for w, _ in placed])
                    record_schemas(self.manifest, con, ids, schemas)
                    sent = True  # leaving the block sends COMMIT: from here the outcome may be unknown
            except BaseException:
                if sent:
                    # COMMIT was sent and failed (or was interrupted): whether it took effect is not
                    # known here, so no file is removed. Unnamed ones are orphans for `gc`, which
                    # decides from the manifest, under the writers' lock, after this commit ends
                    # (a catalog's intents of this commit are left to expire, not released).
                    self.manifest.commit_ended(rolled_back=False)
                    raise
                self._unplace(placed, uploaded)
                self.manifest.commit_ended(rolled_back=True)  # its files are gone: release their intents
                raise
            self.manifest.commit_ended(rolled_back=False)  # committed: the transaction deleted its intents
        return seq, self.manifest.shards_by_id(ids)

    def _place(self, part: Part | WrittenPart, kind: str,
               durable: Durable) -> tuple[NewShard, int, pa.Table | None]:
        """Reserve the paths of one part in the catalog (intents, before any byte) and put its bytes
        in place in the buffer's folder (never over a committed file; an orphan is replaced);
        returns its row-to-be, the inode of its file and its rows (None: a file written elsewhere)."""
        is_orphan = self.manifest.may_replace  # a file found there: ours to replace (no row names it)
        if isinstance(part, WrittenPart):
            if part.table_name == "rollouts":  # its rows were never seen here: not checked finite
                raise ValueError(f"{part.relpath}: a rollouts shard is committed from its rows (a Part, "
                                 "validated and checked finite), never as a file written elsewhere")
            folder = TABLE_DIRS[part.table_name] + "/"
            if not part.relpath.startswith(folder) or ".." in part.relpath.split("/"):
                raise ValueError(f"{part.relpath}: not a path of table {part.table_name}")
            self.manifest.intend([part.relpath])  # before the link: gc leaves it alone, the commit fences
            link_into_place(self.root, part.tmp_relpath, part.relpath, part.bytes, is_orphan, durable)
            new = NewShard(part.table_name, part.relpath, part.rows, part.tokens, part.bytes, part.sha256, part.key)
            table = None
        else:
            table = stored_table(part)
            if part.table_name == "rollouts" and not part.checked:  # no path skips finite floats
                check_finite(table, kind)
            rel = part.relpath()
            tmp_rel = os.path.join("tmp", owned_name("tmp", ".parquet"))
            self.manifest.intend([tmp_rel, rel])  # intents on its temporary and final names before any byte
            nbytes, digest = publish_file(table, self.root, rel, is_orphan, tmp_rel, durable)
            new = NewShard(part.table_name, rel, table.num_rows, token_count(table), nbytes, digest, part.key,
                           finite=part.table_name == "rollouts")  # finite here: checked above or by its caller
        return new, os.stat(os.path.join(self.root, new.path)).st_ino, table

    def _unplace(self, placed: list[tuple[NewShard, int]], uploaded: list[str]) -> None:
        """Before COMMIT was sent: remove the files of `placed` that are still ours (same inode) and
        unnamed, and the objects of `uploaded` that no row names (ours: put-if-absent, intents held)."""
        store = self.manifest.store
        for w, inode in placed:
            full = os.path.join(self.root, w.path)
            try:
                # (a store's buffer: the local file is only this host's copy, never the object another
                # writer committed at that path; a cache must not keep it)
                if os.stat(full).st_ino == inode and (store is not None or self.manifest.is_unnamed(w.path)):
                    os.unlink(full)
            except (FileNotFoundError, CatalogError):
                pass
        for rel in uploaded:
            try:
                if self.manifest.is_unnamed(rel):
                    store.delete(rel)
            except RollstoreError:
                pass  # an orphan object

    def _upload(self, store, rel: str) -> None:
        """Put the local file of `rel` into the store if absent. An object already there that no row
        names is a crashed writer's (this writer holds the key's intent): replaced; one a row names
        (another writer committed that path first) raises FileExistsError."""
        full = os.path.join(self.root, rel)
        try:
            store.put_if_absent(rel, full)
        except FileExistsError:
            if not self.manifest.is_unnamed(rel):
                raise
            store.delete(rel)
            store.put_if_absent(rel, full)

    def append_rollouts(
        self, table: pa.Table, source: str = "<memory>", compact: bool = False,
        metadata: dict[str, str] | None = None, also: dict[str, pa.Table] | None = None,
    ) -> Shard:
        """Validate and append one table of rollouts as one shard (all or nothing). `metadata`:
        extra key-value metadata written into the shard's Parquet footer (e.g. an import's lossy
        conversions). `also`: rows of other tables (by name) committed in the same transaction
        (e.g. the prompt selection that chose these rollouts' prompts)."""
        table = validate_rollouts(table, source, self.manifest.existing_ids)
        if compact:
            table = compact_entropies(table)
        ids_only = table.select(["rollout_id", "group_id"])

        def pairs():
            for batch in ids_only.to_batches(max_chunksize=10_000):
                yield from zip(batch.column(0).to_pylist(), batch.column(1).to_pylist())

        def groups():
            distinct = pc.unique(ids_only.column("group_id"))  # in order of first appearance
            for start in range(0, len(distinct), 10_000):
                yield from distinct.slice(start, 10_000).to_pylist()

        def register(con: Any, seq: int, ids: list[int]) -> None:
            try:
                self.manifest.register_rollouts(con, ids[0], pairs(), groups())
            except CatalogConflict:
                # A concurrent append won the race for an id: report it like validation would.
                rids = ids_only.column("rollout_id").to_pylist()
                gids = ids_only.column("group_id").to_pylist()
                taken, groups_taken = self.manifest.existing_ids(rids, sorted(set(gids)))
                rid = next((r for r in rids if r in taken), None)
                if rid is not None:
                    raise ValidationError(source, rid, "rollout_id", "rollout_id already in the buffer") from None
                rid = next(r for r, g in zip(rids, gids) if g in groups_taken)
                raise ValidationError(source, rid, "group_id", "group is already in the buffer") from None

        parts = [Part("rollouts", table, metadata=metadata, checked=True)]  # first: `register` takes ids[0]
        parts += [Part(name, rows) for name, rows in (also or {}).items()]
        _, shards = self.commit(parts, "append", {"source": source}, register)
        return shards[0]

    def append(self, table_name: str, table: pa.Table, key: str | None = None) -> Shard:
        """Append rows to a non-rollout table (training, evaluations, ...) as one shard."""
        _, shards = self.commit([Part(table_name, table, key)], f"append:{table_name}")
        return shards[0]

    # ---- consumers -------------------------------------------------------------------------
    def lease(self, table: str, n: int, consumer: str, group: str = "default", ttl: float = 600.0):
        return self.manifest.lease(table, n, consumer, group, ttl)

    def ack(self, shards: list[Shard] | list[int], consumer: str, group: str = "default") -> int:
        ids = [s.shard_id if isinstance(s, Shard) else int(s) for s in shards]
        return self.manifest.ack(ids, consumer, group)
