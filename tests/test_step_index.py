"""The catalog's step index (issue 49): which shards hold run R's step S, by index, on SQLite and
PostgreSQL; a loop's curation of one step reads only those shards, and decides exactly what a read of
every shard decides (same curation id, same audit, same curated rows); compaction, shards without
index rows (a buffer written before the index) and the newest checkpoint by the index."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from rollstore.builtin.synthetic import rollouts_table
from rollstore.curate import steps as curate_steps
from rollstore.curate.params import load_recipe, resolve, step_where
from rollstore.curate.run import curate
from rollstore.storage.buffer import Buffer
from rollstore.storage.maintenance import compact


def _rollouts(run: str, step: int, version: int = 0, groups: int = 3) -> pa.Table:
    return rollouts_table(n_groups=groups, group_size=4, mean_tokens=8, seed=1000 * len(run) + step, run_id=run,
                          step=step, policy_version=version, n_prompts=groups)


def _history(buf: Buffer, steps: int = 5) -> None:
    for s in range(steps):
        for run in ("run-a", "run-b"):
            buf.append_rollouts(_rollouts(run, s), source=f"{run}-{s}")


def _paths(buf: Buffer, table: str, run: str, first, last, seq=None) -> set[str]:
    ids = buf.manifest.step_shard_ids(table, run, first, last, seq)
    return {s.path for s in buf.manifest.shards(table, seq) if s.shard_id in ids}


def _holding(buf: Buffer, run: str, step: int) -> set[str]:
    """The rollouts shards that hold a row of (run, step), read from every file."""
    out = set()
    for s in buf.manifest.shards("rollouts"):
        t = pq.read_table(f"{buf.root}/{s.path}", columns=["run_id", "step"]).to_pylist()
        if any(r["run_id"] == run and r["step"] == step for r in t):
            out.add(s.path)
    return out


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_the_index_names_exactly_the_shards_of_a_step_on_both_catalogs(tmp_path, request, kind):
    catalog = request.getfixturevalue("pg").fresh_dsn() if kind == "postgres" else None
    with Buffer.init(str(tmp_path / "buf"), catalog=catalog) as buf:
        _history(buf)
        buf.append_rollouts(pa.concat_tables([_rollouts("run-a", 7), _rollouts("run-b", 9)]), source="mixed")
        for run, step in (("run-a", 0), ("run-a", 4), ("run-b", 3), ("run-a", 7), ("run-b", 9)):
            assert _paths(buf, "rollouts", run, step, step) == _holding(buf, run, step)
        assert _paths(buf, "rollouts", "run-a", 8, 8) == set()
        assert _paths(buf, "rollouts", "nobody", None, None) == set()
        assert len(_paths(buf, "rollouts", "run-b", None, None)) == 6  # the run's shards, every step
        seq = buf.manifest.latest_seq()
        merged = compact(buf, "rollouts", target_bytes=1 << 40)
        assert merged.new_shards == 1
        for run, step in (("run-a", 0), ("run-b", 9)):
            after = _paths(buf, "rollouts", run, step, step)
            assert after == _holding(buf, run, step) and len(after) == 1  # the merged shard
            assert _paths(buf, "rollouts", run, step, step, seq) == {  # an older snapshot: the old shards
                s.path for s in buf.manifest.shards("rollouts", seq) if s.path in
                {p for p in _paths(buf, "rollouts", run, step, step, seq)}}
        assert buf.manifest.con.execute(
            "SELECT value FROM meta WHERE key = 'steps_indexed_through'").fetchone() is not None


def test_shards_without_index_rows_are_always_named(buffer_dir):
    """A buffer written before the index: every shard of it is named by each look-up (a superset), until
    its rows are gone; the shards committed after it are looked up by index."""
    with Buffer.open(buffer_dir) as buf:
        _history(buf, 3)
        old = {s.path for s in buf.manifest.shards("rollouts")}
        with buf.manifest.transaction() as con:  # as a rollstore without the index left it
            con.execute("DROP TABLE shard_steps")
            con.execute("DELETE FROM meta WHERE key = 'steps_indexed_through'")
        assert _paths(buf, "rollouts", "run-a", 1, 1) == old
        buf.append_rollouts(_rollouts("run-a", 3), source="new")
        new = _paths(buf, "rollouts", "run-a", 3, 3)
        assert old < new and len(new) == len(old) + 1
        assert _paths(buf, "rollouts", "run-b", 3, 3) == old


def test_a_steps_curation_reads_its_shards_only_and_decides_as_a_full_read(tmp_path, monkeypatch):
    recipe = load_recipe("d3s")
    results = {}
    for how in ("index", "every shard"):
        with Buffer.init(str(tmp_path / how)) as buf:
            _history(buf, 6)
            read = []
            original = curate_steps.parquet

            def spy(paths, *a, **k):
                read.append(list(paths))
                return original(paths, *a, **k)

            monkeypatch.setattr("rollstore.curate.run.parquet", spy)
            if how == "every shard":  # the reading of earlier versions: every rollouts shard
                monkeypatch.setattr(curate_steps, "step_of_where", lambda where: None)
            res = curate(buf, recipe, {"where": step_where("run-a", 4)})
            monkeypatch.undo()
            audit = buf.snapshot().arrow("selections").to_table().sort_by("rollout_id")
            curated = buf.snapshot().arrow("curated").to_table().sort_by("rollout_id")
            results[how] = (res.curation_id, audit.drop_columns(["curation_id"]), curated.drop_columns(
                [c for c in ("curation_id", "created_at") if c in curated.column_names]), read)
    (cid, audit, curated, read), (cid2, audit2, curated2, read2) = results["index"], results["every shard"]
    assert cid == cid2
    assert audit.equals(audit2) and audit.num_rows == 12
    assert curated.equals(curated2) and curated.num_rows > 0
    assert len(read[0]) == 1 and len(read2[0]) == 12  # the batch: the step's one shard, of 12


def test_the_runs_newest_checkpoint_is_read_from_the_index(buffer_dir, monkeypatch):
    import json

    from learner_util import tiny_llama
    from rollstore.learner.checkpoint import Publish, save_checkpoint

    with Buffer.open(buffer_dir) as buf:
        _history(buf, 2)
        model = tiny_llama()
        for v in (1, 2):
            save_checkpoint(buf, model, publish=Publish(v, "run-a", [], parent_version=v - 1, step=v))
        with buf.snapshot() as snap:
            assert snap.newest_checkpoints(["run-a", "run-b"]) == {"run-a": 2}

        def no_files(session):
            raise AssertionError("a checkpoint file was read")

        monkeypatch.setattr(curate_steps, "checkpoint_versions", no_files)
        res = curate(buf, load_recipe("d3s"), {"where": step_where("run-a", 1)}, dry_run=True)
        assert json.loads(res.record["params"])["current_version"] == 2


def _uses_history(buf: Buffer, recipe) -> None:
    """Two runs of 4 steps as a loop writes them, every step curated twice after its append (its rows'
    `uses` count the first)."""
    for s in range(4):
        for run in ("run-a", "run-b"):
            buf.append_rollouts(_rollouts(run, s), source=f"{run}-{s}")
        for progress in ("0.2", "0.6"):
            curate(buf, recipe, {"where": step_where("run-a", s), "progress": progress})


def test_a_steps_audits_are_read_by_index_and_count_uses_as_a_full_read(tmp_path, monkeypatch):
    """The uses step of a loop's curation reads only the audits committed after its batch's shards
    were added (`steps.step_inputs`), and every audit when a batch shard is compaction's (its rows are
    older than it): the audit rows (uses included) equal those of a read of every shard, both ways."""
    recipe = load_recipe("d3s")
    out = {}
    for how in ("index", "every shard"):
        with Buffer.init(str(tmp_path / how)) as buf:
            _uses_history(buf, recipe)
            with buf.snapshot() as snap:
                inputs = curate_steps.step_inputs(snap, resolve(recipe, {"where": step_where("run-a", 3)}))
                every = curate_steps.committed_audits(snap).paths
            assert len(inputs.batch) == 1 and 0 < len(inputs.audits) < len(every)
            rows = []
            for compacted in (False, True):
                if compacted:
                    compact(buf, "rollouts", target_bytes=1 << 40)
                if how == "every shard":
                    monkeypatch.setattr(curate_steps, "step_of_where", lambda where: None)
                res = curate(buf, recipe, {"where": step_where("run-a", 3), "progress": "0.9" if compacted else "0.8"})
                monkeypatch.undo()
                audit = buf.snapshot().arrow("selections").to_table()
                audit = audit.filter(pc.equal(audit.column("curation_id"), res.curation_id))
                rows.append(audit.drop_columns(["curation_id"]).sort_by("rollout_id"))
            out[how] = rows
    for mine, full in zip(out["index"], out["every shard"]):
        assert mine.equals(full) and mine.num_rows == 12
        assert max(mine.column("uses").to_pylist()) >= 2  # the earlier curations of the step counted


def test_the_default_batch_is_looked_for_in_the_newest_shards_only(tmp_path):
    """A curation without `where` takes the latest step by creation time (ties: the highest run_id,
    then step): the catalog's time index names the shards holding the newest rows (every shard of the
    highest time, so ties are decided by their rows), in any commit order, after compaction, and every
    shard where a buffer has no time index. The decision equals that of a read of every row."""
    import json

    with Buffer.init(str(tmp_path / "b")) as buf:
        for run, step in (("run-a", 5), ("run-a", 1), ("run-b", 5), ("run-a", 2)):  # not in time order
            buf.append_rollouts(_rollouts(run, step), source=f"{run}-{step}")
        with buf.snapshot() as snap:
            newest = set(snap.newest_files())
            every = snap.files("rollouts")
        highest = {f: max(pq.read_table(f, columns=["created_at"]).column("created_at").to_pylist()) for f in every}
        top = max(highest.values())
        assert newest == {f for f, t in highest.items() if t == top} and len(newest) == 2  # run-a 5, run-b 5
        res = curate(buf, load_recipe("d3s"), {}, dry_run=True)
        assert json.loads(res.record["params"])["where"] == step_where("run-b", 5)
        compact(buf, "rollouts", target_bytes=1 << 40)
        with buf.snapshot() as snap:
            assert len(snap.newest_files()) == 1 == len(snap.files("rollouts"))
        with buf.manifest.transaction() as con:  # as a rollstore without the time index left it
            con.execute("DROP TABLE shard_times")
            con.execute("DELETE FROM meta WHERE key = 'times_indexed_through'")
        with buf.snapshot() as snap:
            assert set(snap.newest_files()) == set(snap.files("rollouts"))  # no index: every shard
        buf.append_rollouts(_rollouts("run-a", 0), source="late")  # (older rows, committed last)
        with buf.snapshot() as snap:
            assert set(snap.newest_files()) == set(snap.files("rollouts"))  # the old shard has no time: read
        assert json.loads(curate(buf, load_recipe("d3s"), {}, dry_run=True).record["params"])["where"] == \
            step_where("run-b", 5)
