"""`verl-jsonl`: verl's `trainer.rollout_data_dir` dumps, `{step}.jsonl`.

Follows the writer in verl's `verl/trainer/ppo/ray_trainer.py` (`RayPPOTrainer._dump_generations`):
one JSON object per line with `input` (the decoded prompt), `output` (the decoded response),
`gts` (the ground truth, in versions that log it), `score` (the sequence score), `step` (the
global step), and every reward-extra-info key whose list has one value per sample (e.g. `acc`,
and `uid` where a version or reward function logs it).

Invariants:
- `rollout_id` is a hash of the file's bytes and the line number: importing the same file again
  adds nothing.
- Groups are `uid` when every row has one, else rebuilt from order (consecutive rows with the same
  `input`, recorded as lossy); `policy_version` is `step` (recorded).
- `correct` is `acc` when the line logs a boolean `acc`, else null; `gold_answer` is `gts` when it is
  text (JSON-encoded otherwise); other keys go to `meta`.
"""

from __future__ import annotations

import json

from ..errors import ValidationError
from ..importer import read_jsonl_objects
from .common import (Rows, TextCodec, file_digest, file_time, group_ids, groups_from_order, missing,
                     sample_idx, stable_id)
from .text import fill_text

FORMAT = "verl-jsonl"
_KNOWN = {"input", "output", "gts", "score", "step", "uid", "acc"}


def convert(path: str, codec: TextCodec | None, run_id: str) -> Rows:
    lines = read_jsonl_objects(path)
    for name in ("input", "output", "score", "step"):
        if any(name not in obj for _, obj in lines):
            raise missing(FORMAT, path, name if name != "score" else "score (reward)")
    digest = file_digest(path)
    rows = Rows(FORMAT, path)
    rids = [stable_id(FORMAT, digest, lineno) for lineno, _ in lines]
    objs = [obj for _, obj in lines]
    for (lineno, obj) in lines:
        for name, kind in (("input", str), ("output", str), ("step", int)):
            if not isinstance(obj[name], kind) or isinstance(obj[name], bool):
                raise ValidationError(path, None, name, f"{FORMAT}: line {lineno}: expected {kind.__name__}, "
                                      f"got {obj[name]!r:.60}")
        if isinstance(obj["score"], bool) or not isinstance(obj["score"], (int, float)):
            raise ValidationError(path, None, "reward", f"{FORMAT}: line {lineno}: score {obj['score']!r:.60} is not a number")
    if objs and all(obj.get("uid") is not None for obj in objs):
        keys = [(obj["step"], str(obj["uid"])) for obj in objs]
        gidx, order = [], {}
        for k in keys:
            gidx.append(order.setdefault(k, len(order)))
    else:
        rows.note("group rebuilt from order (consecutive rows with the same input)")
        gidx = groups_from_order([(obj["step"], obj["input"]) for obj in objs])
    rows.note("policy_version is the step")
    rows.set("rollout_id", rids)
    rows.set("group_id", group_ids(FORMAT, gidx, rids))
    rows.set("prompt_id", [stable_id("prompt", obj["input"]) for obj in objs])
    rows.set("sample_idx", sample_idx(gidx))
    rows.set("run_id", [run_id] * len(objs))
    rows.set("step", [obj["step"] for obj in objs])
    rows.set("policy_version", [obj["step"] for obj in objs])
    fill_text(rows, codec, [obj["input"] for obj in objs], [obj["output"] for obj in objs])
    rows.set("reward", [float(obj["score"]) for obj in objs])
    rows.set("correct", [obj["acc"] if isinstance(obj.get("acc"), bool) else None for obj in objs])
    rows.set("gold_answer", [_gold(obj.get("gts")) for obj in objs])
    rows.set("created_at", [file_time(path)] * len(objs))
    rows.extra_meta = [{k: v for k, v in obj.items() if k not in _KNOWN or k == "uid"} for obj in objs]
    return rows


def _gold(value):
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True)
