"""A buffer cataloged in PostgreSQL (issue 36, first slice): the catalog seam, `rollstore init BUF
--catalog DSN`, its bad input, writers serialised in the catalog, and simulated hosts appending to
one buffer concurrently, checked by the invariant checker. The embedded default is untouched: a
buffer without a descriptor is the SQLite manifest (the rest of the suite tests it).

The server: ROLLSTORE_TEST_PG_DSN, else Debian's binaries, else the pgserver wheel (tests/pg_server.py),
started once for this module; without any, the server tests skip with one line saying which is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pytest

import pg_server
from conftest import ROOT
from multihost import appender_script, check_invariants, kill_trials
from rollstore.storage.buffer import Buffer, Part
from rollstore.storage.catalog import open_manifest
from rollstore.storage.catalog_pg import CatalogError, PgManifest
from rollstore.storage.descriptor import DESCRIPTOR, redact
from rollstore.storage.errors import ValidationError
from rollstore.storage.manifest import Manifest
from rollstore.builtin.synthetic import rollouts_table


@pytest.fixture
def pgbuf(pg, tmp_path):
    root = str(tmp_path / "buf")
    Buffer.init(root, catalog=pg.fresh_dsn()).close()
    return root


def _rollouts(step: int, run_id: str = "run0", groups: int = 2) -> pa.Table:
    return rollouts_table(n_groups=groups, group_size=2, mean_tokens=4, step=step, run_id=run_id)


# ---- no server needed ----------------------------------------------------------------------
def test_the_dialects_differ_by_named_hooks_not_by_rewriting():
    """(Replaces the test of the regex `translate`, deleted by issue 48: SQL is written once with
    dialect hooks.) Only the parameter marker changes in `prepare`; the rest are named spellings."""
    from rollstore.storage.dialect import POSTGRES, SQLITE

    sql = "SELECT 1 FROM shards WHERE path = ? AND key LIKE 'a%' LIMIT 1"
    assert SQLITE.prepare(sql) == sql
    assert POSTGRES.prepare(sql) == "SELECT 1 FROM shards WHERE path = %s AND key LIKE 'a%%' LIMIT 1"
    up = SQLITE.upsert("leases", ("consumer_group", "shard_id", "consumer"), ("consumer_group", "shard_id"))
    assert up == POSTGRES.upsert("leases", ("consumer_group", "shard_id", "consumer"), ("consumer_group", "shard_id"))
    assert up.endswith("ON CONFLICT (consumer_group, shard_id) DO UPDATE SET consumer = excluded.consumer")
    assert SQLITE.insert_ignore("meta", ("key", "value")).endswith("ON CONFLICT DO NOTHING")
    assert (SQLITE.distinct, POSTGRES.distinct) == ("IS NOT", "IS DISTINCT FROM")
    assert (SQLITE.greatest, POSTGRES.greatest) == ("max", "GREATEST")
    assert list(SQLITE.in_list("x", [1, 2])) == [("x IN (?, ?)", [1, 2])]
    assert list(POSTGRES.in_list("x", [1, 2], "bigint")) == [("x = ANY(?::bigint[])", [[1, 2]])]
    assert list(SQLITE.in_list("x", [])) == []


def test_passwords_never_reach_a_message():
    assert redact("postgresql://me:s3cret@db:5432/x") == "postgresql://me:***@db:5432/x"
    assert "s3cret" not in redact("host=db password=s3cret dbname=x")


def test_without_a_server_the_tests_skip_saying_what_is_missing(monkeypatch):
    import builtins

    monkeypatch.delenv("ROLLSTORE_TEST_PG_DSN", raising=False)
    monkeypatch.setattr(pg_server, "_bindir", lambda: None)
    real_import = builtins.__import__

    def no_pgserver(name, *args, **kwargs):
        if name == "pgserver":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pgserver)
    line = pg_server.why_missing()
    assert "ROLLSTORE_TEST_PG_DSN" in line and "apt-get install postgresql" in line and "pgserver" in line
    monkeypatch.setenv("ROLLSTORE_TEST_PG_DSN", "postgresql://x@127.0.0.1/y")
    assert pg_server.why_missing() is None


def test_a_buffer_without_a_descriptor_is_the_embedded_manifest(tmp_path):
    root = str(tmp_path / "buf")
    with Buffer.init(root) as buf:
        assert type(buf.manifest) is Manifest
    assert os.path.exists(os.path.join(root, "manifest.sqlite"))
    assert not os.path.exists(os.path.join(root, DESCRIPTOR))
    assert type(open_manifest(root)) is Manifest


def test_a_dsn_that_is_not_postgresql_is_refused_before_anything_is_written(cli, tmp_path):
    res = cli("init", tmp_path / "b", "--catalog", "mysql://x/y")
    assert res.code == 1 and "not a catalog rollstore knows" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()


# ---- with a server -------------------------------------------------------------------------
def test_init_writes_a_descriptor_and_every_operation_goes_to_the_catalog(pg, cli, tmp_path):
    root = str(tmp_path / "buf")
    res = cli("init", root, "--catalog", pg.fresh_dsn())
    assert res.code == 0, res.stderr
    assert os.path.exists(os.path.join(root, DESCRIPTOR)) and not os.path.exists(os.path.join(root, "manifest.sqlite"))
    assert cli("init", root).code == 0  # init again without --catalog opens the same catalog
    assert not os.path.exists(os.path.join(root, "manifest.sqlite"))
    with Buffer.open(root) as buf:
        assert isinstance(buf.manifest, PgManifest)
        for step in range(3):
            buf.append_rollouts(_rollouts(step))
        assert buf.manifest.latest_seq() == 3
        # a duplicate rollout_id is refused exactly as on SQLite, and nothing is committed
        files_before = sorted(os.listdir(os.path.join(root, "rollouts")))
        with pytest.raises(ValidationError, match="already in the buffer"):
            buf.append_rollouts(_rollouts(1))
        assert buf.manifest.latest_seq() == 3
        assert sorted(os.listdir(os.path.join(root, "rollouts"))) == files_before
        # leases: two consumers get disjoint shards; an ack is final
        _, a = buf.lease("rollouts", 2, "a")
        _, b = buf.lease("rollouts", 2, "b")
        assert len(a) == 2 and len(b) == 1 and not {s.shard_id for s in a} & {s.shard_id for s in b}
        assert buf.ack(a, "a") == 2 and buf.ack(a, "b") == 0
        buf.ack(b, "b")
        # a snapshot never changes: snapshot 2 before and after more commits and a compaction
        before = [s.path for s in buf.snapshot(2).shards("rollouts")]
        with buf.snapshot(pin=True) as snap:
            assert buf.manifest.oldest_pinned_seq() == snap.seq
    assert cli("curate", root, "--recipe", "d3s").code == 0
    with Buffer.open(root) as buf:
        assert [s.path for s in buf.snapshot(2).shards("rollouts")] == before
    assert cli("compact", root).code == 0
    assert cli("verify", root).code == 0
    res = cli("sql", root, "SELECT 1", "--format", "csv", "--out", os.path.join(root, DESCRIPTOR))
    assert res.code == 1 and "inside the managed files" in res.stderr  # --out never replaces the descriptor
    res = cli("gc", root)
    assert res.code == 0 and "retired shards" in res.stdout
    with Buffer.open(root) as buf:
        hosts = {r[0] for r in buf.manifest.con.execute("SELECT DISTINCT host FROM commits")}
        assert None not in hosts
    assert check_invariants(root) == []


def test_bad_catalogs_are_one_line_and_write_nothing(pg, cli, tmp_path):
    def refused(folder, dsn, words):
        res = cli("init", folder, "--catalog", dsn)
        assert res.code == 1, res.stdout
        assert words in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr

    nothing = tmp_path / "nothing"
    refused(nothing, "postgresql://rollstore@127.0.0.1:1/postgres?connect_timeout=3", "cannot connect")
    refused(nothing, pg_server.with_schema(pg.dsn, "no_such_schema"), "schema its search_path names does not exist")
    assert not nothing.exists()
    dsn = pg.fresh_dsn()
    first = str(tmp_path / "first")
    assert cli("init", first, "--catalog", dsn).code == 0
    refused(nothing, dsn, "holds another buffer")  # the catalog of another buffer
    assert not nothing.exists()
    refused(first, pg.fresh_dsn(), "already cataloged at")
    import errno

    import rollstore.storage.catalog_pg as catalog_pg

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    real_link = os.link
    os.link = no_links  # a shared mount without hard links
    try:
        refused(nothing, pg.fresh_dsn(), "makes no hard links")
    finally:
        os.link = real_link
    assert not nothing.exists() and not [n for n in os.listdir(tmp_path) if n.startswith(".rollstore-link-probe")]
    assert catalog_pg.check_hard_links(str(tmp_path)) is None
    embedded = str(tmp_path / "embedded")
    assert cli("init", embedded).code == 0
    refused(embedded, pg.fresh_dsn(), "already an embedded buffer")
    assert not os.path.exists(os.path.join(embedded, DESCRIPTOR))
    # opening: a catalog whose tables are gone, or that another buffer's uuid now holds
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as con:
        con.execute("UPDATE meta SET value = 'ffffffffffffffffffffffffffffffff' WHERE key = 'buffer_uuid'")
    res = cli("info", first)
    assert res.code == 1 and "holds buffer ffff" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    with psycopg.connect(dsn, autocommit=True) as con:
        con.execute("DROP TABLE pins")
    res = cli("info", first)
    assert res.code == 1 and "no rollstore catalog there" in res.stderr


def test_writers_are_serialised_in_the_catalog_and_seqs_follow_commit_order(pgbuf):
    a, b = PgManifest(pgbuf), PgManifest(pgbuf)
    order = []
    try:
        with a.transaction() as con:
            seq_a = a.new_commit(con, "a")

            def other():
                with b.transaction() as con_b:  # waits for a's COMMIT (the advisory lock)
                    order.append(("b", b.new_commit(con_b, "b")))

            t = threading.Thread(target=other)
            t.start()
            time.sleep(0.3)
            assert order == []  # b is blocked while a holds the lock
            order.append(("a", seq_a))
        t.join(10)
        assert order == [("a", 1), ("b", 2)]
    finally:
        a.close()
        b.close()


def test_only_intents_commit_without_waiting_for_the_wal_flush(pgbuf):
    """A writer's intents (outside the buffer's lock) commit without a WAL flush: losing one in a
    server crash only fences its writer. Every locked transaction (commits, leases, acks, pins) and
    gc's own intents wait for it."""
    from rollstore.storage.catalog_pg import _locked

    with Buffer.open(pgbuf) as buf:
        man = buf.manifest
        assert man.con.execute("SHOW synchronous_commit").fetchone()[0] == "off"
        with man.transaction() as con:
            assert con.execute("SHOW synchronous_commit").fetchone()[0] == "on"
        with _locked(man.con, None) as con:  # gc's intents
            assert con.execute("SHOW synchronous_commit").fetchone()[0] == "on"
        assert man.con.execute("SHOW synchronous_commit").fetchone()[0] == "off"
        with man.owning("rollouts/none.parquet") as mine:
            assert mine
        buf.append_rollouts(_rollouts(0))
        assert man.con.execute("SELECT count(*) FROM intents").fetchone()[0] == 0


def test_two_writers_of_one_path_one_wins_and_its_file_stays(pgbuf):
    table = _rollouts(0)  # e.g. two hosts finishing one deterministic curation: same path, same bytes
    rids, gids = table.column("rollout_id").to_pylist(), table.column("group_id").to_pylist()

    def register(buf):
        return lambda con, seq, ids: buf.manifest.register_rollouts(con, ids[0], zip(rids, gids), sorted(set(gids)))

    with Buffer.open(pgbuf) as one, Buffer.open(pgbuf) as two:
        one.commit([Part("rollouts", table, name="same")], "e", on_commit=register(one))
        with pytest.raises(FileExistsError):
            two.commit([Part("rollouts", table, name="same")], "e", on_commit=register(two))
        assert two.manifest.latest_seq() == 1
    assert check_invariants(pgbuf) == []


def test_a_catalog_that_goes_away_is_one_line_and_no_committed_file_is_removed(pg, pgbuf):
    import psycopg

    with Buffer.open(pgbuf) as buf:
        buf.append_rollouts(_rollouts(0))
        pid = buf.manifest.con.raw.info.backend_pid
        with psycopg.connect(pg.dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(CatalogError) as err:
            buf.append_rollouts(_rollouts(1))
        assert len(str(err.value).splitlines()) == 1 and "catalog postgresql://" in str(err.value)
    assert check_invariants(pgbuf) == []


def test_simulated_hosts_append_concurrently(pgbuf, tmp_path):
    hosts, n = ("h0", "h1", "h2"), 8
    procs = []
    for i, host in enumerate(hosts):
        script = tmp_path / f"{host}.py"
        script.write_text(appender_script(ROOT, pgbuf, n, seed=i))
        env = {**os.environ, "ROLLSTORE_HOST_ID": host, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        assert len(out.split()) == n
    assert check_invariants(pgbuf) == []
    with Buffer.open(pgbuf) as buf:
        assert buf.manifest.latest_seq() == len(hosts) * n
        per_host = dict(buf.manifest.con.execute("SELECT host, count(*) FROM commits GROUP BY host").fetchall())
        assert per_host == {h: n for h in hosts}


class _LoseCommitAck:
    """A psycopg connection whose next COMMIT is lost: `deliver` True sends it (it takes effect),
    False never sends it; either way the connection then breaks and the caller sees an error."""

    def __init__(self, raw, pg, deliver: bool):
        self._raw, self._pg, self._deliver = raw, pg, deliver

    def __getattr__(self, name):
        return getattr(self._raw, name)

    def execute(self, query, *args, **kwargs):
        import psycopg

        if query == "COMMIT":
            if self._deliver:
                self._raw.execute(query)
            with psycopg.connect(self._pg.dsn, autocommit=True) as admin:  # the backend goes away
                admin.execute("SELECT pg_terminate_backend(%s)", (self._raw.info.backend_pid,))
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return self._raw.execute(query, *args, **kwargs)


@pytest.mark.parametrize("deliver", [True, False], ids=["committed", "not-committed"])
def test_a_lost_commit_acknowledgement_is_resolved_by_the_commit_token(pg, pgbuf, deliver):
    with Buffer.open(pgbuf) as buf:
        buf.append_rollouts(_rollouts(0))
        files = set(os.listdir(os.path.join(pgbuf, "rollouts")))
        buf.manifest.con.raw = _LoseCommitAck(buf.manifest.con.raw, pg, deliver)
        if deliver:
            shard = buf.append_rollouts(_rollouts(1))  # resolved: it committed, so it succeeds
            assert shard.path in {s.path for s in buf.manifest.shards("rollouts")}
            assert buf.manifest.latest_seq() == 2
        else:
            with pytest.raises(CatalogError, match="was NOT committed"):
                buf.append_rollouts(_rollouts(1))
            assert buf.manifest.latest_seq() == 1  # the fresh connection answers
            # no file is unlinked once COMMIT may have been sent: the unnamed one is an orphan for gc
            assert files < set(os.listdir(os.path.join(pgbuf, "rollouts")))
    assert check_invariants(pgbuf) == []


def test_hosts_killed_mid_append_leave_every_invariant_holding(pgbuf):
    results = kill_trials(ROOT, pgbuf, ["h0", "h1", "h2"], kills=2, seed=36)  # more: python tests/multihost.py --kills N
    assert [(t, h) for t, h, bad, _ in results if bad] == [], results
    with Buffer.open(pgbuf) as buf:
        assert buf.manifest.latest_seq() > 0


HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from rollstore.storage.buffer import Buffer
buf = Buffer.open({buffer!r})
buf.manifest.intend(["rollouts/held.parquet"])  # a writer between its intent and its commit
with buf.manifest.holding("tmp/curate-other-1-abc"):
    print("holding", flush=True)
    time.sleep(600)
"""


def test_gc_of_a_cataloged_buffer_leaves_what_live_intents_hold(pgbuf, monkeypatch):
    """Another host's writer holds intents (a file not yet committed, a working folder under tmp/),
    renewed by its heartbeat past their TTL: gc with no grace leaves them, and removes at once what
    no row names and no intent holds (an orphan, a dead host's tmp file); once that writer is
    killed its intents expire on the database's clock and gc takes them over and removes the
    files. Committed files stay; no writers' lock is taken, so gc never waits."""
    import rollstore.storage.maintenance as maintenance

    monkeypatch.setenv("ROLLSTORE_INTENT_TTL_S", "1")
    with Buffer.open(pgbuf) as buf:
        shard = buf.append_rollouts(_rollouts(0))
    held, folder = os.path.join(pgbuf, "rollouts", "held.parquet"), os.path.join(pgbuf, "tmp", "curate-other-1-abc")
    orphan, dead_tmp = os.path.join(pgbuf, "rollouts", "orphan.parquet"), os.path.join(pgbuf, "tmp", "tmp-gone-7-ab.parquet")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(root=ROOT, buffer=pgbuf)],
                              env={**os.environ, "ROLLSTORE_HOST_ID": "other"}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        os.makedirs(folder)
        for path in (held, orphan, dead_tmp):
            with open(path, "wb") as f:
                f.write(b"PAR1 not committed")
        time.sleep(2.0)  # past the TTL: the heartbeat (every TTL/4) keeps the holder's intents live
        with Buffer.open(pgbuf) as buf:
            report = maintenance.gc(buf, grace_s=0.0)
        assert report.orphans_removed == 2 and not os.path.exists(orphan) and not os.path.exists(dead_tmp)
        assert os.path.exists(held) and os.path.exists(folder)
    finally:
        holder.kill()
        holder.wait()
    time.sleep(1.5)  # its intents expire: nobody renews them
    with Buffer.open(pgbuf) as buf:
        report = maintenance.gc(buf, grace_s=0.0)
        assert buf.manifest.con.execute("SELECT count(*) FROM intents").fetchone()[0] == 0
    assert report.orphans_removed == 2 and not os.path.exists(held) and not os.path.exists(folder)
    assert os.path.exists(os.path.join(pgbuf, shard.path))
    assert check_invariants(pgbuf, orphans=True) == []


BETWEEN = """
import os, signal, sys
sys.path.insert(0, {root!r})
from rollstore.storage.buffer import Buffer
from rollstore.builtin.synthetic import rollouts_table
buf = Buffer.open({buffer!r})
real = buf.manifest.transaction

def stalled():  # its files written and linked, its transaction not begun
    print("stalling", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    return real()

buf.manifest.transaction = stalled
try:
    buf.append_rollouts(rollouts_table(n_groups=1, group_size=2, mean_tokens=4, run_id="stalled"))
    print("committed", flush=True)
except Exception as exc:
    print("refused:", exc, flush=True)
"""


def test_a_writer_stalled_between_its_files_and_its_commit_is_fenced(pgbuf):
    """SIGSTOP after the files, before the transaction, past the intent TTL: gc (another host, no
    grace) takes its expired intents over and removes its files; on SIGCONT its commit is refused
    (one line), nothing of it is visible, and no file is left."""
    import signal

    import rollstore.storage.maintenance as maintenance

    proc = subprocess.Popen([sys.executable, "-c", BETWEEN.format(root=ROOT, buffer=pgbuf)],
                            env={**os.environ, "ROLLSTORE_HOST_ID": "stalled", "ROLLSTORE_INTENT_TTL_S": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "stalling"
        assert len(os.listdir(os.path.join(pgbuf, "rollouts"))) == 1
        time.sleep(1.5)
        with Buffer.open(pgbuf) as buf:
            report = maintenance.gc(buf, grace_s=0.0)
            buf.append_rollouts(_rollouts(0))  # the others go on
        assert report.orphans_removed == 1 and len(os.listdir(os.path.join(pgbuf, "rollouts"))) == 1
    finally:
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
    assert out.startswith("refused: catalog postgresql://") and "fenced" in out, (out, err)
    assert len(out.strip().splitlines()) == 1
    with Buffer.open(pgbuf) as buf:
        assert buf.manifest.latest_seq() == 1
        assert buf.manifest.con.execute("SELECT count(*) FROM intents").fetchone()[0] == 0
    assert check_invariants(pgbuf, orphans=True) == []


def test_a_slow_writer_is_kept_alive_by_its_heartbeat(pgbuf, monkeypatch):
    """A writer slower than the intent TTL between its files and its commit is not fenced: its
    heartbeat renews its intents on the database's clock, and a gc meanwhile leaves its files."""
    import rollstore.storage.maintenance as maintenance

    monkeypatch.setenv("ROLLSTORE_INTENT_TTL_S", "0.8")
    with Buffer.open(pgbuf) as buf, Buffer.open(pgbuf) as other:
        real = buf.manifest.transaction
        collected = []

        def slow():
            time.sleep(1.6)
            collected.append(maintenance.gc(other, grace_s=0.0).orphans_removed)
            time.sleep(0.5)
            return real()

        buf.manifest.transaction = slow
        shard = buf.append_rollouts(_rollouts(0))
        assert collected == [0] and buf.manifest.latest_seq() == 1
        assert os.path.exists(os.path.join(pgbuf, shard.path))
    assert check_invariants(pgbuf, orphans=True) == []


STALLER = """
import os, signal, sys
sys.path.insert(0, {root!r})
from rollstore.storage.buffer import Buffer
from rollstore.builtin.synthetic import rollouts_table
buf = Buffer.open({buffer!r})
table = rollouts_table(n_groups=1, group_size=2, mean_tokens=4, run_id="stalled")

def stall(con, seq, ids):  # inside the commit's transaction, holding the buffer's lock
    print("stalling", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)

try:
    buf.commit([__import__("rollstore.storage.buffer", fromlist=["Part"]).Part("rollouts", table)], "append",
               on_commit=stall)
    print("committed", flush=True)
except Exception as exc:
    print("refused:", exc, flush=True)
"""


def test_a_host_stalled_inside_its_commit_is_fenced_and_the_others_go_on(pgbuf):
    """SIGSTOP inside a commit's transaction (the buffer's lock held): after ROLLSTORE_PG_STALL_S on
    the database's clock its session is cut off, the lock released, another host commits; on
    SIGCONT the stalled host's commit is refused, one line, and nothing of it is visible."""
    import signal

    proc = subprocess.Popen([sys.executable, "-c", STALLER.format(root=ROOT, buffer=pgbuf)],
                            env={**os.environ, "ROLLSTORE_HOST_ID": "stalled", "ROLLSTORE_PG_STALL_S": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "stalling"
        t = time.monotonic()
        with Buffer.open(pgbuf) as buf:
            buf.append_rollouts(_rollouts(0))  # waits for the lock until the stalled session is cut off
            assert buf.manifest.latest_seq() == 1
        assert time.monotonic() - t < 30
    finally:
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
    assert out.startswith("refused: catalog postgresql://") and len(out.strip().splitlines()) == 1, (out, err)
    with Buffer.open(pgbuf) as buf:
        assert buf.manifest.latest_seq() == 1
        assert {r[0] for r in buf.manifest.con.execute("SELECT host FROM commits")} != {"stalled"}
    assert check_invariants(pgbuf, orphans=False) == []


def test_leases_and_pins_expire_on_the_databases_clock(pgbuf, monkeypatch):
    """A host whose clock runs an hour ahead neither steals a live lease nor drops a pin early."""
    with Buffer.open(pgbuf) as buf:
        buf.append_rollouts(_rollouts(0))
        _, mine = buf.lease("rollouts", 1, "a", ttl=600.0)
        pin = buf.manifest.pin(1, ttl=600.0)
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 3600.0)
        _, stolen = buf.lease("rollouts", 1, "skewed", ttl=600.0)
        assert len(mine) == 1 and stolen == []
        assert buf.manifest.oldest_pinned_seq() == 1
        monkeypatch.setattr(time, "time", real)
        buf.manifest.unpin(pin)
        _, again = buf.lease("rollouts", 1, "b", ttl=0.0)  # nothing free: a's lease is live
        assert again == []


def test_d3s_on_a_cataloged_buffer_is_the_embedded_buffers_curation(pg, tmp_path):
    """The same rows in an embedded and a PostgreSQL-cataloged buffer: d3s gives the same curation id,
    byte-identical audit shards (by the sha256 the catalogs record) and the same curated rows. (The
    curated shards' bytes differ only in `rollouts_shard`, the referenced file's name, which is
    random per buffer: it is compared as the position of that shard in append order.)"""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    import rollstore as rs

    tables = [_rollouts(step, groups=4) for step in range(3)]
    results = {}
    for kind in ("embedded", "postgres"):
        root = str(tmp_path / kind)
        Buffer.init(root, catalog=pg.fresh_dsn() if kind == "postgres" else None).close()
        with Buffer.open(root) as buf:
            order = [buf.append_rollouts(t).path for t in tables]
        cur = rs.open(root).curate("d3s")
        with Buffer.open(root) as buf:
            audit = sorted(s.sha256 for s in buf.manifest.shards("selections"))
            curated = pa.concat_tables(pq.read_table(os.path.join(root, s.path)) for s in buf.manifest.shards("curated"))
        position = pa.array([order.index(p) for p in curated.column("rollouts_shard").to_pylist()])
        curated = curated.set_column(curated.schema.get_field_index("rollouts_shard"), "rollouts_shard", position)
        results[kind] = (cur.id, audit, curated.replace_schema_metadata(None))
    (id_e, audit_e, cur_e), (id_p, audit_p, cur_p) = results["embedded"], results["postgres"]
    assert id_e == id_p and audit_e == audit_p and audit_e
    assert cur_e.num_rows > 0 and cur_e.equals(cur_p)
    assert pc.all(pc.greater_equal(cur_e.column("rollouts_shard"), 0)).as_py()


# ---- the learner's exactly-once publication, on a cataloged buffer -------------------------
# test_checkpoint.py's own tests, collected here again with `buf` a PostgreSQL-cataloged buffer: a
# version is published once, a shard is trained into a run once, a lease lost to another consumer
# refuses the save. Their checks run inside the commit's transaction, which the catalog's lock
# serialises against every host's writers.
from test_checkpoint import (  # noqa: E402
    _threads,  # noqa: F401 - the autouse fixture: one torch thread
    test_a_shard_is_trained_into_a_run_once as test_pg_a_shard_is_trained_into_a_run_once,  # noqa: F401
    test_a_version_is_published_once as test_pg_a_version_is_published_once,  # noqa: F401
    test_lease_is_acked_in_the_checkpoint_commit as test_pg_lease_is_acked_in_the_checkpoint_commit,  # noqa: F401
)


@pytest.fixture
def buf(pgbuf):
    b = Buffer.open(pgbuf)
    assert isinstance(b.manifest, PgManifest)
    yield b
    b.close()


def test_a_racing_duplicate_is_refused_in_the_commit_and_nothing_of_it_stays(pgbuf):
    """Two hosts appending the same ids at once both pass validation; the catalog's primary keys
    refuse the second inside its transaction (one ValidationError line, as on SQLite), the partial
    claim is undone and the transaction goes on to roll back cleanly."""
    with Buffer.open(pgbuf) as buf:
        buf.append_rollouts(_rollouts(0))
        real, real_register = buf.manifest.existing_ids, buf.manifest.register_rollouts
        committing = []

        def blind(rids, gids):  # the race: validation saw none of the other host's ids
            return real(rids, gids) if committing else (set(), set())

        def register(*args):
            committing.append(1)
            return real_register(*args)

        buf.manifest.existing_ids, buf.manifest.register_rollouts = blind, register
        with pytest.raises(ValidationError, match="rollout_id already in the buffer"):
            buf.append_rollouts(_rollouts(0))
        assert committing and buf.manifest.latest_seq() == 1
        buf.manifest.existing_ids, buf.manifest.register_rollouts = real, real_register
        buf.append_rollouts(_rollouts(1))  # the connection is healthy afterwards
    assert check_invariants(pgbuf) == []


def test_hosts_killed_at_injected_points_leave_every_invariant_holding(pgbuf):
    """Appending hosts kill -9 themselves at chosen points: files linked but no transaction yet;
    inside the transaction (commit and shard rows written, not committed); right after COMMIT
    returned, before the caller knows. gc (no grace) and the invariant checker after each."""
    results = kill_trials(ROOT, pgbuf, ["h0", "h1", "h2"], kills=3, seed=7, inject=0.3)
    assert [(t, h) for t, h, bad, _ in results if bad] == [], results
    assert all("@" in h for _, h, _, _ in results)


# ---- leases and the consumed ledger on the database's clock --------------------------------
class _Weights:
    """What save_checkpoint asks of a model (its weights written to a folder), without a model."""

    def save_pretrained(self, folder, safe_serialization=True):
        with open(os.path.join(folder, "weights.bin"), "wb") as f:
            f.write(b"w")


STALLED_LEARNER = """
import sys, time
sys.path.insert(0, {root!r})
from rollstore.storage.buffer import Buffer
from rollstore.learner.checkpoint import CheckpointError, Publish, consumed_entry, save_checkpoint

class Weights:
    def save_pretrained(self, folder, safe_serialization=True):
        open(folder + "/weights.bin", "wb").write(b"w")

buf = Buffer.open({buffer!r})
_, shards = buf.lease("rollouts", 1, "stalled", group="learn", ttl=1.0)
print("leased", shards[0].path, flush=True)
time.sleep(0.5)  # training: the test stops it here, past its lease's TTL
try:
    save_checkpoint(buf, Weights(), publish=Publish(version=1, run_id="run", lease=("stalled", "learn"),
                    consumed=[consumed_entry("c", s.path) for s in shards]))
    print("published", flush=True)
except CheckpointError as exc:
    print("refused:", exc, flush=True)
"""


def test_a_learner_stalled_past_its_lease_is_refused_at_publish(pgbuf):
    """A learner process stopped (SIGSTOP) past its lease's TTL on the database's clock: another
    learner takes the lease over and publishes the shard; on SIGCONT the stalled one's publish is
    refused (one line), nothing of it is visible, and the consumed ledger (a catalog table) holds
    the shard once."""
    import signal

    from multihost import trained_twice
    from rollstore.learner.checkpoint import Publish, consumed_entry, list_checkpoints, save_checkpoint

    with Buffer.open(pgbuf) as buf:
        buf.append_rollouts(_rollouts(0))
    proc = subprocess.Popen([sys.executable, "-c", STALLED_LEARNER.format(root=ROOT, buffer=pgbuf)],
                            env={**os.environ, "ROLLSTORE_HOST_ID": "stalled"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        said = proc.stdout.readline().split()
        proc.send_signal(signal.SIGSTOP)
        assert said[0] == "leased", proc.stderr.read()
        time.sleep(1.3)
        with Buffer.open(pgbuf) as buf:
            _, taken = buf.lease("rollouts", 1, "other", group="learn", ttl=60.0)
            assert [s.path for s in taken] == [said[1]]  # taken over: it expired on the database's clock
            # (of another run: what refuses the stalled learner is then its lost lease alone; in one
            # run the consumed ledger refuses it first, as the stall trials show)
            save_checkpoint(buf, _Weights(), publish=Publish(version=2, run_id="run-b", lease=("other", "learn"),
                            consumed=[consumed_entry("c", said[1])]))
    finally:
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    assert out.startswith("refused:") and "is not held by 'stalled'" in out and len(out.strip().splitlines()) == 1, \
        (out, err)
    with Buffer.open(pgbuf) as buf:
        assert [c.version for c in list_checkpoints(buf)] == [2]
        assert buf.manifest.con.execute("SELECT run_id, shard, version FROM consumed").fetchall() == [("run-b", said[1], 2)]
        assert not os.path.exists(os.path.join(pgbuf, "checkpoints", "v1"))
    assert trained_twice(pgbuf) == [] and check_invariants(pgbuf, orphans=True) == []


def test_an_expired_lease_nobody_took_still_refuses_the_publish(pgbuf):
    """On a cataloged buffer a lease that expired on the database's clock is not acked, by `ack` or
    at publish, even when no one took it over (a consumer stalled past its TTL is fenced); the
    consumed ledger refuses a shard trained into the run twice, and a version published twice."""
    from rollstore.learner.checkpoint import CheckpointError, Publish, consumed_entry, save_checkpoint

    with Buffer.open(pgbuf) as buf:
        for step in range(3):
            buf.append_rollouts(_rollouts(step))
        _, one = buf.lease("rollouts", 1, "a", group="learn", ttl=0.3)
        time.sleep(0.5)
        with pytest.raises(CheckpointError, match="is not held by 'a'"):
            save_checkpoint(buf, _Weights(), publish=Publish(version=1, run_id="run", lease=("a", "learn"),
                            consumed=[consumed_entry("c", one[0].path)]))
        assert buf.ack(one, "a", group="learn") == 0
        _, two = buf.lease("rollouts", 2, "a", group="learn", ttl=60.0)
        assert two[0].shard_id == one[0].shard_id  # it was never acked: leased again
        save_checkpoint(buf, _Weights(), publish=Publish(version=1, run_id="run", lease=("a", "learn"),
                        consumed=[consumed_entry("c", s.path) for s in two]))
        with pytest.raises(CheckpointError, match="already trained into v1 of run 'run'"):
            save_checkpoint(buf, _Weights(), publish=Publish(version=2, run_id="run",
                            consumed=[consumed_entry("c", two[1].path)]))
        with pytest.raises(CheckpointError, match="version 1 already exists"):
            save_checkpoint(buf, _Weights(), publish=Publish(version=1, run_id="other", consumed=[]))
        assert sorted(r[0] for r in buf.manifest.con.execute("SELECT shard FROM consumed")) == sorted(s.path for s in two)


@pytest.mark.parametrize("old", ["1", "2"])
def test_an_older_catalog_is_upgraded_on_open(pg, pgbuf, old):
    """A catalog made by an earlier slice (schema 1: no intents, consumed or objects table; schema 2:
    no objects table) gains them when this rollstore opens it, its consumed ledger filled from the
    published checkpoints (version 1)."""
    import psycopg

    from rollstore.learner.checkpoint import Publish, consumed_entry, save_checkpoint

    with Buffer.open(pgbuf) as buf:
        shard = buf.append_rollouts(_rollouts(0))
        save_checkpoint(buf, _Weights(), publish=Publish(version=1, run_id="run", consumed=[consumed_entry("c", shard.path)]))
        dsn = buf.manifest.descriptor.catalog
    with psycopg.connect(dsn, autocommit=True) as con:
        drop = "DROP TABLE intents; DROP TABLE consumed; " if old == "1" else ""
        con.execute(f"{drop}DROP TABLE objects; UPDATE meta SET value = '{old}' WHERE key = 'schema_version'")
    with Buffer.open(pgbuf) as buf:
        assert buf.manifest.con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == "3"
        assert buf.manifest.objects_under("checkpoints/") == []
        assert buf.manifest.con.execute("SELECT run_id, shard, version FROM consumed").fetchall() == [("run", shard.path, 1)]
        buf.append_rollouts(_rollouts(1))
    assert check_invariants(pgbuf, orphans=True) == []


def test_stalled_hosts_and_learners_leave_every_invariant_holding(pgbuf, tmp_path):
    """tests/multihost.py's stall trials, one (more: python tests/multihost.py --stalls N): appenders
    and learners stopped past their TTL at random moments while gc runs; then continued; every
    invariant checked after each."""
    from multihost import stall_trials

    results = stall_trials(ROOT, pgbuf, ["h0", "h1", "h2"], stalls=1, logdir=str(tmp_path), learners=2,
                           ttl=1.0, seed=36)
    assert [(t, h, bad) for t, h, bad, _ in results if bad] == []
