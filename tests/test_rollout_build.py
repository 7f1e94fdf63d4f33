"""rollout.build: rows in the rollouts schema from prompts, generations and verdicts."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import pytest

from rollstore.rollout.backends import Generation
from rollstore.rollout.build import StepStamp, build_rollouts, make_group_id
from rollstore.rollout.prompt_sources import Prompt
from rollstore.rollout.reward import Verdict
from rollstore.storage.schema import ROLLOUTS
from rollstore.storage.validate import validate_rollouts


def gen(tokens, reason="stop"):
    return Generation([1, 5, 6], tokens, "x", np.full(len(tokens), -0.5, np.float32), reason)


PROMPTS = [Prompt("pa", "1+1=", "2", "builtin:arith", 1), Prompt("pb", "2+2=", "4", "file.jsonl")]
GENS = [[gen([7, 2]), gen([8, 9, 2])], [gen([]), gen([5, 5, 5], "length")]]
VERDICTS = [[Verdict(True, 1.0, None), Verdict(False, 0.0, None)],
            [Verdict(None, 0.0, "timeout"), Verdict(False, -0.25, None)]]


def test_rows_ids_and_nulls():
    when = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
    table = build_rollouts(PROMPTS, GENS, VERDICTS, StepStamp("r", 4, policy_version=1, prompt_offset=10,
                                                                created_at=when), meta={"backend": "hf"})
    assert table.schema == ROLLOUTS
    validate_rollouts(table, "built")
    rows = table.to_pylist()
    assert [r["group_id"] for r in rows] == ["r-s000004-p00010"] * 2 + ["r-s000004-p00011"] * 2
    assert [r["rollout_id"] for r in rows][:2] == ["r-s000004-p00010-000", "r-s000004-p00010-001"]
    assert [r["sample_idx"] for r in rows] == [0, 1, 0, 1]
    assert rows[2]["correct"] is None and rows[2]["verify_error"] == "timeout"
    assert rows[3]["reward"] == -0.25 and rows[3]["finish_reason"] == "length"
    assert rows[2]["response_token_ids"] == [] and rows[2]["gen_logprobs"] == []
    assert all(r["old_logprobs"] is None and r["entropies"] is None for r in rows)
    assert all(r["created_at"] == when for r in rows)
    assert json.loads(rows[0]["meta"]) == {"backend": "hf", "difficulty": 1}
    assert json.loads(rows[2]["meta"]) == {"backend": "hf"}
    assert table.column("created_at").type == pa.timestamp("us", tz="UTC")


def test_scores_fill_per_token_columns():
    old = [[np.array([-0.1, -0.2], np.float32), np.array([-1, -2, -3], np.float32)],
           [np.zeros(0, np.float32), np.array([-1, -1, -1], np.float32)]]
    ent = [[np.ones(2, np.float32), np.ones(3, np.float32)], [np.zeros(0, np.float32), np.ones(3, np.float32)]]
    table = build_rollouts(PROMPTS, GENS, VERDICTS, StepStamp("r", 0), old_logprobs=old, entropies=ent)
    validate_rollouts(table, "built")
    assert table.column("old_logprobs").to_pylist()[1] == [-1.0, -2.0, -3.0]
    assert table.column("old_logprobs").null_count == 0


def test_group_ids_are_unambiguous():
    assert make_group_id("a-s000001", 2, 3) != make_group_id("a", 1, 2)
    assert make_group_id("run", 12, 7) == "run-s000012-p00007"


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="one entry per prompt"):
        build_rollouts(PROMPTS, GENS[:1], VERDICTS, StepStamp("r", 0))
    with pytest.raises(ValueError, match="verdicts"):
        build_rollouts(PROMPTS, GENS, [VERDICTS[0], VERDICTS[1][:1]], StepStamp("r", 0))
    with pytest.raises(ValueError, match="timezone"):
        build_rollouts(PROMPTS, GENS, VERDICTS, StepStamp("r", 0, created_at=datetime(2026, 1, 1)))
