"""Readers over one snapshot of a buffer: DuckDB views, Polars LazyFrames, pyarrow Datasets.

Invariants:
- A snapshot is a manifest sequence number; its file list comes from the manifest, never from
  listing a directory, so a reader sees exactly the shards committed at that seq while writers go on.
- A snapshot older than the last seq whose retired shards `gc` deleted is refused, never read with
  shards missing.
- Every table of `schema.TABLES` is readable, also when it has no shard yet (an empty relation of
  the contract's schema). `curated` reads resolved (schema `CURATED`: thin shards' references
  joined to the snapshot's live rollouts rows, through the manifest's `moved` chain for shards
  that compaction retired: `moves`) in the DuckDB view, `arrow` and `polars`.
- A pin is best-effort: when the manifest cannot be written (disk full) a snapshot still reads.
- Files are handed to an engine only after a stat shows each exists with its recorded size (a
  deleted or truncated shard is one error line); `verify` also checks sha256 (storage.verify).
"""

from __future__ import annotations

import datetime as dt
import functools
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from .catalog import Catalog, Shard
from .catalog_sql import STEP_INDEXED
from .errors import CatalogError, ManifestError, UnknownName, did_you_mean
from .references import is_thin, locate, read_curated_file
from .schema import CURATED, READ_SCHEMAS, RESPONSE_LENGTH, ROLLOUTS, ROLLOUTS_STORED, TABLES
from .shard_schemas import declare, declared
from .store import cache_shards
from .verify import check_present, verify_shards

if TYPE_CHECKING:
    import duckdb
    import pyarrow.dataset as ds
    import polars as pl


def sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _try_pin(manifest: Catalog, seq: int) -> str | None:
    """Pin `seq` if the manifest can be written; on a full (or read-only) disk read without a pin:
    reads must keep working, and a gc meanwhile is the only (rare) risk."""
    try:
        return manifest.pin(seq)
    except CatalogError:  # (busy, a full disk, read-only)
        return None


class Snapshot:
    """The buffer as of manifest commit `seq`. Use as a context manager to pin it against gc."""

    def __init__(self, root: str, manifest: Catalog, seq: int, pin: bool = False):
        self.root = root
        self.seq = seq
        self._manifest = manifest
        self._pin = _try_pin(manifest, seq) if pin else None  # pin before listing: gc keeps what we list
        self._moves: dict[str, tuple[str, int]] | None = None
        try:
            collected, latest = manifest.collected_seq(), manifest.latest_seq()
            if not 0 <= seq <= latest:  # a future seq would change as commits land
                raise ManifestError(f"{root}: no snapshot {seq} (snapshots are 0..{latest})")
            if seq < collected:
                raise ManifestError(
                    f"{root}: snapshot {seq} is no longer readable: gc removed shards retired after it "
                    f"(snapshots >= {collected} are readable)"
                )
            self._collected = collected
            self._shards: dict[str, list[Shard]] = {}  # each table's shards, listed when first asked
        except BaseException:
            self.close()
            raise

    def commits(self) -> pa.Table:
        """Every commit up to this snapshot: seq, created_at, kind (what: append, curation, checkpoint,
        compact, ...), detail (JSON) and host (the writing host on a shared catalog; null in an
        embedded manifest). Read from the catalog, so call it before a fork (`rollstore sql` does)."""
        rows = self._manifest.commit_log(self.seq)
        cols = list(zip(*rows)) if rows else [[], [], [], [], []]
        return pa.table({
            "seq": pa.array(cols[0], pa.int64()),
            "created_at": pa.array([dt.datetime.fromtimestamp(t, dt.timezone.utc) for t in cols[1]],
                                   pa.timestamp("us", tz="UTC")),
            "kind": pa.array(cols[2], pa.string()),
            "detail": pa.array(cols[3], pa.string()),
            "host": pa.array(cols[4], pa.string()),
        })

    def _check_readable(self) -> None:
        """Raise one line when gc collected shards retired after this snapshot since it was opened (an
        unpinned snapshot kept open): the catalog no longer knows what it read, nor do its files exist."""
        if self.seq < self._manifest.collected_seq():
            raise ManifestError(f"{self.root}: snapshot {self.seq} is no longer readable: gc removed shards "
                                f"retired after it (pin it while reading: `with buf.snapshot(pin=True)`)")

    def hold(self):
        """A pin of this snapshot owned by the caller, which outlives this object's own (`with`): for a
        reader that keeps reading its files after it (a DuckDB session kept between a loop's steps,
        `queries.session.Session`), so that `compact` and `gc` meanwhile remove none of them (it keeps
        shards' files only, `Catalog.pin_shards`: no checkpoint's, which a session never loads). Returns
        the function that releases it (a pin expires by itself after an hour; on a read-only manifest
        nothing is held)."""
        try:  # a pin of shards only: pruned checkpoints' folders go as if it were not there
            pin = self._manifest.pin_shards(self.seq)
        except CatalogError:
            pin = None

        def release() -> None:
            if pin is not None:
                try:
                    self._manifest.unpin(pin)
                except CatalogError:
                    pass  # the pin expires by itself
        return release

    def close(self) -> None:
        if self._pin is not None:
            try:
                self._manifest.unpin(self._pin)
            except CatalogError:
                pass  # the pin expires by itself
            self._pin = None

    def __repr__(self) -> str:
        return f"<Snapshot {self.root!r} @ {self.seq}{', pinned' if self._pin else ''}>"

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _listed(self, table: str) -> list[Shard]:
        """`table`'s shards, listed by the catalog the first time they are asked for (a loop's step
        asks for few tables, and for those through the step index: no listing of the others)."""
        if table not in TABLES:
            raise UnknownName(f"no table {table!r} in a rollstore buffer{did_you_mean(table, TABLES)} "
                              f"(tables: {', '.join(TABLES)})")
        got = self._shards.get(table)
        if got is None:
            got = self._manifest.shards(table, self.seq)
            self._check_readable()  # (after the listing: a gc between the two cannot go unseen)
            self._shards[table] = got
        return got

    def _table(self, table: str) -> list[Shard]:
        """The shards of `table`; a name that is not a table is one `UnknownName` line. A buffer
        whose shards live in object storage has them in its host-local cache first (verified by
        sha256 as they download; curated shards bring the rollouts shards they refer to)."""
        shards = self._listed(table)
        if self._manifest.store is not None:  # (each time: `trim_cache` may have removed a copy)
            for name in (table, "rollouts") if table == "curated" else (table,):
                cache_shards(self.root, self._manifest, self._listed(name))
        return shards

    def shards_after(self, table: str, seq: int) -> list[Shard]:
        """The shards of `table` this snapshot sees that commits after `seq` added, in commit order, by
        the catalog's index (what a reader of snapshot `seq` has not seen), in the host's cache."""
        if table not in TABLES:
            raise UnknownName(f"no table {table!r} in a rollstore buffer")
        if table in self._shards:
            return [s for s in self._shards[table] if s.added_seq > seq]
        shards = self._manifest.shards(table, self.seq, after=seq)
        self._check_readable()
        if self._manifest.store is not None:
            cache_shards(self.root, self._manifest, shards)
        return shards

    def newest_files(self) -> list[str]:
        """The rollouts files that may hold this snapshot's newest row by `created_at` (the default
        batch's latest step is among their rows): by the catalog's time index, or every file."""
        ids = self._manifest.newest_shard_ids("rollouts", self.seq)
        if ids is None:
            return self.files("rollouts")
        shards = sorted(self._manifest.shards_by_id(sorted(ids)), key=lambda s: (s.added_seq, s.shard_id))
        self._check_readable()
        if self._manifest.store is not None:
            cache_shards(self.root, self._manifest, shards)
        return [os.path.join(self.root, s.path) for s in shards]

    def rollout_shards(self, rollout_ids: list[str]) -> dict[str, int]:
        """{rollout_id: the live rollouts shard holding it} (`Catalog.rollout_shards`: live, not as of
        this snapshot: a caller checks the shard is among this snapshot's)."""
        return self._manifest.rollout_shards(rollout_ids)

    def shard_keys(self, ids: list[int]) -> dict[int, list[str]]:
        """{shard_id: its keys} of those of `ids` that compaction merged from several keys (audit shards
        of several curations; `Catalog.shard_keys`)."""
        return self._manifest.shard_keys(ids)

    def written_by_compaction(self, shards: list[Shard]) -> bool:
        """Whether compaction wrote rows of other (older) shards into one of these rollouts shards."""
        return bool(self._manifest.merge_targets([s.path for s in shards]))

    def table_keys(self) -> dict[str, tuple]:
        """Per table, a key that changes whenever the table's view over this snapshot would
        (`Catalog.table_stamp`; `curated`'s also with the rollouts', whose rows it joins): a session
        compares them to know which views a rebind must make again, without listing any shard."""
        keys = {name: self._manifest.table_stamp(name, self.seq) for name in TABLES}
        keys["curated"] += keys["rollouts"]
        return keys

    def shards(self, table: str) -> list[Shard]:
        return list(self._table(table))

    def files(self, table: str) -> list[str]:
        return [os.path.join(self.root, s.path) for s in self._table(table)]

    def step_files(self, table: str, run_id: str, first: int | None = None, last: int | None = None) -> list[str]:
        """The files of `table` (`rollouts` or `prompt_selections`) that may hold a row of `run_id` with a
        step in [`first`, `last`] (None: unbounded), by the catalog's step index
        (`Catalog.step_shard_ids`), in commit order: what a query of one run's steps reads, however
        many shards the history holds. A superset of the files that hold such rows, never a subset."""
        return [os.path.join(self.root, s.path) for s in self.step_shards(table, run_id, first, last)]

    def step_shards(self, table: str, run_id: str, first: int | None = None, last: int | None = None) -> list[Shard]:
        """The shards `step_files` names."""
        if table not in STEP_INDEXED:
            raise ValueError(f"no step index of table {table!r} (only {', '.join(STEP_INDEXED)})")
        ids = self._manifest.step_shard_ids(table, run_id, first, last, self.seq)
        shards = sorted(self._manifest.shards_by_id(sorted(ids)), key=lambda s: (s.added_seq, s.shard_id))
        self._check_readable()  # (after the look-ups: a gc between them cannot go unseen)
        if self._manifest.store is not None:  # only these into the host's cache
            cache_shards(self.root, self._manifest, shards)
        return shards

    def prompt_state(self, run_id: str, prompt_ids: list[str] | None = None) -> tuple[tuple, dict] | None:
        """The run's prompt state as kept by the catalog (`Catalog.prompt_state`, `storage.prompt_state`)
        when it is this snapshot's: None when the run's state is not kept, or a later commit than this
        snapshot changed it (the caller reads the shards instead)."""
        got = self._manifest.prompt_state(run_id, prompt_ids)
        if got is None or got[0][4] > self.seq:
            return None
        return got

    def newest_checkpoints(self, runs: list[str]) -> dict[str, int] | None:
        """{run: the newest checkpoint version of this snapshot} of those of `runs` that have one, by
        the catalog's checkpoint index (`Catalog.checkpoint_index`, one look-up a run); None when a
        visible checkpoints shard has no index row (its version is only in its file: read the files)."""
        out: dict[str, int] = {}
        for run in runs:
            rows, unindexed = self._manifest.checkpoint_index(self.seq, run_id=run, newest=True)
            if unindexed:
                return None
            if rows:
                out[run] = int(rows[0][1])
        return out

    def rows(self, table: str) -> int:
        return sum(s.rows for s in self._table(table))

    def arrow(self, table: str, resolved: bool = True) -> ds.Dataset:
        """A dataset of `table`'s rows. `curated` comes resolved (schema `CURATED`: references
        joined to the rollouts rows, in memory) unless `resolved=False` (the stored references)."""
        import pyarrow.dataset as ds  # here, not at import: it costs every process ~0.25 s to load

        files = self.files(table)  # an unknown table is one line
        if table == "curated" and resolved:
            return ds.dataset(self.curated())
        if not files:
            return ds.dataset(pa.Table.from_batches([], schema=TABLES[table]))
        return ds.dataset(files, schema=TABLES[table], format="parquet")

    def finite_files(self, shards: list[Shard] | None = None) -> frozenset[str]:
        """The rollouts files (absolute paths, as `files`) whose content was checked finite when it
        was committed (`Manifest.finite_checked`, by sha256): a caller that verifies a file's sha256
        before it commits anything from it need not decode its floats to look for NaN again. Of
        `shards` (those a caller reads) when given, else of every rollouts shard."""
        shards = self._listed("rollouts") if shards is None else shards
        checked = self._manifest.finite_checked(sorted({s.sha256 for s in shards}))
        return frozenset(os.path.join(self.root, s.path) for s in shards if s.sha256 in checked)

    def moves(self) -> dict[str, tuple[str, int]]:
        """{retired rollouts shard path: (the shard of this snapshot its rows are in, the offset of
        its row 0 there)} for every shard compaction retired whose rows are in this snapshot."""
        if self._moves is None:
            live = {s.path for s in self._listed("rollouts")}
            moved = self._manifest.moves()
            found = {rel: locate(rel, self.root, live, moved) for rel in moved if rel not in live}
            self._moves = {rel: at for rel, at in found.items() if at is not None}
        return self._moves

    def curated(self) -> pa.Table:
        """Every curated row of this snapshot, resolved (schema `CURATED`), in manifest order."""
        live = [s.path for s in self._listed("rollouts")]
        moves = self.moves()
        tables = [read_curated_file(f, self.root, live, moves) for f in self.files("curated")]
        return pa.concat_tables(tables) if tables else CURATED.empty_table()

    def polars(self, table: str) -> "pl.LazyFrame":
        """A LazyFrame of `table`'s rows (`curated` resolved, as `arrow`)."""
        import polars as pl

        self._table(table)
        if table == "curated":  # resolved, as `arrow`
            return pl.from_arrow(self.curated()).lazy()
        files = self.files(table)
        if not files:
            return pl.from_arrow(pa.Table.from_batches([], schema=TABLES[table])).lazy()
        # a list of exact files: no globbing ("[" in a path) and no hive columns ("k=v" in a path)
        if table == "rollouts":  # the import contract, as `arrow`: shards of version 2 and 3 read alike
            return pl.scan_parquet(files, glob=False, hive_partitioning=False, schema=pl.Schema(
                pl.from_arrow(ROLLOUTS.empty_table()).schema), extra_columns="ignore")
        return pl.scan_parquet(files, glob=False, hive_partitioning=False)

    def check_present(self, tables: list[str] | None = None, since: "Snapshot | None" = None) -> None:
        """Raise one line for the first shard whose file is missing or of the wrong size (cheap).
        `since`: a snapshot of this buffer whose shards were checked already and are pinned by the caller
        (a session's previous one): only the shards it does not have are checked."""
        folders: dict = {}  # each folder checked once for all tables
        for name in tables or list(TABLES):
            if since is not None and since.seq <= self.seq:  # what `since` sees, this one sees only if added
                shards = self.shards_after(name, since.seq)  # at or before its seq: the rest, by the index
            else:
                shards = self._table(name)
            check_present(self.root, shards, folders)

    def check_shards(self, shards: list[Shard]) -> None:
        """`check_present` of these shards only (those a caller reads, from this snapshot's listings)."""
        check_present(self.root, shards, {})

    def verify_shards(self, shards: list[Shard]) -> "Snapshot":
        """`verify` of these shards only (those a caller reads, from this snapshot's listings)."""
        verify_shards(self.root, shards, {})
        return self

    def verify(self, tables: list[str] | None = None) -> "Snapshot":
        """Raise one line for the first shard whose file is not the manifest's (size and sha256);
        call before the data is used for anything committed. Returns the snapshot."""
        folders: dict = {}  # each folder checked once for all tables
        for name in tables or list(TABLES):
            verify_shards(self.root, self._table(name), folders)
        return self

    def declare_schemas(self, shards: list[Shard]) -> None:
        """Make the catalog's records of these shards' schemas known to this process (`file_schema`
        then reads none of their footers: `storage.shard_schemas`)."""
        declare(self._manifest, self.root, shards)

    def register_duckdb(self, con: "duckdb.DuckDBPyConnection", tables: list[str] | None = None,
                        checked: bool = False, schema: str = "") -> None:
        """Create a view per table (named as the table) over this snapshot's files, after checking
        that every file is there with its recorded size (unless the caller just did: `checked`)."""
        if not checked:
            self.check_present(tables)
        curated = tables is None or "curated" in tables  # (the only view that follows moved rows)
        names = set(tables or TABLES) | ({"rollouts"} if curated else set())
        self.declare_schemas([s for name in sorted(names) for s in self._listed(name)])
        _register_duckdb(con, self.files, tables, self.root, self.moves() if curated else None, schema)

    def frozen(self) -> "SnapshotFiles":
        """This snapshot's file lists as a plain, picklable value (for processes that must not open
        the manifest, e.g. Dask workers on other hosts); it does not pin anything."""
        return SnapshotFiles(self.root, self.seq, {name: tuple(self.files(name)) for name in TABLES}, self.moves())


@dataclass(frozen=True)
class SnapshotFiles:
    """A snapshot's absolute file paths per table, taken from the manifest by the process that holds
    the pin. Reads exactly those files, like `Snapshot`; the holder keeps them from gc."""

    root: str
    seq: int
    listing: dict
    moves: dict = field(default_factory=dict)  # `Snapshot.moves`

    def files(self, table: str) -> list[str]:
        return list(self.listing[table])

    def register_duckdb(self, con: "duckdb.DuckDBPyConnection", tables: list[str] | None = None) -> None:
        _register_duckdb(con, self.files, tables, self.root, self.moves)

    def prompt_state(self, run_id: str, prompt_ids: list[str] | None = None) -> None:
        """None: a listing has no catalog to keep a run's prompt state (its reader reads the shards)."""
        return None

    def newest_checkpoints(self, runs: list[str]) -> None:
        """None: a listing has no checkpoint index (its reader reads the checkpoint files)."""
        return None

    def step_files(self, table: str, run_id: str, first: int | None = None, last: int | None = None) -> list[str]:
        """[]: a listing has no step index (its reader reads every file of the table)."""
        return []

    def hold(self):
        """Nothing to hold: the process that made the listing pins it. Returns a no-op release."""
        return lambda: None

    def table_keys(self) -> dict[str, tuple]:
        """As `Snapshot.table_keys`: here, each table's files (`curated`: with the rollouts files and the
        moves its references follow)."""
        keys = {name: tuple(self.listing[name]) for name in TABLES}
        keys["curated"] += (keys["rollouts"], tuple(sorted(self.moves.items())))
        return keys


_SCHEMAS: dict[bytes, pa.Schema] = {}  # each distinct schema once (serialised -> schema)


@functools.lru_cache(maxsize=65536)
def _schema(path: str, size: int, mtime_ns: int) -> pa.Schema:
    schema = pq.read_schema(path)  # (kept once per distinct schema: a long run's thousands of files share a few)
    return _SCHEMAS.setdefault(schema.serialize().to_pybytes(), schema)


def file_schema(path: str) -> pa.Schema:
    """The Arrow schema of the Parquet file at `path`: the catalog's record of it where a snapshot
    declared one (`storage.shard_schemas`: its fields, no key-value metadata), else from its footer,
    read once per process and file (path, size and modification time: shards are written once,
    never changed in place)."""
    st = os.stat(path)
    return declared(path, st.st_size) or _schema(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=65536)
def _string_range(path: str, size: int, mtime_ns: int, column: str) -> tuple[str, str] | None:
    meta = pq.read_metadata(path)
    if not str(meta.created_by or "").startswith("parquet-cpp"):  # other writers may truncate string statistics
        return None
    index = [i for i in range(meta.num_columns) if meta.schema.column(i).path == column]  # a top-level column
    if not index:
        return None
    low = high = None
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(index[0]).statistics
        if meta.row_group(g).num_rows == 0:
            continue
        if stats is None or not stats.has_min_max or not isinstance(stats.min, str) or stats.null_count:
            return None
        low = stats.min if low is None else min(low, stats.min)
        high = stats.max if high is None else max(high, stats.max)
    return (low, high) if low is not None else ("", "")


def string_range(path: str, column: str) -> tuple[str, str] | None:
    """(smallest, largest) value of the string `column` in the Parquet file at `path`, from its
    row groups' statistics, read once per process and file (as `file_schema`); None when the
    footer cannot tell (no statistics, nulls, a writer other than Arrow's, which may truncate
    them) or cannot be read (whoever reads the file then meets the problem and says so in one line,
    and the inputs' sha256 check names the file): the caller must then assume any value. A file
    without rows gives ("", "")."""
    try:
        st = os.stat(path)
        return _string_range(path, st.st_size, st.st_mtime_ns, column)
    except (OSError, pa.ArrowException):
        return None


def stores_response_length(path: str) -> bool:
    """Whether the rollouts shard at `path` stores `response_length` (schema version 3)."""
    return RESPONSE_LENGTH in file_schema(path).names


def union_option(paths: list[str]) -> str:
    """`, union_by_name = true` when these files' schemas differ (a table that gained a column), else
    nothing: with one schema DuckDB reads the same rows without opening every footer to bind (a
    loop rebinds its session's views every iteration over a growing list of files)."""
    first = None
    for path in paths:
        schema = file_schema(path)
        if first is None:
            first = schema
        elif not schema.equals(first):
            return ", union_by_name = true"
    return ""


def rollouts_relation(paths: list[str], located: bool = False, numbered: bool = False,
                      union_by_name: bool = False) -> str:
    """A relation over these rollouts shards with every stored column and `response_length` (plus
    each row's `filename` when `located`, its position `file_row_number` when `numbered`). Shards
    that store the length (version 3) are read as they are: a scan of the length decodes no token
    list. Shards written before it (version 2) get it computed, `len(response_token_ids)`; a mix
    of both is one relation (UNION ALL BY NAME)."""
    extra = (", filename = true" if located else "") + (", file_row_number = true" if numbered else "") + \
        (union_option(paths) if union_by_name else "")

    def read(files: list[str]) -> str:
        return f"read_parquet([{', '.join(sql_string(p) for p in files)}]{extra}, hive_partitioning = false)"

    old = [p for p in paths if not stores_response_length(p)]
    if not old:
        return read(paths)
    computed = f"SELECT *, len(response_token_ids)::INTEGER AS {RESPONSE_LENGTH} FROM {read(old)}"
    if len(old) == len(paths):
        return f"({computed})"
    new = [p for p in paths if p not in set(old)]
    return f"(SELECT * FROM {read(new)} UNION ALL BY NAME {computed})"


def _register_duckdb(con: "duckdb.DuckDBPyConnection", files_of, tables: list[str] | None, root: str,
                     moves: dict | None = None, schema: str = "") -> None:
    """Views by name; columns are matched by name, since a table may gain columns (shards written
    before a column was added read it as null). `curated` shows the resolved columns (`CURATED`):
    thin shards joined to their rollouts rows, materialised ones as stored (`curated_view`).
    `schema`: the qualified schema to make them in (e.g. `"memory".main.`), when a temp object of
    the same name may exist (a session making its views late)."""
    for name in tables or list(TABLES):
        files = files_of(name)
        if name == "curated" and files:
            if moves:  # a table, not a VALUES list in the view: a long run's thousands of moves bind once
                con.register("_moved_rows", pa.table({"moved": list(moves), "shard": [v[0] for v in moves.values()],
                                                      "row_offset": [v[1] for v in moves.values()]}))
                con.execute(f"CREATE OR REPLACE TABLE {schema}{MOVED_TABLE} AS SELECT * FROM _moved_rows")
                con.unregister("_moved_rows")
            con.execute(f"CREATE OR REPLACE VIEW {schema}curated AS "
                        f"{curated_view(files, files_of('rollouts'), root, bool(moves))}")
        elif name == "rollouts" and files:
            con.execute(f"CREATE OR REPLACE VIEW {schema}rollouts AS SELECT * FROM "
                        f"{rollouts_relation(files, union_by_name=True)}")
        elif files:
            listing = ", ".join(sql_string(f) for f in files)
            con.execute(
                f"CREATE OR REPLACE VIEW {schema}{name} AS "
                f"SELECT * FROM read_parquet([{listing}], hive_partitioning = false{union_option(files)})"
            )
        else:
            empty = pa.Table.from_batches([], schema=ROLLOUTS_STORED if name == "rollouts" else READ_SCHEMAS[name])
            con.register(f"_empty_{name}", empty)
            con.execute(f"CREATE OR REPLACE TABLE {schema}{name} AS SELECT * FROM _empty_{name}")
            con.unregister(f"_empty_{name}")


def register_empty(con: "duckdb.DuckDBPyConnection", root: str) -> None:
    """Each table as an empty table of its columns (what a session's views stand on until it makes them)."""
    _register_duckdb(con, lambda name: [], None, root)


MOVED_TABLE = "_rollstore_moved"  # `Snapshot.moves` as a table of the connection (moved, shard, row_offset)


def curated_view(curated: list[str], rollouts: list[str], root: str, moved: bool = False) -> str:
    """The SELECT of the `curated` view (the `CURATED` columns): thin shards' references joined to
    the snapshot's rollouts rows by (file, row position) — with `moved`, a reference to a compacted
    shard at its place in the shard its rows moved to (the table `MOVED_TABLE`) — the rollout_id
    checked by the join; kept runs expanded to the loss mask; materialised (version 1) shards as
    stored."""
    thin, full = [], []
    for path in curated:
        (thin if is_thin(file_schema(path)) else full).append(path)
    selects = []
    if thin:
        refs = ", ".join(sql_string(f) for f in thin)
        shards = ", ".join(sql_string(f) for f in rollouts) if rollouts else None
        prefix = sql_string(os.path.join(root, ""))
        rows = (f"read_parquet([{shards}], filename = true, file_row_number = true, hive_partitioning = false"
                f"{union_option(rollouts)})" if shards else
                "(SELECT NULL::VARCHAR AS filename, NULL::BIGINT AS file_row_number, NULL::VARCHAR AS rollout_id, "
                "NULL::INTEGER[] AS prompt_token_ids, NULL::INTEGER[] AS response_token_ids, "
                "NULL::FLOAT[] AS gen_logprobs, NULL::FLOAT[] AS old_logprobs WHERE false)")
        join = f"JOIN {rows} r ON r.filename = {prefix} || c.rollouts_shard AND r.file_row_number = c.rollouts_row "
        if moved:  # references to compacted shards: at their rows' place in the shard they moved to
            join = (f"LEFT JOIN {MOVED_TABLE} m ON m.moved = c.rollouts_shard "
                    f"JOIN {rows} r ON r.filename = {prefix} || coalesce(m.shard, c.rollouts_shard) "
                    "AND r.file_row_number = c.rollouts_row + coalesce(m.row_offset, 0) ")
        selects.append(
            "SELECT c.curation_id, c.rollout_id, c.group_id, c.prompt_id, c.policy_version, "
            "r.prompt_token_ids, r.response_token_ids, coalesce(r.old_logprobs, r.gen_logprobs) AS old_logprobs, "
            "r.gen_logprobs, c.advantage, "
            # segment k of the bounds [0, runs..., tokens] is kept when k is odd
            "flatten(list_transform(range(len(c.bounds) - 1), lambda k: "
            "list_resize([]::BOOLEAN[], c.bounds[k + 2] - c.bounds[k + 1], k % 2 = 1))) AS loss_mask, "
            "c.weight FROM (SELECT *, list_concat([0], keep_runs, [tokens]) AS bounds "
            f"FROM read_parquet([{refs}], hive_partitioning = false)) c {join}"
            "AND r.rollout_id = c.rollout_id")
    if full:
        listing = ", ".join(sql_string(f) for f in full)
        names = ", ".join(CURATED.names)
        selects.append(f"SELECT {names} FROM read_parquet([{listing}], hive_partitioning = false{union_option(full)})")
    return " UNION ALL ".join(selects)
