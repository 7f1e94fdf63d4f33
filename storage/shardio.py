"""Crash-safe Parquet shard files.

Invariants:
- A shard file is durable before any manifest row names it: it is written under `tmp/` (as
  `tmp-<host>-<pid>-<hex>.parquet`, so gc can tell that its writer lives: `storage.owners`),
  hard-linked into place (a link never overwrites) and the temp name unlinked; the file, its
  folder and the parent of every folder made for it are fsynced — by `publish_file` itself, or,
  handed a `Durable`, all files and folders of one commit at once, on threads, by `Durable.flush`,
  which the committer calls before its manifest transaction. Until the manifest row is committed
  the file is an orphan that `gc` removes (also when a crash left it at its final name before
  the flush: nothing names it). The temp name's removal needs no fsync: a temp name that comes
  back after a power loss is an orphan too.
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
from concurrent.futures import ThreadPoolExecutor
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


def write_parquet(table: pa.Table, path: str, threads: int | None = None, fsync: bool = True) -> None:
    """Write `table` to `path` with rollstore's encodings and fsync it (`fsync=False`: the caller
    does, `Durable`). `threads` sizes the row groups (default: this host's READ_THREADS); a writer
    on another host passes the committer's, so that where a file is written does not change its bytes."""
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
        if fsync:
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


class Durable:
    """The files and folders of one commit, made durable together (`flush`) before its manifest
    transaction: every fsync at once on a few threads, each folder once, instead of three fsyncs
    in a row per file (the disk's latency, not its bandwidth, is what a small commit waits for)."""

    THREADS = 8

    def __init__(self):
        self.paths: dict[str, None] = {}  # files and folders, in order, each once

    def add(self, *paths: str) -> None:
        for path in paths:
            self.paths.setdefault(path)

    def flush(self) -> None:
        """fsync everything added (raises the first error); then nothing is pending."""
        paths, self.paths = list(self.paths), {}
        if len(paths) <= 1:
            for path in paths:
                fsync_dir(path)
            return
        with ThreadPoolExecutor(max_workers=min(self.THREADS, len(paths)), thread_name_prefix="rollstore-fsync") as pool:
            for _ in pool.map(fsync_dir, paths):
                pass


def make_folder(path: str) -> list[str]:
    """`os.makedirs(path, exist_ok=True)`; returns the parents of the folders that did not exist
    (a new folder's own entry is durable once its parent is fsynced)."""
    missing, at = [], path
    while at and not os.path.isdir(at):
        missing.append(at)
        parent = os.path.dirname(at)
        if parent == at:
            break
        at = parent
    os.makedirs(path, exist_ok=True)
    return [os.path.dirname(m) for m in missing]


def publish_file(table: pa.Table, root: str, relpath: str,
                 is_orphan: Callable[[str], bool] | None = None, tmp_relpath: str | None = None,
                 durable: Durable | None = None) -> tuple[int, str]:
    """Write `table` atomically to root/relpath; return (bytes, sha256). Never overwrites, except
    an orphan (see the module's invariants). `tmp_relpath`: the temporary name to write first (one
    the caller already named in its catalog's intents; default a fresh owned name under tmp/).
    `durable`: the fsyncs are left to `durable.flush()` (the caller's, before its commit)."""
    tmp = os.path.join(root, tmp_relpath or os.path.join("tmp", owned_name("tmp", ".parquet")))
    final = os.path.join(root, relpath)
    parents = make_folder(os.path.dirname(final))
    try:
        write_parquet(table, tmp, fsync=durable is None)
        digest = sha256_file(tmp)
        _link(tmp, final, relpath, is_orphan)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if durable is not None:
        durable.add(final, os.path.dirname(final), *parents)
    else:
        for folder in [os.path.dirname(final), *parents]:
            fsync_dir(folder)
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
                    is_orphan: Callable[[str], bool] | None = None, durable: Durable | None = None) -> None:
    """Publish a file `write_tmp` wrote (maybe on another host): check its size, hard-link it to
    root/final_rel (a link never overwrites: FileExistsError), unlink the temp name and fsync the
    file, its folder and the parents of folders made for it (or leave them to `durable`) — the same
    steps and crash safety as `publish_file`."""
    _check_inside(root, tmp_rel, "tmp")
    tmp, final = os.path.join(root, tmp_rel), os.path.join(root, final_rel)
    if _inside(root, final_rel, "tmp") or not _inside(root, final_rel, ""):
        raise ValueError(f"{final_rel}: a published file lives inside the buffer, outside tmp/")
    size = os.path.getsize(tmp)
    if size != nbytes:
        raise OSError(f"{tmp}: {size} bytes on disk, but its writer reported {nbytes}")
    parents = make_folder(os.path.dirname(final))
    _link(tmp, final, final_rel, is_orphan)
    if os.path.exists(tmp):
        os.unlink(tmp)
    paths = [final, os.path.dirname(final), *parents]  # O_RDONLY + fsync works on files too: durable whoever wrote it
    if durable is not None:
        durable.add(*paths)
    else:
        for path in paths:
            fsync_dir(path)


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
