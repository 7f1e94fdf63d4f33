"""Crash-safe Parquet shard files.

Invariants:
- A shard file appears at its final path only complete and fsynced: it is written under `tmp/`
  (as `tmp-<host>-<pid>-<hex>.parquet`, so gc can tell that its writer lives: `storage.owners`),
  fsynced, hard-linked into place (a link never overwrites), the temp name unlinked and the
  directory fsynced. Until the manifest row is committed the file is an orphan that `gc` removes.
- A file already at the final path is replaced only when the caller's `is_orphan(relpath)` says no
  manifest row names it (a crashed run's leftover is never trusted, a committed file never touched);
  otherwise FileExistsError.
- Float32 lists are stored as float32 with BYTE_STREAM_SPLIT on their leaf path and zstd level 3;
  row groups are sized in bytes, not rows.
- `compact_entropies` only ever touches `entropies`, never log-probs.
"""

from __future__ import annotations

import hashlib
import math
import os
import uuid
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .owners import owned_name

ROW_GROUP_BYTES = 96 * 1024 * 1024
MIN_GROUP_BYTES = 8 * 1024 * 1024
READ_THREADS = max(1, os.cpu_count() or 1)


def _float_leaf_paths(schema: pa.Schema) -> tuple[list[str], list[str]]:
    """(byte-stream-split leaf paths, dictionary-encoded columns) for a schema."""
    split, dictionary = [], []
    for field in schema:
        t = field.type
        if pa.types.is_list(t) and pa.types.is_floating(t.value_type):
            split.append(f"{field.name}.list.element")
        elif pa.types.is_floating(t):
            split.append(field.name)
        elif pa.types.is_string(t):
            dictionary.append(field.name)
    return split, dictionary


def rows_per_group(table: pa.Table, target_bytes: int = ROW_GROUP_BYTES, threads: int | None = None) -> int:
    """Rows per row group: ~target_bytes each, and at least `threads` (default READ_THREADS, this
    host's cores) groups for big files."""
    threads = threads or READ_THREADS
    n = max(1, table.num_rows)
    per_row = max(1, table.nbytes // n)
    rows = max(1, target_bytes // per_row)
    if table.nbytes >= MIN_GROUP_BYTES * threads:
        rows = min(rows, math.ceil(n / threads))
    return int(min(rows, n))


def write_parquet(table: pa.Table, path: str, threads: int | None = None) -> None:
    """Write `table` to `path` with rollstore's encodings and fsync it. `threads` sizes the row
    groups (default: this host's READ_THREADS); a writer on another host passes the committer's,
    so that where a file is written does not change its bytes."""
    split, dictionary = _float_leaf_paths(table.schema)
    with open(path, "wb") as fh:
        pq.write_table(
            table,
            fh,
            compression="zstd",
            compression_level=3,
            use_dictionary=dictionary,
            use_byte_stream_split=split,
            row_group_size=rows_per_group(table, threads=threads),
            write_statistics=True,
        )
        fh.flush()
        os.fsync(fh.fileno())


def fsync_dir(path: str) -> None:
    """fsync a directory or a file by path (O_RDONLY works for both)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def new_shard_name() -> str:
    """Time-ordered, collision-free file stem."""
    return f"{os.getpid():x}-{uuid.uuid4().hex}"


def _link(tmp: str, final: str, relpath: str, is_orphan: Callable[[str], bool] | None) -> None:
    """Hard-link tmp to final; if final exists and `is_orphan(relpath)`, atomically replace it."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        if is_orphan is None or not is_orphan(relpath):
            raise
        os.replace(tmp, final)


def publish_file(table: pa.Table, root: str, relpath: str,
                 is_orphan: Callable[[str], bool] | None = None, tmp_relpath: str | None = None) -> tuple[int, str]:
    """Write `table` atomically to root/relpath; return (bytes, sha256). Never overwrites, except
    an orphan (see the module's invariants). `tmp_relpath`: the temporary name to write first (one
    the caller already named in its catalog's intents; default a fresh owned name under tmp/)."""
    tmp = os.path.join(root, tmp_relpath or os.path.join("tmp", owned_name("tmp", ".parquet")))
    final = os.path.join(root, relpath)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    try:
        write_parquet(table, tmp)
        digest = sha256_file(tmp)
        _link(tmp, final, relpath, is_orphan)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fsync_dir(os.path.dirname(final))
    fsync_dir(os.path.join(root, "tmp"))
    return os.path.getsize(final), digest


def write_tmp(table: pa.Table, root: str, folder: str = "tmp", threads: int | None = None) -> tuple[str, int, str]:
    """Write `table` complete and fsynced to a fresh name in root/<folder>, an existing folder under
    `tmp/` (never created here: once its owner removed it, a late writer fails instead of leaving a
    file); return (path relative to root, bytes, sha256). The file stays an orphan (never read,
    collected by `gc`) until `link_into_place` publishes it and its manifest row commits. Used when
    the writer is another process than the committer (a Dask worker writes, the client commits)."""
    rel = os.path.join(folder, owned_name("tmp", ".parquet"))
    _check_inside(root, rel, "tmp")
    path = os.path.join(root, rel)
    write_parquet(table, path, threads)
    return rel, os.path.getsize(path), sha256_file(path)


def link_into_place(root: str, tmp_rel: str, final_rel: str, nbytes: int,
                    is_orphan: Callable[[str], bool] | None = None) -> None:
    """Publish a file `write_tmp` wrote (maybe on another host): check its size, fsync it, hard-link
    it to root/final_rel (a link never overwrites: FileExistsError), unlink the temp name, fsync
    both directories — the same steps and crash safety as `publish_file`."""
    _check_inside(root, tmp_rel, "tmp")
    tmp, final = os.path.join(root, tmp_rel), os.path.join(root, final_rel)
    if _inside(root, final_rel, "tmp") or not _inside(root, final_rel, ""):
        raise ValueError(f"{final_rel}: a published file lives inside the buffer, outside tmp/")
    size = os.path.getsize(tmp)
    if size != nbytes:
        raise OSError(f"{tmp}: {size} bytes on disk, but its writer reported {nbytes}")
    fsync_dir(tmp)  # O_RDONLY + fsync works on files too: durable whoever wrote it
    os.makedirs(os.path.dirname(final), exist_ok=True)
    _link(tmp, final, final_rel, is_orphan)
    if os.path.exists(tmp):
        os.unlink(tmp)
    fsync_dir(os.path.dirname(final))
    fsync_dir(os.path.dirname(tmp))


def _inside(root: str, rel: str, top: str) -> bool:
    base = os.path.realpath(os.path.join(root, top))
    full = os.path.realpath(os.path.join(root, rel))
    return not os.path.isabs(rel) and full != base and os.path.commonpath([full, base]) == base


def _check_inside(root: str, rel: str, top: str) -> None:
    if not _inside(root, rel, top):
        raise ValueError(f"{rel}: expected a path under {top}/ of the buffer")


def compact_entropies(table: pa.Table) -> pa.Table:
    """Round `entropies` to bf16 precision (nearest, ties to even; low 16 mantissa bits zero), kept
    as float32: relative error <= 2^-8, like a real bf16 cast (plain truncation would be 2^-7)."""
    if "entropies" not in table.column_names:
        return table
    col = table.column("entropies").combine_chunks()
    if col.null_count == len(col):
        return table
    values = np.asarray(col.values.to_numpy(zero_copy_only=False), dtype=np.float32).copy()
    bits = values.view(np.uint32)
    rounded = (bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)).astype(np.uint32) & np.uint32(0xFFFF0000)
    finite = np.isfinite(values)
    overflow = finite & ~np.isfinite(rounded.view(np.float32))  # only at float32's largest values
    bits[:] = np.where(finite & ~overflow, rounded, bits & np.uint32(0xFFFF0000))
    new = pa.ListArray.from_arrays(col.offsets, pa.array(values, pa.float32()), mask=col.is_null())
    idx = table.column_names.index("entropies")
    return table.set_column(idx, table.schema.field(idx), new)
