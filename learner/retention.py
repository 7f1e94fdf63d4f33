"""Checkpoint retention: keep the files of the newest K checkpoints of a run, and of those still needed.

Each checkpoint version writes its weights, tokenizer and optimiser state (a 7B policy: tens of GB);
a run of thousands of steps cannot keep them all. Retention decides which versions give their files
up; `storage.maintenance.collect_pruned` (run by `gc`, and by a learner right after each prune)
removes them.

Invariants:
- A version is *pruned* by setting `pruned_seq` on its row of the catalog's checkpoint index, in
  one manifest transaction (the publishing one, when a learner saves with a `Retention`). The row
  stays: lineage, the consumed ledger (exactly-once) and `training` rows never change, and
  `checkpoint:latest` is the highest version, whose files are always kept (K ≥ 1).
- Kept, whatever K: the newest K versions of each run; the newest `replay_window` + 1 versions of
  each run (a replay window needs its behaviour policies); a version a live process holds
  (`hold`: a following learner or generator, until its hold expires); a version with a user's tag.
- Asked explicitly (`prune_checkpoints(strict=True)`, `rollstore gc --keep-checkpoints K`), a K
  that would prune a held version or one a replay window needs is refused with one line naming
  it, and nothing is pruned. A learner's automatic pruning keeps such versions instead.
- Files are removed only after the commit that prunes them, and only when no pinned snapshot older
  than that commit remains (as for retired shards): a reader that listed the version before it was
  pruned keeps its files.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollstore.storage.buffer import Buffer
from rollstore.storage.errors import RollstoreError

from .checkpoint import checkpoint_rows, get_checkpoint, index_missing

DEFAULT_KEEP = 3  # as verl's max_actor_ckpt_to_keep would be set for a long run: the newest few, not every step
HOLD_TTL_S = 3600.0


class RetentionError(RollstoreError):
    """A retention request was refused; nothing was pruned."""


@dataclass(frozen=True)
class Retention:
    """What a learner keeps after each checkpoint it publishes: the newest `keep` versions of its
    run, and the newest `replay_window` + 1 (a replay window's behaviour policies)."""

    keep: int = DEFAULT_KEEP
    replay_window: int = 0

    def __post_init__(self):
        check_keep(self.keep)
        if not (isinstance(self.replay_window, int) and self.replay_window >= 0):
            raise RetentionError(f"replay window {self.replay_window!r}: give an integer ≥ 0")


def check_keep(keep) -> int:
    """`keep` itself, or one line: K must be an integer ≥ 1 (0 would delete `checkpoint:latest`)."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise RetentionError(f"--keep-checkpoints {keep!r}: give an integer ≥ 1 (the newest K checkpoints of "
                             "each run keep their files; checkpoint:latest always does)")
    return keep


def hold(buf: Buffer, holder: str, version: int, ttl: float = HOLD_TTL_S) -> None:
    """Keep the files of `version` while `holder` (a following learner or generator) lives: until
    `ttl` seconds from now, renewed by calling again; `release` ends it."""
    buf.manifest.hold_checkpoint(holder, version, ttl)


def release(buf: Buffer, holder: str) -> None:
    buf.manifest.release_checkpoint(holder)


def tag(buf: Buffer, version: int, name: str | None) -> None:
    """Name checkpoint `version` (its files are then kept); `name=None` removes the tag."""
    ck = get_checkpoint(buf, version)
    if ck is None:
        raise RetentionError(f"{buf.root}: no checkpoint version {version} to tag")
    if ck.pruned_seq is not None and name is not None:
        raise RetentionError(f"{buf.root}: checkpoint v{version}'s files were already pruned; nothing to keep")
    buf.manifest.tag_checkpoint(version, name)


def prune_in(buf: Buffer, con, seq: int, keep: int, replay_window: int = 0, run_id: str | None = None,
             strict: bool = False, exclude=()) -> list[int]:
    """Inside the transaction `con` (commit `seq`): prune every version of `run_id` (each run when
    None) the module's rules do not keep; return the versions pruned now (see the invariants)."""
    man = buf.manifest
    if run_id is None:
        rows = checkpoint_rows(buf, None, con=con, exclude=exclude)
    else:  # a run's newest (the kept and the replay window's), and the others whose files are still kept:
        newest = checkpoint_rows(buf, run_id, newest=max(keep, replay_window + 1), con=con, exclude=exclude)
        rows = list({int(r["version"]): r for r in newest + checkpoint_rows(  # not every version of a long run
            buf, run_id, con=con, exclude=exclude, unpruned=True)}.values())
    if not rows:
        return []
    held = man.checkpoint_holds(con)
    by_run: dict[str, list[dict]] = {}
    for r in rows:
        by_run.setdefault(r["run_id"], []).append(r)
    doomed: list[dict] = []
    for run, rs in by_run.items():
        rs = sorted(rs, key=lambda r: int(r["version"]), reverse=True)
        window = {int(r["version"]) for r in rs[:replay_window + 1]}
        for r in rs[keep:]:
            v = int(r["version"])
            if r.get("pruned_seq") is not None:
                continue
            why = (f"held by {held[v]} (a following learner or generator)" if v in held else
                   f"needed by the replay window of run {run!r} ({replay_window} versions)" if v in window else
                   None)
            if why is not None:
                if strict:
                    raise RetentionError(f"{buf.root}: checkpoint v{v} is {why}; --keep-checkpoints {keep} would "
                                         "prune it; nothing was pruned")
                continue
            if r.get("tag") is not None:
                continue
            doomed.append(r)
    if doomed:
        man.prune_checkpoints(con, seq, [int(r["shard_id"]) for r in doomed])
    return sorted(int(r["version"]) for r in doomed)


def prune_checkpoints(buf: Buffer, keep: int = DEFAULT_KEEP, *, replay_window: int = 0, run_id: str | None = None,
                      strict: bool = True) -> list[int]:
    """Prune, in one commit, the versions the rules do not keep (see the module invariants); return
    them. The files go at the next `gc` (`storage.maintenance.collect_pruned`)."""
    check_keep(keep)
    Retention(keep, replay_window)
    man = buf.manifest
    man.require_writable()
    try:
        with man.transaction() as con:
            seq = man.new_commit(con, "prune:checkpoints", {"keep": keep, "replay_window": replay_window,
                                                             "run_id": run_id})
            index_missing(buf, con, seq)  # a buffer written before the index: indexed first (its files read once)
            pruned = prune_in(buf, con, seq, keep, replay_window, run_id, strict)
            if not pruned:
                raise _NothingPruned  # rolls the commit row back: a prune of nothing commits nothing
    except _NothingPruned:
        return []
    return pruned


class _NothingPruned(Exception):
    """Nothing to prune: the transaction is rolled back."""


__all__ = ["DEFAULT_KEEP", "Retention", "RetentionError", "check_keep", "hold", "release", "tag", "prune_in",
           "prune_checkpoints"]
