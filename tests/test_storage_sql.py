"""`rollstore sql`: the sandbox refuses everything but reading the buffer (each refusal naming its
rule), runaway queries stop at --timeout, and the output formats keep the CLI contract."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import time

import pyarrow.parquet as pq
import pytest

from conftest import ROLLSTORE_BIN, write_parquet
from rollstore.builtin.synthetic import RowOptions, rollouts_table
from rollstore.storage.buffer import Buffer


@pytest.fixture(scope="module")
def shared_buffer(tmp_path_factory):
    """One buffer with two shards for this module's read-only tests (nothing here may change it)."""
    root = str(tmp_path_factory.mktemp("sql") / "buf")
    with Buffer.init(root) as buf:
        buf.append_rollouts(rollouts_table(n_groups=3, group_size=4, mean_tokens=5, step=0))
        buf.append_rollouts(rollouts_table(n_groups=3, group_size=4, mean_tokens=5, step=1))
    return root


@pytest.fixture
def loaded(shared_buffer, tmp_path):
    """The shared buffer, plus a Parquet file OUTSIDE it (tmp_path/outside.parquet)."""
    write_parquet(rollouts_table(n_groups=1, group_size=2, options=RowOptions(id_prefix="out")),
                  tmp_path / "outside.parquet")
    yield shared_buffer
    for link in ("rollouts/sneaky.parquet", "curated/elsewhere"):
        if os.path.islink(os.path.join(shared_buffer, link)):
            os.unlink(os.path.join(shared_buffer, link))


def refused(cli, root, query, rule):
    res = cli("sql", root, query, "--format", "json")
    assert res.code != 0, f"not refused: {query!r} -> {res.stdout[:200]}"
    line = res.stderr.strip()
    assert "\n" not in line and line.startswith("error:"), res.stderr
    assert f"refused by the {rule} rule" in line, line
    assert res.stdout == ""
    return line


def buffer_files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_reading_inside_the_buffer_is_allowed(cli, loaded):
    shard = sorted(os.listdir(os.path.join(loaded, "rollouts")))[0]
    res = cli("sql", loaded, f"SELECT count(*) AS n FROM read_parquet('{loaded}/rollouts/{shard}')", "-f", "json")
    assert res.code == 0, res.stderr
    assert json.loads(res.stdout) == [{"n": 12}]


@pytest.mark.parametrize("where", ["absolute", "dotdot", "sibling", "symlink_file", "symlink_dir", "glob"])
def test_file_rule(cli, loaded, tmp_path, where):
    outside = str(tmp_path / "outside.parquet")
    if where == "absolute":
        query = f"SELECT * FROM read_parquet('{outside}')"
    elif where == "dotdot":
        query = f"SELECT * FROM read_parquet('{loaded}/rollouts/../../outside.parquet')"
    elif where == "sibling":  # a folder whose name starts with the buffer's name
        sibling = loaded + "-other"
        os.makedirs(sibling, exist_ok=True)
        write_parquet(rollouts_table(n_groups=1, group_size=2), os.path.join(sibling, "x.parquet"))
        query = f"SELECT * FROM read_parquet('{sibling}/x.parquet')"
    elif where == "symlink_file":
        os.symlink(outside, os.path.join(loaded, "rollouts", "sneaky.parquet"))
        query = f"SELECT * FROM read_parquet('{loaded}/rollouts/sneaky.parquet')"
    elif where == "symlink_dir":
        os.symlink(str(tmp_path), os.path.join(loaded, "curated", "elsewhere"))
        query = f"SELECT * FROM read_parquet('{loaded}/curated/elsewhere/outside.parquet')"
    else:
        query = f"SELECT * FROM glob('{tmp_path}/*')"
    refused(cli, loaded, query, "file")


def test_other_readers_outside_are_refused(cli, loaded):
    refused(cli, loaded, "SELECT * FROM read_text('/etc/passwd')", "file")
    refused(cli, loaded, "SELECT * FROM read_csv('/etc/hostname')", "file")


@pytest.mark.parametrize("query", [
    "COPY (SELECT * FROM rollouts) TO '{root}/rollouts/evil.parquet' (FORMAT parquet)",
    "SELECT count(*) FROM rollouts; COPY (SELECT * FROM rollouts) TO '{root}/rollouts/evil.parquet' (FORMAT parquet)",
    "SELECT 1;COPY rollouts TO '{root}/evil.csv'",
])
def test_copy_is_refused_and_writes_nothing(cli, loaded, query):
    before = buffer_files(loaded)
    line = refused(cli, loaded, query.format(root=loaded), "read-only")
    assert "COPY" in line
    assert buffer_files(loaded) == before


@pytest.mark.parametrize("query, kind", [
    ("ATTACH '{tmp}/other.db' AS other", "ATTACH"),
    ("SELECT 1; ATTACH ':memory:' AS m", "ATTACH"),
    ("INSTALL httpfs", "LOAD"),
    ("LOAD httpfs", "LOAD"),
    ("SET enable_external_access = true", "SET"),
    ("SET allowed_directories = ['/']", "SET"),
    ("RESET lock_configuration", ""),
    ("PRAGMA enable_profiling", "PRAGMA"),
    ("SELECT 1; PRAGMA version", "PRAGMA"),
    ("CREATE TABLE t AS SELECT 1", "CREATE"),
    ("CALL pragma_version()", "CALL"),
])
def test_statement_rules(cli, loaded, tmp_path, query, kind):
    line = refused(cli, loaded, query.format(tmp=tmp_path), "read-only")
    assert kind in line
    assert not (tmp_path / "other.db").exists()


def test_select_can_neither_change_settings_nor_reach_out(cli, loaded):
    res = cli("sql", loaded, "SELECT current_setting('enable_external_access') AS ext, "
              "current_setting('lock_configuration') AS locked", "-f", "json")
    assert res.code == 0, res.stderr
    assert json.loads(res.stdout) == [{"ext": False, "locked": True}]
    refused(cli, loaded, "SELECT * FROM 'https://example.com/x.parquet'", "file")


def test_runaway_query_stops_at_timeout(cli, loaded):
    start = time.monotonic()
    res = cli("sql", loaded, "SELECT sum(a * b) FROM range(100000000) t(a), range(100000) u(b)", "--timeout", "0.5")
    elapsed = time.monotonic() - start
    assert res.code != 0
    assert "timeout" in res.stderr and "0.5" in res.stderr, res.stderr
    assert elapsed < 10, elapsed


def test_json_format(cli, loaded):
    query = ("SELECT rollout_id, response_token_ids, gen_logprobs, correct, meta, true AS t, false AS f, "
             "NULL AS n, sample_idx, reward, created_at, count(*) OVER () AS total "
             "FROM rollouts ORDER BY rollout_id")
    res = cli("sql", loaded, query, "--format", "json")
    assert res.code == 0, res.stderr
    data = json.loads(res.stdout)  # ONE JSON document
    assert isinstance(data, list) and len(data) == 24 and all(isinstance(r, dict) for r in data)
    with Buffer.open(loaded) as buf:
        table = buf.snapshot().arrow("rollouts").to_table().sort_by("rollout_id")
    for row, want in zip(data, table.to_pylist()):
        assert row["rollout_id"] == want["rollout_id"]
        assert row["response_token_ids"] == want["response_token_ids"]
        assert row["gen_logprobs"] == want["gen_logprobs"]  # float32 -> JSON -> float32 exact
        assert row["correct"] is want["correct"]  # true/false/null
        assert row["meta"] is None and row["n"] is None
        assert row["t"] is True and row["f"] is False
        assert row["total"] == 24 and isinstance(row["total"], int)
        assert row["created_at"].startswith("2026-01-01T")
    assert '"t": true' in res.stdout and '"n": null' in res.stdout


def test_json_integers_stay_integers(cli, loaded):
    res = cli("sql", loaded, "SELECT sum(len(response_token_ids)) AS tokens, avg(reward) AS r, "
              "count(*) AS n FROM rollouts", "-f", "json")
    (row,) = json.loads(res.stdout)
    assert isinstance(row["tokens"], int) and isinstance(row["n"], int) and isinstance(row["r"], float)


def test_csv_format(cli, loaded):
    res = cli("sql", loaded, "SELECT rollout_id, sample_idx, correct, response_token_ids FROM rollouts "
              "ORDER BY rollout_id", "--format", "csv")
    assert res.code == 0, res.stderr
    rows = list(csv.reader(io.StringIO(res.stdout)))
    assert rows[0] == ["rollout_id", "sample_idx", "correct", "response_token_ids"]
    assert len(rows) == 1 + 24
    assert json.loads(rows[1][3]) and rows[1][2] in ("true", "false", "")


def test_parquet_format_needs_out(cli, loaded, tmp_path):
    res = cli("sql", loaded, "SELECT 1", "--format", "parquet")
    assert res.code != 0 and "--out" in res.stderr
    out = tmp_path / "res.parquet"
    res = cli("sql", loaded, "SELECT rollout_id, entropies FROM rollouts", "--format", "parquet", "--out", out)
    assert res.code == 0, res.stderr
    t = pq.read_table(out)
    assert t.num_rows == 24 and t.column_names == ["rollout_id", "entropies"]


def test_views_groups_and_prompts(cli, loaded):
    res = cli("sql", loaded, "SELECT count(*) AS g, min(size) AS lo, max(size) AS hi FROM groups", "-f", "json")
    assert json.loads(res.stdout) == [{"g": 6, "lo": 4, "hi": 4}]
    res = cli("sql", loaded, "SELECT sum(groups) AS g FROM prompts", "-f", "json")
    assert json.loads(res.stdout) == [{"g": 6}]


def test_error_line_is_not_eaten_as_markup(cli, loaded, tmp_path):
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"rollout_id": "[bold]r1[/bold]", "reward": "[red]"}\n')
    res = cli("import", loaded, str(bad))
    assert res.code != 0
    assert "[bold]r1[/bold]" in res.stderr and "'reward'" in res.stderr, res.stderr


def test_sql_through_the_installed_command(loaded, tmp_path):
    proc = subprocess.run([ROLLSTORE_BIN, "sql", loaded, "SELECT count(*) AS n FROM rollouts", "--format", "json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [{"n": 24}]  # stdout holds the JSON document and nothing else


def test_rebind_drops_the_previous_jobs_tables_and_views_and_keeps_the_views_macros(loaded):
    """A session reused for the next job (`Session.rebind`) drops the job's temp tables and views, and
    any view it made outside the temp catalog, in one script; views.sql's views and macros stay."""
    from rollstore.queries.session import Session

    with Buffer.open(loaded) as buf, buf.snapshot() as snap, Session(snap) as s:
        s.execute("CREATE OR REPLACE TEMP TABLE work AS SELECT 1 AS x")
        s.execute("CREATE OR REPLACE TEMP TABLE picked AS SELECT 2 AS y")
        s.execute("CREATE OR REPLACE VIEW mine AS SELECT 3 AS z")
        s.rebind(snap)
        left = {name for (name,) in s.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        assert not left & {"work", "picked", "mine"}, left
        assert {"rollouts", "groups", "prompts"} <= left
        assert s.execute("SELECT accuracy_band_key(0.5) IS NOT NULL").fetchone()[0]


def test_rebind_reads_the_new_snapshot_everywhere(tmp_path):
    """After a rebind every table view and every view of views.sql reads the new snapshot's files (the
    views of tables whose files changed are re-created, the others already read the same files), and a
    table that was empty and now has files is a view over them (and back, on an older snapshot)."""
    from rollstore.queries.session import Session

    root = str(tmp_path / "buf")
    with Buffer.init(root) as buf:
        buf.append_rollouts(rollouts_table(n_groups=3, group_size=4, mean_tokens=5, step=0))
        first = buf.snapshot()
        s = Session(first)
        try:
            def counts():
                return (s.one("SELECT count(*) FROM rollouts")[0], s.one("SELECT count(*) FROM groups")[0],
                        s.one("SELECT count(*) FROM prompt_selections")[0])

            assert counts() == (12, 3, 0)
            buf.append_rollouts(rollouts_table(n_groups=2, group_size=4, mean_tokens=5, step=1))
            with buf.snapshot() as second:
                s.rebind(second)
                assert counts() == (20, 5, 0)
                s.rebind(first)  # an older snapshot: its files again
                assert counts() == (12, 3, 0)
                s.rebind(second)
                assert counts() == (20, 5, 0)
        finally:
            s.close()
            first.close()


def test_rebind_keeps_the_moved_rows_table_of_an_unchanged_curated_view(tmp_path):
    """The `curated` view of a buffer whose referenced rollouts shards were compacted joins the table
    of moved rows the session made for it: a rebind that keeps the view (its files unchanged) keeps
    that table too, and the view reads the same rows after any number of rebinds."""
    from rollstore.curate.params import load_recipe
    from rollstore.curate.run import curate
    from rollstore.queries.session import Session
    from rollstore.storage import maintenance

    root = str(tmp_path / "buf")
    with Buffer.init(root) as buf:
        for step in (0, 1):
            buf.append_rollouts(rollouts_table(n_groups=3, group_size=4, mean_tokens=5, step=step,
                                               options=RowOptions(id_prefix=f"s{step}")))
            curate(buf, load_recipe("grpo"), {"where": f"step = {step}"})
        before = buf.snapshot()
        s = Session(before)
        try:
            rows = s.one("SELECT count(*) FROM curated")[0]
            assert rows > 0
            maintenance.compact(buf)
            with buf.snapshot() as after:
                assert after.moves(), "the compaction moved no referenced rows: the test checks nothing"
                for _ in range(3):
                    s.rebind(after)
                    assert s.one("SELECT count(*) FROM curated")[0] == rows
        finally:
            s.close()
            before.close()


def test_only_views_sql_defines_macros_or_lasting_objects():
    """`Session.rebind` keeps views.sql's views and macros and drops only the temp catalog's objects and
    what it did not make itself (listing duckdb_functions() cost ~15 ms a loop iteration, re-running
    views.sql ~5 ms): it relies on views.sql being the only SQL that creates a macro, or a table or view
    outside the temp catalog (a step that replaced one of views.sql's views would outlive its job). Every
    query file and every step of every built-in recipe's plan is checked here; user SQL is SELECT-only."""
    import glob
    import re

    from rollstore.curate.params import builtin_recipes, load_recipe, resolve
    from rollstore.curate.plan import build

    macro = re.compile(r"\bCREATE\s+(OR\s+REPLACE\s+)?(TEMP\s+|TEMPORARY\s+)?MACRO\b", re.IGNORECASE)
    lasting = re.compile(r"\bCREATE\s+(OR\s+REPLACE\s+)?(TABLE|VIEW)\b", re.IGNORECASE)
    here = os.path.join(os.path.dirname(__file__), "..", "queries")
    texts = {os.path.basename(f): open(f).read() for f in glob.glob(os.path.join(here, "*.sql"))}
    assert len(texts) > 30
    assert sorted(n for n, t in texts.items() if macro.search(t)) == ["views.sql"]
    assert sorted(n for n, t in texts.items() if lasting.search(t)) == ["views.sql"]
    assert lasting.search("CREATE OR REPLACE VIEW groups AS SELECT 1")  # the pattern can fail
    for name in builtin_recipes():
        recipe = load_recipe(name)
        if recipe.sql is not None:
            continue
        for step in build(resolve(recipe, {}), recipe, None).steps:
            assert not macro.search(step.text) and not lasting.search(step.text), (name, step.sql)


def test_a_rebound_session_makes_a_changed_tables_view_when_a_statement_first_names_it(tmp_path):
    """`rebind` drops the views of tables whose files changed and makes each again only when a statement
    names it (a loop's curation reads 3 of the 8 tables): until then the view is absent — a statement that
    reaches it without naming it fails, it never reads the previous snapshot's files — and `Session.con`
    (the connection handed out) has every view made."""
    import duckdb

    from rollstore.curate.params import load_recipe
    from rollstore.curate.run import curate
    from rollstore.queries.session import Session

    root = str(tmp_path / "buf")
    with Buffer.init(root) as buf:
        buf.append_rollouts(rollouts_table(n_groups=3, group_size=4, mean_tokens=5, step=0,
                                           options=RowOptions(id_prefix="s0")))
        first = buf.snapshot()
        s = Session(first)
        try:
            curate(buf, load_recipe("grpo"), {"where": "step = 0"})
            with buf.snapshot() as second:
                s.rebind(second)
                raw = s._con
                s.execute("SELECT count(*) FROM selections", reads={"selections"})
                made = {n for (n,) in raw.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
                assert "selections" in made and "curated" not in made and "curations" not in made, made
                with pytest.raises(duckdb.CatalogException):
                    raw.execute("SELECT count(*) FROM curated")  # absent, not the first snapshot's (empty) table
                assert s.one("SELECT count(*) FROM curated -- named, so made")[0] == s.one(
                    "SELECT n_selected FROM curations")[0] > 0
                s.rebind(first)
                assert s.con.execute("SELECT count(*) FROM curations").fetchone()[0] == 0  # `con`: all made
        finally:
            s.close()
            first.close()


def test_tables_named_finds_every_word_that_names_a_table():
    """A name too many makes a view for nothing; one too few would fail the statement: any word naming a
    table counts, in strings and comments too, quoted or in any case; views.sql's objects read every table."""
    from rollstore.queries.session import tables_named
    from rollstore.storage.schema import TABLES

    assert tables_named("SELECT * FROM curated c JOIN \"Selections\" USING (x) -- the curations") == {
        "curated", "selections", "curations"}
    assert tables_named("SELECT '/buf/rollouts/x.parquet', curated_rows, $training, training_x") == {"rollouts"}
    assert tables_named("SELECT * FROM groups") == set(TABLES)
    assert tables_named("SELECT accuracy_band_key(0.5)") == set(TABLES)
    assert tables_named("SELECT 1") == set()
    for indirect in ("SELECT * FROM query_table($$curations$$)", "SELECT * FROM query_table('roll' || 'outs')",
                     "SELECT * FROM query('SELECT 1')", "SELECT table_name FROM information_schema.tables",
                     "SELECT * FROM duckdb_views()", "SHOW TABLES", "DESCRIBE x", "SELECT $$a$$"):
        assert tables_named(indirect) == set(TABLES), indirect  # may reach any table without naming it
