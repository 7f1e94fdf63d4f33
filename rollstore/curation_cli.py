"""`rollstore curate` and `rollstore audit`: run a recipe, print its summary; read the audit back.

Invariants: `curate` prints the curation id alone on the last line of stdout; the audit views are
plain SQL over the `selections`, `curated` and `rollouts` tables (queries/audit_*.sql, rollstore/audit.py).
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from curate.params import load_recipe, parse_sets
from curate.run import CurationResult, curate
from queries.session import Session
from storage.buffer import Buffer
from storage.errors import RollstoreError


def run_curate(buf: Buffer, recipe: str, sets: list[str], progress: str | None, snapshot: int | None,
               dry_run: bool, memory_limit: str, engine: str = "embedded", scheduler: str | None = None,
               partitions: int | None = None, timeout: float | None = None) -> CurationResult:
    values = parse_sets(sets)
    if progress is not None:
        if "progress" in values:
            raise RollstoreError("parameter 'progress' given twice (--progress and --set progress=...)")
        values["progress"] = progress
    return curate(buf, load_recipe(recipe), values, snapshot_seq=snapshot, dry_run=dry_run,
                  memory_limit=memory_limit, engine=engine, scheduler=scheduler, partitions=partitions,
                  timeout=timeout)


def print_summary(result: CurationResult, out: Console) -> None:
    r = result.record

    def fmt(x):
        return "null" if x is None else f"{x:.6g}"

    reasons = ", ".join(f"{k} {v}" for k, v in sorted(result.reasons.items(), key=lambda kv: -kv[1]))
    kept_pct = 100.0 * r["tokens_kept"] / r["tokens_candidate"] if r["tokens_candidate"] else 0.0
    lines = [
        f"recipe        {r['recipe']}  (snapshot {r['snapshot_seq']}, progress {r['progress']:g})",
        f"candidates    {r['n_candidates']}  ({reasons})",
        f"kept samples  {r['n_selected']}" + (f"  (budget {r['sample_budget']})" if r["sample_budget"] is not None else ""),
        f"kept tokens   {r['tokens_kept']} of {r['tokens_candidate']} ({kept_pct:.1f}%)"
        + (f"  κ={r['token_fraction']:g}, threshold {fmt(r['token_threshold'])}" if r["token_fraction"] is not None else ""),
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


def latest_curation(session: Session) -> str:
    row = session.one("SELECT curation_id FROM curations ORDER BY created_at DESC, curation_id DESC LIMIT 1")
    if row is None:
        raise RollstoreError("the buffer has no curations yet: run `rollstore curate` first")
    return row[0]


def run_audit(buf: Buffer, curation_id: str | None, rollout_id: str | None, out: Console, fmt: str = "table",
              compare: str | None = None) -> None:
    """The audit views (rollstore/audit.py): one curation, one rollout's tokens, or two curations."""
    from rollstore.audit import run_audit as run

    run(buf, curation_id, rollout_id, out, fmt, compare)


def render_marked(response: str, tokens: list[dict]) -> Text:
    """The response with kept tokens in bold green and dropped ones dim. Token i is character i
    when the text has one character per token (character-level policies); otherwise token ids."""
    text = Text()
    per_char = len(response) in (len(tokens), len(tokens) - 1)
    for i, tok in enumerate(tokens):
        piece = (response[i] if i < len(response) else "⏎") if per_char else f"[{tok['token_id']}]"
        text.append(piece, style="bold green" if tok["kept"] else "dim")
    return text
