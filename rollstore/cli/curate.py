"""`rollstore curate`: run a recipe, print its summary (the audit is read back by rollstore/report/audit.py).

Invariants: `curate` prints the curation id alone on the last line of stdout.
"""

from __future__ import annotations

import json

from rich.console import Console

from rollstore.curate.params import parse_sets
from rollstore.curate.run import CurationResult
from rollstore.storage.errors import RollstoreError


def curation_values(sets: list[str], progress: str | None) -> dict[str, str]:
    """The parameter overrides of `rollstore curate`: its --set values and --progress."""
    values = parse_sets(sets)
    if progress is not None:
        if "progress" in values:
            raise RollstoreError("parameter 'progress' given twice (--progress and --set progress=...)")
        values["progress"] = progress
    return values


def print_summary(result: CurationResult, out: Console) -> None:
    r = result.record

    def fmt(x):
        return "null" if x is None else f"{x:.6g}"

    reasons = ", ".join(f"{k} {v}" for k, v in sorted(result.reasons.items(), key=lambda kv: -kv[1]))
    kept_pct = 100.0 * r["tokens_kept"] / r["tokens_candidate"] if r["tokens_candidate"] else 0.0
    params = json.loads(r["params"])
    lines = [
        f"recipe        {r['recipe']}  (snapshot {r['snapshot_seq']}, progress {r['progress']:g})",
        f"batch         where {params['where']}  (current_version {params['current_version']})",
        f"candidates    {r['n_candidates']}  ({reasons})",
        f"kept samples  {r['n_selected']}" + (f"  (budget {r['sample_budget']})" if r["sample_budget"] is not None else ""),
        f"kept tokens   {r['tokens_kept']} of {r['tokens_candidate']} ({kept_pct:.1f}%)"
        + (f"  κ={r['token_fraction']:g} (K = ⌈κ·N⌉ = {r['tokens_kept']}, kept exactly), threshold "
           f"{fmt(r['token_threshold'])}" if r["token_fraction"] is not None else ""),
        f"Var(A)        before {fmt(r['adv_var_before'])}  after {fmt(r['adv_var_after'])}",
    ]
    if r["old_logprobs_fallback"]:
        lines.append(f"note          {r['old_logprobs_fallback']} curated rows use gen_logprobs (no old_logprobs)")
    if result.already_existed:
        lines.append("note          identical curation already committed; nothing new written")
    elif not result.committed:
        lines.append("note          dry run: nothing committed, no curated shards (token ids and log-probs not read)")
    for line in lines:
        out.print(line, highlight=False, markup=False)
    print(result.curation_id, flush=True)
