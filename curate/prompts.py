"""Pre-rollout prompt selection (GRESO, arXiv 2506.02177): skip, before generating, the prompts whose
recent groups in this run were all-correct or all-wrong (docs/curation.md §Before generation).

Its steps are a plan of their own (`prompt_plan`: a `curate.plan.Plan` built from the same
parameters), run by the loop before it generates a step; the curation plans after generation do
not run it (its parameters are in their curation ids like every other parameter). `--explain`
prints its rows, and its hash (`Plan.sha256`) is recorded with every decision.

Invariants:
- `prompt_skip` is read here only (`prompt_plan`: None when it is `none`); where the selection
  cannot run (`generate --follow`, the TRL plug-in, a loop with several learner ranks) it is refused
  with one line (`refuse`).
- History is per run: a prompt's trace is its groups in this run before this step, newest first,
  at most `skip_window` of them (queries/prompt_history.sql). z = how many of them, consecutive from
  the newest, were zero-variance (all rewards equal). A prompt without history, or whose newest
  group had variance (z = 0), is always generated.
- A prompt with z > 0 is skipped with probability p = 1 − p_e^z, p_e the exploration rate of its
  kind (all_correct or all_wrong, of its newest group); the draw is a uniform number from a sha256
  of (seed, run, step, prompt id): the same inputs give the same decisions on every machine.
- The rates start at `skip_explore_start`; at each later step each kind's rate moves by
  `skip_step` from its value at the run's previous selection: down when the zero-variance share of
  the groups that step generated exceeded `skip_target` and that kind occurred among them, up
  otherwise; always within [`skip_explore_min`, 1]. The rates are stored with every decision, so the
  next step (and a resumed run) reads them back (queries/prompt_skip_state.sql).
- `select` examines candidates in stream order until `need` are generated or `limit` were seen;
  short of `need`, the first skipped ones are generated after all (reason `filled`). Every candidate
  examined gets one `prompt_selections` row; none beyond the last one examined does.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Sequence

import pyarrow as pa

from rollstore.queries import render
from rollstore.storage.schema import PROMPT_SELECTIONS
from rollstore.storage.snapshot import rollouts_relation

from .params import ParamError, Params
from .plan import BEFORE_GENERATION, PROMPT, Plan, StepList

SKIP_PARAMS = ("prompt_skip", "skip_window", "skip_target", "skip_explore_start", "skip_explore_min", "skip_step")


PHASE = "prompts"


def prompt_plan(p: Params) -> Plan | None:
    """The selection's plan: its history and state steps, placed before generation, with the $values
    the parameters bind; None when `prompt_skip` is `none` (there is nothing to select)."""
    if p["prompt_skip"] == "none":
        return None
    steps = StepList()
    steps.add("prompt_history", PHASE, PROMPT, ("rollouts",), ("skip decisions",), relations=("candidates",),
              candidates="candidates", at=BEFORE_GENERATION)
    steps.add("prompt_skip_state", PHASE, PROMPT, ("prompt_selections", "rollouts"), ("rates", "resumed positions"),
              at=BEFORE_GENERATION)
    return Plan(p["prompt_skip"], p, tuple(steps), p.bindings())


def rates_text(p: Params) -> str:
    """The decision the plan's steps feed, in Python (`select`, `adapt`), with its parameters."""
    return (f"then: skip with probability 1 − p_e^z; target share {float(p['skip_target']):g}, rates start "
            f"{float(p['skip_explore_start']):g}, step {float(p['skip_step']):g}, floor {float(p['skip_explore_min']):g}")


def refuse(p: Params, where: str) -> None:
    """One line when `p` asks for prompt selection where it does nothing (`where`: the place)."""
    if prompt_plan(p) is not None:
        raise ParamError(f"prompt_skip={p['prompt_skip']}: pre-rollout prompt selection runs in the one-process "
                         f"loop only; {where} would ignore it (leave prompt_skip at none)")


def draw(seed: int, run_id: str, step: int, prompt_id: str) -> float:
    """The seeded uniform number in [0, 1) of one (run, step, prompt) decision."""
    digest = hashlib.sha256(f"greso:{seed}:{run_id}:{step}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def adapt(rate: float, share: float, occurred: bool, p: Params) -> float:
    """One kind's next exploration rate (see the invariants)."""
    step = float(p["skip_step"])
    moved = rate - step if (share > float(p["skip_target"]) and occurred) else rate + step
    return min(1.0, max(float(p["skip_explore_min"]), moved))


@dataclass(frozen=True)
class Rates:
    """The exploration rates of one step, for all-correct and all-wrong prompts."""

    easy: float
    hard: float

    def of(self, kind: str | None) -> float:
        return self.easy if kind == "all_correct" else self.hard


@dataclass(frozen=True)
class SkipState:
    """Where a run's selection stands at one step (queries/prompt_skip_state.sql): the positions this
    step already chose (a resumed step), the last position an earlier step examined, and the rates."""

    recorded: list[int]
    last_position: int | None
    rates: Rates


def state(session, run_id: str, step: int, plan: Plan) -> SkipState:
    """This step's state, its rates adapted from the run's previous selection (or the start rate):
    from the catalog's kept state and the shards of the previous selected step when the snapshot's
    catalog keeps it (`storage.prompt_state`), else by the plan's query over the run's history; the
    same state either way (tests/test_prompt_state.py)."""
    kept = _kept_state(session, run_id, step, plan)
    if kept is not None:
        return kept
    p, s = plan.params, plan.steps[1]
    recorded, last_position, last_step, easy, hard, groups, all_correct, all_wrong = session.one(
        s.render(), {"run": run_id, "step": int(step)}, reads=set(s.reads))
    start = float(p["skip_explore_start"])
    if last_step is None:
        r = Rates(start, start)
    else:
        share = (all_correct + all_wrong) / groups if groups else 0.0
        r = Rates(adapt(easy, share, all_correct > 0, p), adapt(hard, share, all_wrong > 0, p))
    return SkipState(list(recorded), last_position, r)


def _kept_state(session, run_id: str, step: int, plan: Plan) -> SkipState | None:
    """`state` from the catalog's kept state (the run's newest selection: its step, the highest
    position examined, its rates) and the groups of that step, read from the shards the step index
    names; None when the catalog cannot answer for this snapshot and step (not kept, a later commit,
    or a selection at this step or after: a resumed step)."""
    snap = session.snapshot
    got = snap.prompt_state(run_id)  # (None from a listing without a catalog: Dask's workers)
    if got is None:
        return None
    last_step, last_position, easy, hard, _seq = got[0]
    p = plan.params
    start = float(p["skip_explore_start"])
    if last_step is None:
        return SkipState([], None, Rates(start, start))
    if last_step >= step:
        return None
    files = snap.step_files("rollouts", run_id, last_step, last_step)
    groups, all_correct, all_wrong = (0, 0, 0) if not files else session.one(
        render("prompt_last_groups", {"rollouts": rollouts_relation(files)}),
        {"run": run_id, "last_step": int(last_step)}, reads=())
    share = (all_correct + all_wrong) / groups if groups else 0.0
    return SkipState([], last_position, Rates(adapt(easy, share, all_correct > 0, p),
                                              adapt(hard, share, all_wrong > 0, p)))


def _kept_history(session, run_id: str, step: int, prompt_ids: Sequence[str], plan: Plan) -> dict | None:
    """`history` from the catalog's kept state of each prompt (`storage.prompt_state`: for a window w,
    groups_seen = min(groups, w), z = min(streak, groups_seen)); None when it cannot answer (not kept,
    a later commit, or a candidate with a group at this step or after)."""
    got = session.snapshot.prompt_state(run_id, list(prompt_ids))  # (None from a listing without a catalog)
    if got is None:
        return None
    rows = got[1]
    if any(r[2] >= step for r in rows.values()):
        return None
    window = int(plan.values["skip_window"])
    out = {}
    for pid, (groups, streak, _step, _group, all_correct) in rows.items():
        seen = min(int(groups), window)
        z = min(int(streak), seen)
        out[pid] = (seen, z, None if z == 0 else ("all_correct" if all_correct else "all_wrong"))
    return out


def history(session, run_id: str, step: int, prompt_ids: Sequence[str], plan: Plan) -> dict[str, tuple]:
    """prompt_id → (groups_seen, z, kind) for the candidates that have history in the run: from the
    catalog's kept state when it answers for this snapshot (`_kept_history`), else by the plan's query
    (queries/prompt_history.sql) over the run's history; the same answer either way."""
    kept = _kept_history(session, run_id, step, prompt_ids, plan)
    if kept is not None:
        return kept
    session.load("skip_candidates", pa.table({"prompt_id": pa.array(sorted(set(prompt_ids)), pa.string())}))
    s = plan.steps[0]
    t = session.table(s.render(candidates="skip_candidates"),
                      {"run": run_id, "step": int(step), "skip_window": plan.values["skip_window"]},
                      reads=set(s.reads))
    return {pid: (int(n), int(z), kind) for pid, n, z, kind in zip(*(t.column(c).to_pylist() for c in
                                                                       ("prompt_id", "groups_seen", "z", "kind")))}


@dataclass
class Selection:
    """What `select` decided: the prompts to generate (stream order), every examined candidate's
    audit row, and the stream position after the last candidate examined."""

    chosen: list
    rows: list[dict]
    next_position: int

    @property
    def skipped(self) -> int:
        return sum(1 for r in self.rows if r["decision"] == "skip")

    def table(self) -> pa.Table:
        return pa.Table.from_pylist(self.rows, schema=PROMPT_SELECTIONS)


def select(session, plan: Plan, *, run_id: str, step: int, seed: int, stream: Callable[[int], object],
           start: int, need: int, limit: int, rates: Rates | None = None) -> Selection:
    """Examine the prompts `stream(start)`, `stream(start + 1)`, ... (objects with `prompt_id` and
    `prompt`) until `need` are to be generated or `limit` were examined (see the invariants).
    `plan`: `prompt_plan`'s; `rates`: this step's, when the caller already read its `state`."""
    p = plan.params
    r = rates if rates is not None else state(session, run_id, step, plan).rates
    params = json.dumps({**{k: (float(p[k]) if isinstance(p[k], Fraction) else p[k]) for k in SKIP_PARAMS},
                         "sql_sha256": plan.sha256()}, sort_keys=True)
    now = dt.datetime.now(dt.timezone.utc)
    chosen: list = []
    rows: list[dict] = []
    position = start
    candidates = [stream(i) for i in range(start, start + limit)]  # one history query for all of them
    hist = history(session, run_id, step, [c.prompt_id for c in candidates], plan)
    for c in candidates:
        if len(chosen) >= need:
            break
        seen, z, kind = hist.get(c.prompt_id, (0, 0, None))
        explore = r.of(kind)
        p_skip = 1.0 - explore ** z if z else 0.0
        u = draw(seed, run_id, step, c.prompt_id)
        skip = u < p_skip
        reason = ("skipped" if skip else "explored") if z else ("informative" if seen else "no_history")
        rows.append({"run_id": run_id, "step": int(step), "position": position, "prompt_id": c.prompt_id,
                     "prompt": c.prompt, "groups_seen": seen, "z": z, "kind": kind, "explore": explore,
                     "p_skip": p_skip, "draw": u, "decision": "skip" if skip else "generate",
                     "reason": reason, "explore_easy": r.easy, "explore_hard": r.hard, "params": params,
                     "created_at": now})
        if not skip:
            chosen.append(c)
        position += 1
    if len(chosen) < need:  # the stream ran out of prompts worth generating: fill from the skipped ones
        for row in rows:
            if len(chosen) >= need:
                break
            if row["decision"] == "skip":
                row.update(decision="generate", reason="filled")
                chosen.append(None)
        chosen = [stream(row["position"]) for row in rows if row["decision"] == "generate"]
    return Selection(chosen, rows, position)
