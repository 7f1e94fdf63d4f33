"""Compaction of referenced rollouts shards (issue 37, item 5), checked by one invariant checker.

Compaction merges rollouts shards that thin curated shards refer to; the manifest records, in the
same commit, where each retired shard's rows went (`moved`), and every reader of a reference
follows it. `check` is the invariant every test here ends with:
- every live shard is its manifest row (size, sha256) and every live curated shard's references
  resolve (`storage.verify.scan`, `scan_references`);
- the curated shards are exactly those the curations committed, and each resolves to the very
  rows it resolved to before any compaction, through the learner's reader (no snapshot: files on
  disk), a snapshot (`Snapshot.curated`), the DuckDB `curated` view and a frozen snapshot's view
  (a Dask worker's);
- the live rollouts hold every appended rollout exactly once, the id tables name live shards, and
  every retired rollouts shard's rows were moved (no half-done compaction: retired without a move);
- nothing was trained twice: the run's checkpoints consume each curated shard at most once.

The kill -9 trials run compaction (then gc) in a child killed at injected points (after the old
shards are verified, after the first new file is linked, inside the manifest transaction after
the moves are written, after the commit, at gc's first removal) and at random moments, while
`rollstore train` runs beside it (itself killed at random in some trials and resumed later); after
every trial `check` holds, and the final resumed train trains every curated shard exactly once.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import duckdb
import pyarrow as pa
import pytest

from conftest import ROOT
from test_integrity_round3 import tiny_rows
from rollstore.curate.params import load_recipe
from rollstore.curate.run import curate
from rollstore.learner.batches import read_curated
from rollstore.learner.checkpoint import list_checkpoints
from rollstore.storage import maintenance
from rollstore.storage.buffer import Buffer
from rollstore.storage.errors import ManifestError
from rollstore.storage.references import locate
from rollstore.storage.verify import scan, scan_references

RUN = "train"
INJECTED = ("verified", "written", "in-txn", "committed", "gc")
# Random-moment kills per run of the suite (each ~7 s on two cores); more with ROLLSTORE_COMPACT_KILLS=N.
RANDOM_KILLS = int(os.environ.get("ROLLSTORE_COMPACT_KILLS", "2"))


def add_steps(root: str, steps: range, expected: dict, appended: list) -> None:
    """Append one rollouts shard per step and curate it (grpo); record what the curated shards
    resolve to now (`expected`) and the appended rollout ids."""
    with Buffer.open(root) as buf:
        for step in steps:
            table = tiny_rows(step, step=step)
            buf.append_rollouts(table)
            appended += table.column("rollout_id").to_pylist()
            curate(buf, load_recipe("grpo"), {"where": f"step = {step}"})
        for s in buf.manifest.shards("curated"):
            if s.path not in expected:
                expected[s.path] = read_curated([os.path.join(root, s.path)])


def consumed(buf: Buffer) -> list[str]:
    return [e["shard"] for ck in list_checkpoints(buf) if ck.run_id == RUN for e in ck.consumed]


def check(root: str, expected: dict, appended: list) -> None:
    """The invariants of the module docstring; raises AssertionError naming the one that fails."""
    with Buffer.open(root) as buf, buf.snapshot() as snap:
        man = buf.manifest
        assert scan(root, man) == [], "a live shard differs from its manifest row"
        assert scan_references(root, man) == [], "a curated shard's references do not resolve"
        curated = [s.path for s in snap.shards("curated")]
        assert curated == list(expected), "the curated shards changed"
        for rel in curated:  # the learner's reader: no snapshot, the files on disk
            assert read_curated([os.path.join(root, rel)]).equals(expected[rel]), rel
        assert snap.curated().equals(pa.concat_tables(expected.values()))
        con = duckdb.connect()
        snap.register_duckdb(con, ["rollouts", "curated"])
        rows, tokens = con.execute("SELECT count(*), sum(len(loss_mask)) FROM curated").fetchone()
        want = pa.concat_tables(expected.values())
        assert (rows, tokens) == (want.num_rows, sum(len(m) for m in want.column("loss_mask").to_pylist()))
        frozen = duckdb.connect()  # what a Dask worker reads: the file lists and the moves, no manifest
        snap.frozen().register_duckdb(frozen, ["rollouts", "curated"])
        assert frozen.execute("SELECT count(*), sum(len(loss_mask)) FROM curated").fetchone() == (rows, tokens)
        ids = con.execute("SELECT rollout_id FROM rollouts").fetchall()
        assert sorted(r[0] for r in ids) == sorted(appended), "a rollout was lost or duplicated"
        live = {s.path for s in snap.shards("rollouts")}
        live_ids = {s.shard_id for s in snap.shards("rollouts")}
        assert {r[0] for r in man.con.execute("SELECT DISTINCT shard_id FROM rollout_ids")} <= live_ids
        moves = man.moves()
        retired = {r[0] for r in man.con.execute(
            "SELECT path FROM shards WHERE table_name = 'rollouts' AND removed_seq IS NOT NULL")}
        assert retired <= set(moves), "a rollouts shard was retired without recording where its rows went"
        assert all(locate(rel, root, live, moves) is not None for rel in moves), "a move leads nowhere"
        trained = consumed(buf)
        assert len(trained) == len(set(trained)), "a curated shard was trained twice"
        assert set(trained) <= set(expected)


def test_compaction_merges_referenced_shards_and_answers_as_before(buffer_dir, cli):
    """Merged twice (the second merges the first's shard: a chain of moves), gc in between: the
    learner, the snapshot, the view, verify, audit and `why` answer as before; a snapshot pinned
    before the compaction reads what it read."""
    root = buffer_dir
    expected, appended = {}, []
    add_steps(root, range(4), expected, appended)
    pinned = Buffer.open(root)  # a reader that pinned its snapshot before the compaction
    old = pinned.snapshot(pin=True)
    before_view = old.curated()
    cid = old.shards("curated")[0].key
    rid = expected[old.shards("curated")[0].path].column("rollout_id")[0].as_py()
    why = cli("audit", root, cid, "--rollout", rid)
    audit = cli("audit", root, cid)
    assert why.code == 0 and audit.code == 0, why.stderr + audit.stderr
    with Buffer.open(root) as buf:
        assert maintenance.compact(buf).merged_shards == 4
        assert len(buf.manifest.shards("rollouts")) == 1
    check(root, expected, appended)
    with Buffer.open(root) as buf:
        maintenance.gc(buf, grace_s=0)  # the pin keeps the old files
    assert pinned.snapshot(old.seq).curated().equals(before_view)
    old.close()
    pinned.close()
    add_steps(root, range(4, 6), expected, appended)
    with Buffer.open(root) as buf:
        assert maintenance.compact(buf).merged_shards == 3
        maintenance.gc(buf, grace_s=0)
        assert len(buf.manifest.shards("rollouts")) == 1 and len(buf.manifest.moves()) == 7
    check(root, expected, appended)
    assert cli("verify", root).code == 0
    assert cli("audit", root, cid, "--rollout", rid).stdout == why.stdout
    assert cli("audit", root, cid).stdout == audit.stdout


def test_a_compacted_buffer_is_refused_by_an_older_manifest_reader(buffer_dir):
    """The first move makes the manifest version 2 (an older rollstore, which would not follow
    the moves, refuses the buffer in one line, as this one refuses a version it does not know);
    version 1 without moves stays version 1."""
    expected, appended = {}, []
    add_steps(buffer_dir, range(2), expected, appended)
    with Buffer.open(buffer_dir) as buf:
        version = "SELECT value FROM meta WHERE key = 'schema_version'"
        assert buf.manifest.con.execute(version).fetchone()[0] == "1" and buf.manifest.moves() == {}
        maintenance.compact(buf)
        assert buf.manifest.con.execute(version).fetchone()[0] == "2"
        buf.manifest.con.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")  # a newer format
    with pytest.raises(ManifestError, match=r"manifest schema version '3', this rollstore reads versions 1 and 2; "
                                            "use the rollstore that wrote it$"):
        Buffer.open(buffer_dir)


CHILD = r"""
import os, signal, sys
sys.path.insert(0, {root!r})
from rollstore.storage import buffer, maintenance, manifest

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def then_die(owner, name):
    real = getattr(owner, name)
    def wrapped(*args, **kwargs):
        out = real(*args, **kwargs)
        die()
        return out
    setattr(owner, name, wrapped)

point = sys.argv[2]
if point == "verified":
    then_die(maintenance, "verify_shards")
elif point == "written":
    then_die(buffer, "publish_file")
elif point == "in-txn":
    then_die(manifest.Manifest, "record_moves")
elif point == "committed":
    then_die(maintenance, "_rewrite")
elif point == "gc":
    maintenance._remove = lambda path: die()
buf = buffer.Buffer.open(sys.argv[1])
maintenance.compact(buf)
maintenance.gc(buf, grace_s=0)
"""


def _train(root: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "rollstore", "train", root, "--model", "builtin:tiny",
                             "--run-id", RUN], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_kill_9_compaction_beside_train(buffer_dir, tmp_path):
    """kill -9 trials: compaction and gc killed at injected points and at random moments while a
    training run goes on beside them (killed at random in every other trial); `check` after each
    trial; the final resumed training trains every curated shard exactly once."""
    root = buffer_dir
    rng = random.Random(37)
    expected, appended = {}, []
    script = tmp_path / "compact_child.py"
    script.write_text(CHILD.format(root=ROOT))
    trials = [(p, None) for p in INJECTED] + [("none", rng.uniform(0.0, 1.5)) for _ in range(RANDOM_KILLS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    step = 0
    outcomes = []
    for n, (point, delay) in enumerate(trials):
        add_steps(root, range(step, step + 2), expected, appended)
        step += 2
        train = _train(root)
        time.sleep(rng.uniform(0.0, 3.0))  # the trainer started (or is reading its first shards)
        child = subprocess.Popen([sys.executable, str(script), root, point], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if delay is not None:
            time.sleep(delay)
            child.send_signal(signal.SIGKILL)
        child.wait(120)
        outcomes.append((point, child.returncode))
        if point != "none":
            assert child.returncode == -signal.SIGKILL, (point, child.stderr.read().decode())
        if n % 2:
            time.sleep(rng.uniform(0.0, 2.0))
            train.send_signal(signal.SIGKILL)
        _, err = train.communicate(timeout=300)
        assert train.returncode in (0, -signal.SIGKILL), err.decode()
        check(root, expected, appended)
    train = _train(root)  # resumed: trains what no checkpoint of the run consumed, nothing twice
    _, err = train.communicate(timeout=300)
    assert train.returncode == 0, err.decode()
    check(root, expected, appended)
    with Buffer.open(root) as buf:
        assert sorted(consumed(buf)) == sorted(expected), "a curated shard was never trained"
        maintenance.compact(buf)
        maintenance.gc(buf, grace_s=0)
        assert len(buf.manifest.shards("rollouts")) == 1
    check(root, expected, appended)
    print(f"trials={len(trials)} outcomes={outcomes} curated={len(expected)} rollouts={len(appended)}")


def test_a_postgresql_catalog_moves_references_the_same_way(pg, tmp_path, cli):
    """The catalog contract is shared: compaction of referenced shards, moves followed, training
    after it trains each curated shard once, a second compaction chains the moves."""
    root = str(tmp_path / "buf")
    Buffer.init(root, catalog=pg.fresh_dsn()).close()
    expected, appended = {}, []
    add_steps(root, range(3), expected, appended)
    with Buffer.open(root) as buf:
        assert buf.manifest.moves() == {}  # no move recorded yet: none, and no error
        assert maintenance.compact(buf).merged_shards == 3
        maintenance.gc(buf, grace_s=0)
    check(root, expected, appended)
    res = cli("train", root, "--model", "builtin:tiny", "--run-id", RUN)
    assert res.code == 0, res.stderr
    add_steps(root, range(3, 5), expected, appended)
    with Buffer.open(root) as buf:
        assert maintenance.compact(buf).merged_shards == 3
        maintenance.gc(buf, grace_s=0)
        assert len(buf.manifest.shards("rollouts")) == 1 and len(buf.manifest.moves()) == 6
    check(root, expected, appended)
    res = cli("train", root, "--model", "builtin:tiny", "--run-id", RUN)
    assert res.code == 0, res.stderr
    with Buffer.open(root) as buf:
        assert sorted(consumed(buf)) == sorted(expected)
    assert cli("verify", root).code == 0


def test_a_shard_gc_removes_while_the_learner_reads_it_is_read_where_its_rows_went(buffer_dir, monkeypatch):
    """The learner's reader (no snapshot) chose a compacted shard's old file, still on disk; gc
    removes it before the read: the rows are read from the shard they moved to."""
    from rollstore.storage import references

    expected, appended = {}, []
    add_steps(buffer_dir, range(2), expected, appended)  # this process has read the buffer's moves (none)
    with Buffer.open(buffer_dir) as buf:
        assert maintenance.compact(buf).merged_shards == 2  # the old files stay until gc
    real, removed = references._rows_of, []

    def gc_first(path, positions, source, columns=references.RESOLVED_COLUMNS):
        if not removed:
            removed.append(os.path.relpath(path, buffer_dir))
            os.unlink(path)  # as gc would, between choosing the file and reading it
        return real(path, positions, source, columns)

    monkeypatch.setattr(references, "_rows_of", gc_first)
    for rel, rows in expected.items():
        assert read_curated([os.path.join(buffer_dir, rel)]).equals(rows)
    with Buffer.open(buffer_dir) as buf:
        assert removed and removed[0] in buf.manifest.moves()  # an old file was the one removed
