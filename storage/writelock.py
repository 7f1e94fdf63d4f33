"""The writers' lock of a buffer (`BUFFER/writers.lock`): what keeps `gc` from deleting a file that a
live writer is about to commit.

A commit links its files into place BEFORE the manifest transaction that names them; between the
two, a file at a final path is named by no manifest row and looks exactly like a crashed run's
orphan. So:

Invariants:
- A writer holds the lock SHARED (`writing`) from before it writes the first file of a commit until
  its manifest transaction has ended (committed, or rolled back and its files removed). Any number
  of writers hold it together.
- `gc` removes unnamed files under the data folders only while it holds the lock EXCLUSIVELY
  (`collecting`), and reads the manifest's paths after taking it: no writer is then between a
  link and its commit, so an unnamed file there is a true orphan. If writers keep it busy past
  `wait_s`, `collecting` yields False and gc leaves the data folders for its next run.
- The lock is an advisory `flock` on a file that is created once and never removed; a killed
  process's hold ends with it.
- A buffer cataloged in PostgreSQL (`catalog.json`) takes no writers' lock: its writers hold an
  intent in the catalog on every file before its first byte (`catalog_pg.PgManifest.intend`), and
  its gc removes only files no row names and no live intent holds (`maintenance`), so `writing`
  holds nothing for it; `collecting` yields False for it (the flock cannot see other hosts' writers).
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from contextlib import contextmanager
from typing import Iterator

LOCK_NAME = "writers.lock"  # at the buffer's root, beside the manifest


def lock_path(root: str) -> str:
    return os.path.join(root, LOCK_NAME)


def _open(root: str) -> int:
    return os.open(lock_path(root), os.O_RDWR | os.O_CREAT, 0o666)


@contextmanager
def writing(root: str, catalog=None) -> Iterator[None]:
    """Hold the writers' lock shared (blocks only while a gc scans the data folders). A catalog
    shared by hosts (PostgreSQL's) needs none: its write intents keep gc off a writer's files."""
    if catalog is not None and catalog.multi_host:
        yield
        return
    fd = _open(root)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def collecting(root: str, wait_s: float = 30.0, catalog=None) -> Iterator[bool]:
    """Hold the writers' lock exclusively; yields True, or False if writers kept it for `wait_s`
    (or the lock file cannot be created: a full disk; then gc leaves the data folders alone)."""
    if os.path.exists(os.path.join(root, "catalog.json")):
        # A buffer cataloged in PostgreSQL has writers on other hosts, whom this host-local flock does
        # not see: without its catalog's lock the data folders are left alone.
        yield False
        return
    try:
        fd = _open(root)
    except OSError:
        yield False
        return
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() >= deadline:
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                    yield False
                    return
                time.sleep(0.02)
        yield True
    finally:
        os.close(fd)
