"""`rollstore curate` and `rollstore audit`: run a recipe, print its summary; read the audit back.

Invariants: `curate` prints the curation id alone on the last line of stdout; the audit views are
plain SQL over the `selections`, `curated` and `rollouts` tables (queries/audit_*.sql).
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from curate.params import load_recipe, parse_sets
from curate.run import CurationResult, curate
from queries import load_sql
from queries.session import Session
from rollstore.output import render_table
from storage.buffer import Buffer
from storage.errors import RollstoreError


def run_curate(buf: Buffer, recipe: str, sets: list[str], progress: str | None, snapshot: int | None,
               dry_run: bool, memory_limit: str) -> CurationResult:
    values = parse_sets(sets)
    if progress is not None:
        if "progress" in values:
            raise RollstoreError("parameter 'progress' given twice (--progress and --set progress=...)")
        values["progress"] = progress
    return curate(buf, load_recipe(recipe), values, snapshot_seq=snapshot, commit=not dry_run,
                  memory_limit=memory_limit)


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
        lines.append("note          dry run: nothing committed")
    for line in lines:
        out.print(line, highlight=False, markup=False)
    print(result.curation_id, flush=True)


def latest_curation(session: Session) -> str:
    row = session.one("SELECT curation_id FROM curations ORDER BY created_at DESC, curation_id DESC LIMIT 1")
    if row is None:
        raise RollstoreError("the buffer has no curations yet: run `rollstore curate` first")
    return row[0]


def run_audit(buf: Buffer, curation_id: str | None, rollout_id: str | None, out: Console) -> None:
    with buf.snapshot(pin=True) as snap, Session(snap) as s:
        cid = curation_id or latest_curation(s)
        rec = s.one("SELECT recipe, params, n_candidates, n_selected FROM curations WHERE curation_id = $c",
                        {"c": cid})
        if rec is None:
            raise RollstoreError(f"no curation {cid!r} in this buffer")
        if rollout_id:
            tokens = s.con.sql(load_sql("audit_rollout"), params={"curation_id": cid, "rollout_id": rollout_id}).to_arrow_table()
            if tokens.num_rows == 0:
                raise RollstoreError(f"rollout {rollout_id!r} is not a candidate of curation {cid}")
            row = s.one(
                "SELECT s.reason, s.advantage_final, r.response FROM selections s JOIN rollouts r USING (rollout_id) "
                "WHERE s.curation_id = $c AND s.rollout_id = $r", {"c": cid, "r": rollout_id})
            out.print(f"curation {cid}  rollout {rollout_id}  reason {row[0]}  advantage_final {row[1]}", highlight=False)
            out.print(render_marked(row[2], tokens.to_pylist()))
            render_table(tokens, out, title="tokens (kept = in the loss)")
            return
        out.print(f"curation {cid}  recipe {rec[0]}  candidates {rec[2]}  selected {rec[3]}", highlight=False)
        out.print(f"params {rec[1]}", highlight=False, markup=False)
        render_table(s.con.sql(load_sql("audit_reasons"), params={"curation_id": cid}).to_arrow_table(), out, "reasons")
        render_table(s.con.sql(load_sql("audit_bands"), params={"curation_id": cid}).to_arrow_table(), out, "keep rate by difficulty band")


def render_marked(response: str, tokens: list[dict]) -> Text:
    """The response with kept tokens in bold green and dropped ones dim. Token i is character i
    when the text has one character per token (character-level policies); otherwise token ids."""
    text = Text()
    per_char = len(response) in (len(tokens), len(tokens) - 1)
    for i, tok in enumerate(tokens):
        piece = (response[i] if i < len(response) else "⏎") if per_char else f"[{tok['token_id']}]"
        text.append(piece, style="bold green" if tok["kept"] else "dim")
    return text
