"""`prime-rl`: prime-rl's trainer token exports, `token_exports/step_{N}/rank_{R}.jsonl`.

Follows the writer in prime-rl's `src/prime_rl/trainer/rl/token_export.py` (`TokenExporter.export`,
on with `enable_token_export`): one JSON object per trained sequence with `step`, `export_step`,
`sample_id`, `run_id`, `env_name`, `preflight_only`, and per-token lists over the whole sequence
(prompt and completion): `token_ids`, `loss_mask`, `advantages`, `rewards` (may be null),
`inference_logprobs` (the sampler's), `trainer_logprobs`, `entropy`, `temperatures`, ...

Invariants:
- The response is the loss-masked span (`tokens.response_span`); `gen_logprobs` is
  `inference_logprobs`, `old_logprobs` `trainer_logprobs`, `entropies` `entropy`, all cut to it.
- `rollout_id` is a hash of the file's bytes and the line number; importing a file again adds
  nothing. `preflight_only` records are skipped.
- `reward` is `rewards` at the first response position; a record without rewards is refused
  naming the field (prime-rl keeps rewards in its traces; join them into `rewards` first).
- Groups are rebuilt from identical prompt tokens within a step, `policy_version` is the step,
  `finish_reason` is inferred from the tokenizer's eos, text is decoded with `--tokenizer`;
  all recorded as lossy. The per-token advantages are kept in `meta`.
"""

from __future__ import annotations

from ..importer import read_jsonl_objects
from .common import (Rows, TextCodec, file_digest, file_time, finish_from_eos, group_ids, missing,
                     sample_idx, stable_id)
from .tokens import per_token, response_span

FORMAT = "prime-rl"


def convert(path: str, codec: TextCodec | None, run_id: str) -> Rows:
    lines = [(n, o) for n, o in read_jsonl_objects(path) if not o.get("preflight_only")]
    digest = file_digest(path)
    rows = Rows(FORMAT, path)
    if codec is None:
        raise missing(FORMAT, path, "prompt", "the format holds token ids only; pass --tokenizer DIR to decode them")
    cols: dict[str, list] = {k: [] for k in ("rid", "step", "prompt_ids", "resp", "gen", "old", "ent", "reward", "adv", "env")}
    for lineno, obj in lines:
        rid = stable_id(FORMAT, digest, lineno)
        for name in ("token_ids", "loss_mask", "inference_logprobs"):
            if name not in obj:
                raise missing(FORMAT, path, name if name != "inference_logprobs" else "gen_logprobs (inference_logprobs)")
        if obj.get("rewards") is None:
            raise missing(FORMAT, path, "reward", "the export has no rewards; join them from the traces into `rewards`")
        ids = obj["token_ids"]
        start, end = response_span(obj["loss_mask"], path, rid, FORMAT, "loss_mask")
        cols["rid"].append(rid)
        cols["step"].append(obj.get("export_step", obj.get("step")))
        cols["prompt_ids"].append(ids[:start])
        cols["resp"].append(ids[start:end])
        cols["gen"].append(per_token(obj, "inference_logprobs", end, path, rid, FORMAT)[start:end])
        cols["old"].append(obj["trainer_logprobs"][start:end] if obj.get("trainer_logprobs") is not None else None)
        cols["ent"].append(obj["entropy"][start:end] if obj.get("entropy") is not None else None)
        cols["reward"].append(per_token(obj, "rewards", end, path, rid, FORMAT)[start])
        cols["adv"].append(obj["advantages"][start:end] if obj.get("advantages") is not None else None)
        cols["env"].append(obj.get("env_name"))
    if any(s is None for s in cols["step"]):
        raise missing(FORMAT, path, "step")
    keys = [(s, tuple(p)) for s, p in zip(cols["step"], cols["prompt_ids"])]
    order: dict = {}
    gidx = [order.setdefault(k, len(order)) for k in keys]
    rows.note("group rebuilt from identical prompt tokens within a step")
    rows.note("policy_version is the step")
    rows.note("prompt and response text decoded from token ids")
    prompts = [codec.decode(p) for p in cols["prompt_ids"]]
    rows.set("rollout_id", cols["rid"])
    rows.set("group_id", group_ids(FORMAT, gidx, cols["rid"]))
    rows.set("prompt_id", [stable_id("prompt", p) for p in prompts])
    rows.set("sample_idx", sample_idx(gidx))
    rows.set("run_id", [run_id] * len(gidx))
    rows.set("step", cols["step"])
    rows.set("policy_version", cols["step"])
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
    rows.set("created_at", [file_time(path)] * len(gidx))
    rows.extra_meta = [{"advantages": a} for a in cols["adv"]]
    return rows
