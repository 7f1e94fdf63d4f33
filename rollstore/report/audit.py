"""`rollstore audit`: a curation's audit, one rollout's tokens, or two curations side by side, as a
table, JSON or CSV.

Invariants:
- Every view is the result of one SQL file of `queries/` (`audit_reasons`, `audit_bands`, `audit_replay`,
  `audit_rollout`, `audit_compare_summary`, `audit_compare_reasons`, `audit_compare_rows`) run
  over one pinned snapshot; the formats only render those rows (plus, in compare mode, the
  parameters whose effective values differ, read from the two `curations.params` records).
- `--format json` prints one JSON object: the record(s) of the curation(s) under `curation` (or `a`
  and `b`) and each view as an array of row objects (lists as arrays, NULL as null).
- `--format csv` prints one header line then rows: a leading `view` column names the view each row
  belongs to, and the columns are the union of the views' columns (empty where a view has none).
- Compare mode matches candidates by rollout_id; a rollout that is a candidate of only one side has
  a null reason on the other side.
"""

from __future__ import annotations

import json
import sys

import pyarrow as pa
from rich.console import Console
from rich.text import Text

from rollstore.queries import load_sql
from rollstore.queries.session import Session
from rollstore.report.partial import partial_session
from rollstore.output.formats import csv_ready, csv_text, jsonable, render_table
from rollstore.report.token_text import TokenText
from rollstore.storage.buffer import Buffer
from rollstore.storage.errors import RollstoreError, unknown_curation

FORMATS = ("table", "json", "csv")
RECORD_FIELDS = ("curation_id", "recipe", "snapshot_seq", "progress", "n_candidates", "n_selected", "sample_budget",
                 "token_fraction", "token_threshold", "tokens_candidate", "tokens_kept", "adv_var_before",
                 "adv_var_after", "params")
TABLE_ROWS = 50  # rows of the compare differences printed in table format



def latest_curation(session: Session) -> str:
    row = session.one("SELECT curation_id FROM curations ORDER BY created_at DESC, curation_id DESC LIMIT 1")
    if row is None:
        raise RollstoreError("the buffer has no curations yet: run `rollstore curate` first")
    return row[0]


def render_marked(response: str, tokens: list[dict], text: TokenText) -> Text:
    """The response with kept tokens in bold green and dropped ones dim, each token shown as
    `TokenText` shows it (the report's rule)."""
    pieces, _ = text.pieces(response, [t["token_id"] for t in tokens], len(tokens))
    out = Text()
    for piece, tok in zip(pieces, tokens):
        out.append(piece, style="bold green" if tok["kept"] else "dim")
    return out


def record(session: Session, cid: str) -> dict:
    cols = ", ".join(RECORD_FIELDS)
    row = session.one(f"SELECT {cols} FROM curations WHERE curation_id = $c", {"c": cid})
    if row is None:
        known = [r[0] for r in session.execute("SELECT curation_id FROM curations").fetchall()]
        raise unknown_curation(session.root, cid, known)
    rec = dict(zip(RECORD_FIELDS, row))
    rec["params"] = json.loads(rec["params"])
    return jsonable(rec)


def view(session: Session, name: str, params: dict) -> pa.Table:
    return session.con.sql(load_sql(name), params=params).to_arrow_table()


def _text(v) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def params_diff(a: dict, b: dict) -> pa.Table:
    """The parameters whose effective values differ: words as written, numbers and null as JSON."""
    text = _text

    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return pa.table({"parameter": pa.array(keys, pa.string()),
                     "a": pa.array([text(a.get(k)) for k in keys], pa.string()),
                     "b": pa.array([text(b.get(k)) for k in keys], pa.string())})


def training(session: Session, cid: str) -> dict:
    """How curation `cid` was trained (queries/audit_training.sql), as `training.NAME` entries: the
    run and version that consumed it, its optimiser steps, and the loop's settings (μ `epochs`, `lr`,
    loss, batch, pool) when a loop trained it; `training.trained: no` when nothing did."""
    row = session.table(load_sql("audit_training"), {"c": cid}).to_pylist()
    if not row:
        return {"training.trained": "no"}
    r = row[0]
    out = {"training.run_id": r["run_id"], "training.version": r["version"],
           "training.optimiser_steps": r["optimiser_steps"]}
    settings = json.loads(r["settings"] or "{}")
    for k in ("epochs", "lr", "loss", "prompts_per_iter", "group_size", "pool_size", "recipe"):
        if k in settings:
            out[f"training.{k}"] = settings[k]
    return out


def compare_views(session: Session, a: str, b: str) -> list[tuple[str, pa.Table]]:
    """The five views of `--compare`: summary (one row per side), params (the curation parameters
    that differ), training (how each was trained: every `training.*` entry, the same or not),
    reasons (candidates by reason in A and B), differences (rollouts treated differently)."""
    rec_a, rec_b = record(session, a), record(session, b)
    params = {"a": a, "b": b}
    train_a, train_b = training(session, a), training(session, b)
    trained = sorted(set(train_a) | set(train_b))
    both = pa.table({"parameter": trained,
                     "a": [_text(train_a.get(k)) for k in trained], "b": [_text(train_b.get(k)) for k in trained]},
                    schema=pa.schema([("parameter", pa.string()), ("a", pa.string()), ("b", pa.string())]))
    return [
        ("summary", view(session, "audit_compare_summary", params)),
        ("params", params_diff(rec_a["params"], rec_b["params"])),
        ("training", both),
        ("reasons", view(session, "audit_compare_reasons", params)),
        ("differences", view(session, "audit_compare_rows", params)),
    ]


# The most rollout ids one `why` call answers (`Curation.why(ids)`): one query; past it, split the list.
MAX_WHY_IDS = 10_000


def why_rows(session: Session, cid: str, rollout_ids: list[str]) -> tuple[list[dict], float | None]:
    """Why each of `rollout_ids` was kept or dropped by `cid`, in one query (queries/audit_why.sql:
    reason, rank in its selection pool, budget, which block of the order was kept, the side the row
    fell on, prompt, gold answer), in the order given, and the curation's token threshold. More
    than MAX_WHY_IDS ids, or an id that is not a candidate, is refused with one line."""
    ids = list(dict.fromkeys(rollout_ids))
    if len(ids) > MAX_WHY_IDS:
        raise RollstoreError(f"why: {len(ids)} rollout ids in one call; at most {MAX_WHY_IDS:,} (split the list)")
    if not all(isinstance(r, str) for r in ids):
        bad = next(r for r in ids if not isinstance(r, str))
        raise RollstoreError(f"why: rollout ids are strings, not {type(bad).__name__} ({bad!r})")
    rec = record(session, cid)
    sample = rec["params"].get("sample")
    rows = view(session, "audit_why", {"curation_id": cid, "rollout_ids": ids,
                                       "by_group": sample in ("in_group", "pods"),
                                       "by_reward": sample == "pods"}).to_pylist()
    found = {r["rollout_id"]: r for r in rows}
    missing = [r for r in ids if r not in found]
    if missing:
        raise RollstoreError(f"rollout {missing[0]!r} is not a candidate of curation {cid}"
                             + (f" (nor are {len(missing) - 1} more of the {len(ids)} ids)" if len(missing) > 1 else ""))
    return [jsonable(found[r]) for r in ids], rec["token_threshold"]


def why_sentence(row: dict, threshold: float | None = None) -> str:
    """One row of `why_rows` as one plain sentence: the reason, and which side of the cut-off the row
    fell on (the kept top block, the kept bottom block, or the dropped middle), with the ranks each
    block covers; then the tokens kept."""
    def num(v) -> str:
        return "null" if v is None else f"{v:.4g}"

    rid, reason = row["rollout_id"], row["reason"]
    tokens = (f"; {row['tokens_kept']} of {row['tokens_total']} tokens kept"
              + (f" (score threshold {num(threshold)})" if threshold is not None and row["selected"] else "")
              if row.get("tokens_total") is not None else "")
    if row["pool_position"] is None:
        return (f"{rid}: {reason}, refused before sample selection (age {row['age']}, advantage_final "
                f"{num(row['advantage_final'])}){tokens}.")
    k, n, j, b = row["pool_position"], row["pool_size"], row["top_kept"], row["bottom_from"]
    value = f"value {num(row['selection_value'])} ranks {k} of {n} in its pool (by value, highest first)"
    if row["side"] == "whole pool":
        return f"{rid}: {reason}; {value}, and the pool kept all {n} rows{tokens}."
    blocks = " and ".join(x for x in (
        f"ranks 1–{j} (value ≥ {num(row['keep_at_or_above'])})" if j else "",
        f"ranks {b}–{n} (value ≤ {num(row['keep_at_or_below'])})" if b is not None else "") if x)
    dropped_to = (b - 1) if b is not None else n
    where = {"top": "inside the kept top block", "bottom": "inside the kept bottom block",
             "middle": f"in the dropped middle (ranks {j + 1}–{dropped_to})"}[row["side"]]
    return (f"{rid}: {reason}; {value}: {where}. The pool kept its budget of {row['budget']} rows, {blocks} — the "
            f"max-variance subset keeps both ends of the order, ties by rollout_id{tokens}.")


def why_views(session: Session, cid: str, rollout_id: str) -> tuple[dict, pa.Table, float | None]:
    """Why `rollout_id` was kept or dropped by `cid`: its row of `why_rows`, its tokens
    (audit_rollout.sql) and the curation's token threshold. A rollout that is not a candidate is one line."""
    rows, threshold = why_rows(session, cid, [rollout_id])
    tokens = view(session, "audit_rollout", {"curation_id": cid, "rollout_id": rollout_id})
    return rows[0], tokens, threshold


# ---- output -----------------------------------------------------------------------------------


def write_json(head: dict, views: list[tuple[str, pa.Table]]) -> None:
    doc = dict(head)
    for name, table in views:
        doc[name] = [jsonable(r) for r in table.to_pylist()]
    sys.stdout.write(json.dumps(doc, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def write_csv(views: list[tuple[str, pa.Table]]) -> None:
    parts = []
    for name, table in views:
        table = csv_ready(table)  # lists and structs as JSON text
        parts.append(table.add_column(0, "view", pa.array([name] * table.num_rows, pa.string())))
    merged = pa.concat_tables(parts, promote_options="permissive")
    sys.stdout.write(csv_text(merged))
    sys.stdout.flush()


def emit(fmt: str, head: dict, views: list[tuple[str, pa.Table]], table_fn) -> None:
    if fmt == "json":
        write_json(head, views)
    elif fmt == "csv":
        write_csv(views)
    else:
        table_fn()


# ---- the three modes --------------------------------------------------------------------------


def audit_one(s: Session, cid: str, fmt: str, out: Console) -> None:
    rec = record(s, cid)
    views = [("reasons", view(s, "audit_reasons", {"curation_id": cid})),
             ("bands", view(s, "audit_bands", {"curation_id": cid})),
             ("replay", view(s, "audit_replay", {"curation_id": cid}))]

    def as_table():
        out.print(f"curation {cid}  recipe {rec['recipe']}  candidates {rec['n_candidates']}  "
                  f"selected {rec['n_selected']}", highlight=False, markup=False)
        out.print(f"params {json.dumps(rec['params'])}", highlight=False, markup=False)
        render_table(views[0][1], out, "reasons")
        render_table(views[1][1], out, "keep rate by difficulty band")
        render_table(views[2][1], out, "fresh and replayed rows by age (policy versions)")

    emit(fmt, {"curation": rec}, views, as_table)


def audit_rollout(s: Session, cid: str, rollout_id: str, fmt: str, out: Console) -> None:
    why, tokens, threshold = why_views(s, cid, rollout_id)
    head = {"curation_id": cid, "rollout_id": rollout_id, **{k: why[k] for k in WHY_FIELDS},
            "token_threshold": threshold}
    reason, adv, response = why["reason"], why["advantage_final"], why["response"]

    def as_table():
        out.print(f"curation {cid}  rollout {rollout_id}  reason {reason}  advantage_final {adv}", highlight=False, markup=False)
        out.print(f"prompt {why['prompt']!r}  gold answer {why['gold_answer']!r}  reward {why['reward']}",
                  highlight=False, markup=False)
        out.print(why_sentence(why, threshold), highlight=False, markup=False, soft_wrap=True)
        out.print(render_marked(response, tokens.to_pylist(), TokenText.for_snapshot(s)))
        render_table(tokens, out, title="tokens (kept = in the loss)")

    emit(fmt, jsonable(head), [("tokens", tokens)], as_table)


# The fields of queries/audit_why.sql that `--rollout` shows (json: in the head object).
WHY_FIELDS = ("reason", "selected", "advantage_final", "selection_value", "pool_position", "pool_size", "budget",
              "top_kept", "bottom_from", "side", "keep_at_or_above", "keep_at_or_below", "prompt", "gold_answer",
              "response", "reward")


def audit_compare(s: Session, a: str, b: str, fmt: str, out: Console) -> None:
    rec_a, rec_b = record(s, a), record(s, b)
    views = compare_views(s, a, b)
    summary = views[0][1]

    def as_table():
        same = rec_a["snapshot_seq"] == rec_b["snapshot_seq"]
        out.print(f"A {a} ({rec_a['recipe']})  vs  B {b} ({rec_b['recipe']})", highlight=False, markup=False)
        out.print(f"snapshot {rec_a['snapshot_seq']}" if same else
                  f"note: different snapshots (A {rec_a['snapshot_seq']}, B {rec_b['snapshot_seq']}): "
                  "candidates may differ, not only the recipe", highlight=False)
        rows = summary.to_pylist()
        side = {r["side"]: r for r in rows}
        fields = [c for c in summary.column_names if c != "side"]
        render_table(pa.table({"": fields, "A": [_cell(side.get("A", {}).get(f)) for f in fields],
                               "B": [_cell(side.get("B", {}).get(f)) for f in fields]}), out, "side by side")
        render_table(views[1][1], out, "parameters that differ")
        render_table(views[2][1], out, "how each was trained (the checkpoint that consumed it; the loop's settings)")
        render_table(views[3][1], out, "candidates by reason in A and in B")
        diff = views[4][1]
        if not any(r.get("common_candidates") for r in rows):
            out.print("note: no candidate in common (other batches or runs): every kept row differs; the rows are in "
                      "--format csv or json. Two runs compare with `rollstore compare BUFFER RUN_A RUN_B`.",
                      highlight=False, markup=False, soft_wrap=True)
            return
        shown = diff.select(["kind", "rollout_id", "reason_a", "reason_b", "advantage_a", "advantage_b",
                             "tokens_kept_a", "tokens_kept_b", "tokens_total"])
        render_table(shown.slice(0, TABLE_ROWS), out, "rollouts treated differently (a_only: kept by A only)")
        if diff.num_rows > TABLE_ROWS:
            out.print(f"({diff.num_rows} rows, first {TABLE_ROWS} shown; --format csv or json for all)",
                      highlight=False)

    emit(fmt, {"a": rec_a, "b": rec_b}, views, as_table)


def audit_skips(s: Session, run_id: str | None, fmt: str, out: Console) -> None:
    """Pre-rollout prompt selection of one run, per step (queries/audit_skips.sql)."""
    from rollstore.queries import load_sql, render

    runs = [r[0] for r in s.execute("SELECT DISTINCT run_id FROM prompt_selections ORDER BY run_id").fetchall()]
    if run_id is None:
        if len(runs) != 1:
            raise RollstoreError("no run has pre-rollout prompt selections in this buffer" if not runs else
                                 f"--skips: {len(runs)} runs have prompt selections ({', '.join(runs[:5])}"
                                 f"{', ...' if len(runs) > 5 else ''}): name one with --run")
        run_id = runs[0]
    elif run_id not in runs:
        raise RollstoreError(f"--run {run_id!r}: no pre-rollout prompt selection recorded for this run")
    steps = s.table(render("audit_skips", {"outcomes": load_sql("prompt_skip_outcomes")}), {"run": run_id})
    views = [("steps", steps)]

    def as_table():
        total = sum(steps.column("examined").to_pylist())
        skipped = sum(steps.column("skipped").to_pylist())
        later = sum(steps.column("later_sampled").to_pylist())
        wrong = sum(steps.column("later_informative").to_pylist())
        out.print(f"run {run_id}: {total} prompts examined, {skipped} skipped; {later} skipped prompts generated "
                  f"again later, {wrong} of those groups informative", highlight=False, markup=False)
        render_table(steps, out, "pre-rollout prompt selection by step")

    emit(fmt, {"run": run_id}, views, as_table)


def _cell(v) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def run_audit(buf: Buffer, curation_id: str | None, rollout_id: str | None, out: Console, fmt: str = "table",
              compare: str | None = None, skips: bool = False, run_id: str | None = None) -> None:
    if fmt not in FORMATS:
        raise RollstoreError(f"--format must be table, json or csv, not {fmt!r}")
    if skips or run_id is not None:
        if curation_id is not None or rollout_id is not None or compare is not None:
            raise RollstoreError("--skips shows a run's prompt selection: it takes --run, not a curation, --rollout "
                                 "or --compare")
        with buf.snapshot(pin=True) as snap, Session(snap) as s:
            audit_skips(s, run_id, fmt, out)
        return
    if compare is not None and rollout_id is not None:
        raise RollstoreError("--compare and --rollout cannot be used together")
    with buf.snapshot(pin=True) as snap:
        if compare is None and rollout_id is None:
            audit_latest_or_one(snap, curation_id, fmt, out)
            return
        with Session(snap) as s:
            cid = curation_id or latest_curation(s)
            record(s, cid)  # an unknown id is one line naming it, in every mode
            if compare is not None:
                audit_compare(s, cid, compare, fmt, out)
            else:
                audit_rollout(s, cid, rollout_id, fmt, out)


def audit_latest_or_one(snap, curation_id: str | None, fmt: str, out: Console) -> None:
    """`rollstore audit BUFFER [CURATION]`: the curation's record and audit views, read from its own
    shards (`partial_session`: its record and audit shards, by their catalog key) and, to find the
    latest curation when none is named, the `curations` table alone; the buffer's other tables and
    the other curations' audits are not opened, so the cost does not grow with the history."""
    if curation_id is None:
        with partial_session(snap, ["curations"]) as s:
            curation_id = latest_curation(s)
    with partial_session(snap, ["curations", "selections"], keys=[curation_id]) as s:
        if s.one("SELECT count(*) FROM curations WHERE curation_id = $c", {"c": curation_id})[0] == 0:
            with partial_session(snap, ["curations"]) as every:
                record(every, curation_id)  # the one line naming it (with every known id)
        audit_one(s, curation_id, fmt, out)
