"""`rollstore audit --format table|json|csv` and `--compare`: two recipes run on one snapshot ("what-if")
compared side by side, every count recomputed from the raw `selections` rows."""

from __future__ import annotations

import csv
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
