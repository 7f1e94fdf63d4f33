"""Custom recipes: a user's SELECT over the `candidates` view chooses rows and their advantages.

Invariants:
- The user SQL runs in the session's sandbox and must be one SELECT (checked before it runs).
- Its result must have `rollout_id` and `advantage` (optional `weight`), the last two numeric;
  every id must be a candidate of the pool, appear once, and carry an advantage (and a
  non-negative weight) that is finite AFTER the cast to float32, the type it is stored in —
  otherwise one error line names the rollout_id and the column, and nothing is written.
- Rows it returns become `selected` with advantage_final = f32(advantage); the rest of the pool
  `not_selected`; the audit treats them like any built-in recipe.
"""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.compute as pc

from rollstore.queries.session import Session
from rollstore.storage.errors import RollstoreError



class CustomRecipeError(RollstoreError):
    pass


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t) or pa.types.is_null(t)


def _as_f32(col) -> list:
    """Values as stored (float32), back in Python floats: 1e39 becomes inf here, and is refused."""
    return col.cast(pa.float64()).cast(pa.float32(), safe=False).cast(pa.float64()).to_pylist()


def choose_custom(session: Session, statement: str) -> None:
    """Run the user's SELECT over `candidates` (one statement, checked by the sandbox), validate its
    result, and leave its choice as the temp table `custom_choice` (curate_custom_apply.sql
    records it in `work`)."""
    result: pa.Table = session.run_user_sql(statement, timeout=None)
    cols = result.column_names
    twice = sorted({c for c in cols if cols.count(c) > 1})
    if twice:
        raise CustomRecipeError(f"custom recipe: the result has column {twice[0]!r} {cols.count(twice[0])} times "
                                "(give each column once)")
    for need in ("rollout_id", "advantage"):
        if need not in cols:
            raise CustomRecipeError(f"custom recipe: the result has no column {need!r} (columns: {', '.join(cols)})")
    for name in ("advantage", "weight"):
        if name in cols and not _numeric(result.column(name).type):
            raise CustomRecipeError(f"custom recipe: column {name!r} is {result.column(name).type}, not a number")
    work = session.unload("work")
    pool = set(work.filter(pc.is_null(work.column("reason"))).column("rollout_id").to_pylist())
    ids = result.column("rollout_id").to_pylist()
    advs = _as_f32(result.column("advantage"))
    weights = _as_f32(result.column("weight")) if "weight" in cols else [1.0] * len(ids)
    seen: set = set()
    for rid, adv, weight in zip(ids, advs, weights):
        if rid not in pool:
            raise CustomRecipeError(f"custom recipe: row rollout_id={rid!r}: column 'rollout_id': not a candidate of this batch")
        if rid in seen:
            raise CustomRecipeError(f"custom recipe: row rollout_id={rid!r}: column 'rollout_id': returned twice")
        seen.add(rid)
        if adv is None or not math.isfinite(adv):
            raise CustomRecipeError(f"custom recipe: row rollout_id={rid!r}: column 'advantage': {adv!r} is not a finite number")
        if weight is None or not math.isfinite(weight) or weight < 0:
            raise CustomRecipeError(f"custom recipe: row rollout_id={rid!r}: column 'weight': {weight!r} is not a finite number ≥ 0")
    chosen = pa.table({
        "rollout_id": pa.array(ids, pa.string()),
        "adv": pa.array(advs, pa.float64()).cast(pa.float32()),
        "wt": pa.array(weights, pa.float64()).cast(pa.float32()),
    })
    session.load("custom_choice", chosen)
