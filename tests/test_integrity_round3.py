"""Integrity, round three (issue 35): training verifies what thin curated shards refer to, use caps
hold under concurrent curations, no non-finite number is trained or published, every curation
parameter has a range rule; and (issue 36, item 4) no file is unlinked while a commit's outcome is
unknown.

Commands go through the real command line (typer's CliRunner in-process) unless said otherwise."""

from __future__ import annotations

import os
import shutil
import sqlite3

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from rollstore.storage.buffer import Buffer, Part
from rollstore.synthetic import rollouts_table


def one_error_line(res) -> str:
    """The single stderr line of a refused command (non-zero exit, no traceback)."""
    assert res.code != 0, (res.stdout, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert lines[0].startswith("error:"), lines[0]
    assert "unexpected" not in lines[0], lines[0]
    return lines[0]


def seq_of(root: str) -> int:
    with Buffer.open(root) as buf:
        return buf.manifest.latest_seq()


def tiny_rows(seed: int, step: int = 0, n_groups: int = 4, group_size: int = 4) -> pa.Table:
    """Synthetic rollouts whose token ids the builtin tiny model (24 ids) can embed."""
    table = rollouts_table(n_groups=n_groups, group_size=group_size, step=step, policy_version=step, seed=seed)
    for name in ("prompt_token_ids", "response_token_ids"):
        col = table.column(name).combine_chunks()
        values = pa.array(col.values.to_numpy() % 20 + 1, pa.int32())
        fixed = pa.ListArray.from_arrays(col.offsets, values)
        table = table.set_column(table.column_names.index(name), name, fixed.cast(table.schema.field(name).type))
    return table


# ---- issue 36, item 4: no file is unlinked while a commit's outcome is unknown -------------------
@pytest.mark.parametrize("took_effect", [True, False])
def test_a_failed_commit_statement_unlinks_nothing(buffer_dir, monkeypatch, took_effect):
    """COMMIT sent, then an error (a lost acknowledgement): whether or not it took effect, and even
    when the manifest then *seems* not to name the file (a stale view), no file is removed."""
    import contextlib

    buf = Buffer.open(buffer_dir)
    real = buf.manifest.transaction

    @contextlib.contextmanager
    def lost_ack():
        with contextlib.ExitStack() as stack:
            if took_effect:
                con = stack.enter_context(real())
                yield con
            else:  # the server rolled back after COMMIT was sent
                buf.manifest.con.execute("BEGIN IMMEDIATE")
                yield buf.manifest.con
                buf.manifest.con.execute("ROLLBACK")
        raise sqlite3.OperationalError("disk I/O error (COMMIT acknowledgement lost)")

    monkeypatch.setattr(buf.manifest, "transaction", lost_ack)
    monkeypatch.setattr(buf.manifest, "is_unnamed", lambda path: True)  # what a stale view would say
    with pytest.raises(sqlite3.OperationalError):
        buf.commit([Part("rollouts", tiny_rows(1))], "append")
    files = [f for f in os.listdir(os.path.join(buffer_dir, "rollouts")) if f.endswith(".parquet")]
    assert len(files) == 1, files  # the file stays: an orphan for gc when the commit did not take effect
    monkeypatch.undo()
    named = {s.path for s in buf.manifest.shards("rollouts")}
    assert (f"rollouts/{files[0]}" in named) == took_effect
    buf.close()


def test_a_failure_before_commit_still_removes_the_files(buffer_dir):
    buf = Buffer.open(buffer_dir)

    def boom(con, seq, ids):
        raise RuntimeError("inside the transaction")

    with pytest.raises(RuntimeError):
        buf.commit([Part("rollouts", tiny_rows(1))], "append", on_commit=boom)
    assert [f for f in os.listdir(os.path.join(buffer_dir, "rollouts")) if f.endswith(".parquet")] == []
    buf.close()
