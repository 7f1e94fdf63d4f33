"""Output paths of the command line: `report --out`, `sql --out`, `export --to`.

Invariants:
- An output path is checked BEFORE any work is done, and refused with one line when it lies in a
  buffer's managed files, when its folder does not exist, or when something other than a regular
  file is there: a device (`/dev/null`, `/dev/full`), a FIFO, a socket, a directory or a symbolic
  link. Only a regular file the user named is ever replaced. (`export --to` takes a directory that
  must not exist or be empty, and never a symbolic link.)
- A file is written complete under `.<name>.partial-<host>-<pid>-<hex>` in the target's folder,
  fsynced, then renamed over the target: a reader sees the old file or the new one, never a part.
  The check is repeated right before the rename.
- A killed writer's partial (file or folder) is removed by the next output to the same name, once
  its process is gone (`storage.owners`); a live writer's partial is never touched.
"""

from __future__ import annotations

import os
import shutil
import stat
from typing import Callable

from rollstore.storage.buffer import refuse_managed
from rollstore.storage.errors import RollstoreError
from rollstore.storage.owners import owned_name, owner_gone
from rollstore.storage.shardio import fsync_dir

_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"))


def _what(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _partial_prefix(target: str) -> str:
    return f".{os.path.basename(target)}."


def remove_dead_partials(target: str) -> int:
    """Remove the partials of `target` (beside it) whose writer is gone; returns how many."""
    folder, prefix = os.path.dirname(target), _partial_prefix(target)
    removed = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(prefix) or not owner_gone(name[len(prefix):]):
            continue
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        removed += 1
    return removed


def check_output_file(path: str, option: str = "--out") -> str:
    """The absolute target of an output file, or one error line (see the invariants)."""
    refuse_managed(path, option)
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise RollstoreError(f"{option} {path}: the folder {folder} does not exist")
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return target
    if not stat.S_ISREG(st.st_mode):
        raise RollstoreError(f"{option} {path}: {_what(st.st_mode)} is there; only a regular file is "
                             "ever replaced: choose another path")
    return target


def write_output(path: str, write: Callable[[str], None], option: str = "--out") -> str:
    """Check `path`, let `write(partial)` write the whole content to a fresh partial file beside it,
    fsync it and rename it over `path`. Returns the absolute target."""
    target = check_output_file(path, option)
    remove_dead_partials(target)
    partial = os.path.join(os.path.dirname(target), _partial_prefix(target) + owned_name("partial"))
    try:
        write(partial)
        os.chmod(partial, 0o644)  # a report or a result is meant to be shared
        fd = os.open(partial, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        check_output_file(path, option)  # nothing else appeared there meanwhile
        os.replace(partial, target)
        fsync_dir(os.path.dirname(target))
    except BaseException:
        try:
            os.unlink(partial)
        except FileNotFoundError:
            pass
        raise
    return target


def check_output_dir(path: str, option: str = "--to") -> str:
    """The absolute target of an output directory: it must not exist, or be an empty directory
    (not a symbolic link), and must not lie in a buffer's managed files."""
    refuse_managed(path, option)
    refuse_managed(os.path.join(path, "README.md"), option)
    target = os.path.abspath(path)
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return target
    if not stat.S_ISDIR(st.st_mode):
        raise RollstoreError(f"{option} {path}: {_what(st.st_mode)} is there; give a new or empty directory")
    if os.listdir(target):
        raise RollstoreError(f"{option} {path}: exists and is not an empty directory; choose a new one")
    return target


def partial_dir(target: str) -> str:
    """A fresh partial folder beside `target`, owned by this process (after removing dead ones)."""
    remove_dead_partials(target)
    path = os.path.join(os.path.dirname(target), _partial_prefix(target) + owned_name("partial"))
    os.makedirs(path)
    return path

