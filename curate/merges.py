"""The registered merges of GLOBAL plan steps: how the partial results of one step combine.

A GLOBAL step needs the whole batch. An engine runs it over each part it holds (the embedded engine
has one part: the whole session; the Dask engine one per partition or input shard), collects the
partial results, and hands them to the step's merge, named in the plan (`Step.merge`). The merge
returns the $values the later steps bind (μ, the bucket, the token threshold, ...) or raises the
run's error. A new GLOBAL step with an existing merge needs no engine code.

Two merges are not combinations of partials:
- `whole`: the step runs once over every candidate's narrow row (the embedded session; on Dask the
  client or one task that loads them all); its result is kept under `Step.result`.
- `custom`: a custom recipe's SELECT, embedded engine only.

Invariants:
- Every combination is exact: integer counts add, the first missing id is the minimum, the token
  threshold is taken from the heads of its bucket (`curate.tokens`). So any split of the batch into
  parts gives the same values.
- `MERGES` names every merge a plan may use (each registered with `@register_merge`); both
  engines dispatch through it. Besides these
  combinations, merges that find a refusal (`one_run`, `first_missing`, `first_without_behaviour`)
  raise the run's one-line error; nothing is committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .params import CurationError, EmptyBatch
from .tokens import check_exact, mask_values, merge_histograms, missing_entropies_error, pick_bucket, threshold_of


def mu_of(counts: list[tuple[int, int]]) -> float | None:
    """μ = Σk / Σn over the partitions' (k, n) counts (None when Σn = 0)."""
    k = sum(int(c[0] or 0) for c in counts)
    n = sum(int(c[1] or 0) for c in counts)
    return k / n if n else None


def _rows(partials: list) -> list[tuple]:
    return [row for part in partials for row in part]


@dataclass(frozen=True)
class Merge:
    combine: Callable[[list, dict], dict] | None  # None: the step runs once over the whole batch
    arrow: bool = False  # partials are Arrow tables (else lists of rows)
    runs: Callable[[dict], bool] = lambda values: True  # False: nothing to do (the step is skipped)
    values: tuple[str, ...] = ()  # the run's $values it reads (--explain shows them)


MERGES: dict[str, Merge] = {}


def register_merge(name: str, **declared) -> Callable[[Callable | None], Callable | None]:
    """Register the merge `name` with the decorated combination (and `declared`'s `Merge` fields), as
    a loss is registered with `register_loss`; `register_merge(name)(None)` registers a merge that is
    no combination (`whole`, `custom`). A name registered twice is an error."""

    def decorate(combine):
        if name in MERGES:
            raise ValueError(f"merge {name!r} registered twice")
        MERGES[name] = Merge(combine, **declared)
        return combine

    return decorate


@register_merge("nonempty")
def _nonempty(partials: list, values: dict) -> dict:
    n = sum(int(r[0]) for r in _rows(partials))
    if n == 0:
        raise EmptyBatch.of(values["where_text"])
    return {"batch_size": n}


@register_merge("one_run")
def _one_run(partials: list, values: dict) -> dict:
    runs = sorted({str(r[0]) for r in _rows(partials)})
    if len(runs) > 1:
        shown = ", ".join(repr(r) for r in runs[:3]) + (", ..." if len(runs) > 3 else "")
        raise CurationError(f"parameter replay: the batch holds rows of {len(runs)} runs ({shown}); replay draws "
                            "on the batch's own run, so narrow `where` to one run_id")
    return {}


@register_merge("first_without_behaviour")
def _first_without_behaviour(partials: list, values: dict) -> dict:
    missing = sorted(str(r[0]) for r in _rows(partials))
    if missing:
        raise CurationError(
            f"rollout_id={missing[0]!r}: column 'old_logprobs' is null and 'gen_logprobs' were recomputed at import "
            "by another model, so the row has no behaviour log-probs to replay it with; curate it without replay "
            "(--set replay=none) or import the trainer's log-probs")
    return {}


@register_merge("mu")
def _mu(partials: list, values: dict) -> dict:
    return {"mu": mu_of(_rows(partials))}


@register_merge("first_missing")
def _first_missing(partials: list, values: dict) -> dict:
    missing = sorted((str(r[0]), bool(r[1]), str(r[2])) for r in _rows(partials))
    if missing:
        rid, absent, file = missing[0]
        if not absent:
            raise CurationError(f"{file}: row rollout_id={rid!r}: column 'entropies' holds NaN or infinity; import "
                                "refuses such rows, so this shard reached the buffer another way: re-import it from "
                                "its source, or quarantine it")
        raise missing_entropies_error(rid, values["token_mode"])
    return {}


@register_merge("first_non_finite")
def _first_non_finite(partials: list, values: dict) -> dict:
    bad = sorted((str(r[0]), str(r[1]), r[2]) for r in _rows(partials))
    if bad:
        rid, file, reward = bad[0]
        raise CurationError(f"{file}: row rollout_id={rid!r}: column 'reward': {reward} is not a finite number; "
                            "import refuses such rows, so this shard reached the buffer another way: re-import it "
                            "from its source, or quarantine it")
    return {}


@register_merge("histogram", values=("token_budget",))
def _histogram(partials: list, values: dict) -> dict:
    found = pick_bucket(merge_histograms([[(int(b), int(n)) for b, n in p] for p in partials]), values["token_budget"])
    if found is None:
        return {"bucket": None, "n": 0, **mask_values(None)}
    bucket, offset = found
    return {"bucket": bucket, "n": offset + 1}


@register_merge("heads", arrow=True, runs=lambda values: values.get("bucket") is not None)
def _heads(partials: list, values: dict) -> dict:
    threshold = threshold_of(partials, values["n"] - 1)
    return {**mask_values(threshold), "threshold": threshold}


@register_merge("kept", values=("token_budget",))
def _kept(partials: list, values: dict) -> dict:
    total = sum(int(r[0]) for r in _rows(partials))
    if values.get("token_budget") is not None:
        check_exact(values["token_budget"], total)
    return {"tokens_kept": total}


register_merge("whole", arrow=True)(None)  # the step runs once over every candidate (see above)
register_merge("custom")(None)  # a custom recipe's SELECT, embedded engine only
