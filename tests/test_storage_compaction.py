"""`rollstore compact` and `rollstore gc`: compaction changes no query's result and retires the old
shards in one commit; old snapshots stay readable until gc; gc removes retired files no pinned
snapshot needs, and refuses snapshots it made incomplete; uniqueness survives compaction."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import write_jsonl
from rollstore.queries.session import Session
from rollstore.builtin.synthetic import RowOptions, rollouts_table
from rollstore.storage.buffer import Buffer, Part
from rollstore.storage.errors import ManifestError
from rollstore.storage.schema import SELECTIONS

QUERIES = [
    "SELECT count(*), count(DISTINCT group_id), count(DISTINCT prompt_id), sum(len(response_token_ids)) FROM rollouts",
    "SELECT policy_version, step, count(*), sum(reward::DOUBLE), count(correct), min(created_at) FROM rollouts "
    "GROUP BY ALL ORDER BY ALL",
    "SELECT group_id, size, n_correct, accuracy, round(reward_mean, 9), round(reward_std, 9), tokens FROM groups "
    "ORDER BY group_id",
    "SELECT prompt_id, policy_version, attempts, correct, pooled_accuracy FROM prompts ORDER BY ALL",
    "SELECT rollout_id, list_sum(gen_logprobs), list_max(entropies), finish_reason FROM rollouts ORDER BY rollout_id",
]


def results(snap) -> list:
    with Session(snap) as s:
        out = [s.execute(q).fetchall() for q in QUERIES]
    out.append(snap.arrow("rollouts").to_table().sort_by("rollout_id"))
    return out


def assert_same(a: list, b: list) -> None:
    for i, (x, y) in enumerate(zip(a[:-1], b[:-1])):
        assert x == y, QUERIES[i]
    assert a[-1].equals(b[-1]), "full table differs"


@pytest.fixture
def many_shards(buffer_dir):
    with Buffer.open(buffer_dir) as buf:
        for step in range(6):
            buf.append_rollouts(rollouts_table(n_groups=3, group_size=4, mean_tokens=10, step=step,
                                               policy_version=step // 2, n_prompts=4, seed=step))
    return buffer_dir


def test_compaction_changes_no_result(cli, many_shards):
    with Buffer.open(many_shards) as buf:
        before = buf.snapshot()
        old_shards = before.shards("rollouts")
        want = results(before)
        res = cli("compact", many_shards)
        assert res.code == 0, res.stderr
        assert "merged 6 shards into 1" in res.stdout
        after = buf.snapshot()
        # one commit retired all six and added the merged shard
        assert after.seq == before.seq + 1
        (merged,) = after.shards("rollouts")
        assert merged.added_seq == after.seq and merged.rows == 72
        assert merged.tokens == sum(s.tokens for s in old_shards)
        removed = buf.manifest.con.execute(
            "SELECT DISTINCT removed_seq FROM shards WHERE table_name = 'rollouts' AND shard_id != ?",
            (merged.shard_id,)).fetchall()
        assert removed == [(after.seq,)]
        kind = buf.manifest.con.execute("SELECT kind FROM commits WHERE seq = ?", (after.seq,)).fetchone()[0]
        assert kind == "compact:rollouts"
        assert_same(results(after), want)
        # the old snapshot still reads its own six files, and they are still on disk
        old = buf.snapshot(before.seq)
        assert [s.shard_id for s in old.shards("rollouts")] == [s.shard_id for s in old_shards]
        assert_same(results(old), want)
    assert json.loads(cli("sql", many_shards, "SELECT count(*) AS n FROM rollouts", "-f", "json",
                          "--snapshot", str(before.seq)).stdout) == [{"n": 72}]


def test_gc_keeps_pinned_then_removes_retired(cli, many_shards):
    with Buffer.open(many_shards) as buf:
        pinned = buf.snapshot(pin=True)
        old_files = pinned.files("rollouts")
        want = results(pinned)
        assert cli("compact", many_shards).code == 0
        res = cli("gc", many_shards, "--grace", "0")
        assert res.code == 0 and "0 retired" in res.stdout, res.stdout
        assert all(os.path.exists(f) for f in old_files)
        assert_same(results(pinned), want)  # a pinned reader keeps reading
        pinned.close()
        res = cli("gc", many_shards, "--grace", "0")
        assert res.code == 0 and "6 retired" in res.stdout, res.stdout
        assert not any(os.path.exists(f) for f in old_files)
        assert sorted(os.listdir(os.path.join(many_shards, "rollouts"))) == sorted(
            os.path.basename(s.path) for s in buf.snapshot().shards("rollouts"))
        assert_same(results(buf.snapshot()), want)
        # the old snapshot would now miss shards: it is refused, not read incomplete
        with pytest.raises(ManifestError, match="no longer readable"):
            buf.snapshot(pinned.seq)
    res = cli("sql", many_shards, "SELECT count(*) FROM rollouts", "--snapshot", str(pinned.seq))
    assert res.code != 0 and "no longer readable" in res.stderr


def test_uniqueness_survives_compaction_and_gc(cli, many_shards, tmp_path):
    assert cli("compact", many_shards).code == 0
    assert cli("gc", many_shards, "--grace", "0").code == 0
    again = rollouts_table(n_groups=3, group_size=4, mean_tokens=10, step=2)  # same ids as step 2
    res = cli("import", many_shards, write_jsonl(again, tmp_path / "again.jsonl"))
    assert res.code != 0 and "already in the buffer" in res.stderr and "'rollout_id'" in res.stderr
    rows = again.to_pylist()
    for r in rows:
        r["rollout_id"] += "-new"  # fresh ids, but groups already stored
    res = cli("import", many_shards, write_jsonl(rows, tmp_path / "group.jsonl"))
    assert res.code != 0 and "'group_id'" in res.stderr
    with Buffer.open(many_shards) as buf:
        assert buf.snapshot().rows("rollouts") == 72


def test_leased_shards_are_not_merged(many_shards):
    from rollstore.storage.maintenance import compact

    with Buffer.open(many_shards) as buf:
        _, (held,) = buf.lease("rollouts", 1, "learner")
        report = compact(buf)
        assert report.merged_shards == 5
        live = buf.snapshot().shards("rollouts")
        assert held.shard_id in {s.shard_id for s in live} and len(live) == 2
        assert compact(buf).merged_shards == 0  # nothing left to merge


def audit_rows(curation: str, n: int) -> pa.Table:
    t = rollouts_table(n_groups=1, group_size=n, options=RowOptions(id_prefix=curation))
    given = {
        "curation_id": [curation] * n, "rollout_id": t.column("rollout_id"), "group_id": t.column("group_id"),
        "prompt_id": t.column("prompt_id"), "policy_version": t.column("policy_version"),
        "selected": [True] * n, "reason": ["selected"] * n, "tokens_total": [3] * n, "tokens_kept": [3] * n,
    }
    return pa.table({f.name: given.get(f.name, pa.nulls(n, f.type)) for f in SELECTIONS}).cast(SELECTIONS)


def test_audits_without_a_committed_record_never_merge(cli, buffer_dir):
    """Audit shards merge across curations only when every curation they hold is committed (its record
    live: tests/test_audit_compaction.py); audit rows committed without a record (as an interrupted or
    foreign writer could leave them) stay as they are, and the curated table is refused outright."""
    from rollstore.storage.maintenance import compact

    with Buffer.open(buffer_dir) as buf:
        for cid in ("c1", "c2", "c3", "c3"):
            buf.commit([Part("selections", audit_rows(f"{cid}-{buf.manifest.latest_seq()}", 3), key=cid,
                             subdir=cid)], "curate")
        before = sorted((s.shard_id, s.path) for s in buf.snapshot().shards("selections"))
        report = compact(buf, "selections")
        assert (report.merged_shards, report.new_shards) == (0, 0)
        assert sorted((s.shard_id, s.path) for s in buf.snapshot().shards("selections")) == before
    res = cli("compact", buffer_dir, "--table", "curated")
    assert res.code != 0 and "cannot be compacted" in res.stderr


def test_compact_unknown_table_is_one_line(cli, buffer_dir):
    res = cli("compact", buffer_dir, "--table", "nope")
    assert res.code != 0 and "cannot be compacted" in res.stderr and len(res.stderr.strip().splitlines()) == 1
