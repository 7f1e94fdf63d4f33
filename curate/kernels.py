"""Kernel steps: the registered Python/numpy functions a plan runs beside its SQL steps.

A kernel turns a relation (an Arrow table holding at least the columns it `reads`) into the same
rows with the columns it `adds` (and without those it `drops`). A plan step names a kernel and its
arguments (`curate.plan`, `Step.kernel`, `Step.args`); `rollstore recipes --explain` shows it, and
the curation id hashes its name, version and arguments, as it hashes an SQL step's text.

Invariants:
- `KERNELS` names every kernel a plan may use; both engines run a kernel step through `apply`
  and nothing else (the embedded engine in its process, the Dask engine in the task that holds
  the rows), so both write the same bytes.
- `apply` checks the relation on the way in (every column the kernel reads is there) and on the
  way out (exactly the declared columns, of the declared types, one value per input row): a
  kernel that returns another shape stops the run with one line naming the step, and nothing is
  committed (the engines commit after every kernel step has run).
- A change to what a kernel computes bumps its `version` (so every curation id that used it
  changes); a faster kernel with the same results keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pyarrow as pa

from rollstore.storage.references import logprob_lists

from .params import CurationError
from .tokens import keep_runs


@dataclass(frozen=True)
class Kernel:
    name: str
    version: str
    fn: Callable[[pa.Table, dict, dict], dict]  # (rows with `reads`, run values, step args) -> {column: array}
    reads: tuple[str, ...]
    adds: tuple[tuple[str, pa.DataType], ...]
    drops: tuple[str, ...] = ()
    doc: str = ""  # one line for --explain


def _keep_runs(rows: pa.Table, values: dict, args: dict) -> dict:
    return {"keep_runs": keep_runs(rows, args["token"], values)}


def _fallback(rows: pa.Table, values: dict, args: dict) -> dict:
    flags, bad = logprob_lists(rows.column("shard_file"), rows.column("rollouts_row").to_numpy(),
                               rows.column("rollout_id"))
    if bad is not None:
        rid, file, column = bad
        raise CurationError(f"{file}: row rollout_id={rid!r}: column {column!r} holds NaN or infinity; import "
                            "refuses such rows, so this shard reached the buffer another way: re-import it from its "
                            "source, or quarantine it")
    return {"fallback": pa.array(flags, pa.bool_())}


KERNELS: dict[str, Kernel] = {
    "keep_runs": Kernel(
        "keep_runs", "1", _keep_runs, ("rollout_id", "advantage", "tokens", "entropies"),
        (("keep_runs", pa.list_(pa.int32())),), drops=("entropies",),
        doc="the loss mask as kept runs [s0, e0, s1, e1, …] from the entropies and $thr, $thr_rollout, $thr_pos "
            "(curate/tokens.py keep_runs; the predicate of curate_tokens_kept.sql)"),
    "fallback": Kernel(
        "fallback", "1", _fallback, ("shard_file", "rollouts_row", "rollout_id"),
        (("fallback", pa.bool_()),),
        doc="whether the row has no old_logprobs (the rollouts shards' column statistics; the column is decoded "
            "only in row groups that may hold a null), and refuses NaN/inf log-probs "
            "(storage/references.py logprob_lists)"),
}


def signature(name: str, args: tuple[tuple[str, object], ...]) -> str:
    """What the curation id hashes of a kernel step: its name, version and arguments."""
    k = KERNELS[name]
    return f"kernel {k.name} version {k.version} " + " ".join(f"{a}={v!r}" for a, v in args)


def apply(step, table: pa.Table, values: dict) -> pa.Table:
    """`table` after kernel step `step`: its declared columns added (and dropped), checked."""
    k = KERNELS[step.kernel]
    where = f"kernel step {k.name} (version {k.version})"
    missing = [c for c in k.reads if c not in table.column_names]
    if missing:
        raise CurationError(f"{where}: its input has no column {missing[0]!r} "
                            f"(columns: {', '.join(table.column_names)}); nothing was committed (please report this)")
    out = k.fn(table.select(list(k.reads)), values, dict(step.args))
    got = sorted(out) if isinstance(out, dict) else None
    want = sorted(name for name, _ in k.adds)
    if got != want:
        shape = "columns " + ", ".join(got) if got is not None else type(out).__name__
        raise CurationError(f"{where}: returned {shape}, declared {', '.join(want)}; nothing was committed")
    table = table.drop_columns(list(k.drops))
    for name, dtype in k.adds:
        col = out[name]
        if not isinstance(col, (pa.Array, pa.ChunkedArray)) or len(col) != table.num_rows or col.type != dtype:
            arrow = isinstance(col, (pa.Array, pa.ChunkedArray))
            shape = f"{len(col)} values of {col.type}" if arrow else type(col).__name__
            raise CurationError(f"{where}: column {name!r}: returned {shape}, declared {table.num_rows} values of "
                                f"{dtype}; nothing was committed")
        table = table.append_column(name, col)
    return table
