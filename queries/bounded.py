"""User SQL in a worker process whose memory and time are bounded from outside.

DuckDB's own `memory_limit` does not bound everything (a huge list built in one function call
grows past it, and cannot be interrupted until it returns), so `run_bounded` forks a child that
opens the sandboxed `Session` and runs the query, while this process watches the child's resident
memory and the clock and kills it when either limit is passed.

Invariants:
- The child only reads: it never writes the manifest (it does not open it) and its only files are
  its spill folder under tmp/, which is removed once the child is gone, killed or not.
- The child is killed once its RSS exceeds the RSS it started with (its parent's) plus the limit
  plus a margin of max(64 MiB, limit/4); the error is one line: "memory limit 200MB exceeded".
- A query past its timeout is interrupted by the child itself; if it cannot be (a single long
  call), the child is killed a few seconds later. Either way: one line, the buffer unchanged.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import shutil
import time

import pyarrow as pa

from rollstore.storage.errors import RollstoreError
from rollstore.storage.maintenance import spill_prefix

from .session import (MemoryLimitError, Session, SqlError, SqlRefused, SqlTimeout, names_commits,
                      parse_memory_limit)

POLL_S = 0.01
KILL_GRACE_S = 5.0
_ERRORS = {cls.__name__: cls for cls in (SqlRefused, SqlError, SqlTimeout, MemoryLimitError, RollstoreError)}


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return 0


def _child(conn, snapshot, sql: str, timeout: float | None, memory_limit: str, threads: int | None,
           commits: pa.Table | None = None) -> None:
    try:
        with Session(snapshot, memory_limit, threads) as session:
            table = session.run_user_sql(sql, timeout=timeout, commits=commits)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        conn.send(("ok", sink.getvalue().to_pybytes()))
    except RollstoreError as exc:
        conn.send(("error", type(exc).__name__ if type(exc).__name__ in _ERRORS else "RollstoreError", str(exc)))
    except BaseException as exc:  # noqa: BLE001 - reported as one line by the parent
        conn.send(("error", "RollstoreError", f"unexpected {type(exc).__name__}: {exc}"))
    finally:
        conn.close()
        os._exit(0)


class Usage:
    """What the last bounded query used: the child's peak RSS seen by the watchdog, in bytes."""

    peak_rss = 0


def run_bounded(snapshot, sql: str, timeout: float | None, memory_limit: str,
                threads: int | None = None) -> pa.Table:
    """Run user SQL over `snapshot` in a forked child under `memory_limit` and `timeout`."""
    limit = parse_memory_limit(memory_limit)
    snapshot.check_present()
    ctx = multiprocessing.get_context("fork")
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    base = _rss(os.getpid())
    cap = base + limit + max(64 << 20, limit // 4)
    commits = snapshot.commits() if names_commits(sql) else None  # the catalog is read here, never in the child
    proc = ctx.Process(target=_child, args=(child_conn, snapshot, sql, timeout, memory_limit, threads, commits),
                       daemon=True)
    start = time.monotonic()
    proc.start()
    child_conn.close()
    message, peak = None, 0
    try:
        while True:
            if parent_conn.poll(POLL_S):
                message = parent_conn.recv()
                break
            if not proc.is_alive():
                break
            rss = _rss(proc.pid)
            peak = max(peak, rss)
            if rss > cap:
                proc.kill()
                raise MemoryLimitError(f"memory limit {memory_limit} exceeded; the query was stopped")
            if timeout and time.monotonic() - start > timeout + KILL_GRACE_S:
                proc.kill()
                raise SqlTimeout(f"query stopped at the timeout of {timeout:g} s")
    finally:
        Usage.peak_rss = peak
        if proc.is_alive() and message is None:
            proc.kill()
        proc.join()
        parent_conn.close()
        _remove_spill(snapshot.root, proc.pid)
    if message is None:
        raise RollstoreError(f"the query's worker process ended unexpectedly (exit code {proc.exitcode})")
    if message[0] == "ok":
        with pa.ipc.open_stream(message[1]) as reader:
            return reader.read_all()
    raise _ERRORS.get(message[1], RollstoreError)(message[2])


def _remove_spill(root: str, pid: int) -> None:
    prefix = spill_prefix().rsplit("-", 2)[0] + f"-{pid}-"
    tmp = os.path.join(root, "tmp")
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
