"""Integrity under faults and hostile input (issue 14): verified shards, curations decided by the
manifest, the type rule, finiteness after the cast, `where` as one expression, one-line errors, data
printed as data, `--out` outside managed files, reads on a full disk, limits that hold, spill cleanup.

Every case goes through the real command line (typer's CliRunner in-process, or a subprocess)."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest

from conftest import write_jsonl, write_parquet
from rollstore.builtin.synthetic import RowOptions, rollouts_table
from rollstore.storage.buffer import Buffer


def one_error_line(res) -> str:
    """The single stderr line of a refused command (non-zero exit, no traceback)."""
    assert res.code != 0, (res.stdout, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert lines[0].startswith("error:"), lines[0]
    return lines[0]


@pytest.fixture
def filled(tmp_path):
    root = str(tmp_path / "buf")
    with Buffer.init(root) as buf:
        for v in range(2):
            buf.append_rollouts(rollouts_table(n_groups=6, group_size=4, step=v, policy_version=v, seed=3))
    return root


def rollout_shards(root: str) -> list[str]:
    with Buffer.open(root) as buf:
        return [os.path.join(root, s.path) for s in buf.manifest.shards("rollouts")]


def flip(path: str, offset: int | None = None, n: int = 8) -> None:
    with open(path, "r+b") as fh:
        size = os.fstat(fh.fileno()).st_size
        offset = size // 2 if offset is None else offset
        fh.seek(offset)
        data = fh.read(n)
        fh.seek(offset)
        fh.write(bytes(b ^ 0xFF for b in data))


# ---- 1: shard verification -------------------------------------------------------------------
def test_corrupted_shard_refused_by_curate_and_named_by_verify(cli, filled):
    bad = rollout_shards(filled)[0]
    flip(bad)
    line = one_error_line(cli("curate", filled, "--recipe", "grpo", "--set", "where=true"))
    assert bad in line and "sha256" in line and "--quarantine" in line
    res = cli("verify", filled)
    assert res.code == 1 and bad in res.stderr
    assert res.stderr.count("shard") >= 2  # the file's own line, then the summary line
    with Buffer.open(filled) as buf:
        seq = buf.manifest.latest_seq()
    assert cli("compact", filled, "--small-mb", "100").code == 1  # never merges a bad file
    res = cli("verify", filled, "--quarantine")
    assert res.code == 0, res.stderr
    assert os.path.exists(os.path.join(filled, "quarantine", os.path.relpath(bad, filled)))
    assert not os.path.exists(bad)
    assert cli("verify", filled).code == 0
    res = cli("curate", filled, "--recipe", "grpo", "--set", "where=true")
    assert res.code == 0, res.stderr
    with Buffer.open(filled) as buf:
        assert buf.manifest.latest_seq() == seq + 2  # quarantine, then the curation


def test_only_a_committing_curation_hashes_its_inputs(cli, filled, monkeypatch):
    """sha256 before anything is committed: the curation hashes, its dry run (nothing committed)
    does not, and still checks sizes (a truncated shard is refused by both)."""
    from rollstore.storage.snapshot import Snapshot

    hashed = []
    real = Snapshot.verify
    monkeypatch.setattr(Snapshot, "verify", lambda self, tables=None: hashed.append(tables) or real(self, tables))
    assert cli("curate", filled, "--recipe", "grpo", "--set", "where=true", "--dry-run").code == 0
    assert hashed == []
    assert cli("curate", filled, "--recipe", "grpo", "--set", "where=true").code == 0
    assert len(hashed) == 1 and "rollouts" in hashed[0]
    bad = rollout_shards(filled)[0]
    with open(bad, "r+b") as fh:
        fh.truncate(os.path.getsize(bad) // 2)
    line = one_error_line(cli("curate", filled, "--recipe", "dapo", "--set", "where=true", "--dry-run"))
    assert bad in line


@pytest.mark.parametrize("damage", ["truncate", "empty", "delete"])
def test_damaged_shard_is_one_line_everywhere(cli, filled, damage):
    bad = rollout_shards(filled)[1]
    if damage == "delete":
        os.unlink(bad)
    else:
        with open(bad, "r+b") as fh:
            fh.truncate(0 if damage == "empty" else os.path.getsize(bad) // 2)
    for args in (("sql", filled, "SELECT count(*) FROM rollouts"),
                 ("curate", filled, "--recipe", "grpo", "--set", "where=true"),
                 ("audit", filled)):
        line = one_error_line(cli(*args))
        if args[0] != "audit":
            assert bad in line and "verify" in line and "restore" in line, line
    res = cli("verify", filled)
    assert res.code == 1 and bad in res.stderr


# ---- 2: a killed curation is never "committed"; its orphans are replaced ---------------------
CURATE_ZYGOTE = r"""
import os, signal, sys
sys.path.insert(0, {root!r})
import rollstore.storage.shardio, rollstore.storage.manifest, rollstore.storage.buffer
from rollstore import storage
from typer.main import get_command
from rollstore.cli import app
import pyarrow
pyarrow.array([0]).to_numpy()  # pyarrow loads pandas at its first conversion: once here, not in every child

EVENTS = [(storage.shardio, "write_parquet"), (storage.shardio, "sha256_file"), (storage.shardio, "fsync_dir"),
          (storage.shardio.os, "link"), (storage.shardio.os, "replace"), (storage.shardio.os, "unlink"),
          (storage.manifest.Manifest, "new_commit"), (storage.manifest.Manifest, "add_shards")]

def arm(n):
    count = [0]
    for owner, name in EVENTS:
        real = getattr(owner, name)
        def wrapped(*a, _real=real, **k):
            out = _real(*a, **k)
            count[0] += 1
            if count[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        setattr(owner, name, wrapped)

print("ready", flush=True)
for line in sys.stdin:
    n, seq = map(int, line.split())
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            arm(n)
            get_command(app).main(["curate", {buffer!r}, "--recipe", "d3s", "--set", "where=true",
                                   "--snapshot", str(seq)], standalone_mode=False)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(status, flush=True)
"""


def test_curation_killed_at_every_point_is_redone_and_committed(cli, filled):
    import signal
    import subprocess
    import sys

    from conftest import ROOT

    zygote = subprocess.Popen([sys.executable, "-c", CURATE_ZYGOTE.format(root=ROOT, buffer=filled)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert zygote.stdout.readline().strip() == "ready"
    orphans_seen = 0
    try:
        for n in range(1, 200):
            with Buffer.open(filled) as buf:
                seq = buf.manifest.latest_seq()
            zygote.stdin.write(f"{n} {seq}\n")
            zygote.stdin.flush()
            status = int(zygote.stdout.readline())
            if os.WIFEXITED(status):  # ran to the end: every point before it was a kill point
                assert os.WEXITSTATUS(status) == 0
                break
            assert os.WTERMSIG(status) == signal.SIGKILL
            with Buffer.open(filled) as buf:
                assert buf.manifest.latest_seq() == seq, f"kill point {n} committed something"
            orphans_seen += any(files for _d, _s, files in os.walk(os.path.join(filled, "curated")))
            res = cli("curate", filled, "--recipe", "d3s", "--set", "where=true", "--snapshot", str(seq))
            assert res.code == 0, res.stderr
            assert "already committed" not in res.stdout, f"kill point {n}: an orphan was trusted"
            cid = res.stdout.strip().splitlines()[-1]
            assert cli("audit", filled, cid).code == 0
            assert cli("verify", filled).code == 0  # every live curated shard's references resolve
            n_sel = json.loads(cli("sql", filled, f"SELECT n_selected AS n FROM curations WHERE curation_id = '{cid}'",
                                   "--format", "json").stdout)[0]["n"]
            n_view = json.loads(cli("sql", filled, f"SELECT count(*) AS n FROM curated WHERE curation_id = '{cid}'",
                                    "--format", "json").stdout)[0]["n"]
            assert n_view == n_sel, f"kill point {n}: the curated view does not resolve every row"
        else:
            pytest.fail("the curation never ran to its end")
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=60)
    print(f"{n - 1} kill points, {orphans_seen} with orphans")
    assert n > 10 and orphans_seen > 3  # the points covered writes of every part, not just the first
    res = cli("curate", filled, "--recipe", "d3s", "--set", "where=true", "--snapshot", str(seq))
    assert "already committed" in res.stdout  # the last child's commit is decided by the manifest


# ---- 3: the type rule; the added validation rules ---------------------------------------------
def small_rows(n_groups: int = 2) -> list[dict]:
    rows = rollouts_table(n_groups=n_groups, group_size=2, mean_tokens=4, seed=1).to_pylist()
    for row in rows:
        row["created_at"] = row["created_at"].isoformat()
    return rows


@pytest.mark.parametrize("column, value, needle", [
    ("step", 1.5, "JSON float"),
    ("step", 1.0, "JSON float"),
    ("policy_version", 0.999, "JSON float"),
    ("prompt", 17, "JSON integer"),
    ("reward", "1", "JSON string"),
    ("correct", 1, "JSON integer"),
    ("response_token_ids", [1, 7.9], "JSON array"),
])
def test_json_values_follow_the_type_rule(cli, buffer_dir, tmp_path, column, value, needle):
    rows = small_rows()
    rows[1][column] = value
    path = write_jsonl(rows, tmp_path / "x.jsonl")
    line = one_error_line(cli("import", buffer_dir, path))
    assert path in line and f"column {column!r}" in line and rows[1]["rollout_id"] in line and needle in line
    assert cli("sql", buffer_dir, "SELECT count(*) AS n FROM rollouts", "-f", "json").stdout.strip() == '[{"n": 0}]'


def test_lossless_casts_are_accepted(cli, buffer_dir, tmp_path):
    rows = small_rows()
    for row in rows:
        row["reward"] = int(row["reward"])  # an integer into a float column
    assert cli("import", buffer_dir, write_jsonl(rows, tmp_path / "ok.jsonl")).code == 0
    table = rollouts_table(n_groups=1, group_size=2, seed=2, options=RowOptions(id_prefix="p"))
    wide = table.set_column(table.schema.get_field_index("response_token_ids"), "response_token_ids",
                            table.column("response_token_ids").cast(pa.list_(pa.int64())))
    assert cli("import", buffer_dir, write_parquet(wide, tmp_path / "wide.parquet")).code == 0


@pytest.mark.parametrize("column, cast, needle", [
    ("step", pa.float64(), "expected int64, got double"),
    ("prompt", None, "expected string, got int64"),
    ("response_token_ids", pa.list_(pa.float64()), "expected list<item: int32>"),
])
def test_parquet_types_follow_the_type_rule(cli, buffer_dir, tmp_path, column, cast, needle):
    table = rollouts_table(n_groups=1, group_size=2, seed=2)
    i = table.schema.get_field_index(column)
    new = pa.array(range(table.num_rows), pa.int64()) if cast is None else table.column(column).cast(cast)
    path = write_parquet(table.set_column(i, column, new), tmp_path / "t.parquet")
    line = one_error_line(cli("import", buffer_dir, path))
    assert f"column {column!r}" in line and needle in line, line


@pytest.mark.parametrize("edit, column, needle", [
    (lambda r: r.__setitem__("response_token_ids", [5, -1] + r["response_token_ids"][2:]), "response_token_ids", "negative token id"),
    (lambda r: r.__setitem__("prompt_token_ids", [-3]), "prompt_token_ids", "negative token id"),
    (lambda r: r.__setitem__("prompt_id", ""), "prompt_id", "empty id"),
    (lambda r: r.__setitem__("run_id", ""), "run_id", "empty id"),
    (lambda r: r.__setitem__("prompt", r["prompt"] + " (edited)"), "prompt", "disagrees on prompt"),
    (lambda r: r.__setitem__("created_at", "9999-12-31T23:59:59.999999-14:00"), "created_at", "years 1-9999"),
    (lambda r: r.__setitem__("gen_logprobs", [-1e39] + r["gen_logprobs"][1:]), "gen_logprobs", "NaN or infinity"),
])
def test_added_validation_rules(cli, buffer_dir, tmp_path, edit, column, needle):
    rows = small_rows()
    edit(rows[1])
    path = write_jsonl(rows, tmp_path / "bad.jsonl")
    line = one_error_line(cli("import", buffer_dir, path))
    assert f"column {column!r}" in line and needle in line and rows[1]["rollout_id"] in line, line
    assert cli("sql", buffer_dir, "SELECT count(*) AS n FROM rollouts", "-f", "json").stdout.strip() == '[{"n": 0}]'


def test_empty_rollout_id_is_refused(cli, buffer_dir, tmp_path):
    rows = small_rows()
    rows[0]["rollout_id"] = ""
    line = one_error_line(cli("import", buffer_dir, write_jsonl(rows, tmp_path / "e.jsonl")))
    assert "column 'rollout_id'" in line and "empty id" in line


# ---- 4: finiteness after the float32 cast -----------------------------------------------------
@pytest.mark.parametrize("select, column", [
    ("rollout_id, 1e39 AS advantage", "advantage"),
    ("rollout_id, 1.0 AS advantage, 1e40 AS weight", "weight"),
])
def test_custom_recipe_overflowing_float32_is_refused(cli, filled, tmp_path, select, column):
    recipe = tmp_path / "big.sql"
    recipe.write_text(f"SELECT {select} FROM candidates")
    line = one_error_line(cli("curate", filled, "--recipe", str(recipe), "--set", "where=true"))
    assert f"column {column!r}" in line and "inf" in line
    with Buffer.open(filled) as buf:
        assert not buf.manifest.shards("curations")


# ---- 5: `where` is one boolean expression -----------------------------------------------------
@pytest.mark.parametrize("where, needle", [
    ("true) UNION ALL SELECT * FROM rollouts WHERE (true", "not one SQL expression"),
    ("true --", "not one SQL expression"),
    ("true /*", "not one SQL expression"),
    ("true; SELECT 1", "not one SQL expression"),
    ("'x'", "must be a boolean expression"),
    ("step + 1", "must be a boolean expression"),
    ("no_such_column > 1", "where:"),
])
def test_where_must_be_one_boolean_expression(cli, filled, where, needle):
    line = one_error_line(cli("curate", filled, "--recipe", "grpo", "--set", f"where={where}"))
    assert needle in line, line
    with Buffer.open(filled) as buf:
        assert not buf.manifest.shards("curations")


def test_where_with_subquery_and_comment_is_fine(cli, filled):
    where = "step = (SELECT max(step) FROM rollouts) /* the last step */"
    res = cli("curate", filled, "--recipe", "grpo", "--set", f"where={where}", "--dry-run")
    assert res.code == 0, res.stderr


def test_where_reading_a_file_outside_is_refused(cli, filled, tmp_path):
    outside = tmp_path / "secret.parquet"
    write_parquet(pa.table({"x": [1]}), outside)
    line = one_error_line(cli("curate", filled, "--recipe", "grpo", "--dry-run",
                              "--set", f"where=(SELECT count(*) FROM read_parquet('{outside}')) > 0"))
    assert "file rule" in line


# ---- 6: curate --timeout covers user SQL ----------------------------------------------------
@pytest.mark.parametrize("engine", [[], ["--engine", "dask", "--scheduler", "local:1"]], ids=["embedded", "dask"])
def test_curate_timeout_stops_a_where_that_never_ends(cli, filled, engine):
    """On Dask the predicate runs inside the map tasks, each under the timeout."""
    import time

    if engine:
        pytest.importorskip("distributed")
    start = time.monotonic()
    line = one_error_line(cli("curate", filled, "--recipe", "grpo", "--dry-run", "--timeout", "1", *engine,
                              "--set", "where=(SELECT count(*) FROM range(10000000000000)) > 0"))
    assert "timeout of 1 s" in line
    assert time.monotonic() - start < 60


def test_curate_timeout_stops_a_custom_recipe_that_never_ends(cli, filled, tmp_path):
    recipe = tmp_path / "forever.sql"
    recipe.write_text("SELECT rollout_id, 1.0 AS advantage FROM candidates "
                      "WHERE (SELECT count(*) FROM range(10000000000000)) > 0")
    line = one_error_line(cli("curate", filled, "--recipe", str(recipe), "--set", "where=true", "--timeout", "1"))
    assert "timeout" in line
    with Buffer.open(filled) as buf:
        assert not buf.manifest.shards("curations")


# ---- 13: one line, never a traceback ---------------------------------------------------------
def test_hostile_inputs_are_one_line(cli, filled, tmp_path):
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 200_000 + "]" * 200_000 + "\n")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"rollout_id": "caf\xe9"}\n')
    recipe = tmp_path / "latin.sql"
    recipe.write_bytes(b"SELECT rollout_id, 1.0 AS advantage FROM candidates -- caf\xe9\n")
    abc = tmp_path / "abc.sql"
    abc.write_text("SELECT rollout_id, 'abc' AS advantage FROM candidates")
    cases = [
        (("import", filled, str(deep)), "nested too deeply"),
        (("import", filled, str(latin)), "not UTF-8"),
        (("curate", filled, "--recipe", str(recipe), "--set", "where=true"), "not UTF-8"),
        (("curate", filled, "--recipe", str(abc), "--set", "where=true"), "not a number"),
        (("curate", filled, "--recipe", "grpo", "--set", "where='x'"), "boolean"),
        (("sql", filled, "--memory-limit", "abc", "SELECT 1"), "memory limit 'abc'"),
        (("curate", filled, "--recipe", "grpo", "--memory-limit", "abc"), "memory limit 'abc'"),
        (("sql", filled, "SELECT '\udcaa' AS x"), "not valid UTF-8"),
    ]
    for args, needle in cases:
        line = one_error_line(cli(*args))
        assert needle in line, (args, line)


def test_non_utf8_query_through_a_real_process(filled):
    import subprocess

    from conftest import ROLLSTORE_BIN

    res = subprocess.run([ROLLSTORE_BIN.encode(), b"sql", filled.encode(), b"SELECT '\xaa' AS x"], capture_output=True)
    assert res.returncode == 1 and res.stderr.count(b"\n") == 1 and b"UTF-8" in res.stderr, res.stderr


def test_unrepresentable_values_print_in_every_format(cli, filled):
    res = cli("sql", filled, "-f", "csv", "SELECT '\\xAA'::BLOB AS b")
    assert res.code == 0 and res.stdout.splitlines()[1].strip('"') == "aa", (res.stdout, res.stderr)
    res = cli("sql", filled, "-f", "json", "SELECT 'infinity'::TIMESTAMP AS t, '-infinity'::DATE AS d, "
              "TIMESTAMP '0001-01-01 00:00:00' AS lo")
    assert res.code == 0, res.stderr
    assert json.loads(res.stdout) == [{"t": "infinity", "d": "-infinity", "lo": "0001-01-01T00:00:00"}]
    res = cli("sql", filled, "SELECT 'infinity'::TIMESTAMP AS t")
    assert res.code == 0 and "infinity" in res.stdout


def test_unexpected_exception_is_one_line_with_debug_hint(cli, filled, monkeypatch):
    import rollstore.storage.buffer
    from rollstore import storage

    def boom(*a, **k):
        raise KeyError("surprise")

    monkeypatch.setattr(storage.buffer.Buffer, "open", classmethod(lambda cls, root: boom()))
    line = one_error_line(cli("info", filled))
    assert "unexpected KeyError" in line and "--debug" in line
    with pytest.raises(KeyError):
        cli("--debug", "info", filled)


# ---- 12: data is data in tables --------------------------------------------------------------
def test_markup_in_data_is_printed_literally(cli, buffer_dir, tmp_path):
    rows = small_rows(1)
    for row in rows:
        row["prompt"] = "[INST] hi [/INST] [bold red]x"
    assert cli("import", buffer_dir, write_jsonl(rows, tmp_path / "m.jsonl")).code == 0
    res = cli("sql", buffer_dir, "SELECT DISTINCT prompt FROM rollouts")
    assert res.code == 0, res.stderr
    assert "[INST] hi [/INST] [bold red]x" in res.stdout
    res = cli("sql", buffer_dir, "SELECT '[bold red]x' AS \"[i]col\"")
    assert "[bold red]x" in res.stdout and "[i]col" in res.stdout
    assert cli("curate", buffer_dir, "--recipe", "grpo", "--set", "where=true").code == 0
    rid = rows[0]["rollout_id"]
    res = cli("audit", buffer_dir)
    assert res.code == 0, res.stderr
    res = cli("audit", buffer_dir, "--rollout", rid)
    assert res.code == 0, res.stderr


# ---- 11: --out never lands in a buffer's managed files ----------------------------------------
def test_out_inside_managed_files_is_refused(cli, filled, tmp_path):
    manifest = os.path.join(filled, "manifest.sqlite")
    before = open(manifest, "rb").read()
    for target in (manifest, os.path.join(filled, "rollouts", "x.parquet"), os.path.join(filled, "tmp", "r.html"),
                   os.path.join(filled, "manifest.sqlite-wal")):
        line = one_error_line(cli("report", filled, "--out", target))
        assert "managed files" in line
        line = one_error_line(cli("sql", filled, "SELECT 1 AS x", "-f", "csv", "--out", target))
        assert "managed files" in line
    assert open(manifest, "rb").read() == before
    ok = os.path.join(filled, "notes.csv")  # the buffer's own top folder, not a managed file
    assert cli("sql", filled, "SELECT 1 AS x", "-f", "csv", "--out", ok).code == 0
    assert cli("info", filled).code == 0


# ---- 10: hostile text cannot break the report ------------------------------------------------
HOSTILE = "<!--<script></script><b>"


def hostile_report(cli, root, tmp_path) -> str:
    rows = small_rows(2)
    for row in rows:
        for key in ("rollout_id", "group_id", "prompt_id", "run_id", "prompt", "response", "gold_answer",
                    "source", "meta"):
            row[key] = HOSTILE + str(row[key])
        row["verify_error"] = None
    assert cli("import", root, write_jsonl(rows, tmp_path / "h.jsonl")).code == 0
    assert cli("curate", root, "--recipe", "grpo", "--set", "where=true").code == 0
    out = str(tmp_path / "report.html")
    res = cli("report", root, "--out", out)
    assert res.code == 0, res.stderr
    return out


def test_report_json_blocks_hold_no_markup(cli, buffer_dir, tmp_path):
    import re

    html = open(hostile_report(cli, buffer_dir, tmp_path), encoding="utf-8").read()
    blocks = re.findall(r'<script type="application/json" id="data-([a-z_]+)">(.*?)</script>', html, re.DOTALL)
    assert blocks
    for name, text in blocks:
        assert "<" not in text, name
        json.loads(text)
    assert any(HOSTILE in json.dumps(json.loads(text), ensure_ascii=False) for _, text in blocks)
    assert html.count('<section id=') == html.count("</section>") > 3


def test_report_with_hostile_text_renders_in_chromium(cli, buffer_dir, tmp_path):
    import re
    import subprocess

    from test_report import find_chromium

    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium binary on PATH (see tests/test_report.py)")
    path = hostile_report(cli, buffer_dir, tmp_path)
    base = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(base + ["--dump-dom", f"file://{path}"], capture_output=True, text=True, timeout=120)
    root_tag = re.search(r"<html[^>]*>", dom.stdout)
    assert root_tag and 'data-rendered="' in root_tag.group(0), dom.stderr[-2000:]  # the page's script ran
    assert "data-errors" not in root_tag.group(0)
    assert 'id="training"' in dom.stdout or "data-section" in dom.stdout


# ---- 7: the memory limit holds (a worker process watched from outside) ----------------------
def test_memory_bomb_stops_at_the_limit(cli, filled):
    from rollstore.queries.bounded import Usage

    with Buffer.open(filled) as buf:
        seq = buf.manifest.latest_seq()
    line = one_error_line(cli("sql", filled, "--timeout", "60", "--memory-limit", "200MB",
                              "SELECT len(list(range(100000000)))"))
    assert "memory limit 200MB exceeded" in line
    assert Usage.peak_rss < 2 << 30  # stopped near the limit, far below the 7.8 GB it reached before
    assert not [n for n in os.listdir(os.path.join(filled, "tmp")) if n.startswith("duckdb-")]
    with Buffer.open(filled) as buf:
        assert buf.manifest.latest_seq() == seq
    res = cli("sql", filled, "--memory-limit", "200MB", "-f", "json", "SELECT count(*) AS n FROM rollouts")
    assert res.code == 0 and json.loads(res.stdout) == [{"n": 48}]


def test_sql_errors_from_the_worker_are_one_line(cli, filled):
    assert "only SELECT" in one_error_line(cli("sql", filled, "COPY rollouts TO 'x.csv'"))
    assert "timeout of 1 s" in one_error_line(cli("sql", filled, "--timeout", "1",
                                                  "SELECT count(*) FROM range(10000000000000)"))


# ---- 8: a full disk ------------------------------------------------------------------------
def test_reads_work_and_writes_fail_in_one_line_on_a_full_disk(cli, filled, tmp_path, monkeypatch):
    import errno

    import rollstore.storage.manifest
    from rollstore.storage.errors import CatalogError

    from rollstore import storage
    import rollstore.storage.shardio
    from rollstore import storage

    def full(*a, **k):  # what the manifest's connection raises for sqlite3's "database or disk is full"
        raise CatalogError("manifest: database or disk is full")

    monkeypatch.setattr(storage.manifest.Manifest, "pin", full)
    monkeypatch.setattr(storage.manifest.Manifest, "new_commit", full)
    assert cli("info", filled).code == 0
    res = cli("sql", filled, "-f", "json", "SELECT count(*) AS n FROM rollouts")
    assert res.code == 0 and json.loads(res.stdout) == [{"n": 48}], res.stderr
    line = one_error_line(cli("curate", filled, "--recipe", "grpo", "--set", "where=true"))
    assert "disk is full" in line

    def enospc(table, path, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.undo()
    monkeypatch.setattr(storage.shardio, "write_parquet", enospc)
    rows = rollouts_table(n_groups=1, group_size=2, seed=9, options=RowOptions(id_prefix="full"))
    line = one_error_line(cli("import", filled, write_parquet(rows, tmp_path / "f.parquet")))
    assert "No space left on device" in line
    line = one_error_line(cli("curate", filled, "--recipe", "grpo", "--set", "where=true"))
    assert "No space left on device" in line
    monkeypatch.undo()
    assert cli("verify", filled).code == 0
    with Buffer.open(filled) as buf:
        assert not buf.manifest.shards("curations") and len(buf.manifest.shards("rollouts")) == 2


# ---- 9: spill folders of dead processes are collected ------------------------------------------
def test_gc_removes_spill_folders_of_dead_processes(cli, filled):
    import subprocess
    import sys

    from rollstore.storage.maintenance import spill_prefix

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    mine = spill_prefix().rsplit("-", 2)[0]
    tmp = os.path.join(filled, "tmp")
    for name in (f"{mine}-{pid}-abc123", f"{mine}-{os.getpid()}-def456", f"duckdb-otherhost-{pid}-abc123"):
        os.makedirs(os.path.join(tmp, name))
        with open(os.path.join(tmp, name, "duckdb_temp_block-1.block"), "wb") as fh:
            fh.write(b"x" * 1000)
    res = cli("gc", filled, "--grace", "3600")
    assert res.code == 0 and "1 spill folders" in res.stdout, res.stdout
    assert sorted(os.listdir(tmp)) == sorted([f"{mine}-{os.getpid()}-def456", f"duckdb-otherhost-{pid}-abc123"])
