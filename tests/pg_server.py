"""A PostgreSQL server for the tests (and bench/multihost.py) on this machine.

Found, in order: a DSN in ROLLSTORE_TEST_PG_DSN; Debian's server binaries (/usr/lib/postgresql/*/bin,
or `initdb` on PATH), started as the `postgres` user when running as root (initdb and pg_ctl refuse
root); the `pgserver` wheel. Started in a temporary folder on a free port of 127.0.0.1, stopped by
`stop()`. `why_missing()` is the one line a test skips with when none is there.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Callable


@dataclass
class PgServer:
    dsn: str  # of the database `postgres` as a superuser, no password
    stop: Callable[[], None]
    how: str  # "env", "binaries" or "pgserver"

    def fresh_dsn(self) -> str:
        """A DSN whose search_path is a new, empty schema: one buffer's own catalog."""
        import psycopg

        name = "s_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.dsn, autocommit=True) as con:
            con.execute(f"CREATE SCHEMA {name}")
        return with_schema(self.dsn, name)


def with_schema(dsn: str, schema: str) -> str:
    sep = "&" if "?" in dsn else "?"
    return f"{dsn}{sep}options=-csearch_path%3D{schema}"


def _bindir() -> str | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4])
                   if p.split("/")[4].isdigit() else 0)
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def why_missing() -> str | None:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg 3 is not installed (pip install -e '.[dev]')"
    if os.environ.get("ROLLSTORE_TEST_PG_DSN") or _bindir():
        return None
    try:
        import pgserver  # noqa: F401
    except ImportError:
        return ("no PostgreSQL: set ROLLSTORE_TEST_PG_DSN, or install the server (apt-get install postgresql) "
                "or the pgserver wheel")
    return None


def start(durable: bool = False) -> PgServer:
    """A running server. `durable`: fsync and synchronous_commit on (benchmarks); else off (tests)."""
    dsn = os.environ.get("ROLLSTORE_TEST_PG_DSN")
    if dsn:
        return PgServer(dsn, lambda: None, "env")
    bindir = _bindir()
    if bindir:
        return _start_binaries(bindir, durable)
    import pgserver

    folder = tempfile.mkdtemp(prefix="rollstore-pgserver-")
    srv = pgserver.get_server(folder, cleanup_mode="stop")
    return PgServer(srv.get_uri(), lambda: (srv.cleanup(), shutil.rmtree(folder, ignore_errors=True)), "pgserver")


def _start_binaries(bindir: str, durable: bool) -> PgServer:
    folder = tempfile.mkdtemp(prefix="rollstore-pg-")
    data = os.path.join(folder, "data")
    as_root = os.geteuid() == 0
    run_as: list[str] = []
    if as_root:
        os.chmod(folder, 0o755)
        shutil.chown(folder, "postgres", "postgres")
        runuser = shutil.which("runuser")
        run_as = [runuser, "-u", "postgres", "--"] if runuser else ["su", "postgres", "-s", "/bin/sh", "-c"]
    port = _free_port()

    def cmd(*args: str) -> list[str]:
        if run_as and run_as[0] == "su":
            return [*run_as, " ".join(args)]
        return [*run_as, *args]

    subprocess.run(cmd(os.path.join(bindir, "initdb"), "-D", data, "-A", "trust", "-U", "rollstore",
                       "--no-sync", "-E", "UTF8", "--locale=C"), check=True, capture_output=True, cwd=folder)
    opts = f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories='' -c max_connections=100"
    if not durable:
        opts += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
    subprocess.run(cmd(os.path.join(bindir, "pg_ctl"), "-D", data, "-o", opts, "-l",
                       os.path.join(folder, "log"), "-w", "-t", "60", "start"), check=True, capture_output=True,
                   cwd=folder)
    dsn = f"postgresql://rollstore@127.0.0.1:{port}/postgres"

    def stop() -> None:
        subprocess.run(cmd(os.path.join(bindir, "pg_ctl"), "-D", data, "-m", "immediate", "-w", "stop"),
                       capture_output=True, cwd=folder)
        shutil.rmtree(folder, ignore_errors=True)

    deadline = time.monotonic() + 30
    import psycopg

    while True:
        try:
            psycopg.connect(dsn, connect_timeout=2).close()
            break
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                stop()
                raise
            time.sleep(0.1)
    return PgServer(dsn, stop, "binaries")
