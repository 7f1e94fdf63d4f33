"""Thin curated shards (issue 26): a curated row refers to its rollouts row (shard, row position,
rollout_id) and carries advantage, weight and kept runs; readers resolve the references.

Covered here, through the real call paths: the stored format (no token lists), the learner's
reader (row-group aware, rollout_id checked) against the rollouts themselves, the `curated` view
(same columns as before, resolved on read), `verify` following references, quarantine of a
referenced rollouts shard (training and export refuse with one line), compaction merging
referenced rollouts shards with the references following (also when a curation commits
meanwhile; tests/test_compact_referenced.py has the rest), a curation refusing to commit references to a shard retired while it ran, and a self-contained export."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from rollstore.curate.params import CurationError, load_recipe
from rollstore.curate.run import curate
from rollstore.learner.batches import collate, read_curated
from rollstore.queries.session import Session
from rollstore.builtin.synthetic import rollouts_table
from rollstore.storage import maintenance
from rollstore.storage.buffer import Buffer
from rollstore.storage.references import UnresolvedReference, read_curated_file, resolve, runs_to_mask
from rollstore.storage.schema import CURATED, CURATED_REFS, ROLLOUTS, TOKEN_LIST_COLUMNS


@pytest.fixture
def curated_buffer(buffer_dir):
    """Six small rollouts shards (steps 0..5), one d3s curation over steps 2 and 3."""
    with Buffer.open(buffer_dir) as buf:
        for step in range(6):
            table = rollouts_table(n_groups=4, group_size=4, mean_tokens=12, step=step,
                                   policy_version=step // 2, n_prompts=6, seed=step)
            if step == 3:  # some rows without old_logprobs: the learner falls back to gen_logprobs
                old = table.column("old_logprobs").to_pylist()
                old = [None if i % 3 == 0 else v for i, v in enumerate(old)]
                table = table.set_column(table.schema.get_field_index("old_logprobs"), "old_logprobs",
                                         pa.array(old, table.schema.field("old_logprobs").type))
            buf.append_rollouts(table)
        result = curate(buf, load_recipe("d3s"), {"where": "step IN (2, 3)", "progress": "0.4"})
    return buffer_dir, result


def _paths(root: str, result) -> list[str]:
    return [os.path.join(root, p) for p in result.output_files if p.startswith("curated/")]


def _rollouts(root: str) -> dict:
    with Buffer.open(root) as buf:
        rows = buf.snapshot().arrow("rollouts").to_table().to_pylist()
    return {r["rollout_id"]: r for r in rows}


def test_curated_shards_hold_references_not_token_lists(curated_buffer):
    root, result = curated_buffer
    paths = _paths(root, result)
    assert paths and result.record["n_selected"] > 0
    stored = pa.concat_tables(pq.read_table(p) for p in paths)
    assert stored.schema.names == CURATED_REFS.names
    for col in ("prompt_token_ids", "response_token_ids", *TOKEN_LIST_COLUMNS, "loss_mask"):
        assert col not in stored.schema.names
    # each reference names the row that holds its rollout_id, in a live rollouts shard
    with Buffer.open(root) as buf:
        live = {s.path for s in buf.manifest.shards("rollouts")}
    for row in stored.to_pylist():
        assert row["rollouts_shard"] in live
        at = pq.read_table(os.path.join(root, row["rollouts_shard"]), columns=["rollout_id"])
        assert at.column("rollout_id")[row["rollouts_row"]].as_py() == row["rollout_id"]
    assert int(pc.sum(stored.column("fallback")).as_py()) == result.record["old_logprobs_fallback"] > 0
    # the curated folder is small next to the rollouts folder
    size = lambda top: sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(os.path.join(root, top))
                           for f in fs)
    assert size("curated") < 0.5 * size("rollouts")


def test_learner_reads_the_same_rows_as_the_rollouts_hold(curated_buffer):
    root, result = curated_buffer
    rows = read_curated(_paths(root, result))
    assert rows.schema == CURATED and rows.num_rows == result.record["n_selected"]
    audit = {r["rollout_id"]: r for r in result.audit.to_pylist()}
    source = _rollouts(root)
    kept = 0
    for got in rows.to_pylist():
        src = source[got["rollout_id"]]
        assert got["prompt_token_ids"] == src["prompt_token_ids"]
        assert got["response_token_ids"] == src["response_token_ids"]
        assert got["gen_logprobs"] == pytest.approx(src["gen_logprobs"])
        old = src["old_logprobs"] if src["old_logprobs"] is not None else src["gen_logprobs"]
        assert got["old_logprobs"] == pytest.approx(old)
        assert len(got["loss_mask"]) == len(src["response_token_ids"])
        assert sum(got["loss_mask"]) == audit[got["rollout_id"]]["tokens_kept"]
        assert got["advantage"] == pytest.approx(audit[got["rollout_id"]]["advantage_final"])
        assert (got["group_id"], got["prompt_id"], got["policy_version"]) == (
            src["group_id"], src["prompt_id"], src["policy_version"])
        kept += sum(got["loss_mask"])
    assert kept == result.record["tokens_kept"]
    batch = collate(rows)
    assert int(batch.loss_mask.sum()) == kept


def test_curated_view_shows_the_resolved_columns(curated_buffer):
    root, result = curated_buffer
    with Buffer.open(root) as buf, Session(buf.snapshot()) as s:
        names = [d[0] for d in s.execute("SELECT * FROM curated LIMIT 0").description]
        viewed = s.table("SELECT * FROM curated ORDER BY rollout_id")
        n = s.one("SELECT count(*) FROM curated WHERE curation_id = $c", {"c": result.curation_id})[0]
    assert names == CURATED.names
    assert n == result.record["n_selected"]
    direct = read_curated(_paths(root, result)).sort_by("rollout_id")
    assert viewed.cast(CURATED).equals(direct)


def test_row_group_aware_resolution_and_mismatch_refused(tmp_path):
    # a rollouts file of several row groups; references into some of them, out of order
    table = rollouts_table(n_groups=8, group_size=4, mean_tokens=6, seed=3).cast(ROLLOUTS)
    os.makedirs(tmp_path / "rollouts")
    pq.write_table(table, tmp_path / "rollouts" / "r.parquet", row_group_size=5)
    assert pq.ParquetFile(tmp_path / "rollouts" / "r.parquet").metadata.num_row_groups > 4
    picks = [27, 3, 4, 18, 31, 0]
    lengths = pc.list_value_length(table.column("response_token_ids")).to_pylist()
    refs = pa.table({
        "curation_id": ["c"] * len(picks),
        "rollout_id": table.column("rollout_id").take(picks),
        "group_id": table.column("group_id").take(picks),
        "prompt_id": table.column("prompt_id").take(picks),
        "policy_version": table.column("policy_version").take(picks),
        "rollouts_shard": ["rollouts/r.parquet"] * len(picks),
        "rollouts_row": picks,
        "advantage": [1.0] * len(picks),
        "weight": [1.0] * len(picks),
        "keep_runs": [[0, 1], [], [0, lengths[4]], [1, 2, 3, lengths[18]], [0, lengths[31]], []],
        "tokens": [lengths[i] for i in picks],
        "fallback": [False] * len(picks),
    }).cast(CURATED_REFS)
    got = resolve(refs, str(tmp_path))
    assert got.column("rollout_id").to_pylist() == table.column("rollout_id").take(picks).to_pylist()
    assert got.column("response_token_ids").equals(table.column("response_token_ids").take(picks))
    masks = got.column("loss_mask").to_pylist()
    assert masks[0] == [True] + [False] * (lengths[27] - 1) and masks[1] == [False] * lengths[3]
    assert masks[3] == [False, True, False] + [True] * (lengths[18] - 3)
    wrong = refs.set_column(6, "rollouts_row", pa.array([26, 3, 4, 18, 31, 0], pa.int64()))
    with pytest.raises(UnresolvedReference, match="holds rollout_id=") as exc:
        resolve(wrong, str(tmp_path))
    assert "\n" not in str(exc.value)
    with pytest.raises(UnresolvedReference, match="not live"):
        resolve(refs, str(tmp_path), live=["rollouts/other.parquet"])


def test_runs_to_mask_matches_a_loop():
    rng = np.random.default_rng(0)
    masks = [list(rng.random(int(rng.integers(0, 20))) < 0.5) for _ in range(200)]
    runs = []
    for m in masks:
        edges = [i for i in range(len(m) + 1) if (i < len(m) and m[i]) != (i > 0 and m[i - 1])]
        runs.append(edges)
    got = runs_to_mask(pa.array(runs, pa.list_(pa.int32())), np.array([len(m) for m in masks]))
    assert got.to_pylist() == [[bool(x) for x in m] for m in masks]
    sliced = runs_to_mask(pa.array(runs, pa.list_(pa.int32())).slice(7, 50), np.array([len(m) for m in masks[7:57]]))
    assert sliced.to_pylist() == [[bool(x) for x in m] for m in masks[7:57]]


def test_runs_to_mask_edges_and_refusals():
    """A run ending where the next begins, empty runs, empty rows, several chunks; a bound outside
    the row, an odd number of bounds, a run ending before it starts: a ValueError, never a mask."""
    runs = pa.chunked_array([pa.array([[0, 2, 2, 5], []], pa.list_(pa.int32())),
                             pa.array([[1, 1], [0, 0, 1, 3, 3, 3], [0, 4], []], pa.list_(pa.int32()))])
    got = runs_to_mask(runs, np.array([5, 3, 4, 3, 4, 0]))
    assert got.to_pylist() == [[True] * 5, [False] * 3, [False] * 4, [False, True, True], [True] * 4, []]
    for bad, match in (([0, 6], "not pairs"), ([0], "not pairs"), ([-1, 2], "not pairs"), ([3, 1], "ends before")):
        with pytest.raises(ValueError, match=match):
            runs_to_mask(pa.array([bad], pa.list_(pa.int32())), np.array([5]))


def test_verify_follows_references_and_quarantine_refuses_training(curated_buffer, cli, tmp_path):
    root, result = curated_buffer
    res = cli("verify", root)
    assert res.code == 0 and "every curated reference resolves" in res.stdout
    stored = pq.read_table(_paths(root, result)[0])
    target = stored.column("rollouts_shard")[0].as_py()
    with open(os.path.join(root, target), "r+b") as fh:  # corrupt a referenced rollouts shard
        fh.seek(100)
        fh.write(b"\xff\xff\xff\xff")
    assert cli("verify", root, "--quarantine").code == 0
    res = cli("verify", root)
    assert res.code == 1
    assert f"refers to rollouts shard {target}" in res.stderr and "not live" in res.stderr
    with pytest.raises(UnresolvedReference) as exc:
        read_curated(_paths(root, result))
    assert "\n" not in str(exc.value) and target in str(exc.value) and "curate again" in str(exc.value)
    res = cli("export", root, "--to", str(tmp_path / "out"))
    assert res.code == 1 and len(res.stderr.strip().splitlines()) == 1 and target in res.stderr


def test_compaction_merges_referenced_rollouts_shards(curated_buffer, cli):
    """Referenced shards merge too; the references follow (`moved`), before and after gc."""
    root, result = curated_buffer
    before = read_curated(_paths(root, result))
    with Buffer.open(root) as buf:
        n = len(buf.manifest.shards("rollouts"))
    res = cli("compact", root)
    assert res.code == 0, res.stderr
    with Buffer.open(root) as buf:
        assert len(buf.manifest.shards("rollouts")) == 1 < n
    assert read_curated(_paths(root, result)).equals(before)
    assert cli("gc", root, "--grace", "0").code == 0  # the referenced files are gone now
    assert cli("verify", root).code == 0
    assert read_curated(_paths(root, result)).equals(before)


def test_compaction_goes_on_when_a_curation_commits_meanwhile(curated_buffer, monkeypatch):
    root, _ = curated_buffer
    real = maintenance.verify_shards

    def curate_meanwhile(r, shards):  # after compaction chose its shards, before it commits
        real(r, shards)
        with Buffer.open(root) as buf:
            curate(buf, load_recipe("grpo"), {"where": "step = 4"})

    monkeypatch.setattr(maintenance, "verify_shards", curate_meanwhile)
    with Buffer.open(root) as buf:
        seq = buf.manifest.latest_seq()
        maintenance.compact(buf)
        assert buf.manifest.latest_seq() == seq + 2  # the curation, then the compaction
        paths = [os.path.join(root, s.path) for s in buf.manifest.shards("curated")]
    monkeypatch.setattr(maintenance, "verify_shards", real)
    assert read_curated(paths).num_rows > 0


def test_curation_refuses_references_to_a_shard_retired_while_it_ran(curated_buffer, monkeypatch):
    root, _ = curated_buffer
    import rollstore.curate.finish as finish

    real = finish.publish

    def retire_then_publish(buf, parts, curation_id, out, referenced=(), capped=False):
        # as a compaction committed meanwhile would: the shard retired, its file left for gc
        with buf.manifest.transaction() as con:
            seq = buf.manifest.new_commit(con, "compact:rollouts", {})
            con.execute("UPDATE shards SET removed_seq = ? WHERE path = ?", (seq, referenced[0]))
        return real(buf, parts, curation_id, out, referenced, capped)

    monkeypatch.setattr(finish, "publish", retire_then_publish)
    with Buffer.open(root) as buf:
        n, seq = len(buf.manifest.shards("curated")), buf.manifest.latest_seq()
        with pytest.raises(CurationError, match="retired while this curation ran"):
            curate(buf, load_recipe("grpo"), {"where": "step = 5"})
        assert len(buf.manifest.shards("curated")) == n and buf.manifest.latest_seq() == seq + 1


def test_export_materialises_curated_rows(curated_buffer, cli, tmp_path):
    root, result = curated_buffer
    out = tmp_path / "export"
    res = cli("export", root, "--to", str(out))
    assert res.code == 0, res.stderr
    exported = pq.read_table(out / "curated" / "data-00000.parquet")
    assert exported.schema.names == CURATED.names
    direct = read_curated(_paths(root, result))
    assert exported.sort_by("rollout_id").equals(direct.sort_by("rollout_id"))
    assert read_curated_file(str(out / "curated" / "data-00000.parquet")).num_rows == direct.num_rows


def test_null_lists_from_statistics_or_the_column(tmp_path):
    from rollstore.storage.references import null_lists

    table = rollouts_table(n_groups=8, group_size=4, mean_tokens=6, seed=4).cast(ROLLOUTS)
    old = table.column("old_logprobs").to_pylist()
    old = [None if 10 <= i < 13 or i == 30 else v for i, v in enumerate(old)]  # row groups 2 and 6 hold nulls
    table = table.set_column(table.schema.get_field_index("old_logprobs"), "old_logprobs",
                             pa.array(old, ROLLOUTS.field("old_logprobs").type))
    path = str(tmp_path / "r.parquet")
    pq.write_table(table, path, row_group_size=5)
    picks = np.array([31, 30, 0, 12, 9, 10, 22, 13])
    got = null_lists(pa.array([path] * len(picks)), picks)
    assert got.tolist() == [old[i] is None for i in picks]
