"""Issue 47's weaker items, each through its real call path: a catalog DSN's password is never
readable through the SQL sandbox; the cross-parameter rule skip_explore_start ≥ skip_explore_min;
`rs.open(create=True)` / `rollstore init` refuse a file, a link loop and a folder of other files;
front-door mistakes are one `RollstoreError` line."""

from __future__ import annotations

import os

import pytest

import rollstore as rs
from rollstore.builtin.synthetic import rollouts_table
from rollstore.storage.buffer import Buffer


def one_line(res) -> str:
    lines = [x for x in res.stderr.strip().splitlines() if x.strip()]
    assert res.code != 0 and len(lines) == 1, (res.code, res.stdout, res.stderr)
    return lines[0]


def test_dsn_password_never_readable_through_sql(pg, cli, tmp_path):
    dsn = pg.fresh_dsn().replace("postgresql://rollstore@", "postgresql://rollstore:s3cr3t-pw@")
    assert "s3cr3t-pw" in dsn
    root = str(tmp_path / "buf")
    assert cli("init", root, "--catalog", dsn).code == 0, "the test server trusts its user: any password opens it"
    with Buffer.open(root) as buf:
        buf.append_rollouts(rollouts_table(n_groups=2, group_size=2, mean_tokens=4))
    assert "s3cr3t-pw" in open(os.path.join(root, "catalog.json")).read()  # the descriptor holds the DSN as given
    reads = [f"SELECT content FROM read_text('{root}/catalog.json')",
             f"SELECT content FROM read_text('{root}/rollouts/../catalog.json')",
             f"SELECT * FROM read_csv('{root}/catalog.json', header=false, sep='|')",
             f"SELECT * FROM read_json_auto('{root}/catalog.json')",
             f"SELECT content FROM read_blob('{root}/*')",
             f"SELECT content FROM read_text('{root}/*.json')"]
    for query in reads:
        res = cli("sql", root, query)
        assert "s3cr3t-pw" not in res.stdout + res.stderr, query
        assert "file rule" in one_line(res), query
        with pytest.raises(rs.RollstoreError) as exc:
            rs.open(root).sql(query)
        assert "s3cr3t-pw" not in str(exc.value)
    res = cli("sql", root, "SELECT count(*) AS n FROM rollouts", "--format", "csv")  # the data still reads
    assert res.code == 0 and res.stdout.split()[-1] == "4", res.stdout + res.stderr


def test_skip_explore_start_below_its_floor_is_refused(cli, buffer_dir):
    with Buffer.open(buffer_dir) as buf:
        buf.append_rollouts(rollouts_table(n_groups=2, group_size=2, mean_tokens=4))
    res = cli("curate", buffer_dir, "--recipe", "greso", "--set", "skip_explore_min=0.9", "--set",
              "skip_explore_start=0.1")
    line = one_line(res)
    assert "skip_explore_start=0.1" in line and "skip_explore_min=0.9" in line, line
    res = cli("curate", buffer_dir, "--recipe", "greso", "--set", "skip_explore_min=0.9")  # the default start 0.5
    assert "skip_explore_start=0.5" in one_line(res)
    with pytest.raises(rs.ParamError, match="skip_explore_start"):
        rs.open(buffer_dir).curate("greso", skip_explore_min=0.9)
    res = cli("curate", buffer_dir, "--recipe", "greso", "--set", "skip_explore_min=0.5", "--set",
              "skip_explore_start=0.5", "--dry-run")
    assert res.code == 0, res.stderr  # equal is fine
    with Buffer.open(buffer_dir) as buf:
        assert not buf.manifest.shards("curations")


def test_create_refuses_what_init_refuses(cli, tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "thesis.tex").write_text("mine")
    for call in (lambda: rs.open(folder, create=True), lambda: Buffer.init(str(folder))):
        with pytest.raises(rs.RollstoreError, match="other files"):
            call()
    assert "other files" in one_line(cli("init", str(folder)))
    assert sorted(os.listdir(folder)) == ["thesis.tex"]  # nothing made there
    empty = tmp_path / "empty"
    empty.mkdir()
    assert rs.open(empty, create=True) == rs.open(empty)  # an empty folder, then the buffer itself, are fine
    assert rs.open(empty, create=True) == rs.open(empty)
    afile = tmp_path / "afile"
    afile.write_text("x")
    loop_a, loop_b = tmp_path / "loop-a", tmp_path / "loop-b"
    os.symlink(loop_b, loop_a)
    os.symlink(loop_a, loop_b)
    for path in (afile, loop_a):
        for create in (False, True):
            with pytest.raises(rs.RollstoreError) as exc:
                rs.open(path, create=create)
            assert "\n" not in str(exc.value)
        assert one_line(cli("init", str(path)))
    assert afile.read_text() == "x"


def test_front_door_mistakes_are_rollstore_errors(buffer_dir):
    buf = rs.open(buffer_dir)
    for call in (lambda: buf.sql(None), lambda: buf.sql("SELECT 1", snapshot=10**30),
                 lambda: buf.sql("SELECT 1", timeout=float("nan")), lambda: buf.generate(num_prompts=0),
                 lambda: buf.train(lr=float("nan")), lambda: buf.train(micro_batch_size=0),
                 lambda: buf.train(epochs=-1), lambda: buf.curate("grpo", snapshot=10**30)):
        with pytest.raises(rs.RollstoreError) as exc:
            call()
        assert str(exc.value) and "\n" not in str(exc.value)
