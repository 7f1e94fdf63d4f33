"""The Python front door's curation handle: one curation's rows, audit, summary, comparison and
"why", and its rows as tensors for a user's own learner.

Invariants:
- Only this curation's files are read: its curated shards and its audit shard are the manifest's
  shards keyed by its id, filtered before anything is resolved (a thin curated row's references
  are resolved for this curation's rows alone, never for every curation's, Polars' "filter before
  you materialise").
- Lazy: nothing is read when the handle is made; `curated`, `audit` and `summary` are read on
  first use and kept (a committed curation never changes).
- Every value is Polars (or a small dataclass of Polars frames and plain values); nothing prints.
- `compare` returns the data of `rollstore audit A --compare B`, `why` the data of
  `rollstore audit A --rollout R` (same SQL files: queries/audit_*.sql).
- A dry run's handle has its record and audit (in memory) but no curated rows: `curated`,
  `batches`, `compare` and `why` raise one line saying so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Iterator, Protocol

import pyarrow as pa

from rollstore.storage.errors import RollstoreError

if TYPE_CHECKING:
    import polars as pl

    from rollstore.curate.run import CurationResult
    from rollstore.learner.batches import Batch
    from rollstore.storage.buffer import Buffer as StorageBuffer

class Buffer(Protocol):
    """What a curation handle asks of the buffer handle that made it (`rollstore.handle.Buffer`;
    named here so that this module does not import the one that imports it)."""

    root: str

    def _open(self) -> AbstractContextManager["StorageBuffer"]: ...
    def _curation_id(self, curation: "Curation | str", command: str = ..., name: str = ...) -> str: ...
    def curations(self) -> "pl.DataFrame": ...
    def curation(self, curation_id: str | None = None) -> "Curation": ...


RECORD_FIELDS = ("curation_id", "recipe", "created_at", "snapshot_seq", "progress", "n_candidates", "n_selected",
                 "sample_budget", "tokens_candidate", "tokens_kept", "token_fraction", "token_threshold",
                 "adv_var_before", "adv_var_after", "params")


@dataclass(frozen=True)
class Comparison:
    """Two curations side by side (the data of `rollstore audit A --compare B`)."""

    a: str
    b: str
    summary: "pl.DataFrame"  # one row per side: candidates, kept, tokens, Var(A) ...
    params: "pl.DataFrame"  # parameters whose effective values differ
    reasons: "pl.DataFrame"  # candidates by reason in A and in B
    differences: "pl.DataFrame"  # rollouts treated differently (kind a_only / b_only / ...)
    training: "pl.DataFrame | None" = None  # how each was trained: training.* entries (run, version, μ, lr, ...)

    def __repr__(self) -> str:
        return (f"<Comparison {self.a} vs {self.b}: {self.differences.height} rollouts treated differently, "
                f"{self.params.height} parameters differ>")


@dataclass(frozen=True)
class Why:
    """Why one rollout was kept or dropped by one curation (`Curation.why`).

    `pool_position` of `pool_size`: its place in its sample-selection pool, ordered by
    `selection_value` (advantage_final, or the reward with PODS) descending; `budget`: the rows the
    pool kept: the top `top_kept` ranks and the ranks from `bottom_from` on (the max-variance subset
    keeps both ends of the order); `side`: where the row fell — `top` or `bottom` (kept), `middle`
    (dropped), `whole pool` (nothing dropped), None (refused before sample selection). A row is kept
    when its value is ≥ `keep_at_or_above` or ≤ `keep_at_or_below`. `token_threshold`: the |A|·H
    score a token needed to stay in the loss. `tokens`: position, token id, its `text` (decoded as
    `rollstore audit --rollout` shows it), entropy, score and kept per token."""

    curation_id: str
    rollout_id: str
    reason: str
    selected: bool
    selection_value: float | None
    pool_position: int | None
    pool_size: int | None
    budget: int | None
    keep_at_or_above: float | None
    keep_at_or_below: float | None
    token_threshold: float | None
    advantage_final: float | None
    prompt: str
    gold_answer: str | None
    response: str
    tokens: "pl.DataFrame" = field(repr=False)
    details: dict = field(repr=False, default_factory=dict)  # every column of queries/audit_why.sql
    top_kept: int | None = None
    bottom_from: int | None = None
    side: str | None = None

    def explain(self) -> str:
        """The answer as one sentence: the reason and which side of the cut-off the row fell on."""
        from rollstore.report.audit import why_sentence

        return why_sentence(self.details, self.token_threshold)


class Curation:
    """A handle to one curation of a buffer (from `Buffer.curate` or `Buffer.curation(id)`)."""

    def __init__(self, buffer: "Buffer", curation_id: str, result: "CurationResult | None" = None):
        self.buffer = buffer
        self.id = curation_id
        self._result = result
        self._cache: dict[str, Any] = {}

    @property
    def result(self) -> "CurationResult | None":
        """What the `Buffer.curate` call that made this handle returned (its record, reasons, dry-run
        state; what `rollstore curate` prints); None for a handle opened by id."""
        return self._result

    @property
    def committed(self) -> bool:
        """False for a dry run (nothing written)."""
        return self._result is None or self._result.committed

    def __repr__(self) -> str:
        try:
            r = self.record
            return (f"<rollstore.Curation {self.id} ({r['recipe']}, snapshot {r['snapshot_seq']}): "
                    f"{r['n_selected']} of {r['n_candidates']} candidates kept, {r['tokens_kept']} of "
                    f"{r['tokens_candidate']} tokens{'' if self.committed else ', dry run'}>")
        except RollstoreError as exc:
            return f"<rollstore.Curation {self.id}: unreadable ({exc})>"

    def _require_committed(self, what: str) -> None:
        if not self.committed:
            raise RollstoreError(f"curation {self.id} is a dry run: nothing was written, so it has no {what}")

    def _files(self, table: str) -> list[str]:
        """This curation's shards of `table` (keyed by its id) at the latest snapshot."""
        with self.buffer._open() as buf, buf.snapshot() as snap:
            files = [f"{buf.root}/{s.path}" for s in snap.shards(table) if s.key == self.id]
        if not files and table == "curations":
            from rollstore.storage.errors import unknown_curation

            with self.buffer._open() as buf:
                known = [s.key for s in buf.manifest.shards("curations")]
            raise unknown_curation(self.buffer.root, self.id, known)
        return files

    # ---- the record -----------------------------------------------------------------------

    @property
    def record(self) -> dict:
        """The curation's record (the `curations` row) as a dict; `params` decoded."""
        if "record" not in self._cache:
            if self._result is not None and not self._result.committed:
                rec = dict(self._result.record)
            else:
                import pyarrow.parquet as pq

                table = pa.concat_tables([pq.read_table(f) for f in self._files("curations")])
                rows = [r for r in table.to_pylist() if r["curation_id"] == self.id]
                rec = rows[0]
            params = rec.get("params")
            rec["params"] = json.loads(params) if isinstance(params, str) else params
            self._cache["record"] = rec
        return self._cache["record"]

    @property
    def recipe(self) -> str:
        """The recipe's name."""
        return self.record["recipe"]

    @property
    def params(self) -> dict:
        """Every parameter's effective value."""
        return dict(self.record["params"])

    @property
    def summary(self) -> "pl.DataFrame":
        """One row: what `rollstore curate` prints (candidates, budget, kept samples and tokens,
        κ and its threshold, Var(A) before and after)."""
        import polars as pl

        rec = self.record
        return pl.DataFrame([{k: rec.get(k) for k in RECORD_FIELDS if k != "params"}])

    @property
    def reasons(self) -> "pl.DataFrame":
        """Candidates, tokens and kept tokens per reason (`rollstore audit`'s first table)."""
        import polars as pl

        return (self.audit.group_by("reason")
                .agg(pl.len().alias("candidates"), pl.col("tokens_total").sum().alias("tokens"),
                     pl.col("tokens_kept").sum().alias("tokens_kept"))
                .sort(["candidates", "reason"], descending=[True, False]))

    # ---- rows -----------------------------------------------------------------------------

    @property
    def curated(self) -> "pl.DataFrame":
        """This curation's curated rows, resolved (token ids, log-probs, advantage, loss mask, weight:
        schema `curated`, docs/schema.md); only its own shards are read and resolved."""
        import polars as pl

        if "curated" not in self._cache:
            self._cache["curated"] = pl.from_arrow(self.curated_arrow())
        return self._cache["curated"]

    def curated_arrow(self) -> pa.Table:
        """`curated` as a pyarrow Table."""
        self._require_committed("curated rows")
        if "curated_arrow" not in self._cache:
            from rollstore.storage.references import read_curated_file
            from rollstore.storage.schema import CURATED

            with self.buffer._open() as buf, buf.snapshot(pin=True) as snap:
                live = [s.path for s in snap.shards("rollouts")]
                files = [f"{buf.root}/{s.path}" for s in snap.shards("curated") if s.key == self.id]
                tables = [read_curated_file(f, buf.root, live, snap.moves()) for f in files]
            self._cache["curated_arrow"] = pa.concat_tables(tables) if tables else CURATED.empty_table()
        return self._cache["curated_arrow"]

    @property
    def audit(self) -> "pl.DataFrame":
        """One row per candidate of this curation with its reason (the `selections` rows)."""
        import polars as pl

        if "audit" not in self._cache:
            if self._result is not None and not self._result.committed:
                table = self._result.audit
                self._cache["audit"] = pl.from_arrow(table) if table is not None else pl.DataFrame()
            else:
                files = self._files("selections")
                self._cache["audit"] = (pl.scan_parquet(files, glob=False, hive_partitioning=False)
                                        .filter(pl.col("curation_id") == self.id).collect())
        return self._cache["audit"]

    def batches(self, batch_size: int, *, shuffle_seed: int | None = None, pad_id: int = 0) -> Iterator["Batch"]:
        """This curation's rows as padded torch tensors, `batch_size` rows at a time (the last may be
        short): `learner.batches.Batch` (input_ids, attention_mask, positions, response_ids,
        loss_mask, old_logprobs, gen_logprobs, advantage, weight, ...), the learner's own collation.
        `shuffle_seed`: a seeded permutation, the same on every machine."""
        from rollstore import rules

        rules.check("batches", rules.BATCHES, {"batch_size": batch_size, "shuffle_seed": shuffle_seed,
                                               "pad_id": pad_id}, optional={"shuffle_seed"})
        return self._batches(batch_size, shuffle_seed, pad_id)  # checked now, not at the first next()

    def _batches(self, batch_size: int, shuffle_seed: int | None, pad_id: int) -> Iterator["Batch"]:
        from rollstore.learner.batches import collate, row_order

        rows = self.curated_arrow()
        order = row_order(rows.num_rows, shuffle_seed)
        for start in range(0, rows.num_rows, batch_size):
            yield collate(rows.take(pa.array(order[start:start + batch_size])), pad_id)

    # ---- questions ------------------------------------------------------------------------

    def _session(self):
        from contextlib import ExitStack

        from rollstore.queries.session import Session

        stack = ExitStack()
        buf = stack.enter_context(self.buffer._open())
        snap = stack.enter_context(buf.snapshot(pin=True))
        session = stack.enter_context(Session(snap))
        return stack, session

    def compare(self, other: "Curation | str") -> Comparison:
        """This curation (A) against `other` (B): the data of `rollstore audit A --compare B`."""
        import polars as pl

        from rollstore.report.audit import compare_views

        other_id = self.buffer._curation_id(other, "compare", "other")
        self._require_committed("comparison")
        if other_id not in {s for s in self.buffer.curations()["curation_id"].to_list()}:
            self.buffer.curation(other_id)  # raises UnknownCuration
        stack, session = self._session()
        with stack:
            views = dict(compare_views(session, self.id, other_id))
        return Comparison(self.id, other_id, **{k: pl.from_arrow(v) for k, v in views.items()})

    def why(self, rollout_id: "str | list[str]") -> "Why | pl.DataFrame":
        """Why a rollout was kept or dropped: its reason, its rank in its selection pool against the
        budget and the kept blocks of the order (which side of the cut-off it fell on), its tokens'
        text, scores and kept marks, the prompt and the gold answer (the data of `rollstore audit
        ID --rollout R`). Given a list of ids (at most 10,000; duplicates once): one query, a Polars
        frame with one row per id in the order given — the columns of queries/audit_why.sql and
        `why`, the sentence of `Why.explain`. An id that is not a candidate is refused with one line."""
        import polars as pl

        from rollstore import rules
        from rollstore.report.audit import why_rows, why_sentence, why_views

        if not isinstance(rollout_id, (list, tuple)):
            rollout_id = rules.text("why", "rollout_id", rollout_id)
        self._require_committed("audit to question")
        if not isinstance(rollout_id, str):
            stack, session = self._session()
            with stack:
                rows, threshold = why_rows(session, self.id, list(rollout_id))
            frame = pl.from_dicts(rows, infer_schema_length=None) if rows else pl.DataFrame()
            return frame.with_columns(pl.Series("why", [why_sentence(r, threshold) for r in rows], pl.String))
        from rollstore.report.token_text import TokenText

        stack, session = self._session()
        with stack:
            row, tokens, threshold = why_views(session, self.id, rollout_id)
            text = TokenText.for_snapshot(session)
        pieces, _ = text.pieces(row["response"] or "", tokens.column("token_id").to_pylist(), tokens.num_rows)
        frame = pl.from_arrow(tokens)
        frame = frame.insert_column(2, pl.Series("text", pieces, pl.String))
        return Why(curation_id=self.id, rollout_id=rollout_id, reason=row["reason"], selected=row["selected"],
                   selection_value=row["selection_value"], pool_position=row["pool_position"],
                   pool_size=row["pool_size"], budget=row["budget"], keep_at_or_above=row["keep_at_or_above"],
                   keep_at_or_below=row["keep_at_or_below"], token_threshold=threshold,
                   advantage_final=row["advantage_final"], prompt=row["prompt"], gold_answer=row["gold_answer"],
                   response=row["response"], tokens=frame, details=row, top_kept=row["top_kept"],
                   bottom_from=row["bottom_from"], side=row["side"])


__all__ = ["Comparison", "Curation", "Why"]
