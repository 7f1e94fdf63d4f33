"""`cur.why(ids)`: thousands of rows in one query, each sentence saying which side of the cut-off
the row fell on (docs/python.md, docs/audit.md); one id's tokens decoded to text."""

from __future__ import annotations

import time

import pytest

import rollstore as rs
from rollstore.storage.errors import RollstoreError


@pytest.fixture(scope="module")
def d3s(tmp_path_factory):
    buf = rs.open(tmp_path_factory.mktemp("why") / "buf", create=True)
    buf.generate(num_prompts=160, group_size=8)  # 1,280 candidates in one pool
    return buf, buf.curate("d3s", progress=0.3)


def test_why_answers_every_candidate_in_one_call_and_says_which_side(d3s):
    _, cur = d3s
    ids = cur.audit["rollout_id"].to_list()[::-1]
    start = time.perf_counter()
    frame = cur.why(ids + ids[:5])  # duplicates answered once
    seconds = time.perf_counter() - start
    assert frame["rollout_id"].to_list() == ids  # in the order given
    assert seconds / (len(ids) / 1000) < 1.0, f"{seconds:.2f} s for {len(ids)} ids"
    kept = frame.filter(frame["selected"])
    dropped = frame.filter(frame["reason"] == "not_selected")
    assert kept.height == cur.summary["n_selected"][0] and dropped.height > 0
    assert set(kept["side"].to_list()) <= {"top", "bottom", "whole pool"}
    assert set(dropped["side"].to_list()) == {"middle"}
    for row in dropped.iter_rows(named=True):  # the rank lies strictly between the kept blocks
        assert row["top_kept"] < row["pool_position"] < row["bottom_from"]
        assert "in the dropped middle" in row["why"] and "inside" not in row["why"]
    for row in kept.filter(kept["side"] == "top").iter_rows(named=True):
        assert row["pool_position"] <= row["top_kept"] and "inside the kept top block" in row["why"]
    for row in kept.filter(kept["side"] == "bottom").iter_rows(named=True):
        assert row["pool_position"] >= row["bottom_from"] and "inside the kept bottom block" in row["why"]
    one = cur.why(dropped["rollout_id"][0])
    assert one.explain() == dropped["why"][0] and one.side == "middle"


def test_one_rows_tokens_are_decoded_to_text(d3s):
    _, cur = d3s
    rid = cur.audit.filter(cur.audit["reason"] == "selected")["rollout_id"][0]
    why = cur.why(rid)
    assert why.tokens.columns[:3] == ["pos", "token_id", "text"]
    text = "".join(t for t in why.tokens["text"].to_list() if not t.startswith("["))
    assert text and why.response.startswith(text)


def test_why_refuses_unknown_ids_and_too_many(d3s):
    _, cur = d3s
    ids = cur.audit["rollout_id"].to_list()[:3]
    with pytest.raises(RollstoreError, match=r"rollout 'nope' is not a candidate .* \(nor are 1 more of the 5 ids\)"):
        cur.why(ids + ["nope", "nope-2"])
    with pytest.raises(RollstoreError, match="10001 rollout ids in one call; at most 10,000"):
        cur.why([f"x{i}" for i in range(10_001)])


def test_a_row_refused_before_selection_says_so(d3s):
    buf, _ = d3s
    stale = buf.curate("grpo", current_version=3, max_policy_lag=0)
    frame = stale.why(stale.audit["rollout_id"].to_list()[:50])
    assert frame["side"].null_count() == 50
    assert all(w.endswith(".") and "stale, refused before sample selection (age 3" in w for w in frame["why"])


def test_batches_line_up_as_docs_python_says(d3s):
    """docs/python.md, job 9: input_ids [B, L] holds prompt then response; every per-token tensor is
    [B, T] over the response; positions index the response tokens in input_ids."""
    _, cur = d3s
    batch = next(cur.batches(8))
    assert batch.input_ids.shape[0] == batch.loss_mask.shape[0] == 8
    assert batch.loss_mask.shape == batch.response_ids.shape == batch.positions.shape == batch.old_logprobs.shape
    gathered = batch.input_ids.gather(1, batch.positions)
    assert (gathered[batch.response_mask] == batch.response_ids[batch.response_mask]).all()
    assert not (batch.loss_mask & ~batch.response_mask).any()
    assert batch.input_ids.shape[1] == int(batch.attention_mask.sum(1).max())
