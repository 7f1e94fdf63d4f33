"""Prompt datasets from JSONL and Parquet: fields, answer reduction, ids, templates, bad rows."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollstore.rollout.datasets import DatasetError, gsm8k_answer, last_boxed, load_prompts, reduce_answer
from rollstore.rollout.prompt_sources import prompt_hash


def write_jsonl(path, rows, raw_lines=()):
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
        for line in raw_lines:
            fh.write(line + "\n")
    return str(path)


def test_gsm8k_and_math_answers_are_reduced(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"question": "Natalia sold 48 clips...", "answer": "She sold 48/2 = 24.\n#### 72"},
        {"problem": "Compute 1/2.", "solution": r"We get $\boxed{\frac{1}{2}}$."},
        {"prompt": "p3", "answer": 19},
        {"prompt": "p4", "answer": "#### 1,072"},
    ])
    got = load_prompts(path)
    assert [p.gold_answer for p in got] == ["72", r"\frac{1}{2}", "19", "1072"]
    assert got[0].prompt == "Natalia sold 48 clips..."
    assert got[0].source == "d.jsonl"


def test_boxed_with_nested_and_escaped_braces():
    assert last_boxed(r"so \boxed{\frac{a^{2}}{b_{1}}} done") == r"\frac{a^{2}}{b_{1}}"
    assert last_boxed(r"\boxed{1} then \boxed{\{1,2\}}") == r"\{1,2\}"
    assert last_boxed(r"answer \boxed 5$") == "5"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"\boxed{open") is None
    assert last_boxed("no box") is None
    assert gsm8k_answer("x\n#### -3") == "-3"
    assert reduce_answer("answer", r"\frac{3}{4}") == r"\frac{3}{4}"


def test_prompt_ids_from_file_or_hash(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"id": 7, "prompt": "a", "answer": "1"},
        {"prompt_id": "q-2", "prompt": "b", "answer": "2"},
        {"prompt": "c", "answer": "3"},
    ])
    got = load_prompts(path)
    assert [p.prompt_id for p in got] == ["7", "q-2", prompt_hash("c")]
    assert load_prompts(path)[2].prompt_id == got[2].prompt_id  # stable


def test_chat_template_applies_but_ids_follow_raw_text(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "2+2", "answer": "4"}])
    plain = load_prompts(path)[0]
    templated = load_prompts(path, template="<|user|>{prompt}<|assistant|>")[0]
    assert templated.prompt == "<|user|>2+2<|assistant|>"
    assert templated.prompt_id == plain.prompt_id == prompt_hash("2+2")
    with pytest.raises(DatasetError, match="must contain"):
        load_prompts(path, template="no placeholder")


def test_parquet_dataset(tmp_path):
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"problem": ["x", "y"], "solution": [r"\boxed{2}", r"\boxed{\sqrt{2}}"],
                             "extra": [1, 2]}), path)
    got = load_prompts(path)
    assert [(p.prompt, p.gold_answer) for p in got] == [("x", "2"), ("y", r"\sqrt{2}")]


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"answer": "1"}', "no prompt field"),
        ('{"prompt": "x"}', "no answer field"),
        ('{"prompt": "", "answer": "1"}', "non-empty"),
        ('{"prompt": "x", "solution": "no box here"}', "no \\\\boxed"),
        ('{"prompt": "x", "answer": "#### "}', "nothing after"),
        ('[1, 2]', "JSON object"),
        ('{"prompt": "x", "answer": ', "invalid JSON"),
    ],
)
def test_bad_row_names_file_and_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": "1"}], raw_lines=["", line])
    with pytest.raises(DatasetError, match=message) as err:
        load_prompts(path)
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(f"{path}: line 3: ")  # line 2 is blank and still counted


def test_bad_parquet_row_names_row(tmp_path):
    path = str(tmp_path / "bad.parquet")
    pq.write_table(pa.table({"prompt": ["a", None], "answer": ["1", "2"]}), path)
    with pytest.raises(DatasetError, match=r"bad\.parquet: row 2: no prompt field"):
        load_prompts(path)


def test_conflicting_ids_and_bad_files(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": 1, "prompt": "a", "answer": "1"},
                                              {"id": 1, "prompt": "b", "answer": "1"}])
    with pytest.raises(DatasetError, match="line 2: prompt_id '1' names a different prompt"):
        load_prompts(path)
    with pytest.raises(DatasetError, match="no such file"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    other = tmp_path / "d.csv"
    other.write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match="unknown dataset format"):
        load_prompts(str(other))
