"""`prime-rl`: prime-rl's trainer token exports, `token_exports/step_{N}/rank_{R}.jsonl`.

Follows the writer in prime-rl's `src/prime_rl/trainer/rl/token_export.py` (`TokenExporter.export`
and `_export_columns`, on with the trainer's `enable_token_export`), from its first version
(e971d905a) up to 289562d2e: every data-parallel rank appends to its own file of the step
(`step_{N}/rank_{R}.jsonl`, compact `json.dumps(..., separators=(",", ":"), allow_nan=False)`),
one JSON object per trained sequence of its packed micro-batches, with `schema_version` (1),
`step`, `rank`, `micro_step`, `micro_sequence_idx`, `export_sequence_idx` (the record's index in
its file), `env_name`, and per-token lists over the whole sequence (prompt and completion):
`token_ids`, `position_ids`, `loss_mask`, `advantages`, `inference_logprobs` (the sampler's),
`trainer_logprobs`, `entropy`, and diagnostics (`mismatch_kl`, `importance_ratio`, ...; null
lists when off). Non-finite floats are written as null. Versions from 941019f2e to acbabc6f0 add
`export_step` and `run_id` (multi-tenant runs); versions before 0be5ac452 (2026-06-27) add
`training_mode` and a per-token `rewards` list (all null when the batch carried no rewards).
Since 0be5ac452 the export holds no rewards at all. When every rank has flushed a step, the
trainer touches `step_{N}/STABLE`.

Rewards for an export without them come from `--rewards FILE` (JSONL, one object per sequence,
`reward` plus a key: either the export's own record key `step`, `rank`, `export_sequence_idx`, or
the sequence's full `token_ids` as exported, optionally with `step`), e.g. joined from the
orchestrator's `rollouts/step_{N}/train/effective/traces.jsonl`.

Invariants:
- The unit of import is the STEP: any rank file given stands for its step directory, and all the
  step's `rank_*.jsonl` files are read (in rank order) and appended as one shard, so a group
  split over ranks by data-parallel packing is one group.
- The response is the loss-masked span (`tokens.response_span`); `gen_logprobs` is
  `inference_logprobs`, `old_logprobs` `trainer_logprobs`, `entropies` `entropy`, all cut to it.
- `rollout_id` is a hash of the rank file's bytes and the line number; importing a step again
  adds nothing.
- Groups are rebuilt from identical prompt tokens within a step, across all its rank files;
  `policy_version` is the step; text is decoded with `--tokenizer`; `finish_reason` is inferred
  from the eos token; all recorded as lossy. Per-token advantages go to `meta`.
- `reward` is the export's `rewards` at the first response token, else the `--rewards` entry;
  a sequence with neither is refused naming the file, the line and the field.
- Every refusal names the format, the file, the line and the field; a step without records
  is refused as empty.
"""

from __future__ import annotations

import glob
import os
import re

from rollstore.storage.importer import read_jsonl_objects
from .common import (ImportRefused, Rows, TextCodec, bad, empty, file_digest, file_time, finish_from_eos, float_list,
                     groups_by_key, int_list, kind, missing, number, stable_id)
from .tokens import response_span

FORMAT = "prime-rl"
_RANK = re.compile(r"rank_(\d+)\.jsonl$")


def unit(path: str) -> str:
    """The step directory a rank file belongs to (a directory stands for itself)."""
    if os.path.isdir(path):
        return os.path.normpath(path)
    if _RANK.search(os.path.basename(path)) and os.path.isfile(path):
        return os.path.dirname(path) or "."
    return path


def _files(path: str) -> list[str]:
    if not os.path.isdir(path):
        return [path]
    files = [f for f in glob.glob(os.path.join(path, "rank_*.jsonl")) if _RANK.search(os.path.basename(f))]
    if not files:
        raise empty(FORMAT, path)
    return sorted(files, key=lambda f: int(_RANK.search(os.path.basename(f)).group(1)))


def load_rewards(path: str) -> dict:
    """`--rewards FILE`: {("idx", step, rank, export_sequence_idx) or ("ids", step|None, token_ids): reward}."""
    table: dict = {}
    lines = read_jsonl_objects(path)
    if not lines:
        raise ImportRefused(f"{FORMAT}: --rewards {path}: the file is empty (no rewards)")
    for lineno, obj in lines:
        where = f"--rewards {path}: line {lineno}"
        if "reward" not in obj:
            raise ImportRefused(f"{FORMAT}: {where}: field 'reward': missing required field")
        reward = number(FORMAT, f"--rewards {path}", f"line {lineno}", "reward", obj["reward"])
        if "token_ids" in obj:
            ids = int_list(FORMAT, f"--rewards {path}", f"line {lineno}", "token_ids", obj["token_ids"])
            key = ("ids", obj.get("step"), tuple(ids))
        elif all(k in obj for k in ("step", "rank", "export_sequence_idx")):
            key = ("idx", obj["step"], obj["rank"], obj["export_sequence_idx"])
        else:
            raise ImportRefused(f"{FORMAT}: {where}: field 'token_ids': a rewards line needs `token_ids` or "
                                "`step`, `rank` and `export_sequence_idx`")
        if key in table and table[key] != reward:
            raise ImportRefused(f"{FORMAT}: {where}: field 'reward': {reward} for a key given {table[key]} earlier")
        table[key] = reward
    return table


def _reward_of(obj: dict, step, ids: list[int], table: dict | None):
    if table is None:
        return None
    for key in (("idx", step, obj.get("rank"), obj.get("export_sequence_idx")), ("ids", step, tuple(ids)),
                ("ids", None, tuple(ids))):
        if key in table:
            return table[key]
    return None


KEYS = ("rid", "step", "prompt_ids", "resp", "gen", "old", "ent", "reward", "adv", "env", "src")


def _line_reward(obj: dict, f: str, at: str, step: int, ids: list[int], start: int,
                 rewards: dict | None) -> tuple[float, bool]:
    """(reward, whether it came from the --rewards file): the export's own per-token `rewards`
    when it has them, else the --rewards table's entry; refused when neither has one."""
    logged = obj.get("rewards")
    if isinstance(logged, list) and len(logged) > start and logged[start] is not None:
        return number(FORMAT, f, at, "rewards", logged[start]), False
    if logged is not None and not isinstance(logged, list):
        raise bad(FORMAT, f, at, "rewards", f"expected a per-token list, got {kind(logged)}")
    reward = _reward_of(obj, step, ids, rewards)
    if reward is None:
        hint = ("no entry for this sequence in --rewards" if rewards is not None else
                "this export holds no rewards (prime-rl writes none since 0be5ac452); pass --rewards FILE "
                "(docs/importers.md)")
        raise bad(FORMAT, f, at, "reward", hint)
    return reward, True


def _line(f: str, digest: str, lineno: int, obj: dict, rewards: dict | None) -> tuple[dict, bool]:
    """One exported sequence as the values of `KEYS`, and whether its reward came from --rewards."""
    at = f"line {lineno}"
    for name in ("token_ids", "loss_mask", "inference_logprobs"):
        if name not in obj:
            raise bad(FORMAT, f, at, name if name != "inference_logprobs" else "gen_logprobs (inference_logprobs)",
                      "missing required field")
    step = obj.get("export_step", obj.get("step"))
    if isinstance(step, bool) or not isinstance(step, int):
        raise bad(FORMAT, f, at, "step", f"expected an integer, got {kind(step)}")
    ids = int_list(FORMAT, f, at, "token_ids", obj["token_ids"])
    mask = obj["loss_mask"]
    if not isinstance(mask, list) or len(mask) != len(ids):
        raise bad(FORMAT, f, at, "loss_mask", f"expected a list of {len(ids)} booleans, got {kind(mask)}")
    start, end = response_span(mask, f, at, FORMAT, "loss_mask")
    gen = float_list(FORMAT, f, at, "inference_logprobs", obj["inference_logprobs"], end)[start:end]
    if any(v is None for v in gen):
        raise bad(FORMAT, f, at, "inference_logprobs", "null (non-finite) log-prob inside the response")
    reward, from_file = _line_reward(obj, f, at, step, ids, start, rewards)
    trainer, ent, adv = obj.get("trainer_logprobs"), obj.get("entropy"), obj.get("advantages")
    return {
        "rid": stable_id(FORMAT, digest, lineno), "step": step, "prompt_ids": ids[:start], "resp": ids[start:end],
        "gen": gen, "reward": reward, "env": obj.get("env_name"),
        "old": float_list(FORMAT, f, at, "trainer_logprobs", trainer, end)[start:end] if trainer is not None else None,
        "ent": float_list(FORMAT, f, at, "entropy", ent, end)[start:end] if ent is not None else None,
        "adv": adv[start:end] if isinstance(adv, list) else None,
        "src": {"file": os.path.basename(f), "line": lineno, "rank": obj.get("rank"),
                "export_sequence_idx": obj.get("export_sequence_idx")},
    }, from_file


def convert(path: str, codec: TextCodec | None, run_id: str, rewards: dict | None = None) -> Rows:
    files = _files(path)
    if codec is None:
        raise missing(FORMAT, path, "prompt", "the format holds token ids only; pass --tokenizer DIR to decode them")
    cols: dict[str, list] = {k: [] for k in KEYS}
    from_file = 0
    for f in files:
        digest = file_digest(f)
        for lineno, obj in read_jsonl_objects(f):
            row, filed = _line(f, digest, lineno, obj, rewards)
            from_file += filed
            for k in KEYS:
                cols[k].append(row[k])
    return _rows(path, files, codec, run_id, cols, from_file)


def _rows(path: str, files: list[str], codec: TextCodec, run_id: str, cols: dict[str, list], from_file: int) -> Rows:
    """The converted columns as `Rows`, groups rebuilt, with what the conversion guessed noted."""
    rows = Rows(FORMAT, path)
    if not cols["rid"]:
        if len(files) == 1:
            raise empty(FORMAT, files[0])
        raise ImportRefused(f"{FORMAT}: {path}: every rank file of the step is empty "
                            f"({', '.join(os.path.basename(f) for f in files)}: no rows to import)")
    gidx = groups_by_key([(s, tuple(p)) for s, p in zip(cols["step"], cols["prompt_ids"])])
    if len(files) > 1 or os.path.isdir(path):
        rows.note(f"group rebuilt from identical prompt tokens within a step, over its {len(files)} rank file(s)")
    else:
        rows.note("group rebuilt from identical prompt tokens within a step")
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "STABLE")):
        rows.note("the step directory has no STABLE marker (a rank may not have finished writing)")
    if from_file:
        rows.note("reward taken from the --rewards file")
    rows.note("policy_version is the step")
    rows.note("prompt and response text decoded from token ids")
    prompts = [codec.decode(p) for p in cols["prompt_ids"]]
    rows.identify(cols["rid"], gidx, prompts, run_id, cols["step"])
    rows.set("prompt", prompts)
    rows.set("prompt_token_ids", cols["prompt_ids"])
    rows.set("response", [codec.decode(r) for r in cols["resp"]])
    rows.set("response_token_ids", cols["resp"])
    rows.set("gen_logprobs", cols["gen"])
    rows.set("old_logprobs", cols["old"])
    rows.set("entropies", cols["ent"])
    rows.set("finish_reason", finish_from_eos(cols["resp"], codec, rows))
    rows.set("reward", cols["reward"])
    rows.set("source", cols["env"])
    rows.set("created_at", [file_time(files[0])] * len(gidx))
    rows.extra_meta = [{"advantages": a, "export": s} for a, s in zip(cols["adv"], cols["src"])]
    return rows

