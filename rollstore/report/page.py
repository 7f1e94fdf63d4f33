"""`rollstore report`: one self-contained HTML page of a buffer, built from the audit and training tables.

Invariants:
- Every number on the page is a value returned by one of the queries in `queries/report_*.sql`, run
  over ONE pinned snapshot. Beside each chart the page prints the exact SQL text that ran (its one
  parameter, `$curation_id`, bound as a literal, so the text runs as is with `rollstore sql`) and
  embeds that query's result as JSON (`<script type="application/json" id="data-report_…">`).
- The page loads nothing from anywhere: inline CSS, inline SVG charts and one inline script (which
  only records that the sections rendered, any table wider than its frame, and any script error, as
  attributes of `<html>`). It
  opens offline.
- Its size does not grow with the number of rollouts: per-token views are a fixed sample (at most
  12 rollouts × 400 tokens, chosen in SQL); everything else is aggregated in SQL (per policy
  version, step, curation, band, histogram bin). Long per-step tables are cut in the page (the JSON
  block keeps every row).
- `--curation ID` scopes the candidate-level sections (bands, advantages, tokens); without it they
  cover every curation, one block per recipe when curations of several recipes are in the buffer
  (candidates of different recipes are never pooled). The accuracy, curation timeline, replay and
  training sections always cover the whole snapshot.
- Every chart's legend names every series drawn (report_svg); a replayed row's token card is marked
  with its age.
- The output file appears atomically (written beside its target, then renamed).
- Each shard of `rollouts` (its scalar columns), `selections`, `curations` and `checkpoints` (and
  views.sql's `run_versions`) is read once per report (`READ_ONCE`: temp tables of the same names, the
  snapshot's rows, which the queries read instead of the views; report_tokens reads the `rollouts`
  view, for token lists: `rollouts_view`), and the token cards resolve only the picked curations' `curated` shards
  (`picked_masks`): the results are the printed SQL's over the views, at a cost that does not
  multiply a long history's shard count by the number of queries.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from dataclasses import dataclass
from html import escape

import pyarrow as pa

from rollstore.queries import load_sql
from rollstore.queries.session import Session
from rollstore.output.formats import jsonable
from rollstore.report.svg import (
    PALETTE,
    Series,
    fmt,
    grouped_hbars,
    histogram,
    line_chart,
    stacked_bars,
)
from rollstore.output.outfile import check_output_file, write_output
from rollstore.report.token_text import TokenText
from rollstore.storage.buffer import Buffer
from rollstore.storage.catalog_sql import CHECKPOINT_COLS
from rollstore.storage.errors import RollstoreError
from rollstore.storage.schema import CHECKPOINTS
from rollstore.storage.snapshot import Snapshot, curated_view, file_schema, rollouts_relation, sql_string

# (section id, heading): the page's sections, in order.
SECTIONS = [
    ("overview", "Buffer"),
    ("accuracy", "Accuracy and reward"),
    ("curations", "Curations"),
    ("bands", "Keep rate by difficulty band"),
    ("replay", "Replay: share and age of the rows trained"),
    ("skips", "Prompts skipped before generation"),
    ("advantages", "Advantages before and after amplification and selection"),
    ("tokens", "Selected and rejected rollouts, token by token"),
    ("training", "Training"),
]

# Query files (queries/<name>.sql) the report runs, in order.
QUERIES = [
    "report_overview",
    "report_accuracy_by_version",
    "report_accuracy_by_step",
    "report_evaluations",
    "report_curations",
    "report_bands",
    "report_replay",
    "report_prompt_skips",
    "report_advantages",
    "report_advantage_stats",
    "report_tokens",
    "report_training",
]

REASON_COLORS = {
    "selected": "#009E73",
    "not_selected": "#E69F00",
    "zero_variance": "#9a9a9a",
    "invalid": "#D55E00",
    "truncated": "#CC79A7",
    "stale": "#0072B2",
    "reused": "#56B4E9",
}
SERIES_COLORS = {"raw": "#7f7f7f", "pool": "#0072B2", "selected": "#009E73"}
MAX_TABLE_ROWS = 200


# The candidate-level queries: scoped to `--curation`, else run once per recipe when the buffer
# holds curations of several recipes (never pooled across recipes), else over every curation.
SCOPED = ("report_bands", "report_advantages", "report_advantage_stats", "report_tokens")


@dataclass
class Result:
    name: str
    sql: str  # the exact text that ran
    rows: list[dict]
    key: str = ""  # the page's id of this result (data-<key>): the name, with a suffix per recipe scope

    def __post_init__(self):
        self.key = self.key or self.name


@dataclass(frozen=True)
class Scope:
    """One block of the candidate-level sections: every curation in scope (`recipe` None) or the
    curations of one recipe; `suffix` makes its results' keys unique on the page."""

    recipe: str | None = None
    suffix: str = ""
    curations: int = 0


@dataclass
class ReportInfo:
    path: str
    bytes: int
    seconds: float
    snapshot_seq: int
    curation_id: str | None


def with_literals(sql: str, params: dict) -> str:
    """`sql` with each `$name` replaced by the SQL literal of params[name] (NULL for None)."""

    def literal(m: re.Match) -> str:
        v = params[m.group(1)]
        if v is None:
            return "NULL"
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return repr(v)
        return sql_string(str(v))

    return re.sub(r"\$([A-Za-z_][A-Za-z0-9_]*)", literal, sql)


def run_query(session: Session, name: str, curation_id: str | None, scope: Scope = Scope()) -> Result:
    sql = with_literals(load_sql(name), {"curation_id": curation_id, "recipe": scope.recipe})
    with token_sources(session, sql) if name == "report_tokens" else contextlib.nullcontext():
        rows = [jsonable(r) for r in session.con.sql(sql).to_arrow_table().to_pylist()]
    return Result(name, sql, rows, name + scope.suffix)


@contextlib.contextmanager
def token_sources(session: Session, sql: str):
    """What report_tokens reads, while it runs: the `rollouts` view, not the `READ_ONCE` table
    (`rollouts_view`), then narrowed to its picks' shards, with their curated masks (`picked_masks`,
    which makes its temp view `rollouts` once the table is set aside)."""
    with rollouts_view(session), picked_masks(session, sql):
        yield


ROLLOUTS_ONCE = "_rollouts_read_once"  # the `READ_ONCE` rollouts table's name while a query reads the view


@contextlib.contextmanager
def rollouts_view(session: Session):
    """While a query that reads rollouts' token lists runs (report_tokens: a handful of rows): the
    `READ_ONCE` temp table of `rollouts`, which holds its scalar columns only, is set aside, so that
    `rollouts` names the view over the files again."""
    loaded = "rollouts" in session.temp_tables()
    if loaded:
        session.con.execute(f'ALTER TABLE temp.main.rollouts RENAME TO "{ROLLOUTS_ONCE}"')
    try:
        yield
    finally:
        if loaded:
            session.con.execute(f'ALTER TABLE temp.main."{ROLLOUTS_ONCE}" RENAME TO rollouts')


PICKED = "-- The picked rows with their rollouts and curated masks:"  # where report_tokens.sql's picks end


@contextlib.contextmanager
def picked_masks(session: Session, sql: str):
    """While report_tokens runs: a temp view `curated` over the curated shards (by catalog key) of the
    curations of its picked rows only, the only rows its `LEFT JOIN curated` can match, resolved
    against the rollouts shards those shards refer to (followed through compaction's moves) only: the
    same masks come out without resolving every curated row of the snapshot against every rollouts
    shard."""
    snap = session.snapshot
    if not isinstance(snap, Snapshot) or PICKED not in sql:  # a session over a listing: the view as it is
        yield
        return
    picks = session.con.sql(sql.split(PICKED)[0] + "SELECT DISTINCT curation_id, rollout_id FROM picks").fetchall()
    wanted = {cid for cid, _ in picks}
    holding = picked_rollouts(snap, sorted({rid for _, rid in picks}))
    shards = [s for s in snap.shards("curated") if s.key is None or s.key in wanted]
    files = [os.path.join(snap.root, s.path) for s in shards]
    view = (curated_view(files, referred_rollouts(snap, files), snap.root, bool(snap.moves())) if files
            else "SELECT * FROM main.curated WHERE false")
    session.con.execute(f"CREATE OR REPLACE TEMP VIEW curated AS {view}")
    if holding is not None:
        session.con.execute(f"CREATE OR REPLACE TEMP VIEW rollouts AS SELECT * FROM "
                            f"{rollouts_relation(holding, union_by_name=True)}" if holding else
                            "CREATE OR REPLACE TEMP VIEW rollouts AS SELECT * FROM main.rollouts WHERE false")
    try:
        yield
    finally:
        session.con.execute("DROP VIEW IF EXISTS temp.curated")
        session.con.execute("DROP VIEW IF EXISTS temp.rollouts")


def picked_rollouts(snap: Snapshot, rollout_ids: list[str]) -> list[str] | None:
    """The snapshot's rollouts files that hold the picked `rollout_ids` (the catalog's `rollout_ids`,
    kept as compaction moves rows): the only rows report_tokens' `JOIN rollouts` can match, rollout
    ids being unique in a buffer. None (read the whole view) when one of them is in no live shard or
    in one the snapshot does not see (an older snapshot, a quarantined shard)."""
    if not rollout_ids:
        return []
    held = snap.rollout_shards(rollout_ids)
    paths = {s.shard_id: s.path for s in snap.shards("rollouts")}
    if len(held) < len(rollout_ids) or not set(held.values()) <= paths.keys():
        return None
    wanted = set(held.values())
    return [os.path.join(snap.root, p) for i, p in paths.items() if i in wanted]


def referred_rollouts(snap: Snapshot, curated_files: list[str]) -> list[str]:
    """The snapshot's rollouts files that the thin curated shards `curated_files` refer to, each
    reference followed through compaction's moves (`Snapshot.moves`), in snapshot order: the only
    rollouts rows those shards' `curated_view` can join (a reference to no live shard joins none)."""
    import pyarrow.parquet as pq

    named = set()
    for f in curated_files:
        if "rollouts_shard" in file_schema(f).names:  # thin; a materialised shard refers to nothing
            named.update(pq.read_table(f, columns=["rollouts_shard"]).column(0).unique().to_pylist())
    moves = snap.moves()
    at = {moves[p][0] if p in moves else p for p in named}
    return [os.path.join(snap.root, s.path) for s in snap.shards("rollouts") if s.path in at]


def scopes(session: Session, curation_id: str | None) -> list[Scope]:
    """The blocks of the candidate-level sections: one, unless no curation is focused and the
    buffer holds curations of several recipes: then one per recipe, in the order they first ran."""
    if curation_id is not None:
        return [Scope()]
    recipes = session.execute("SELECT recipe, count(*) FROM curations GROUP BY recipe "
                              "ORDER BY min(created_at), recipe").fetchall()
    if len(recipes) <= 1:
        return [Scope()]
    return [Scope(recipe, f"__{i}", n) for i, (recipe, n) in enumerate(recipes, 1)]


# Tables (and views.sql's `run_versions`) several report queries read: each is loaded once into a temp table of the same name (its
# columns that the queries use), which the queries then read instead of the view (DuckDB looks a name
# up in the temp catalog first). The rows are the snapshot's, so every result is the one the printed
# SQL gives over the views; but the shards are opened once per report, not once per query (a long
# run holds one `selections`, `curations` and `checkpoints` shard per step, thousands of small files).
READ_ONCE = {
    # rollouts' scalar columns the accuracy, overview and run-version queries read (the token lists
    # stay in the files: report_tokens reads the view, `rollouts_view`)
    "rollouts": ("run_id", "step", "policy_version", "group_id", "prompt_id", "correct", "reward", "response_length"),
    "selections": ("curation_id", "rollout_id", "selected", "reason", "group_accuracy", "difficulty", "advantage_raw",
                   "amplification", "advantage_final", "tokens_total", "tokens_kept", "replayed", "age"),
    "curations": ("curation_id", "recipe", "created_at", "snapshot_seq", "progress", "n_candidates", "n_selected",
                  "sample_budget", "token_fraction", "token_threshold", "tokens_candidate", "tokens_kept",
                  "adv_var_before", "adv_var_after"),
    "checkpoints": ("run_id", "version", "path"),
    "run_versions": ("run_id", "policy_version", "run_version"),  # views.sql's view (reads every rollouts shard)
}


def read_once(session: Session, checkpoints: pa.Table | None = None) -> None:
    """Load the `READ_ONCE` tables of the session's snapshot into temp tables that shadow their views;
    `checkpoints`: the snapshot's checkpoints rows already known (`indexed_checkpoints`), not read again."""
    for name, columns in READ_ONCE.items():
        if name == "checkpoints" and checkpoints is not None:
            session.load(name, checkpoints.select(list(columns)))
        else:
            session.execute(f"CREATE TEMP TABLE {name} AS SELECT {', '.join(columns)} FROM main.{name}")


def indexed_checkpoints(buf: Buffer, seq: int) -> pa.Table | None:
    """The `checkpoints` rows visible at snapshot `seq` (their `READ_ONCE` columns) as the catalog's
    checkpoint index holds them (storage.catalog_sql.CHECKPOINT_DDL: a copy of each row, written in the
    commit that publishes it), so no checkpoint shard is opened; None when a visible checkpoints shard
    has no index row (published before the index): then the files are read."""
    rows, unindexed = buf.manifest.checkpoint_index(seq)
    if unindexed:
        return None
    at = {c: CHECKPOINT_COLS.index(c) for c in READ_ONCE["checkpoints"]}
    return pa.table({c: pa.array([r[i] for r in rows], CHECKPOINTS.field(c).type) for c, i in at.items()})


def collect(session: Session, curation_id: str | None, blocks: list[Scope] | None = None) -> dict[str, Result]:
    """Every query's result (`QUERIES`; the `SCOPED` ones once per block of `scopes`, or of `blocks`)."""
    if session.one("SELECT count(*) FROM rollouts")[0] == 0:
        raise RollstoreError(f"{session.root}: the buffer has no rollouts: nothing to report "
                             "(append some with `rollstore generate` or `rollstore import`)")
    if curation_id is not None and session.one(
            "SELECT count(*) FROM curations WHERE curation_id = $c", {"c": curation_id})[0] == 0:
        n = session.one("SELECT count(*) FROM curations")[0]
        raise RollstoreError(f"no curation {curation_id!r} in this buffer ({n} curations; "
                             "`rollstore sql BUFFER \"SELECT curation_id, recipe FROM curations\"` lists them)")
    res = {}
    blocks = scopes(session, curation_id) if blocks is None else blocks
    for name in QUERIES:
        for scope in blocks if name in SCOPED else [Scope()]:
            result = run_query(session, name, curation_id, scope)
            res[result.key] = result
    return res


# ---- HTML pieces ------------------------------------------------------------------------------


def _json_block(result: Result) -> str:
    text = json.dumps(result.rows, ensure_ascii=False, separators=(",", ":"))
    # No "<" at all inside the block: neither "</script>" nor "<!--<script>" (which would make the
    # HTML parser swallow the rest of the page) can occur; JSON reads \u003c back as "<".
    text = text.replace("<", "\\u003c")
    return f'<script type="application/json" id="data-{result.key}">{text}</script>'


def sql_block(result: Result) -> str:
    return (f'<details class="sql"><summary>SQL: <code>queries/{result.name}.sql</code> '
            f"({len(result.rows)} rows)</summary><pre>{escape(result.sql.strip())}</pre></details>"
            + _json_block(result))


def table(rows: list[dict], columns: list[str], *, highlight=None, limit: int = MAX_TABLE_ROWS,
          name: str = "") -> str:
    head = "".join(f"<th>{escape(c).replace('_', '_<wbr>')}</th>" for c in columns)  # headers may wrap
    body = []
    for r in rows[:limit]:
        cls = ' class="focus"' if highlight and highlight(r) else ""
        cells = "".join(
            f'<td class="{"num" if isinstance(r.get(c), (int, float)) else "txt"}" data-col="{escape(c)}">'
            f"{escape(fmt(r.get(c)))}</td>" for c in columns)
        body.append(f"<tr{cls}>{cells}</tr>")
    note = ""
    if len(rows) > limit:
        note = (f'<p class="note">First {limit} of {len(rows)} rows; every row is in the JSON block '
                f"<code>data-{escape(name)}</code> and the query below.</p>")
    return (f'<div class="tw"><table data-query="{escape(name)}"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>{note}')


def _section(sid: str, title: str, intro: str, body: str) -> str:
    return (f'<section id="{sid}" data-section="{sid}"><h2>{escape(title)}</h2>'
            f'<p class="intro">{intro}</p>{body}</section>')


def _charts(*svgs: str) -> str:
    return '<div class="charts">' + "".join(f'<figure>{s}</figure>' for s in svgs) + "</div>"


def _by(rows: list[dict], key: str) -> dict:
    groups: dict = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    return groups


# The result sets whose rows name a run (`run_id`): every per-run chart takes its colour from here.
RUN_RESULTS = ("report_accuracy_by_version", "report_accuracy_by_step", "report_evaluations", "report_training",
               "report_prompt_skips")


def run_colours(res: dict[str, Result]) -> dict:
    """One colour per run of the snapshot, the same in every chart of the page (runs sorted by id)."""
    runs = sorted({r["run_id"] for name in RUN_RESULTS if name in res for r in res[name].rows}, key=str)
    return {run: PALETTE[i % 8] for i, run in enumerate(runs)}


def _unit_range(values) -> tuple[float, float] | None:
    vals = [v for v in values if isinstance(v, (int, float))]
    return (0.0, 1.0) if vals and all(0 <= v <= 1 for v in vals) else None


def section_overview(res: dict[str, Result], root: str, seq: int, curation_id: str | None) -> str:
    o = res["report_overview"].rows[0]
    scope = (f"the curation <code>{escape(curation_id)}</code>" if curation_id
             else f"every curation of the buffer ({o['curations']}), one block per recipe when there are several")
    cells = "".join(f'<div class="stat"><div class="v" data-col="{k}">{escape(fmt(v))}</div>'
                    f'<div class="k">{escape(k.replace("_", " "))}</div></div>' for k, v in o.items())
    intro = (f"Buffer <code>{escape(root)}</code> at snapshot {seq}. Candidate-level sections (bands, "
             f"advantages, tokens) cover {scope}; the rest cover the whole snapshot. Every number below "
             "is the result of the SQL printed under its chart (open <em>SQL</em>); it runs as printed: "
             f"<code>rollstore sql BUFFER --snapshot {seq} -- \"…\"</code> (the <code>--</code> lets the "
             "text start with a comment).")
    return _section("overview", "Buffer", intro, f'<div class="stats">{cells}</div>' + sql_block(res["report_overview"]))


def section_accuracy(res: dict[str, Result]) -> str:
    ver = res["report_accuracy_by_version"].rows
    step = res["report_accuracy_by_step"].rows
    evals = res["report_evaluations"].rows
    # One colour per run in every chart of the section: sampled solid, held-out dashed, against the
    # run's own versions (`run_version`; docs/choices.md §Runs), so no run is drawn across another's.
    colour = run_colours(res)
    many = len({r["run_id"] for r in ver + step + evals}) > 1
    acc = [Series(f"{run} sampled" if many else "sampled accuracy", [(r["run_version"], r["accuracy"]) for r in rows],
                  colour[run]) for run, rows in _by(ver, "run_id").items()]
    for i, ((run, split, metric), rows) in enumerate(sorted(
            _by([dict(r, key=(r["run_id"], r["split"], r["metric"])) for r in evals
                 if r["policy_version"] is not None], "key").items(), key=lambda kv: str(kv[0]))):
        label = (f"{run} " if many else "") + f"{split or 'eval'} {metric}"
        points = [(r["policy_version"] if r["run_version"] is None else r["run_version"], r["value"]) for r in rows]
        acc.append(Series(label, points, colour.get(run) if many else PALETTE[(i + 1) % 8], dashed=True))
    yr = _unit_range([p[1] for s in acc for p in s.points])
    runs = _by(step, "run_id")
    step_acc = [Series(f"{run}", [(r["step"], r["accuracy"]) for r in rows], colour[run]) for run, rows in runs.items()]
    step_rew = [Series(f"{run}", [(r["step"], r["reward_mean"]) for r in rows], colour[run]) for run, rows in runs.items()]
    reward = [Series(f"{run}" if many else "reward mean", [(r["run_version"], r["reward_mean"]) for r in rows], colour[run])
              for run, rows in _by(ver, "run_id").items()]
    charts = _charts(
        line_chart(acc, title="Accuracy by version of each run (held-out dashed)", x_label="version of the run",
                   y_label="accuracy", y_range=yr, integer_x=True),
        line_chart(reward, title="Reward by version of each run", x_label="version of the run", y_label="mean reward",
                   integer_x=True),
        line_chart(step_acc, title="Sampled accuracy by step (per run)", x_label="step", y_label="accuracy",
                   y_range=_unit_range([r["accuracy"] for r in step]), integer_x=True),
        line_chart(step_rew, title="Reward by step (per run)", x_label="step", y_label="mean reward", integer_x=True),
    )
    ev = ("<p class=\"note\">No held-out evaluation in this buffer (<code>rollstore loop --eval-every N</code> "
          "or <code>rollstore eval --buffer</code> records one).</p>" if not evals else
          "<h3>Held-out evaluations</h3>" + table(evals, ["run_id", "split", "metric", "policy_version", "run_version",
                                                          "iteration",
                                                          "value", "n_problems", "n_samples"], name="report_evaluations"))
    body = (charts + "<h3>By policy version</h3>"
            + table(ver, ["run_id", "policy_version", "run_version", "rollouts", "groups", "judged", "accuracy",
                          "reward_mean", "reward_std",
                          "mean_response_tokens"], name="report_accuracy_by_version")
            + sql_block(res["report_accuracy_by_version"]) + ev + sql_block(res["report_evaluations"])
            + "<details><summary>By step</summary>"
            + table(step, ["run_id", "step", "min_policy_version", "max_policy_version", "rollouts", "judged",
                           "accuracy", "reward_mean", "mean_response_tokens"], name="report_accuracy_by_step")
            + "</details>" + sql_block(res["report_accuracy_by_step"]))
    intro = ("Accuracy (mean of <code>correct</code> over judged rollouts) and mean reward of the sampled "
             "rollouts of each run, by the version that sampled them and by generation step; held-out evaluations "
             "(greedy accuracy of each published version in the loop, pass@k of <code>rollstore eval</code>) "
             "are drawn dashed against the version they measured. Versions are numbered buffer-wide, so each run "
             "is drawn against its own: <code>run_version</code> n is the run's n-th (views.sql "
             "<code>run_versions</code>; docs/choices.md, Runs).")
    return _section("accuracy", "Accuracy and reward", intro, body)


def _per_recipe(rows: list[dict], fields: list[tuple[str, str]], dashed: set[str] = frozenset()) -> list[Series]:
    """One series per (recipe, field); recipe names are left out when there is a single recipe."""
    recipes = _by(rows, "recipe")
    out = []
    for j, (recipe, rs) in enumerate(recipes.items()):
        for i, (col, label) in enumerate(fields):
            name = label if len(recipes) == 1 else f"{recipe} · {label}"
            out.append(Series(name, [(r["seq"], r[col]) for r in rs], PALETTE[(i + j * len(fields)) % 8],
                              dashed=col in dashed))
    return out


def section_curations(res: dict[str, Result], curation_id: str | None) -> str:
    rows = res["report_curations"].rows
    if not rows:
        return _section("curations", "Curations", "No curation in this buffer yet (<code>rollstore curate</code>).",
                        sql_block(res["report_curations"]))
    reasons = [r for r in REASON_COLORS if any(row[r] for row in rows)]
    charts = _charts(
        stacked_bars([str(r["seq"]) for r in rows], [(k, [r[k] for r in rows], REASON_COLORS[k]) for k in reasons],
                     title="Candidates by reason", x_label="curation", y_label="candidates"),
        # budget drawn last, dashed, so it stays visible where it equals what was kept
        line_chart(_per_recipe(rows, [("n_candidates", "candidates"), ("n_selected", "kept"),
                                      ("sample_budget", "budget")], {"sample_budget"}),
                   title="Samples: candidates, budget, kept", x_label="curation", y_label="rollouts", integer_x=True),
        line_chart(_per_recipe(rows, [("progress", "progress t"), ("token_fraction", "κ"),
                                      ("sample_keep_rate", "samples kept"), ("token_keep_rate", "tokens kept")],
                               {"progress", "token_fraction"}),
                   title="Schedule as it ran (fractions)", x_label="curation", y_label="fraction",
                   y_range=(0.0, 1.0), integer_x=True),
        line_chart(_per_recipe(rows, [("adv_var_before", "Var(A) before"), ("adv_var_after", "Var(A) after")]),
                   title="Variance of advantages before / after selection", x_label="curation",
                   y_label="Var(A)", integer_x=True),
    )
    # two tables, so that neither is wider than the page: the schedule and what it kept, then the
    # candidates by reason and the token threshold
    focus = lambda r: r["curation_id"] == curation_id  # noqa: E731
    cols = ["seq", "curation_id", "recipe", "progress", "n_candidates", "sample_budget", "n_selected",
            "token_fraction", "tokens_kept", "token_keep_rate", "adv_var_before", "adv_var_after"]
    by_reason = ["seq", "curation_id", "recipe"] + reasons + ["tokens_candidate", "token_threshold"]
    body = (charts + table(rows, cols, highlight=focus, name="report_curations")
            + "<h3>Candidates by reason, and the token threshold</h3>"
            + table(rows, by_reason, highlight=focus, name="report_curations") + sql_block(res["report_curations"]))
    intro = ("One point per curation run, in the order they ran (<code>seq</code>): the audit's reason counts, "
             "the sample budget against what was kept, the schedule position t with the token fraction κ it "
             "gave, the fractions of samples and tokens actually kept, and the population variance of the "
             "final advantages over the selection pool (before) and over the selected rows (after)."
             + (" The row of the focused curation is highlighted." if curation_id else ""))
    return _section("curations", "Curations", intro, body)


def _scope_head(scope: Scope) -> str:
    if scope.recipe is None:
        return ""
    return (f'<h3 class="scope" data-scope="{escape(scope.recipe)}">Recipe <code>{escape(scope.recipe)}</code> '
            f"({scope.curations} curation{'s' if scope.curations != 1 else ''})</h3>")


def _bands_block(res: dict[str, Result], scope: Scope) -> str:
    result = res["report_bands" + scope.suffix]
    rows = result.rows
    if not rows:
        return _scope_head(scope) + ('<p class="note">No candidates in scope (no curation yet: '
                                     "<code>rollstore curate</code>).</p>") + sql_block(result)
    charts = []
    for measure, title in (("group accuracy", "Keep rate by group accuracy (dynamic sampling)"),
                           ("difficulty", "Keep rate by estimated difficulty q̂ (amplification)")):
        rs = [r for r in rows if r["measure"] == measure]
        if rs:
            charts.append(grouped_hbars([r["band"] for r in rs],
                                        [("samples kept", [r["keep_rate"] for r in rs], PALETTE[2]),
                                         ("tokens kept", [r["token_keep_rate"] for r in rs], PALETTE[0])],
                                        title=title, x_label="fraction kept"))
    if not any(r["measure"] == "difficulty" for r in rows):
        charts.append('<p class="note">No difficulty q̂ recorded: it is estimated with <code>amplify=da3po</code>.</p>')
    return (_scope_head(scope) + _charts(*charts)
            + table(rows, ["measure", "band", "candidates", "selected", "keep_rate", "tokens_total", "tokens_kept",
                           "token_keep_rate", "amplified", "max_amplification"], name=result.key) + sql_block(result))


def section_bands(res: dict[str, Result], blocks: list[Scope] = (Scope(),)) -> str:
    intro = ("Candidates banded by their group's accuracy (dynamic sampling drops acc = 0 and acc = 1) and by "
             "the prompt's estimated success rate q̂ (amplification scales correct answers of hard groups); "
             "<em>ineligible</em> rows left before group statistics (invalid, truncated, stale, reused)."
             + (" One block per recipe: candidates of different recipes are never pooled." if len(blocks) > 1 else ""))
    return _section("bands", "Keep rate by difficulty band", intro, "".join(_bands_block(res, b) for b in blocks))


def section_replay(res: dict[str, Result]) -> str:
    rows = res["report_replay"].rows
    intro = ("Per curation, in the order they ran: the selected rows that came from the replay window "
             "(earlier steps of the run, docs/replay.md), their share of the selection, the selected rows "
             "by age in policy versions (<code>age:rows</code>; 0 is the fresh batch) and the candidates "
             "refused at their use cap (<code>reused</code>).")
    if not any(r["replayed"] for r in rows):
        return _section("replay", "Replay: share and age of the rows trained",
                        intro + " No curation of this buffer replayed a stored row (recipes <code>replay-*</code>).",
                        table(rows, ["seq", "curation_id", "recipe", "selected", "replayed", "replay_share",
                                     "selected_by_age", "at_use_cap"], name="report_replay")
                        + sql_block(res["report_replay"]))
    chart = line_chart(_per_recipe(rows, [("replay_share", "replay share")]), title="Share of selected rows replayed",
                       x_label="curation", y_label="share", y_range=(0.0, 1.0), integer_x=True)
    body = (_charts(chart) + table(rows, ["seq", "curation_id", "recipe", "selected", "replayed", "replay_share",
                                          "selected_by_age", "at_use_cap"], name="report_replay")
            + sql_block(res["report_replay"]))
    return _section("replay", "Replay: share and age of the rows trained", intro, body)


def section_skips(res: dict[str, Result]) -> str:
    rows = res["report_prompt_skips"].rows
    title = "Prompts skipped before generation"
    intro = ("Per run and step, the prompts pre-rollout selection examined before generating (docs/curation.md, "
             "Before generation): skipped because their recent groups had no variance, and generated anyway "
             "because the pool ran out (<code>filled</code>); the exploration rates of all-correct and all-wrong "
             "prompts. <code>rollstore audit BUF --skips</code> adds how often a skipped prompt was informative "
             "when generated later.")
    columns = ["run_id", "step", "examined", "skipped", "filled", "skip_share", "explore_easy", "explore_hard"]
    if not rows:
        return _section("skips", title, intro + " No run of this buffer selected its prompts before generating "
                        "(recipe <code>greso</code>, or <code>--set prompt_skip=greso</code>).",
                        table(rows, columns, name="report_prompt_skips") + sql_block(res["report_prompt_skips"]))
    colour = run_colours(res)
    series = [Series(run, [(r["step"], r["skip_share"]) for r in rs], colour[run])
              for run, rs in _by(rows, "run_id").items()]
    chart = line_chart(series, title="Share of examined prompts skipped", x_label="step", y_label="share",
                       y_range=(0.0, 1.0), integer_x=True)
    return _section("skips", title, intro, _charts(chart) + table(rows, columns, name="report_prompt_skips")
                    + sql_block(res["report_prompt_skips"]))


def _advantages_block(res: dict[str, Result], scope: Scope) -> str:
    hist_result, stats_result = res["report_advantages" + scope.suffix], res["report_advantage_stats" + scope.suffix]
    hist, stats = hist_result.rows, stats_result.rows
    if not stats:
        return (_scope_head(scope) + '<p class="note">No candidate in scope reached group statistics.</p>'
                + sql_block(hist_result) + sql_block(stats_result))
    series = _by(hist, "series")  # every series has the same 30 bins (queries/report_advantages.sql)
    first = next(iter(series.values()))
    edges = [r["bin_lo"] for r in first] + [first[-1]["bin_hi"]]
    titles = {"raw": "raw (before filter and amplification)", "pool": "selection pool (after amplification)",
              "selected": "selected (what the learner gets)"}
    charts = [histogram(edges, [(name, [r["n"] for r in rs], SERIES_COLORS.get(name, PALETTE[0]))],
                        title=titles.get(name, name), x_label="advantage", y_label="rollouts", width=350)
              for name, rs in series.items()]  # one panel each: shared bins, own count scale
    return (_scope_head(scope) + _charts(*charts)
            + table(stats, ["series", "n", "mean", "var_pop", "min", "max", "amplified", "mean_amplification"],
                    name=stats_result.key)
            + sql_block(hist_result) + sql_block(stats_result))


def section_advantages(res: dict[str, Result], blocks: list[Scope] = (Scope(),)) -> str:
    intro = ("<b>raw</b>: group-normalised advantages of every row that reached group statistics, before the "
             "filter and amplification; <b>pool</b>: final advantages (after amplification) of the rows that "
             "entered sample selection; <b>selected</b>: final advantages of the selected rows, what the "
             "learner receives. Var over the pool and over the selected rows is what selection trades."
             + (" One block per recipe." if len(blocks) > 1 else ""))
    return _section("advantages", "Advantages before and after amplification and selection", intro,
                    "".join(_advantages_block(res, b) for b in blocks))


def _token_card(r: dict, text: TokenText, top: float) -> str:
    pieces, special = text.pieces(r["response"], r["token_ids"], r["tokens_total"])
    scores = r["scores"] or [None] * len(pieces)
    kept = r["kept"] or [False] * len(pieces)
    ents = r["entropies"] or [None] * len(pieces)
    spans = []
    for i, (p, sp) in enumerate(zip(pieces, special)):
        s = scores[i]
        alpha = 0.06 + 0.84 * (s / top) if isinstance(s, (int, float)) and top > 0 else 0.0
        cls = "tok" + (" kept" if kept[i] else "") + (" sp" if sp else "") + (" na" if s is None else "")
        shown = p.replace("\n", "⏎").replace("\t", "⇥")
        tip = (f"#{i + 1} id {r['token_ids'][i]}  H={fmt(ents[i])}  |A|·H={fmt(s)}  "
               f"{'kept' if kept[i] else 'not kept'}")
        style = f' style="background:rgba(213,94,0,{alpha:.3f})"' if alpha else ""
        spans.append(f'<span class="{cls}"{style} title="{escape(tip)}">{escape(shown)}</span>')
    more = r["tokens_total"] - len(pieces)
    if more > 0:
        spans.append(f'<span class="more">… {more} more tokens</span>')
    badge = f'<span class="badge" style="background:{REASON_COLORS.get(r["reason"], "#777")}">{escape(r["reason"])}</span>'
    if r.get("replayed"):  # a stored row from the replay window, not the fresh batch
        badge += (f' <span class="badge replay" data-replayed="{escape(fmt(r.get("age")))}" title="replayed from the '
                  f'replay window: sampled {escape(fmt(r.get("age")))} policy versions before this curation">'
                  f'replayed · age {escape(fmt(r.get("age")))}</span>')
    facts = (f"A<sub>final</sub> {escape(fmt(r['advantage_final']))} · w {escape(fmt(r['amplification']))} · "
             f"group acc {escape(fmt(r['group_accuracy']))} · q̂ {escape(fmt(r['difficulty']))} · "
             f"tokens kept {r['tokens_kept']}/{r['tokens_total']} · gold answer "
             f"<code>{escape(fmt(r.get('gold_answer')))}</code> · correct {escape(fmt(r['correct']))} · "
             f"reward {escape(fmt(r['reward']))} · {escape(r['finish_reason'])}")
    replayed = ' data-replayed="true"' if r.get("replayed") else ""
    return (f'<div class="card" data-rollout="{escape(r["rollout_id"])}"{replayed}>{badge} <code>{escape(r["rollout_id"])}</code> '
            f'<span class="cid">in {escape(r["curation_id"])}</span><div class="facts">{facts}</div>'
            f'<div class="resp"><span class="prompt" title="prompt">{escape(r["prompt"][-300:])}</span>'
            f'<span class="arrow">→</span>{"".join(spans)}</div></div>')


def section_tokens(res: dict[str, Result], text: TokenText, blocks: list[Scope] = (Scope(),)) -> str:
    results = [res["report_tokens" + b.suffix] for b in blocks]
    scores = [s for result in results for r in result.rows for s in (r["scores"] or []) if isinstance(s, (int, float))]
    top = max(scores, default=0.0)
    body = ""
    for scope, result in zip(blocks, results):
        cards = "".join(_token_card(r, text, top) for r in result.rows) or '<p class="note">No candidates in scope.</p>'
        body += _scope_head(scope) + cards + sql_block(result)
    decoded = (f"decoded with <code>{escape(text.source)}</code>" if text.source else
               "shown as characters when the response has one character per token, else as <code>[id]</code>")
    legend = ('<p class="legend"><span class="tok" style="background:rgba(213,94,0,0.9)">high</span> '
              '<span class="tok" style="background:rgba(213,94,0,0.3)">low</span> |A|·H score (shared scale, max '
              f"{escape(fmt(top))}) · <span class=\"tok kept\">kept</span> token in the loss · "
              '<span class="tok sp">special</span> token · <span class="badge replay">replayed · age a</span> a '
              "stored row from the replay window, sampled a policy versions earlier</p>")
    intro = ("A fixed sample of candidates: selected rows (partly pruned ones first, and up to two replayed ones) "
             "and rejected rows from each reason in turn. Each token is shaded by its |A|·H score "
             "(|advantage_final| × entropy) and "
             f"framed green when the curated loss mask kept it; tokens are {decoded}. Hover a token for its numbers.")
    return _section("tokens", "Selected and rejected rollouts, token by token", intro, legend + body)


def section_training(res: dict[str, Result]) -> str:
    rows = res["report_training"].rows
    if not rows:
        return _section("training", "Training", "No training step in this buffer yet (<code>rollstore train</code> "
                        "or <code>rollstore loop</code>).", sql_block(res["report_training"]))
    runs, colour = _by(rows, "run_id"), run_colours(res)

    def chart(col: str, title: str) -> str:
        return line_chart([Series(run, [(r["step"], r[col]) for r in rs], colour[run]) for run, rs in runs.items()],
                          title=title, x_label="optimiser step", y_label=col, integer_x=True)

    body = (_charts(chart("loss", "Loss"), chart("clip_fraction", "Clip fraction"), chart("approx_kl", "Approx. KL"),
                    chart("entropy", "Entropy of kept tokens"))
            + "<details><summary>Every step</summary>"
            + table(rows, ["run_id", "step", "version", "curation_id", "loss", "clip_fraction", "approx_kl", "entropy",
                           "grad_norm", "tokens", "samples", "lr"], name="report_training")
            + "</details>" + sql_block(res["report_training"]))
    intro = ("The learner's metrics per optimiser step (one line per run), each a mean over the step's kept tokens.")
    return _section("training", "Training", intro, body)


CSS = """
:root{--fg:#1d232a;--mut:#5b6670;--line:#d9dee3;--bg:#fff;--card:#f7f8fa}
*{box-sizing:border-box}body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:var(--bg)}
header{padding:18px 28px 8px;border-bottom:1px solid var(--line)}h1{font-size:22px;margin:0 0 6px}
nav a{margin-right:14px;color:#0072B2;text-decoration:none;font-size:13px}
main{padding:0 28px 40px;max-width:1180px}section{padding-top:18px;border-bottom:1px solid var(--line);padding-bottom:14px}
h2{font-size:18px;margin:6px 0}h3{font-size:15px;margin:14px 0 6px}.intro{color:var(--mut);max-width:900px;margin:4px 0 10px}
.charts{display:flex;flex-wrap:wrap;gap:12px}figure{margin:0;background:var(--card);border:1px solid var(--line);border-radius:6px;padding:4px}
svg.chart{display:block;font-family:inherit}svg .ct{font-size:13px;font-weight:600;fill:var(--fg)}
svg .tick{font-size:10.5px;fill:var(--mut)}svg .al{font-size:11px;fill:var(--mut)}svg .lg{font-size:11px;fill:var(--fg)}
svg .grid{stroke:#e7eaee}svg .axis{stroke:#8a949e}
div.tw{overflow-x:auto;max-width:100%}table{border-collapse:collapse;margin:10px 0;font-size:12.5px}th,td{border-bottom:1px solid var(--line);padding:3px 8px;text-align:right;white-space:nowrap}
th{background:var(--card);font-weight:600;white-space:normal;vertical-align:bottom}
td[data-col=curation_id]{white-space:normal;word-break:break-all;min-width:8em}td.txt{text-align:left}tr.focus td{background:#fff3cd}
details.sql{margin:6px 0}details.sql pre{background:#f2f4f7;border:1px solid var(--line);padding:8px;overflow:auto;font-size:12px;max-height:360px}
summary{cursor:pointer;color:var(--mut)}.note{color:var(--mut);font-style:italic}
.stats{display:flex;flex-wrap:wrap;gap:10px;margin:8px 0}.stat{background:var(--card);border:1px solid var(--line);border-radius:6px;padding:6px 12px;min-width:110px}
.stat .v{font-size:18px;font-weight:600}.stat .k{color:var(--mut);font-size:12px}
.card{border:1px solid var(--line);border-radius:6px;padding:6px 10px;margin:6px 0;background:var(--card)}
.badge{color:#fff;border-radius:4px;padding:1px 6px;font-size:12px}.cid{color:var(--mut);font-size:12px}
.facts{color:var(--mut);font-size:12px;margin:2px 0}.prompt{color:var(--mut)}.arrow{color:var(--mut);margin:0 6px}
.resp{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:15px;line-height:2;white-space:pre-wrap;word-break:break-all}
.tok{padding:1px 1px;margin:0 1px;border:2px solid transparent;border-radius:3px}.tok.kept{border-color:#009E73}
.badge.replay{background:#56B4E9;color:#10222e}h3.scope{border-top:1px dashed var(--line);padding-top:8px}
.tok.sp{font-size:11px;color:var(--mut)}.tok.na{background-image:repeating-linear-gradient(45deg,#0000 0 3px,#0001 3px 6px)}
.more{color:var(--mut);font-size:12px}.legend{font-size:12.5px}
"""

HEAD_SCRIPT = ("<script>window.addEventListener('error',function(e){var d=document.documentElement;"
               "d.setAttribute('data-errors',(d.getAttribute('data-errors')||'')+(e.message||'error')+';');});</script>")
TAIL_SCRIPT = ("<script>(function(){var ok=[],wide=[];document.querySelectorAll('section[data-section]').forEach(function(s){"
               "var r=s.getBoundingClientRect();if(r.width>0&&r.height>0)ok.push(s.id);});"
               "document.querySelectorAll('div.tw').forEach(function(w){var t=w.querySelector('table');"
               "if(t&&w.scrollWidth>w.clientWidth+1)wide.push(t.getAttribute('data-query'));});"
               "var d=document.documentElement;d.setAttribute('data-rendered',ok.join(' '));"
               "if(wide.length)d.setAttribute('data-overflow',wide.join(' '));})();</script>")


def render(res: dict[str, Result], text: TokenText, root: str, seq: int, curation_id: str | None,
           blocks: list[Scope] = (Scope(),)) -> str:
    nav = "".join(f'<a href="#{sid}">{escape(title.split(",")[0])}</a>' for sid, title in SECTIONS)
    sections = [
        section_overview(res, root, seq, curation_id),
        section_accuracy(res),
        section_curations(res, curation_id),
        section_bands(res, blocks),
        section_replay(res),
        section_skips(res),
        section_advantages(res, blocks),
        section_tokens(res, text, blocks),
        section_training(res),
    ]
    title = f"rollstore report — {os.path.basename(os.path.normpath(root))} @ snapshot {seq}"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{escape(title)}</title>"
            f"<style>{CSS}</style>{HEAD_SCRIPT}</head><body><header><h1>{escape(title)}</h1><nav>{nav}</nav></header>"
            f"<main>{''.join(sections)}</main>{TAIL_SCRIPT}</body></html>\n")


def build_report(buf: Buffer, out_path: str, curation_id: str | None = None, snapshot: int | None = None,
                 memory_limit: str | None = None) -> ReportInfo:
    """Write the report of `buf` (at `snapshot`, default the latest) to `out_path`, atomically;
    never inside a buffer's managed files."""
    check_output_file(out_path)  # before the work: a device, a folder or a link there is refused
    t0 = time.perf_counter()
    kwargs = {"memory_limit": memory_limit} if memory_limit else {}
    with buf.snapshot(snapshot, pin=True) as snap, Session(snap, **kwargs) as session:
        read_once(session, indexed_checkpoints(buf, snap.seq))
        blocks = scopes(session, curation_id)
        res = collect(session, curation_id, blocks)
        text = TokenText.for_snapshot(session)
        page = render(res, text, buf.root, snap.seq, curation_id, blocks)
        seq = snap.seq
    def write(partial: str) -> None:
        with open(partial, "x", encoding="utf-8") as fh:
            fh.write(page)

    target = write_output(out_path, write)
    return ReportInfo(target, os.path.getsize(target), time.perf_counter() - t0, seq, curation_id)


__all__ = ["QUERIES", "SECTIONS", "ReportInfo", "TokenText", "build_report", "collect", "render", "with_literals"]
