"""`verl-jsonl`: verl's `trainer.rollout_data_dir` dumps, `{step}.jsonl`.

Follows the writer in verl's `verl/trainer/ppo/ray_trainer.py` at b178a3cd
(`RayPPOTrainer._dump_generations`, called from `_log_rollout_data`): one JSON object per line
(`json.dumps(..., ensure_ascii=False)`) with `input` (the prompt decoded with
`skip_special_tokens=True`), `output` (the response, likewise), `gts` (the ground truth, null when
the dataset has none), `score` (the sum of the token-level scores), `step` (the global step), and
every reward-extra-info key whose list has one value per sample (e.g. `acc`, `pred`). `uid` is
not among them in verl's default setup.

verl's default `trainer.balance_batch: True` reorders the batch by sequence length (across data
parallel ranks) before the dump, so a prompt's samples are not next to each other in the file.

Invariants:
- `rollout_id` is a hash of the file's bytes and the line number: importing the same file again
  adds nothing.
- Groups are `uid` when every row has one; otherwise the rows of one (`step`, `input`) pair,
  wherever they are in the file (recorded as lossy: two dataset rows with the same prompt text in
  one step become one group). Never position: that would split groups under `balance_batch`.
- `policy_version` is `step` (recorded).
- An empty file is refused as empty; a line without `input`, `output`, `score` or `step`, or with
  a value of the wrong kind, is refused naming the line and the field.
- `correct` is `acc` when the line logs a boolean `acc`, else null; `gold_answer` is `gts` when it is
  text (JSON-encoded otherwise); other keys go to `meta`.
"""

from __future__ import annotations

import json

from rollstore.storage.importer import read_jsonl_objects
from .common import (Rows, TextCodec, bad, empty, file_digest, file_time, groups_by_key, kind, number, stable_id)
from .text import fill_text

FORMAT = "verl-jsonl"
_KNOWN = {"input", "output", "gts", "score", "step", "uid", "acc"}


def convert(path: str, codec: TextCodec | None, run_id: str) -> Rows:
    lines = read_jsonl_objects(path)
    if not lines:
        raise empty(FORMAT, path)
    for name in ("input", "output", "score", "step"):
        for lineno, obj in lines:
            if name not in obj:
                raise bad(FORMAT, path, f"line {lineno}", name if name != "score" else "score (reward)",
                          "missing required field")
    digest = file_digest(path)
    rows = Rows(FORMAT, path)
    rids = [stable_id(FORMAT, digest, lineno) for lineno, _ in lines]
    objs = [obj for _, obj in lines]
    for (lineno, obj) in lines:
        for name, want in (("input", str), ("output", str), ("step", int)):
            if not isinstance(obj[name], want) or isinstance(obj[name], bool):
                raise bad(FORMAT, path, f"line {lineno}", name, f"expected {'text' if want is str else 'an integer'}, "
                          f"got {kind(obj[name])}")
        number(FORMAT, path, f"line {lineno}", "score (reward)", obj["score"])
    if objs and all(obj.get("uid") is not None for obj in objs):
        gidx = groups_by_key([(obj["step"], str(obj["uid"])) for obj in objs])
    else:
        rows.note("group rebuilt from (step, input): rows with the same prompt text in a step are one group")
        gidx = groups_by_key([(obj["step"], obj["input"]) for obj in objs])
    rows.note("policy_version is the step")
    rows.identify(rids, gidx, [obj["input"] for obj in objs], run_id, [obj["step"] for obj in objs])
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
