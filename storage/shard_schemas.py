"""Each shard's Arrow schema, recorded in the catalog by the commit that adds the shard, so that a
reader of a table's every file need not open every footer to learn its columns.

Invariants:
- A schema is recorded as written: its fields (names, types, nullability, field metadata), without
  the schema's key-value metadata (a file's own, such as a curation's), serialised by Arrow IPC. Its
  id is the sha256 of that body; a table's thousands of shards share a few bodies.
- `Buffer.commit` records every new shard's schema in the transaction that adds it
  (`record_schemas`): a rollouts, selections or curated part from the table it writes, a file
  written elsewhere from its footer, read once as it is placed.
- `declare` makes the recorded schemas of a snapshot's shards known to this process, each with the
  shard's recorded size; `declared` answers for a path only while the file there has that size
  (`storage.snapshot.file_schema` reads the footer otherwise, and for any shard without a record:
  committed before the catalog kept them). What is declared answers the questions a reader asks
  of a footer's schema (which columns; whether two files' schemas differ), not the file's bytes:
  those are checked by size where it is bound and by sha256 where it is verified.
- The registry is bounded (`LIMIT` paths; emptied past it): a long-lived process declares the new
  shards of each step.
"""

from __future__ import annotations

import hashlib
import threading

import pyarrow as pa

LIMIT = 1 << 17  # paths declared at most before the registry is emptied
_declared: dict[str, tuple[int, pa.Schema]] = {}  # absolute path -> (recorded bytes, schema)
_bodies: dict[str, pa.Schema] = {}  # hex body -> schema (each distinct schema once)
_lock = threading.Lock()


def schema_record(schema: pa.Schema) -> tuple[str, str]:
    """(schema_id, body): the hex of `schema`'s fields serialised, and its sha256 (see the invariants)."""
    body = pa.schema(list(schema)).serialize().to_pybytes().hex()
    return hashlib.sha256(body.encode()).hexdigest()[:32], body


def record_schemas(catalog, con, ids: list[int], schemas: list[pa.Schema]) -> None:
    """Inside the commit's transaction `con`: each new shard's schema (`ids[i]`'s is `schemas[i]`)."""
    rows, bodies = [], {}
    for shard_id, schema in zip(ids, schemas):
        schema_id, body = schema_record(schema)
        rows.append((int(shard_id), schema_id))
        bodies[schema_id] = body
    if rows:
        catalog.record_schemas(con, rows, bodies)


def _schema_of(body: str) -> pa.Schema:
    got = _bodies.get(body)
    if got is None:
        got = _bodies.setdefault(body, pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(body))))
    return got


def declare(catalog, root: str, shards) -> None:
    """Make the recorded schemas of `shards` (catalog `Shard`s under `root`) known to this process."""
    import os

    by_id = {s.shard_id: s for s in shards}
    recorded = catalog.shard_schemas(list(by_id))
    with _lock:
        if len(_declared) + len(recorded) > LIMIT:
            _declared.clear()
        for shard_id, body in recorded.items():
            s = by_id[shard_id]
            _declared[os.path.join(root, s.path)] = (int(s.bytes), _schema_of(body))


def declared(path: str, size: int) -> pa.Schema | None:
    """The recorded schema of the shard at `path` (absolute, as declared), if the file there has its size."""
    hit = _declared.get(path)
    return hit[1] if hit is not None and hit[0] == size else None


def forget() -> None:
    """Empty the registry (a process's caches, as a resumed process starts)."""
    with _lock:
        _declared.clear()
