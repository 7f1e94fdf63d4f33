"""The cross-group sample selection in numpy: the maximum-variance subset of the whole pool.

`max_variance` is the kernel step `max_variance` (`curate.kernels`), the plan's selection with
sample=cross_group (one pool: every eligible row of the batch). It computes what
`queries/curate_select.sql` computes for one pool (the SQL stays the selection of per-group pools,
sample=in_group and pods), from the same definition (docs/curation.md §Sample selection):
budget m = min(n, max(2, ⌊n·f + ½⌋)) with f = $f_num / $f_den exactly; the pool in (v desc,
rollout_id asc) order; S_j = the first j rows ∪ the last m − j rows, j = 0..m; the variance of
every S_j from prefix sums of the values centred on the pool mean; among the j with
Var(S_j) ≥ V*·(1 − 1e-9) − 1e-12, the smallest |2j − m|, then the smaller j.

Invariants:
- The result is the table `picked` of the SQL step: one row per pool row (rollout_id, selected,
  sample_rank: 1-based among the selected rows in pool order, null when not selected), in
  rollout_id order (the order of `work`, which curate_apply_selection.sql updates in place).
- The order is exact (float64 of the stored float32 values; rollout_ids compared bytewise, as in
  DuckDB); the variances are float64 sums in another order than DuckDB's window sums, so they may
  differ in the last bits: the tie tolerance (1e-9 relative) is what makes the choice the same,
  as it makes it the same as the reference's direct `np.var` of each subset (tests/reference.py).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

PICKED_SCHEMA = pa.schema([("rollout_id", pa.string()), ("selected", pa.bool_()), ("sample_rank", pa.int32())])


def budget(n: int, f_num: int, f_den: int) -> int:
    """m = min(n, max(2, ⌊n·f + ½⌋)), in integers."""
    return min(n, max(2, (2 * n * f_num + f_den) // (2 * f_den)))


def max_variance(rows: pa.Table, values: dict, args: dict) -> pa.Table:
    """`picked` for one pool: the eligible rows (reason null) of `rows` (rollout_id, reason and the
    value column `args["value"]`), with f = $f_num / $f_den from `values`."""
    pool = rows.filter(pc.is_null(rows.column("reason")))
    pool = pool.sort_by("rollout_id") if pool.num_rows else pool
    n = pool.num_rows
    if n == 0:
        return PICKED_SCHEMA.empty_table()
    ids = pool.column("rollout_id").combine_chunks().cast(pa.string())
    v = pool.column(args["value"]).to_numpy(zero_copy_only=False).astype(np.float64)
    order = pc.sort_indices(pa.table({"v": v, "id": ids}), [("v", "descending"), ("id", "ascending")]).to_numpy()
    m = budget(n, int(values["f_num"]), int(values["f_den"]))
    c = v[order] - v.mean()
    s1 = np.zeros(n + 1)
    s2 = np.zeros(n + 1)
    np.cumsum(c, out=s1[1:])
    np.cumsum(c * c, out=s2[1:])
    j = np.arange(m + 1)
    cut = n - (m - j)
    var = (s2[j] + s2[n] - s2[cut]) / m - ((s1[j] + s1[n] - s1[cut]) / m) ** 2
    near = np.flatnonzero(var >= var.max() * (1 - 1e-9) - 1e-12)
    best = int(near[np.lexsort((near, np.abs(2 * near - m)))[0]])
    pos = np.empty(n, np.int64)
    pos[order] = np.arange(1, n + 1)
    selected = (pos <= best) | (pos > n - (m - best))
    rank = np.where(pos <= best, pos, pos - (n - m)).astype(np.int32)
    return pa.table({"rollout_id": ids, "selected": pa.array(selected, pa.bool_()),
                     "sample_rank": pa.array(rank, pa.int32(), mask=~selected)}, schema=PICKED_SCHEMA)
