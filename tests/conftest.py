"""Shared fixtures: a fresh buffer and the CLI run in-process; writers of rows as a user's JSONL/Parquet."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# The real `rollstore` entry point of the venv (for the tests that go through a subprocess).
ROLLSTORE_BIN = os.path.join(os.path.dirname(sys.executable), "rollstore")


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str


@pytest.fixture
def cli():
    """Run `rollstore ARGS...` in-process through typer's CliRunner (the real command functions)."""
    from typer.testing import CliRunner

    from rollstore.cli import app

    runner = CliRunner()

    def run(*args: str) -> CliResult:
        res = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
        return CliResult(res.exit_code, res.stdout, res.stderr)

    return run


@pytest.fixture(scope="session")
def pg():
    """One PostgreSQL server for the session (tests/pg_server.py finds or starts it); each test makes its
    own catalog with `pg.fresh_dsn()`. Skips with one line saying what is missing."""
    import pg_server

    yield from serving(pg_server, "PostgreSQL tests")


def serving(server_module, label: str):
    """A fixture's body for a local test server module (tests/pg_server.py, tests/s3_server.py): skip
    with one line saying what is missing, else start it, yield it and stop it."""
    missing = server_module.why_missing()
    if missing:
        pytest.skip(f"{label}: {missing}")
    server = server_module.start()
    yield server
    server.stop()


@pytest.fixture
def buffer_dir(tmp_path):
    """An initialised, empty buffer; returns its path."""
    from rollstore.storage.buffer import Buffer

    root = tmp_path / "buf"
    Buffer.init(str(root)).close()
    return str(root)


# Hypothesis makes a buffer per example, outside pytest's tmp_path (which its examples share): each in
# a folder from `example_root`, removed when the module that made it ends.
_EXAMPLE_ROOTS: list[str] = []


def example_root(prefix: str) -> str:
    root = tempfile.mkdtemp(prefix=prefix)
    _EXAMPLE_ROOTS.append(root)
    return root


@pytest.fixture(autouse=True, scope="module")
def _remove_example_roots():
    yield
    while _EXAMPLE_ROOTS:
        shutil.rmtree(_EXAMPLE_ROOTS.pop(), ignore_errors=True)


def write_jsonl(table: pa.Table | list[dict], path) -> str:
    """Rows as JSON lines (timestamps as ISO-8601; NaN/inf as Python's json writes them)."""
    rows = table.to_pylist() if isinstance(table, pa.Table) else table
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            row = {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in row.items()}
            fh.write(json.dumps(row) + "\n")
    return str(path)


def write_parquet(table: pa.Table, path) -> str:
    pq.write_table(table, str(path))
    return str(path)

