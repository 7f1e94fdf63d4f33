"""One curation run: a snapshot and a recipe in, curated shards + audit + a curation record out.

Invariants:
- The stages run in the order of docs/curation.md §Order of a run, each as one SQL file of
  `queries/`, in one DuckDB session over one pinned snapshot; per-token arrays are read from
  Parquet only by the token and materialisation stages, and never pulled into Python except as
  the output being written.
- Every candidate gets exactly one audit row with exactly one reason.
- Curated shards, audit rows and the record are published in ONE manifest commit; a failure
  before it leaves nothing visible. The curation id is a hash of the snapshot, the recipe, the
  effective parameters and the SQL text, so re-running the same curation is idempotent and gives
  byte-identical files. The SQL text hashed is `stage_texts` (the plan of the run, a function of
  the parameters alone); the run checks that it executed exactly that plan. The engine is not part
  of the hash: `curate.distributed` runs the same stage helpers and SQL on Dask with the same id.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from queries import load_sql
from queries.session import DEFAULT_MEMORY_LIMIT, Session
from storage.buffer import Buffer, Part
from storage.errors import RollstoreError
from storage.schema import CURATED, CURATIONS, SELECTIONS
from storage.shardio import ROW_GROUP_BYTES
from storage.snapshot import sql_string

from .custom import apply_custom_recipe
from .params import ParamError, Params, Recipe, resolve, token_budget

FILL_ENTROPIES = "`rollstore generate` fills entropies (learner scoring) when it writes rollouts"
CURATED_SHARD_BYTES = ROW_GROUP_BYTES
DEFAULT_TIMEOUT = 600.0  # seconds for the stages that run user SQL (`where`, a custom recipe)
# Tables a curation reads: their shards are verified (size and sha256) before a run uses them.
CURATION_INPUTS = ["rollouts", "selections", "curations", "checkpoints"]


class CurationError(RollstoreError):
    """The run cannot proceed (empty batch, missing entropies, bad custom SQL, ...)."""


@dataclass
class CurationResult:
    curation_id: str
    record: dict
    reasons: dict[str, int]
    snapshot_seq: int
    committed: bool = True
    already_existed: bool = False
    audit: pa.Table | None = None
    curated: pa.Table | None = None
    output_files: list[str] = field(default_factory=list)


class _Stages:
    """Runs the stage files in one session and keeps the exact SQL text for the record's hash.
    `sql` maps stage names to their text (default: queries/<name>.sql of this installation)."""

    def __init__(self, session: Session, sql: dict[str, str] | None = None):
        self.session = session
        self.text: list[str] = []
        self.sql = sql

    def run(self, name: str, params: dict | None = None, **subs: str):
        sql, args = self.prepare(name, params, subs)
        return self.session.execute(sql, args if args else None)

    def table(self, name: str, params: dict | None = None, **subs: str) -> pa.Table:
        sql, args = self.prepare(name, params, subs)
        return self.session.con.sql(sql, params=args or None).to_arrow_table()

    def prepare(self, name: str, params: dict | None, subs: dict[str, str]) -> tuple[str, dict]:
        sql = _substitute(self.sql[name] if self.sql is not None else load_sql(name), subs)
        self.text.append(sql)
        needed = set(re.findall(r"\$([a-z_]+)", sql))
        args = {k: v for k, v in (params or {}).items() if k in needed}
        missing = needed - set(args)
        if missing:
            raise RuntimeError(f"{name}.sql needs parameters {sorted(missing)}")
        return sql, args

    def sha256(self) -> str:
        return texts_sha256(self.text)


def _substitute(sql: str, subs: dict[str, str]) -> str:
    for key, value in subs.items():
        sql = sql.replace("{" + key + "}", value)
    return sql


def texts_sha256(texts: list[str]) -> str:
    return hashlib.sha256("\n;\n".join(texts).encode()).hexdigest()


# Relations the stages read, as substituted into their text (part of the hashed plan).
ELIGIBLE = "(SELECT * FROM work WHERE reason IS NULL)"
CHOSEN = "(SELECT * FROM work WHERE selected)"
HISTORY_ROWS = "(SELECT * FROM rollouts WHERE prompt_id IN (SELECT prompt_id FROM work WHERE group_size IS NOT NULL))"
EMPTY_DIFFICULTY = ("CREATE OR REPLACE TEMP TABLE difficulty AS "
                    "SELECT NULL::VARCHAR AS group_id, NULL::DOUBLE AS q_hat WHERE false")
EMPTY_SUBSET = ("CREATE OR REPLACE TEMP TABLE subset_adv AS SELECT NULL::VARCHAR AS rollout_id, "
                "0 AS g_size, 0 AS g_correct, 0.0::FLOAT AS adv WHERE false")
SELECT_ALL = ("CREATE OR REPLACE TEMP TABLE picked AS SELECT rollout_id, true AS selected, "
              "NULL::INTEGER AS sample_rank FROM work WHERE reason IS NULL")
MISSING_ENTROPIES = ("SELECT w.rollout_id FROM work w JOIN rollouts r USING (rollout_id) "
                     "WHERE w.selected AND r.entropies IS NULL ORDER BY w.rollout_id LIMIT 1")
HISTOGRAM = "SELECT bucket, count(*) FROM token_scores GROUP BY bucket ORDER BY bucket DESC"
TOKEN_ORDER = "ORDER BY score DESC, rollout_id ASC, pos ASC"
SUMMARY_COUNTS = "SELECT coalesce(sum(tokens_total), 0) FROM work WHERE selected"
REASONS = "SELECT reason, count(*) FROM work GROUP BY reason ORDER BY reason"


def stage_texts(params: Params, recipe: Recipe, custom_statement: str | None = None) -> list[str]:
    """The SQL text of every stage of a run with these (resolved) parameters, in the order the
    embedded engine runs them: what the curation id hashes, whatever engine runs the stages."""
    p = params
    pods, token = p["sample"] == "pods", p["token"]
    out: list[str] = []

    def add(name: str, times: int = 1, **subs: str) -> None:
        out.extend([_substitute(load_sql(name), subs)] * times)

    add("curate_candidates", rollouts="rollouts", selections="selections", where=p["where"])
    add("curate_group_stats", rows=ELIGIBLE, out="full_groups")
    add("curate_advantages", rows=ELIGIBLE, groups="full_groups", out="full_adv")
    add("curate_filter")
    if p["amplify"] == "da3po":
        add("curate_batch_accuracy")
        add("curate_history", rows=HISTORY_ROWS, out="prompt_history")
        add("curate_difficulty")
    if not pods:
        add("curate_amplify_inputs")
        add("curate_amplify")
    if recipe.sql is not None:
        out.append(custom_statement or "")
    elif p["sample"] == "none":
        add("curate_apply_selection")
    else:
        add("curate_select", **_select_subs(p))
        add("curate_apply_selection")
    if pods:
        add("curate_group_stats", rows=CHOSEN, out="subset_groups")
        add("curate_advantages", rows=CHOSEN, groups="subset_groups", out="subset_adv")
        add("curate_amplify_inputs")
        add("curate_amplify")
    if token != "none":
        add("curate_token_scores", score=_score_expr(token, "h", "advantage_final"))
    add("curate_materialise", 2, score=_score_expr(token, "h", "w.advantage_final"))
    add("curate_audit", 2)
    add("curate_record", 2)
    add("curate_record_values", 2)
    return out


def stage_params(p: Params) -> dict:
    """The named parameters ($name) of the stage SQL."""
    tau = p["amplify_tau"]
    f = p.sample_fraction()
    return {
        "drop_truncated": p["truncated"] == "drop",
        "max_policy_lag": p["max_policy_lag"],
        "max_reuse": p["max_reuse"],
        "current_version": 0 if p["current_version"] is None else p["current_version"],
        "std_mode": p["std"],
        "dynamic": p["filter"] == "dynamic",
        "window": p["difficulty_window"],
        "prior": float(p["difficulty_prior"]),
        "tau_num": tau.numerator,
        "tau_den": tau.denominator,
        "w_max": float(p["amplify_max"]),
        "mode": p["amplify"],
        "amplify_on": p["amplify"] != "none",
        "pods": p["sample"] == "pods",
        "f_num": f.numerator,
        "f_den": f.denominator,
    }


def _select_subs(p: Params) -> dict[str, str]:
    return {"pool_key": "'batch'" if p["sample"] == "cross_group" else "group_id",
            "value": "reward" if p["sample"] == "pods" else "advantage_final"}


# ---- stage groups shared by the engines (each runs in one session over `work`) --------------
def stage_groups(stages: _Stages, q: dict) -> None:
    """Steps 2–4 over the eligible rows: group statistics, advantages, the filter. Group-local."""
    stages.run("curate_group_stats", q, rows=ELIGIBLE, out="full_groups")
    stages.run("curate_advantages", q, rows=ELIGIBLE, groups="full_groups", out="full_adv")
    stages.run("curate_filter", q)


def batch_accuracy(stages: _Stages, q: dict) -> tuple[int, int]:
    """(k, n) of the rows that reached group statistics; μ = k / n (`batch_mu`)."""
    k, n = stages.run("curate_batch_accuracy", q).fetchall()[0]
    return int(k or 0), int(n or 0)


def batch_mu(k: int, n: int) -> float | None:
    return k / n if n else None


def stage_amplify(stages: _Stages, q: dict, p: Params, mu: float | None) -> None:
    """Step 5 for every recipe but PODS (whose amplification follows its selection): difficulty
    (da3po; `prompt_history` must hold the history of the groups' prompts), then amplification."""
    if p["amplify"] == "da3po":
        stages.run("curate_difficulty", {**q, "mu": mu})
    else:
        stages.session.execute(EMPTY_DIFFICULTY)
    if p["sample"] != "pods":
        stages.session.execute(EMPTY_SUBSET)
        stages.run("curate_amplify_inputs", q)
        stages.run("curate_amplify", q)


def stage_select(stages: _Stages, q: dict, p: Params) -> None:
    """Steps 6–7 over the pools present in `work`: the table `picked`."""
    if p["sample"] == "none":
        stages.session.execute(SELECT_ALL)
    else:
        stages.run("curate_select", q, **_select_subs(p))


def stage_apply(stages: _Stages, q: dict, p: Params) -> None:
    """Record `picked` in `work`; with PODS, re-normalise on the chosen subset and amplify."""
    stages.run("curate_apply_selection", q)
    if p["sample"] == "pods":
        stages.run("curate_group_stats", q, rows=CHOSEN, out="subset_groups")
        stages.run("curate_advantages", q, rows=CHOSEN, groups="subset_groups", out="subset_adv")
        stages.run("curate_amplify_inputs", q)
        stages.run("curate_amplify", q)


def _default_where(session: Session) -> str | None:
    row = session.one(
        "SELECT run_id, step FROM rollouts ORDER BY created_at DESC, run_id DESC, step DESC LIMIT 1"
    )
    if row is None:
        return None
    return f"run_id = {sql_string(row[0])} AND step = {int(row[1])}"


def _default_version(session: Session) -> int | None:
    row = session.one("SELECT max(version) FROM checkpoints")
    if row[0] is not None:
        return int(row[0])
    row = session.one("SELECT max(policy_version) FROM rollouts")
    return None if row[0] is None else int(row[0])


def _threshold(session: Session, k: int) -> tuple[float, str, int] | None:
    """The K-th token in (score desc, rollout_id asc, pos asc) order, in two streaming passes."""
    found = pick_bucket(session.execute(HISTOGRAM).fetchall(), k)
    if found is None:
        return None
    row = session.one(
        f"SELECT score, rollout_id, pos FROM token_scores WHERE bucket = $b {TOKEN_ORDER} LIMIT 1 OFFSET $o",
        {"b": found[0], "o": found[1]},
    )
    return float(row[0]), str(row[1]), int(row[2])


def pick_bucket(hist: list[tuple[int, int]], k: int) -> tuple[int, int] | None:
    """(bucket, offset inside it) of the K-th token, from the (bucket, count) histogram in bucket
    order descending. Counts add exactly, so summed per-shard histograms give the same answer."""
    if k <= 0:
        return None
    above = 0
    for bucket, n in hist:
        if above + n >= k:
            return bucket, k - above - 1
        above += n
    return None


def missing_entropies_error(rollout_id: str, token: str) -> CurationError:
    return CurationError(
        f"rollout_id={rollout_id!r}: column 'entropies' is null, but token={token} needs "
        f"per-token entropies; {FILL_ENTROPIES} (or run with --set token=none)"
    )


def mask_parameters(token: str, threshold: tuple[float, str, int] | None) -> dict:
    return {
        "token_stage": token != "none",
        "thr": threshold[0] if threshold else float("inf"),
        "thr_rollout": threshold[1] if threshold else "",
        "thr_pos": threshold[2] if threshold else 0,
    }


def run_summary(stages: _Stages, p: Params) -> dict:
    """The record's numbers over the whole `work` table (every candidate of the run)."""
    session = stages.session
    n_candidates, n_selected, tokens_candidate = stages.run("curate_record").fetchall()[0]
    values = stages.table("curate_record_values", {"pods": p["sample"] == "pods"})
    selected = values.column("selected").to_numpy(zero_copy_only=False).astype(bool)
    after = values.column("after").to_numpy(zero_copy_only=False)[selected]
    var_before = exact_var_pop(values.column("before").to_numpy(zero_copy_only=False))
    var_after = exact_var_pop(after)
    curated_tokens = int(session.one(SUMMARY_COUNTS)[0])
    return {
        "n_candidates": int(n_candidates),
        "n_selected": int(n_selected),
        "tokens_candidate": int(tokens_candidate),
        "adv_var_before": var_before,
        "adv_var_after": var_after,
        "reasons": dict(session.execute(REASONS).fetchall()),
        "curated_tokens": curated_tokens,
    }


def curated_rows_per_shard(summary: dict) -> int:
    """Rows per curated shard: about CURATED_SHARD_BYTES of learner input each."""
    n_selected = summary["n_selected"]
    per_row = max(1, (summary["curated_tokens"] * 14 + n_selected * 64) // max(1, n_selected))
    return max(1, CURATED_SHARD_BYTES // per_row)


def exact_var_pop(values: np.ndarray) -> float | None:
    """Population variance with exactly rounded sums: the same float whatever the order of values."""
    values = values[~np.isnan(values)] if values.dtype.kind == "f" else values.astype(np.float64)
    if len(values) == 0:
        return None
    mean = math.fsum(values) / len(values)
    return math.fsum((values - mean) ** 2) / len(values)


def new_record(curation_id: str, snapshot_seq: int, recipe: Recipe, params: Params, sql_sha: str,
               summary: dict, sample_budget: int | None, threshold) -> dict:
    p = params
    kappa = p.token_fraction() if p["token"] != "none" else None
    return {
        "curation_id": curation_id,
        "created_at": dt.datetime.now(dt.timezone.utc),
        "recipe": recipe.name,
        "params": params.to_json(),
        "sql_sha256": sql_sha,
        "snapshot_seq": snapshot_seq,
        "progress": float(p["progress"]),
        "sample_budget": sample_budget,
        "token_fraction": float(kappa) if kappa is not None else None,
        "token_threshold": threshold[0] if threshold else None,
        "n_candidates": summary["n_candidates"],
        "n_selected": summary["n_selected"],
        "tokens_candidate": summary["tokens_candidate"],
        "tokens_kept": 0,
        "adv_var_before": summary["adv_var_before"],
        "adv_var_after": summary["adv_var_after"],
        "old_logprobs_fallback": 0,
        "output_files": "[]",
    }


def materialise_shard(session: Session, path: str, materialise_sql: str, mask_params: dict) -> pa.Table:
    """The curated rows of one input shard (the selected rows of `work` in it), by rollout_id."""
    session.execute(f"CREATE OR REPLACE TEMP VIEW shard_rows AS SELECT * FROM read_parquet({sql_string(path)})")
    table = session.con.sql(materialise_sql, params=mask_params).to_arrow_table()
    return table.take(pc.sort_indices(table, [("rollout_id", "ascending")]))


def shards_with_selected_rows(session: Session, paths: list[str]) -> list[str]:
    """The input shards (of `paths`, in that order) that hold a selected row of `work`."""
    if not paths:
        return []
    listing = ", ".join(sql_string(p) for p in paths)
    session.execute(f"CREATE OR REPLACE TEMP VIEW rollout_files AS SELECT rollout_id, filename "
                    f"FROM read_parquet([{listing}], filename = true, hive_partitioning = false)")
    hit = {row[0] for row in session.execute(load_sql("curate_selected_files")).fetchall()}
    return [p for p in paths if p in hit]


def curated_table(pieces: list[pa.Table], curation_id: str) -> pa.Table:
    """One curated shard's table from consecutive slices of materialised input shards."""
    table = pa.concat_tables(pieces)
    table = table.add_column(0, "curation_id", pa.array([curation_id] * table.num_rows, pa.string()))
    return table.select(CURATED.names).cast(CURATED)


def kept_counts_table(ids: list[str], counts: list[int]) -> pa.Table:
    return pa.table({"rollout_id": pa.array(ids, pa.string()), "tokens_kept": pa.array(counts, pa.int32())})


def _score_expr(token: str, entropy: str, advantage: str) -> str:
    if token == "entropy":
        return f"{entropy}::DOUBLE"
    return f"abs({advantage}::DOUBLE) * {entropy}::DOUBLE"


def curation_id_for(snapshot_seq: int, recipe: str, params_json: str, sql_sha: str) -> str:
    digest = hashlib.sha256(f"{snapshot_seq}\n{recipe}\n{params_json}\n{sql_sha}".encode()).hexdigest()
    return f"cur-{digest[:20]}"


def curate(
    buf: Buffer,
    recipe: Recipe,
    sets: dict[str, object] | None = None,
    snapshot_seq: int | None = None,
    commit: bool = True,
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
    threads: int | None = None,
    engine: str = "embedded",
    scheduler=None,
    partitions: int | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    session: Session | None = None,
) -> CurationResult:
    """Run `recipe` (with `sets` overrides) over a snapshot; commit unless `commit` is False.

    `session`: an open `Session` of this buffer to reuse (a loop pays the connection once per run);
    it is rebound to the snapshot (`Session.rebind`: nothing of an earlier job stays visible), its
    own limits apply instead of `memory_limit`/`threads`, and it is left open.

    `timeout` (seconds; None or 0: none) bounds the stages that run user SQL (the `where`
    predicate and a custom recipe's SELECT); past it the run stops with one line, committing nothing.

    `engine="dask"` runs the same curation on dask.distributed (`scheduler`: "local:N", a scheduler
    address, or a `distributed.Client`; `partitions`: hash partitions of the batch) with the same
    curation id and byte-identical output; see `curate.distributed`."""
    if engine == "dask":
        from .distributed import curate_dask

        return curate_dask(buf, recipe, sets, snapshot_seq=snapshot_seq, commit=commit, memory_limit=memory_limit,
                           threads=threads, scheduler=scheduler, partitions=partitions)
    if engine != "embedded":
        raise ParamError(f"unknown engine {engine!r} (embedded or dask)")
    if scheduler is not None or partitions is not None:
        raise ParamError("a scheduler and partitions are options of the dask engine: add --engine dask")
    params = resolve(recipe, dict(sets or {}))
    if recipe.sql is not None and params["sample"] != "none":
        raise ParamError("a custom SQL recipe replaces the sample stage: leave `sample` at none")
    with buf.snapshot(snapshot_seq, pin=True) as snap, (
            contextlib.nullcontext(session.rebind(snap.verify(CURATION_INPUTS))) if session is not None
            else Session(snap.verify(CURATION_INPUTS), memory_limit, threads)) as session:
        values = dict(params.values)
        if values["where"] is None:
            values["where"] = _default_where(session)
            if values["where"] is None:
                raise CurationError("empty batch: the snapshot has no rollouts")
        if values["current_version"] is None:
            values["current_version"] = _default_version(session)
        params = Params(values, params.user_set)
        stages = _Stages(session)
        with session.deadline(timeout):
            session.check_predicate(values["where"])
            result = _run_stages(stages, session, params, recipe)
        return _materialise(buf, snap, session, stages, params, recipe, result, commit)


def _run_stages(stages: _Stages, session: Session, params: Params, recipe: Recipe) -> dict:
    p = params
    q = stage_params(p)
    stages.run("curate_candidates", q, rollouts="rollouts", selections="selections", where=p["where"])
    n_candidates = session.one("SELECT count(*) FROM work")[0]
    if n_candidates == 0:
        raise CurationError(f"empty batch: no rollouts match where = {p['where']}")
    stage_groups(stages, q)
    mu = None
    if p["amplify"] == "da3po":
        mu = batch_mu(*batch_accuracy(stages, q))
        stages.run("curate_history", q, rows=HISTORY_ROWS, out="prompt_history")
    stage_amplify(stages, q, p, mu)
    sample_budget = None
    if recipe.sql is not None:
        sample_budget = apply_custom_recipe(session, stages, recipe.sql)
    else:
        stage_select(stages, q, p)
        stage_apply(stages, q, p)
        if p["sample"] != "none":
            sample_budget = session.one("SELECT count(*) FROM work WHERE selected")[0]
    return {"sample_budget": sample_budget}


def _materialise(buf, snap, session, stages, params, recipe, result, commit) -> CurationResult:
    p = params
    token = p["token"]
    kappa: Fraction | None = p.token_fraction() if token != "none" else None
    threshold = None
    if token != "none":
        missing = session.one(MISSING_ENTROPIES)
        if missing:
            raise missing_entropies_error(missing[0], token)
        stages.run("curate_token_scores", score=_score_expr(token, "h", "advantage_final"))
        n_tokens = session.one(SUMMARY_COUNTS)[0]
        threshold = _threshold(session, token_budget(int(n_tokens), kappa))
    mask_params = mask_parameters(token, threshold)
    mask_score = _score_expr(token, "h", "w.advantage_final")
    materialise_sql, _ = stages.prepare("curate_materialise", mask_params, {"score": mask_score})
    stages.text.append(materialise_sql)
    for name in ("curate_audit", "curate_record", "curate_record_values"):
        stages.text.append(stages.prepare(name, {"pods": False, "curation_id": ""}, {})[0])
    custom = session.check_user_sql(recipe.sql)[0] if recipe.sql is not None else None
    if stages.text != stage_texts(params, recipe, custom):
        raise RuntimeError("curate.run: the stages run differ from stage_texts(); update the plan with the run")
    sql_sha = stages.sha256()
    curation_id = curation_id_for(snap.seq, recipe.name, params.to_json(), sql_sha)

    summary = run_summary(stages, p)
    rows_per_shard = curated_rows_per_shard(summary)
    record = new_record(curation_id, snap.seq, recipe, params, sql_sha, summary, result["sample_budget"], threshold)
    out = CurationResult(curation_id, record, summary["reasons"], snap.seq, committed=False)

    def curated_tables():
        """Curated rows, input shard by input shard, each sorted by rollout_id (bounded memory)."""
        for path in shards_with_selected_rows(session, snap.files("rollouts")):
            table = materialise_shard(session, path, materialise_sql, mask_params)
            if table.num_rows:
                yield table

    def parts():
        kept_ids, kept_counts, output_files = [], [], []
        pending: list[pa.Table] = []
        pending_rows = 0
        index = 0

        def flush():
            nonlocal pending, pending_rows, index
            name = f"part-{index:05d}"
            table = curated_table(pending, curation_id)
            output_files.append(f"curated/{curation_id}/{name}.parquet")
            pending, pending_rows, index = [], 0, index + 1
            return Part("curated", table, curation_id, curation_id, name)

        for table in curated_tables():
            kept_ids.extend(table.column("rollout_id").to_pylist())
            kept_counts.extend(table.column("tokens_kept").to_pylist())
            record["old_logprobs_fallback"] += int(pc.sum(table.column("fallback")).as_py() or 0)
            while table.num_rows:
                take = min(table.num_rows, rows_per_shard - pending_rows)
                pending.append(table.slice(0, take))
                pending_rows += take
                table = table.slice(take)
                if pending_rows == rows_per_shard:
                    yield flush()
        if pending_rows:
            yield flush()
        record["tokens_kept"] = int(sum(kept_counts))
        session.con.register("kept_counts", kept_counts_table(kept_ids, kept_counts))
        out.audit = stages.table("curate_audit", {"curation_id": curation_id}).cast(SELECTIONS)
        session.con.unregister("kept_counts")
        output_files.append(f"audit/{curation_id}/audit.parquet")
        record["output_files"] = json.dumps(output_files)
        out.output_files = output_files
        yield Part("selections", out.audit, curation_id, curation_id, "audit")
        yield Part("curations", pa.Table.from_pylist([record], schema=CURATIONS), curation_id)

    if not commit:
        produced = list(parts())
        curated = [part.table for part in produced if part.table_name == "curated"]
        out.curated = pa.concat_tables(curated) if curated else CURATED.empty_table()
        return out

    return publish(buf, parts, curation_id, out)


def already_committed(buf: Buffer, curation_id: str) -> bool:
    """Whether the manifest holds a live record of this curation: the only test of "committed"
    (files on disk without a manifest row are orphans of a crashed run, never trusted)."""
    return bool(buf.manifest.con.execute(
        "SELECT count(*) FROM shards WHERE table_name = 'curations' AND key = ? AND removed_seq IS NULL",
        (curation_id,),
    ).fetchone()[0])


def publish(buf: Buffer, parts, curation_id: str, out: CurationResult) -> CurationResult:
    """Commit `parts()` (curated shards, the audit, the record) in ONE manifest transaction, unless
    the manifest says this curation is already committed (then nothing is written: the run is
    idempotent). A concurrent identical run that commits first makes this one roll back."""

    def refuse_duplicate(con, _seq, _ids):
        row = con.execute(
            "SELECT count(*) FROM shards WHERE table_name = 'curations' AND key = ? AND removed_seq IS NULL",
            (curation_id,),
        ).fetchone()
        if row[0] > 1:
            raise _AlreadyCommitted()

    out.committed = True
    if already_committed(buf, curation_id):
        out.already_existed = True
        return out
    try:
        buf.commit(parts(), "curate", {"curation_id": curation_id}, refuse_duplicate)
    except _AlreadyCommitted:
        out.already_existed = True
    except FileExistsError:
        # A file of this curation is named by the manifest but its record is not live (e.g. a
        # concurrent identical run committed between our check and our link): decide again.
        if not already_committed(buf, curation_id):
            raise
        out.already_existed = True
    return out


class _AlreadyCommitted(Exception):
    pass
