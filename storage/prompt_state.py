"""Each prompt's group history in a run, kept as rows are committed (the catalog's `prompt_state`), and
each run's newest prompt selection (`prompt_state_runs`): what pre-rollout prompt selection (greso,
`curate.prompts`) reads every step, without reading the run's history.

Invariants:
- A prompt's state in a run summarises its groups in commit order: how many (`groups`), how many of
  the newest, consecutively, had all rewards equal (`streak`), and the newest group's (step,
  group_id) and whether all its rows were correct (a null `correct` counts as not correct). "Newest"
  orders groups by (step, group_id), as queries/prompt_history.sql does; the newest `w` of them then
  give that query's answer for any window `w`: groups_seen = min(groups, w), z = min(streak,
  groups_seen), kind of the newest group.
- A run's state is kept only from its first committed row on (`tracked`); a commit that adds a group
  older than a prompt's newest, or a selection at a step not after the run's newest selection, or any
  retirement of such rows but compaction (which moves rows, `storage.maintenance`), stops keeping it:
  `tracked` = 0, and readers recompute from the shards (the plan's queries), as before.
- Compaction and migration rewrite rows they do not add: they change no state.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc


@dataclass(frozen=True)
class Groups:
    """One prompt's groups of one run in one commit, oldest first: n, their streak from the newest,
    the oldest's and the newest's (step, group_id), and whether the newest was all correct."""

    n: int
    streak: int
    oldest: tuple[int, str]
    newest: tuple[int, str]
    newest_all_correct: bool


def group_summaries(table: pa.Table) -> dict[tuple[str, str], Groups]:
    """{(run_id, prompt_id): Groups} of a rollouts table's rows."""
    if table.num_rows == 0:
        return {}
    t = pa.table({"run_id": table.column("run_id"), "prompt_id": table.column("prompt_id"),
                  "group_id": table.column("group_id"), "step": table.column("step"),
                  "reward": table.column("reward"),
                  "correct": pc.fill_null(table.column("correct"), False)})
    g = t.group_by(["run_id", "prompt_id", "group_id"]).aggregate(
        [("step", "max"), ("reward", "min"), ("reward", "max"), ("correct", "all")])
    rows = sorted(zip(g.column("run_id").to_pylist(), g.column("prompt_id").to_pylist(),
                      g.column("step_max").to_pylist(), g.column("group_id").to_pylist(),
                      g.column("reward_min").to_pylist(), g.column("reward_max").to_pylist(),
                      g.column("correct_all").to_pylist()))
    out: dict[tuple[str, str], Groups] = {}
    start = 0
    for i in range(1, len(rows) + 1):
        if i < len(rows) and rows[i][:2] == rows[start][:2]:
            continue
        mine = rows[start:i]  # one prompt's groups, by (step, group_id)
        streak = 0
        for r in reversed(mine):
            if r[4] != r[5]:
                break
            streak += 1
        out[mine[0][0], mine[0][1]] = Groups(len(mine), streak, (mine[0][2], mine[0][3]),
                                             (mine[-1][2], mine[-1][3]), bool(mine[-1][6]))
        start = i
    return out


def merged(old: tuple | None, new: Groups) -> tuple | None:
    """A prompt's state (groups, streak, newest_step, newest_group, newest_all_correct) after `new`
    is added to `old` (None: no group yet); None when `new` holds a group not newer than `old`'s
    newest (the state cannot follow it: the run stops being kept)."""
    if old is None:
        return (new.n, new.streak, *new.newest, int(new.newest_all_correct))
    groups, streak, step, group = old[0], old[1], old[2], old[3]
    if not (step, group) < new.oldest:
        return None
    joined = new.streak + streak if new.streak == new.n else new.streak
    return (groups + new.n, joined, *new.newest, int(new.newest_all_correct))


@dataclass(frozen=True)
class Selected:
    """A run's prompt selection rows in one commit: their first and last step, the highest position,
    and the rates of the last step."""

    first: int
    last: int
    position: int
    easy: float
    hard: float


def selection_summaries(table: pa.Table) -> dict[str, Selected]:
    """{run_id: Selected} of a prompt_selections table's rows."""
    out: dict[str, Selected] = {}
    if table.num_rows == 0:
        return out
    cols = zip(*(table.column(c).to_pylist() for c in ("run_id", "step", "position", "explore_easy", "explore_hard")))
    for run, step, position, easy, hard in cols:
        s = out.get(run)
        if s is None:
            out[run] = Selected(step, step, position, easy, hard)
            continue
        first, last, easy, hard = min(s.first, step), max(s.last, step), *(
            (easy, hard) if step > s.last else (s.easy, s.hard))
        out[run] = Selected(first, last, max(s.position, position), easy, hard)
    return out
