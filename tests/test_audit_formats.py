"""`rollstore audit --format table|json|csv` and `--compare`: two recipes run on one snapshot ("what-if")
compared side by side, every count recomputed from the raw `selections` rows."""

from __future__ import annotations

import csv
import os
import io
import json
from collections import Counter

import pytest

from rollstore.curate.params import load_recipe
from rollstore.curate.run import curate
from rollstore.builtin.synthetic import rollouts_table
from rollstore.storage.buffer import Buffer


@pytest.fixture(scope="module")
def whatif(tmp_path_factory):
    """Three steps of synthetic rollouts; on one snapshot, the last step curated by PODS (a quarter of every
    group, degenerate ones included) and by dapo + DA3PO (every non-degenerate group, amplified)."""
    root = str(tmp_path_factory.mktemp("audit") / "buf")
    with Buffer.init(root) as buf:
        for v in range(3):
            buf.append_rollouts(rollouts_table(n_groups=12, group_size=8, step=v, policy_version=v, seed=7))
        seq = buf.manifest.latest_seq()
        where = {"where": "step = 2"}
        a = curate(buf, load_recipe("pods"), where, snapshot_seq=seq).curation_id
        b = curate(buf, load_recipe("dapo"), {**where, "amplify": "da3po"}, snapshot_seq=seq).curation_id
        with buf.snapshot() as snap:
            selections = snap.arrow("selections").to_table().to_pylist()
    return root, a, b, selections


def parse_csv(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


def test_audit_json_and_csv_hold_the_table_views(cli, whatif):
    root, a, _, selections = whatif
    mine = [s for s in selections if s["curation_id"] == a]
    table = cli("audit", root, a)
    assert table.code == 0 and "reasons" in table.stdout and "keep rate" in table.stdout
    doc = json.loads(cli("audit", root, a, "--format", "json").stdout)
    assert set(doc) == {"curation", "reasons", "bands", "replay"}
    assert [(r["origin"], r["candidates"]) for r in doc["replay"]] == [("fresh", len(mine))]  # no replay here
    assert doc["curation"]["curation_id"] == a and doc["curation"]["params"]["sample"] == "pods"
    assert {r["reason"]: r["candidates"] for r in doc["reasons"]} == dict(Counter(s["reason"] for s in mine))
    assert sum(r["tokens_kept"] for r in doc["reasons"]) == sum(s["tokens_kept"] for s in mine)
    res = cli("audit", root, a, "--format", "csv")
    rows = parse_csv(res.stdout)
    assert res.stdout.splitlines()[0].startswith("view,")  # CSV quotes only what must be quoted
    assert Counter(r["view"] for r in rows) == {"reasons": len(doc["reasons"]), "bands": len(doc["bands"]),
                                                "replay": len(doc["replay"])}
    reasons = {r["reason"]: int(r["candidates"]) for r in rows if r["view"] == "reasons"}
    assert reasons == {r["reason"]: r["candidates"] for r in doc["reasons"]}
    assert all(r["band"] == "" for r in rows if r["view"] == "reasons")  # columns of other views stay empty


def test_audit_rollout_formats(cli, whatif):
    root, a, _, selections = whatif
    row = next(s for s in selections if s["curation_id"] == a and s["selected"] and s["tokens_kept"] > 0)
    doc = json.loads(cli("audit", root, a, "--rollout", row["rollout_id"], "-f", "json").stdout)
    assert doc["reason"] == "selected" and len(doc["tokens"]) == row["tokens_total"]
    assert sum(t["kept"] for t in doc["tokens"]) == row["tokens_kept"]
    rows = parse_csv(cli("audit", root, a, "--rollout", row["rollout_id"], "-f", "csv").stdout)
    assert [int(r["pos"]) for r in rows] == list(range(1, row["tokens_total"] + 1))
    assert {r["view"] for r in rows} == {"tokens"} and sum(r["kept"] == "true" for r in rows) == row["tokens_kept"]


def test_compare_two_recipes_on_one_snapshot(cli, whatif):
    root, a, b, selections = whatif
    sa = {s["rollout_id"]: s for s in selections if s["curation_id"] == a}
    sb = {s["rollout_id"]: s for s in selections if s["curation_id"] == b}
    only_a = {r for r in sa if sa[r]["selected"] and not (r in sb and sb[r]["selected"])}
    only_b = {r for r in sb if sb[r]["selected"] and not (r in sa and sa[r]["selected"])}
    both = {r for r in sa if sa[r]["selected"] and r in sb and sb[r]["selected"]}
    assert only_a and only_b  # the two recipes disagree somewhere

    doc = json.loads(cli("audit", root, a, "--compare", b, "--format", "json").stdout)
    assert set(doc) == {"a", "b", "summary", "params", "training", "reasons", "differences"}
    assert doc["training"] == [{"parameter": "training.trained", "a": "no", "b": "no"}]  # neither was trained
    side = {r["side"]: r for r in doc["summary"]}
    assert side["A"]["recipe"] == "pods" and side["B"]["recipe"] == "dapo"
    assert side["A"]["snapshot_seq"] == side["B"]["snapshot_seq"]
    assert side["A"]["kept_only_here"] == len(only_a) and side["B"]["kept_only_here"] == len(only_b)
    assert side["A"]["kept_by_both"] == len(both) and side["A"]["common_candidates"] == len(set(sa) & set(sb))
    kinds = Counter(r["kind"] for r in doc["differences"])
    assert kinds["a_only"] == len(only_a) and kinds["b_only"] == len(only_b)
    assert {r["rollout_id"] for r in doc["differences"] if r["kind"] == "a_only"} == only_a
    for r in doc["differences"]:
        if r["kind"] == "both_differ":  # PODS re-normalises, DA3PO amplifies: same rollout, other advantage
            assert r["rollout_id"] in both
            assert r["advantage_a"] != r["advantage_b"] or r["tokens_kept_a"] != r["tokens_kept_b"]
    pairs = Counter((sa.get(r, {}).get("reason"), sb.get(r, {}).get("reason")) for r in set(sa) | set(sb))
    assert {(r["reason_a"], r["reason_b"]): r["rollouts"] for r in doc["reasons"]} == dict(pairs)
    params = {r["parameter"]: (r["a"], r["b"]) for r in doc["params"]}
    assert params["sample"] == ("pods", "none") and params["amplify"] == ("none", "da3po")
    assert "where" not in params  # same batch on both sides

    rows = parse_csv(cli("audit", root, a, "--compare", b, "--format", "csv").stdout)
    assert kinds["both_differ"] > 0
    assert Counter(r["view"] for r in rows) == {"summary": 2, "params": len(doc["params"]), "training": 1,
                                                "reasons": len(doc["reasons"]), "differences": len(doc["differences"])}
    text = cli("audit", root, a, "--compare", b).stdout
    assert "side by side" in text and a in text and b in text and "parameters that differ" in text


def test_compare_with_itself_and_errors(cli, whatif):
    root, a, _, _ = whatif
    doc = json.loads(cli("audit", root, a, "--compare", a, "-f", "json").stdout)
    assert doc["differences"] == [] and doc["params"] == []
    assert all(r["kept_only_here"] == 0 for r in doc["summary"])
    for args, needle in ((("--format", "xml"), "--format must be table, json or csv"),
                         (("--compare", "cur-nope"), "no curation 'cur-nope'"),
                         (("--compare", a, "--rollout", "x"), "cannot be used together")):
        res = cli("audit", root, a, *args)
        assert res.code == 1 and needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def documented_audit(root: str, cid: str) -> dict:
    """The record and the three views of `rollstore audit ROOT CID --format json`, run straight over the
    latest snapshot's plain views (every shard of every table)."""
    import duckdb

    from rollstore.output.formats import jsonable
    from rollstore.queries import load_sql

    with Buffer.open(root) as buf, buf.snapshot() as snap:
        con = duckdb.connect()
        snap.register_duckdb(con)
        con.execute(load_sql("views"))
        out = {name: [jsonable(r) for r in con.sql(load_sql(f"audit_{name}"), params={"curation_id": cid})
                      .to_arrow_table().to_pylist()] for name in ("reasons", "bands", "replay")}
        latest = con.execute("SELECT curation_id FROM curations ORDER BY created_at DESC, curation_id DESC LIMIT 1").fetchone()
        con.close()
    return out, latest[0]


def test_audit_reads_its_own_shards_only(cli, whatif, tmp_path):
    """`rollstore audit ROOT [CID]` reads the curation's record and audit shards (by catalog key) and the
    curations table, nothing else: its views equal the documented queries over every shard; another
    curation's audit shard, or any rollouts shard, can be gone without it noticing; shards without a
    key (written before keys) are read too."""
    import shutil
    import sqlite3

    root, a, b, _ = whatif
    views, latest = documented_audit(root, a)
    doc = json.loads(cli("audit", root, a, "-f", "json").stdout)
    assert {k: doc[k] for k in views} == views and sum(r["candidates"] for r in doc["reasons"]) > 0
    assert latest == b and json.loads(cli("audit", root, "-f", "json").stdout)["curation"]["curation_id"] == b

    copy = str(tmp_path / "copy")
    shutil.copytree(root, copy)
    with Buffer.open(copy) as buf, buf.snapshot() as snap:
        other = [s.path for s in snap.shards("selections") if s.key == b]
        rollouts = [s.path for s in snap.shards("rollouts")]
    assert other and rollouts
    for path in other + rollouts:
        os.remove(os.path.join(copy, path))
    assert json.loads(cli("audit", copy, a, "-f", "json").stdout) == doc
    res = cli("audit", copy, b, "-f", "json")  # its own shard gone: one line naming the file
    assert res.code == 1 and other[0] in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    res = cli("audit", copy, "cur-nope")
    assert res.code == 1 and "no curation 'cur-nope'" in res.stderr and "2 curations" in res.stderr

    unkeyed = str(tmp_path / "unkeyed")  # shards written before keys: read whatever curation they hold
    shutil.copytree(root, unkeyed)
    con = sqlite3.connect(os.path.join(unkeyed, "manifest.sqlite"))
    con.execute("UPDATE shards SET key = NULL WHERE table_name IN ('selections', 'curations')")
    con.commit()
    con.close()
    assert json.loads(cli("audit", unkeyed, a, "-f", "json").stdout) == doc
    assert json.loads(cli("audit", unkeyed, "-f", "json").stdout)["curation"]["curation_id"] == b
