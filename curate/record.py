"""A curation's record and result: the numbers its record steps gave (`summarise`), the record row
(`new_record`), and what a run returns (`CurationResult`).

Invariants:
- The record's numbers come from the plan's record steps over every candidate; its variances are
  summed exactly (math.fsum), so they do not depend on row order, threads or engine.
- κ and the sample budget are the plan's (`Params.kappa`, `Plan.sample_budget`), not recomputed here.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from .plan import Plan

# The reasons that refuse a candidate before any group statistic (docs/curation.md §Eligibility).
REFUSALS = frozenset({"invalid", "truncated", "stale", "reused"})


@dataclass
class CurationResult:
    curation_id: str
    record: dict
    reasons: dict[str, int]
    snapshot_seq: int
    committed: bool = True
    already_existed: bool = False
    audit: pa.Table | None = field(default=None, repr=False)  # a repr stays one screen, whatever the batch
    curated: pa.Table | None = field(default=None, repr=False)
    output_files: list[str] = field(default_factory=list, repr=False)

    def refusal(self) -> str | None:
        """One line saying why, when the batch had candidates and every one was refused before the
        pool (`REFUSALS`: nothing of it can ever be trained, whatever the recipe); else None. The
        curate command and the loop exit non-zero with it (docs/curation.md §Eligibility). A result
        without its reasons (a committed curation a resumed loop step reuses) says nothing: None."""
        n = self.record.get("n_candidates") or 0
        if not n or not self.reasons or any(reason not in REFUSALS for reason in self.reasons):
            return None
        params = json.loads(self.record["params"]) if isinstance(self.record.get("params"), str) else {}
        why = {"invalid": "no verdict (correct is null) or a verify_error",
               "truncated": "finish_reason length or abort, with truncated=drop",
               "stale": (f"policy_version below current_version {params.get('current_version')} − max_policy_lag "
                         f"{params.get('max_policy_lag')}"),
               "reused": f"selected max_reuse = {params.get('max_reuse')} times already"}
        counts = "; ".join(f"{k} {v}: {why[k]}" for k, v in sorted(self.reasons.items(), key=lambda kv: -kv[1]))
        return f"every one of {n} candidates was refused before selection ({counts}); nothing to train"


def summarise(results: dict) -> dict:
    """The record's numbers from the record steps' results (over every candidate of the run), and
    the selected rows per input shard (filename -> rows)."""
    counts = results["counts"].to_pylist()  # per (reason, selected, a selected row's shard): n, tokens
    values = results["variances"]
    selected = values.column("selected").to_numpy(zero_copy_only=False).astype(bool)
    after = values.column("after").to_numpy(zero_copy_only=False)[selected]
    reasons: dict[str, int] = {}
    files: dict[str, int] = {}
    for r in counts:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + int(r["n"])
        if r["selected"]:
            files[r["filename"]] = files.get(r["filename"], 0) + int(r["n"])
    return {
        "n_candidates": sum(int(r["n"]) for r in counts),
        "n_selected": sum(int(r["n"]) for r in counts if r["selected"]),
        "tokens_candidate": sum(int(r["tokens"]) for r in counts),
        "tokens_selected": sum(int(r["tokens"]) for r in counts if r["selected"]),
        "adv_var_before": exact_var_pop(values.column("before").to_numpy(zero_copy_only=False)),
        "adv_var_after": exact_var_pop(after),
        "reasons": dict(sorted(reasons.items(), key=lambda kv: (kv[0] is None, kv[0] or ""))),
        "selected_files": files,
    }


def exact_var_pop(values: np.ndarray) -> float | None:
    """Population variance with exactly rounded sums: the same float whatever the order of values."""
    values = values[~np.isnan(values)] if values.dtype.kind == "f" else values.astype(np.float64)
    if len(values) == 0:
        return None
    mean = math.fsum(values) / len(values)
    return math.fsum((values - mean) ** 2) / len(values)


def new_record(plan: Plan, curation_id: str, snapshot_seq: int, summary: dict, values: dict) -> dict:
    """The curation's record from its summary and the run's final values (threshold, tokens kept)."""
    p = plan.params
    threshold = values.get("threshold")
    return {
        "curation_id": curation_id,
        "created_at": dt.datetime.now(dt.timezone.utc),
        "recipe": plan.recipe,
        "params": p.to_json(),
        "sql_sha256": plan.sha256(),
        "snapshot_seq": snapshot_seq,
        "progress": float(p["progress"]),
        "sample_budget": plan.sample_budget(summary["n_selected"]),
        "token_fraction": None if p.kappa is None else float(p.kappa),
        "token_threshold": threshold[0] if threshold else None,
        "n_candidates": summary["n_candidates"],
        "n_selected": summary["n_selected"],
        "tokens_candidate": summary["tokens_candidate"],
        "tokens_kept": int(values["tokens_kept"]),
        "adv_var_before": summary["adv_var_before"],
        "adv_var_after": summary["adv_var_after"],
        "old_logprobs_fallback": None,  # counted while the curated rows are materialised
        "output_files": "[]",
    }
