"""Hosts that share a buffer (docs/multihost.md): a second writer of a run is refused at once, a
run sampling another run's seed is warned of, and `rollstore sql` shows who committed what."""

from __future__ import annotations

import os

import pytest

from rollstore.storage.buffer import Buffer
from rollstore.storage.catalog import holding


def test_a_second_writer_of_a_run_is_refused_before_any_work(pg, cli, tmp_path, monkeypatch):
    root = str(tmp_path / "shared")
    assert cli("init", root, "--catalog", pg.fresh_dsn()).code == 0
    monkeypatch.setenv("ROLLSTORE_HOST_ID", "host-b")
    other = Buffer.open(root)  # another writer (host-a's generate, still running) holds run `gen`
    try:
        with holding(other.manifest, "tmp/runs/gen"):
            res = cli("generate", root, "--num-prompts", "4", "--model", "builtin:tiny")
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert res.code == 1 and len(lines) == 1, res.stderr
        assert "run 'gen' is being generated into this buffer by another writer" in lines[0]
        assert "--run-id" in lines[0] and "--seed" in lines[0] and "nothing was written" in lines[0]
        assert cli("sql", root, "SELECT count(*) AS n FROM rollouts", "-f", "csv").stdout.split()[1:] == ["0"]
        # once the other writer is done, the run goes on at its next step
        assert cli("generate", root, "--num-prompts", "4").code == 0
        res = cli("generate", root, "--num-prompts", "4", "--run-id", "gen-2")
        assert res.code == 0 and "warning: run 'gen-2' samples step 0 with the seed run 'gen' used" in res.stderr
        res = cli("sql", root, "SELECT host, kind FROM commits ORDER BY seq", "-f", "csv")
        rows = [line.replace('"', "").split(",") for line in res.stdout.split()[1:]]
        assert rows[-2:] == [["host-b", "append"], ["host-b", "append"]], res.stdout
    finally:
        other.close()


def test_the_commits_view_of_an_embedded_manifest(cli, tmp_path):
    root = str(tmp_path / "b")
    assert cli("init", root).code == 0
    assert cli("generate", root, "--num-prompts", "4").code == 0
    res = cli("sql", root, "SELECT seq, kind, host IS NULL AS no_host, created_at IS NOT NULL AS t FROM commits",
              "-f", "csv")
    assert res.stdout.replace('"', "").split()[1:] == ["1,append,true,true"], res.stdout
    import rollstore as rs

    assert rs.open(root).sql("SELECT count(*) FROM commits").fetchall() == [(1,)]
    # a snapshot's view holds the commits up to it
    assert cli("sql", root, "--snapshot", "0", "SELECT count(*) AS n FROM commits", "-f", "csv").stdout.split()[1:] == ["0"]
