"""One curation run: a snapshot and a recipe in, curated shards + audit + a curation record out.

Invariants:
- The stages run in algorithms.md's order, each as one SQL file of `queries/`, in one DuckDB
  session over one pinned snapshot; per-token arrays are read from Parquet only by the token and
  materialisation stages, and never pulled into Python except as the output being written.
- Every candidate gets exactly one audit row with exactly one reason.
- Curated shards, audit rows and the record are published in ONE manifest commit; a failure
  before it leaves nothing visible. The curation id is a hash of the snapshot, the recipe, the
  effective parameters and the SQL text, so re-running the same curation is idempotent and gives
  byte-identical files.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from dataclasses import dataclass, field
from fractions import Fraction

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
    """Runs the stage files in one session and keeps the exact SQL text for the record's hash."""

    def __init__(self, session: Session):
        self.session = session
        self.text: list[str] = []

    def run(self, name: str, params: dict | None = None, **subs: str):
        sql, args = self.prepare(name, params, subs)
        return self.session.execute(sql, args if args else None)

    def table(self, name: str, params: dict | None = None, **subs: str) -> pa.Table:
        sql, args = self.prepare(name, params, subs)
        return self.session.con.sql(sql, params=args or None).to_arrow_table()

    def prepare(self, name: str, params: dict | None, subs: dict[str, str]) -> tuple[str, dict]:
        sql = load_sql(name)
        for key, value in subs.items():
            sql = sql.replace("{" + key + "}", value)
        self.text.append(sql)
        needed = set(re.findall(r"\$([a-z_]+)", sql))
        args = {k: v for k, v in (params or {}).items() if k in needed}
        missing = needed - set(args)
        if missing:
            raise RuntimeError(f"{name}.sql needs parameters {sorted(missing)}")
        return sql, args

    def sha256(self) -> str:
        return hashlib.sha256("\n;\n".join(self.text).encode()).hexdigest()


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
    if k <= 0:
        return None
    hist = session.execute(
        "SELECT bucket, count(*) FROM token_scores GROUP BY bucket ORDER BY bucket DESC"
    ).fetchall()
    above = 0
    for bucket, n in hist:
        if above + n >= k:
            row = session.one(
                "SELECT score, rollout_id, pos FROM token_scores WHERE bucket = $b "
                "ORDER BY score DESC, rollout_id ASC, pos ASC LIMIT 1 OFFSET $o",
                {"b": bucket, "o": k - above - 1},
            )
            return float(row[0]), str(row[1]), int(row[2])
        above += n
    return None


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
) -> CurationResult:
    """Run `recipe` (with `sets` overrides) over a snapshot; commit unless `commit` is False."""
    params = resolve(recipe, dict(sets or {}))
    if recipe.sql is not None and params["sample"] != "none":
        raise ParamError("a custom SQL recipe replaces the sample stage: leave `sample` at none")
    with buf.snapshot(snapshot_seq, pin=True) as snap, Session(snap, memory_limit, threads) as session:
        values = dict(params.values)
        if values["where"] is None:
            values["where"] = _default_where(session)
            if values["where"] is None:
                raise CurationError("empty batch: the snapshot has no rollouts")
        if values["current_version"] is None:
            values["current_version"] = _default_version(session)
        params = Params(values, params.user_set)
        session.check_user_sql(f"SELECT * FROM rollouts WHERE ({values['where']})")
        stages = _Stages(session)
        result = _run_stages(stages, session, params, recipe)
        return _materialise(buf, snap, session, stages, params, recipe, result, commit)


def _run_stages(stages: _Stages, session: Session, params: Params, recipe: Recipe) -> dict:
    p = params
    pods = p["sample"] == "pods"
    tau = p["amplify_tau"]
    f = p.sample_fraction()
    q = {
        "drop_truncated": p["truncated"] == "drop",
        "max_policy_lag": p["max_policy_lag"],
        "max_reuse": p["max_reuse"],
        "current_version": p["current_version"],
        "std_mode": p["std"],
        "dynamic": p["filter"] == "dynamic",
        "window": p["difficulty_window"],
        "prior": float(p["difficulty_prior"]),
        "tau_num": tau.numerator,
        "tau_den": tau.denominator,
        "w_max": float(p["amplify_max"]),
        "mode": p["amplify"],
        "amplify_on": p["amplify"] != "none",
        "pods": pods,
        "f_num": f.numerator,
        "f_den": f.denominator,
    }
    if q["current_version"] is None:
        q["current_version"] = 0
    stages.run("curate_candidates", q, where=p["where"])
    n_candidates = session.one("SELECT count(*) FROM work")[0]
    if n_candidates == 0:
        raise CurationError(f"empty batch: no rollouts match where = {p['where']}")
    eligible = "(SELECT * FROM work WHERE reason IS NULL)"
    stages.run("curate_group_stats", q, rows=eligible, out="full_groups")
    stages.run("curate_advantages", q, rows=eligible, groups="full_groups", out="full_adv")
    stages.run("curate_filter", q)
    if p["amplify"] == "da3po":
        stages.run("curate_difficulty", q)
    else:
        session.execute("CREATE OR REPLACE TEMP TABLE difficulty AS SELECT NULL::VARCHAR AS group_id, NULL::DOUBLE AS q_hat WHERE false")
    empty_subset = "CREATE OR REPLACE TEMP TABLE subset_adv AS SELECT NULL::VARCHAR AS rollout_id, 0 AS g_size, 0 AS g_correct, 0.0::FLOAT AS adv WHERE false"
    if not pods:
        session.execute(empty_subset)
        stages.run("curate_amplify_inputs", q)
        stages.run("curate_amplify", q)
    sample_budget = None
    if recipe.sql is not None:
        sample_budget = apply_custom_recipe(session, stages, recipe.sql)
    elif p["sample"] == "none":
        session.execute(
            "CREATE OR REPLACE TEMP TABLE picked AS SELECT rollout_id, true AS selected, "
            "NULL::INTEGER AS sample_rank FROM work WHERE reason IS NULL"
        )
        stages.run("curate_apply_selection", q)
    else:
        pool_key = "'batch'" if p["sample"] == "cross_group" else "group_id"
        value = "reward" if pods else "advantage_final"
        stages.run("curate_select", q, pool_key=pool_key, value=value)
        stages.run("curate_apply_selection", q)
        sample_budget = session.one("SELECT count(*) FROM work WHERE selected")[0]
    if pods:
        chosen = "(SELECT * FROM work WHERE selected)"
        stages.run("curate_group_stats", q, rows=chosen, out="subset_groups")
        stages.run("curate_advantages", q, rows=chosen, groups="subset_groups", out="subset_adv")
        stages.run("curate_amplify_inputs", q)
        stages.run("curate_amplify", q)
    return {"sample_budget": sample_budget}


def _materialise(buf, snap, session, stages, params, recipe, result, commit) -> CurationResult:
    p = params
    token = p["token"]
    kappa: Fraction | None = p.token_fraction() if token != "none" else None
    threshold = None
    if token != "none":
        missing = session.one(
            "SELECT w.rollout_id FROM work w JOIN rollouts r USING (rollout_id) "
            "WHERE w.selected AND r.entropies IS NULL ORDER BY w.rollout_id LIMIT 1"
        )
        if missing:
            raise CurationError(
                f"rollout_id={missing[0]!r}: column 'entropies' is null, but token={token} needs "
                f"per-token entropies; {FILL_ENTROPIES} (or run with --set token=none)"
            )
        stages.run("curate_token_scores", score=_score_expr(token, "h", "advantage_final"))
        n_tokens = session.one("SELECT coalesce(sum(tokens_total), 0) FROM work WHERE selected")[0]
        threshold = _threshold(session, token_budget(int(n_tokens), kappa))
    mask_params = {
        "token_stage": token != "none",
        "thr": threshold[0] if threshold else float("inf"),
        "thr_rollout": threshold[1] if threshold else "",
        "thr_pos": threshold[2] if threshold else 0,
    }
    mask_score = _score_expr(token, "h", "w.advantage_final")
    materialise_sql, _ = stages.prepare("curate_materialise", mask_params, {"score": mask_score})
    stages.text.append(materialise_sql)
    for name in ("curate_audit", "curate_record"):
        stages.text.append(stages.prepare(name, {"pods": False, "curation_id": ""}, {})[0])
    sql_sha = stages.sha256()
    params_json = params.to_json()
    curation_id = curation_id_for(snap.seq, recipe.name, params_json, sql_sha)

    rec = stages.run("curate_record", {"pods": p["sample"] == "pods"}).fetchall()[0]
    n_candidates, n_selected, tokens_candidate, var_before, var_after = rec
    reasons = dict(session.execute("SELECT reason, count(*) FROM work GROUP BY reason ORDER BY reason").fetchall())
    curated_tokens = int(session.one("SELECT coalesce(sum(tokens_total), 0) FROM work WHERE selected")[0])
    per_row = max(1, (curated_tokens * 14 + int(n_selected) * 64) // max(1, int(n_selected)))
    rows_per_shard = max(1, CURATED_SHARD_BYTES // per_row)
    record = {
        "curation_id": curation_id,
        "created_at": dt.datetime.now(dt.timezone.utc),
        "recipe": recipe.name,
        "params": params_json,
        "sql_sha256": sql_sha,
        "snapshot_seq": snap.seq,
        "progress": float(p["progress"]),
        "sample_budget": result["sample_budget"],
        "token_fraction": float(kappa) if kappa is not None else None,
        "token_threshold": threshold[0] if threshold else None,
        "n_candidates": int(n_candidates),
        "n_selected": int(n_selected),
        "tokens_candidate": int(tokens_candidate),
        "tokens_kept": 0,
        "adv_var_before": var_before,
        "adv_var_after": var_after,
        "old_logprobs_fallback": 0,
        "output_files": "[]",
    }
    out = CurationResult(curation_id, record, reasons, snap.seq, committed=False)

    def curated_tables():
        """Curated rows, input shard by input shard, each sorted by rollout_id (bounded memory)."""
        for path in snap.files("rollouts"):
            session.execute(f"CREATE OR REPLACE TEMP VIEW shard_rows AS SELECT * FROM read_parquet({sql_string(path)})")
            table = session.con.sql(materialise_sql, params=mask_params).to_arrow_table()
            if table.num_rows:
                yield table.take(pc.sort_indices(table, [("rollout_id", "ascending")]))

    def parts():
        kept_ids, kept_counts, output_files = [], [], []
        pending: list[pa.Table] = []
        pending_rows = 0
        index = 0

        def flush():
            nonlocal pending, pending_rows, index
            name = f"part-{index:05d}"
            table = pa.concat_tables(pending)
            table = table.add_column(0, "curation_id", pa.array([curation_id] * table.num_rows, pa.string()))
            output_files.append(f"curated/{curation_id}/{name}.parquet")
            pending, pending_rows, index = [], 0, index + 1
            return Part("curated", table.select(CURATED.names).cast(CURATED), curation_id, curation_id, name)

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
        session.con.register("kept_counts", pa.table({
            "rollout_id": pa.array(kept_ids, pa.string()), "tokens_kept": pa.array(kept_counts, pa.int32())}))
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

    def refuse_duplicate(con, _seq, _ids):
        row = con.execute(
            "SELECT count(*) FROM shards WHERE table_name = 'curations' AND key = ? AND removed_seq IS NULL",
            (curation_id,),
        ).fetchone()
        if row[0] > 1:
            raise _AlreadyCommitted()

    existing = buf.manifest.con.execute(
        "SELECT count(*) FROM shards WHERE table_name = 'curations' AND key = ?", (curation_id,)
    ).fetchone()[0]
    out.committed = True
    if existing:
        out.already_existed = True
        return out
    try:
        buf.commit(parts(), "curate", {"curation_id": curation_id}, refuse_duplicate)
    except (_AlreadyCommitted, FileExistsError):
        out.already_existed = True
    return out


class _AlreadyCommitted(Exception):
    pass
