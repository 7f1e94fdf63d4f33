"""The descriptor of a buffer whose catalog is not the embedded SQLite manifest: a small JSON file,
`BUFFER/catalog.json`, that says where the catalog lives and which buffer it is.

    {"rollstore_descriptor": 1, "buffer_uuid": "<32 hex>", "catalog": "postgresql://host/db"}

and, for a buffer whose shards live in object storage, `"data": "s3://bucket/prefix"` (then the
folder is host-local: this file and a read cache; `storage/store.py`).

Invariants:
- A buffer folder holds either `manifest.sqlite` (the embedded default, unchanged) or this file,
  never both; a folder with neither is not a buffer.
- The file is written once, by `rollstore init BUF --catalog ...`, complete and fsynced before it
  is renamed into place: a reader sees no descriptor or a whole one.
- `buffer_uuid` is also stored in the catalog (`meta.buffer_uuid`); opening checks that the two are
  equal, so a descriptor never reads or writes another buffer's catalog.
- The DSN is stored as given. A password belongs in libpq's own places (PGPASSWORD, a
  ~/.pgpass file, PGSERVICEFILE), not here: `redact` removes one from every message, and the SQL
  sandbox never reads this file (only the buffer's data folders: queries/session.py).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from .errors import ManifestError

DESCRIPTOR = "catalog.json"
VERSION = 1
SCHEMES = ("postgresql://", "postgres://")


@dataclass(frozen=True)
class Descriptor:
    buffer_uuid: str
    catalog: str  # the catalog's DSN, e.g. postgresql://user@host:5432/db
    data: str | None = None  # where the shards' bytes live: s3://bucket/prefix (None: this folder)


def path_of(root: str) -> str:
    return os.path.join(root, DESCRIPTOR)


def exists(root: str) -> bool:
    return os.path.exists(path_of(root))


def redact(dsn: str) -> str:
    """`dsn` without a password (URL form `user:secret@` or keyword form `password=secret`)."""
    dsn = re.sub(r"(://[^:/@?#]*):[^@/?#]*@", r"\1:***@", dsn)
    return re.sub(r"(password\s*=\s*)('[^']*'|\S+)", r"\1***", dsn, flags=re.IGNORECASE)


def check_dsn(dsn: str) -> str:
    """`dsn` if it names a catalog rollstore knows (PostgreSQL), else one line saying why not."""
    if not isinstance(dsn, str) or not dsn.startswith(SCHEMES):
        raise ManifestError(f"--catalog {redact(str(dsn))}: not a catalog rollstore knows "
                            "(give postgresql://[user@]host[:port]/database)")
    return dsn


def read(root: str) -> Descriptor:
    """The descriptor of the buffer at `root`; one line if it is unreadable or not a descriptor."""
    path = path_of(root)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path}: not a readable rollstore descriptor ({exc})") from None
    if not isinstance(data, dict) or data.get("rollstore_descriptor") != VERSION:
        raise ManifestError(f"{path}: not a rollstore descriptor of version {VERSION}")
    uuid, dsn = data.get("buffer_uuid"), data.get("catalog")
    if not isinstance(uuid, str) or not re.fullmatch(r"[0-9a-f]{32}", uuid) or not isinstance(dsn, str):
        raise ManifestError(f"{path}: a rollstore descriptor needs buffer_uuid (32 hex) and catalog (a DSN)")
    data = data.get("data")
    if data is not None and (not isinstance(data, str) or not data.startswith("s3://")):
        raise ManifestError(f"{path}: data must be s3://bucket/prefix when given")
    return Descriptor(uuid, check_dsn(dsn), data)


def write(root: str, desc: Descriptor) -> None:
    """Write the descriptor of `root` atomically (temporary file, fsync, rename, fsync the folder)."""
    path = path_of(root)
    tmp = f"{path}.tmp-{os.getpid()}"
    fields = {"rollstore_descriptor": VERSION, "buffer_uuid": desc.buffer_uuid, "catalog": desc.catalog}
    if desc.data is not None:
        fields["data"] = desc.data
    body = json.dumps(fields, indent=1) + "\n"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
