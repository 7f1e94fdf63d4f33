"""Audit shards merge across curations (issue 49, `storage.maintenance.compact(buf, "selections")`): a
long run writes one audit shard a curation; compaction merges runs of committed curations' audits into
shards that name their curations (`Catalog.shard_keys`), and no curation's rows change: every audit
row, every later curation's `uses` (by the step index and by a full read) and what a quarantined
record excludes are those of the same history never compacted. A curation in flight keeps the audits
committed after its snapshot unmerged (its conflict check finds them by key)."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

from rollstore.builtin.synthetic import rollouts_table
from rollstore.curate.params import load_recipe, step_where
from rollstore.curate.run import curate
from rollstore.storage.buffer import Buffer
from rollstore.storage.maintenance import compact, gc

RECIPE = load_recipe("d3s")


def _step(buf: Buffer, s: int) -> list[str]:
    """One loop step of two runs: the rows appended, then run-a's step curated twice (uses count)."""
    for run in ("run-a", "run-b"):
        buf.append_rollouts(rollouts_table(n_groups=3, group_size=4, mean_tokens=8, seed=len(run) * 100 + s,
                                           run_id=run, step=s, n_prompts=3), source=f"{run}-{s}")
    return [curate(buf, RECIPE, {"where": step_where("run-a", s), "progress": p}).curation_id for p in ("0.3", "0.7")]


def _audits(buf: Buffer, cids: list[str]) -> list[pa.Table]:
    """Each curation's audit rows (by rollout_id), its id left out (ids name their snapshot)."""
    with buf.snapshot() as snap:
        every = snap.arrow("selections").to_table()
    return [every.filter(pa.compute.equal(every.column("curation_id"), c)).drop_columns(["curation_id"])
            .sort_by("rollout_id") for c in cids]


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_merged_audits_change_no_curations_rows_nor_later_uses(tmp_path, request, kind):
    out = {}
    for how in ("plain", "compacted"):
        catalog = request.getfixturevalue("pg").fresh_dsn() if kind == "postgres" else None
        with Buffer.init(str(tmp_path / how), catalog=catalog) as buf:
            cids = [c for s in range(4) for c in _step(buf, s)]
            if how == "compacted":
                before = buf.manifest.shards("selections")
                report = compact(buf, "selections")
                assert (report.merged_shards, report.new_shards) == (8, 1)
                (merged,) = buf.manifest.shards("selections")
                assert merged.key is None and merged.path.startswith("audit/merged/")
                assert buf.manifest.shard_keys([merged.shard_id]) == {merged.shard_id: sorted(cids)}
                gc(buf, 0)
                assert not any(os.path.exists(os.path.join(buf.root, s.path)) for s in before)
            cids += _step(buf, 4)  # a new step after the compaction (the step index path) ...
            cids.append(curate(buf, RECIPE, {"where": step_where("run-a", 1), "progress": "0.9"}).curation_id)
            cids.append(curate(buf, RECIPE, {"where": "step <= 2", "progress": "0.95"}).curation_id)  # (every shard)
            out[how] = _audits(buf, cids)
    for plain, compacted in zip(out["plain"], out["compacted"]):
        assert plain.equals(compacted) and plain.num_rows > 0
    assert max(out["compacted"][-2].column("uses").to_pylist()) >= 2  # step 1's two curations, in the merged shard
    assert max(out["compacted"][-1].column("uses").to_pylist()) >= 2


def test_a_quarantined_record_excludes_its_rows_of_a_merged_shard(tmp_path):
    """A curation whose record is retired after its audit was merged does not count: the later
    curation's uses are those of the committed curations' selected rows, counted straight."""
    with Buffer.init(str(tmp_path / "b")) as buf:
        cids = [c for s in range(3) for c in _step(buf, s)]
        assert compact(buf, "selections").new_shards == 1
        gone = cids[3]  # step 1's second curation
        with buf.manifest.transaction() as con:
            seq = buf.manifest.new_commit(con, "quarantine", {"why": "test"})
            (record,) = [s for s in buf.manifest.shards("curations") if s.key == gone]
            assert buf.manifest.retire_shards(con, seq, [record.shard_id]) == 1
        later = curate(buf, RECIPE, {"where": step_where("run-a", 1), "progress": "0.9"}).curation_id
        with buf.snapshot() as snap:
            audit = snap.arrow("selections").to_table().to_pylist()
        live = {s.key for s in buf.manifest.shards("curations")} - {later}
        expected: dict[str, int] = {}
        for row in audit:
            if row["curation_id"] in live and row["selected"]:
                expected[row["rollout_id"]] = expected.get(row["rollout_id"], 0) + 1
        mine = {r["rollout_id"]: r["uses"] for r in audit if r["curation_id"] == later}
        assert mine == {rid: expected.get(rid, 0) for rid in mine}
        assert any(r["curation_id"] == gone and r["selected"] and r["rollout_id"] in mine for r in audit)


def test_audits_committed_after_a_pinned_snapshot_are_not_merged(tmp_path):
    with Buffer.init(str(tmp_path / "b")) as buf:
        cids = [c for s in range(2) for c in _step(buf, s)]
        with buf.snapshot(pin=True):  # as a curation in flight holds its snapshot
            cids += _step(buf, 2)
            assert compact(buf, "selections").merged_shards == 4  # the two steps before the pin
            keys = {s.key for s in buf.manifest.shards("selections")}
            assert set(cids[4:]) <= keys and None in keys
        report = compact(buf, "selections")  # the pin gone: the merged shard and the rest merge again
        assert (report.merged_shards, report.new_shards) == (3, 1)
        gc(buf, 0)
        (merged,) = buf.manifest.shards("selections")
        assert buf.manifest.shard_keys([merged.shard_id])[merged.shard_id] == sorted(cids)
        rows = buf.manifest.con.execute("SELECT count(DISTINCT shard_id) FROM shard_keys").fetchone()[0]
        assert rows == 1  # gc forgot the keys of the shard it collected


def test_one_curations_audit_reads_the_merged_shard_that_holds_it(tmp_path, cli):
    """`audit` of one curation reads its own shards by key (`report.partial`), and after a merge the
    merged shard that names it: the same output before and after compaction and gc."""
    root = str(tmp_path / "b")
    with Buffer.init(root) as buf:
        cids = [c for s in range(3) for c in _step(buf, s)]
    before = {c: cli("audit", root, c, "--format", "json") for c in (cids[1], cids[-1])}
    with Buffer.open(root) as buf:
        assert compact(buf, "selections").new_shards == 1
        gc(buf, 0)
    for c, res in before.items():
        after = cli("audit", root, c, "--format", "json")
        assert res.code == 0 and after.code == 0 and after.stdout == res.stdout and c in res.stdout
