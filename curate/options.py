"""How a curation runs, as opposed to what it decides: its limits and its engine.

Invariants:
- Neither object is part of a curation's result: the curation id, the curated shards and the
  audit are the same whatever the limits and the engine (the Dask engine writes the same bytes).
- `Limits.timeout` bounds the user's SQL (the `where` predicate, a custom recipe's SELECT): on the
  embedded engine the whole candidates and selection phases run under it; on Dask every task that
  evaluates the predicate (one per input shard) runs under it, and the client's check of the
  predicate too. Past it the run stops with one line and commits nothing.
- `memory_limit` and `threads` are per DuckDB session: the one session of the embedded engine, or
  each task's on Dask.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollstore.queries.session import DEFAULT_MEMORY_LIMIT

from .params import ParamError

CURATION_TIMEOUT = 600.0  # seconds the user SQL of a curation may run by default


@dataclass(frozen=True)
class Limits:
    memory_limit: str = DEFAULT_MEMORY_LIMIT
    threads: int | None = None  # DuckDB's default (the cores) when None
    timeout: float | None = CURATION_TIMEOUT  # seconds; None or 0: none


@dataclass(frozen=True)
class Dask:
    """The Dask engine: `scheduler` is "local:N" (a LocalCluster of N one-thread worker
    processes), a scheduler address, or a `distributed.Client`; `partitions` hash partitions of the
    batch (default: 2 per worker)."""

    scheduler: object = None
    partitions: int | None = None


def engine_option(name: str, scheduler: str | None = None, partitions: int | None = None) -> str | Dask:
    """The engine the command line names: "embedded", or "dask" with its scheduler and partitions."""
    if name == "dask":
        return Dask(scheduler, partitions)
    if name != "embedded":
        raise ParamError(f"unknown engine {name!r} (embedded or dask)")
    if scheduler is not None or partitions is not None:
        raise ParamError("a scheduler and partitions are options of the dask engine: add --engine dask")
    return name
