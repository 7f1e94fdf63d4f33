"""The curation plan: one ordered list of typed steps, built from the parameters alone.

A step is either SQL — one file of `queries/` with its fragments (`{name}`) and the values it binds
(`$name`) — or a registered kernel (`curate.kernels`: a Python/numpy function with a declared input
and output relation and a version). Each step has a scope, what it reads and writes, and where it
runs (`Step.at`). `rollstore recipes --explain NAME` prints the plan.

Invariants:
- This module is the only place where recipe modes branch: the engines, the record and the
  commit ask the plan (its steps, `Plan.sample_budget`, `Plan.use_capped`), never the parameters'
  modes; the values derived from the parameters (f, κ, the token budget K) are the resolved
  parameters' own (`curate.params.DERIVED`, `Params.token_budget`), and the plan's `values` are
  `Params.bindings()`. The engines (`curate.run`, embedded; `curate.dask_client`, Dask) run the
  steps in order and run no other SQL or kernel on the batch; a step declares where it runs
  (`at`: per input shard, per partition, on the client, once over every candidate, per shard
  holding a selected row) and the engines place it there without inferring anything from its
  phase, scope or relations; a GLOBAL step's partial results are gathered for its registered
  merge (`Step.merge`, `curate.merges`). A new step is one `add` (or `kernel`) here.
- The curation id is a hash of the plan: of every step's text as built here (relations at their
  canonical names; comments and spacing left out, `executable`; a kernel step's name, version and
  arguments), with the snapshot, the recipe name and the effective parameters. Two runs with the
  same id run the same SQL and kernels on the same data, on either engine.
- Scopes: ROW steps act on each candidate alone; PROMPT steps add up per prompt; GROUP steps need
  whole groups (a Dask partition holds whole prompts, hence whole groups); SHARD steps run per
  input shard; GLOBAL steps need the whole batch, and name their merge.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

import duckdb

from rollstore.queries import load_sql, parameters_of, render

from .kernels import KERNELS, signature
from .merges import MERGES
from .params import DERIVED_BY_NAME, TOKEN_BUDGET, Params, Recipe, derived_from
from .tokens import kept_expression

ROW, PROMPT, GROUP, SHARD, GLOBAL = "row", "prompt", "group", "shard", "global"
# Where a step runs (`Step.at`). The embedded engine runs every step in its one session; the Dask
# engine places each step by this declaration alone.
PER_SHARD = "per input shard"           # over one input shard of the snapshot, before rows move to partitions
PER_PARTITION = "per partition"         # over a partition of whole prompts (hence whole groups)
ON_CLIENT = "on the client"             # over every partition's `work`, once (a `whole` merge mid-selection)
ONCE = "once over every candidate"      # over every candidate's final narrow row, in one task
PER_SELECTED = "per selected shard"     # over one input shard holding a selected row (its rows and entropies)
BEFORE_GENERATION = "before generation, by the loop"  # prompt selection's plan (curate.prompts), no engine's
PLACES = (PER_SHARD, PER_PARTITION, ON_CLIENT, ONCE, PER_SELECTED, BEFORE_GENERATION)
PHASES = ("candidates", "groups", "replay", "difficulty", "amplify", "select", "apply", "record", "tokens", "output",
          "materialise")
SELECTION_PHASES = ("groups", "replay", "difficulty", "amplify", "select", "apply")

# Relations some steps read, at their canonical names (what the plan hashes).
ELIGIBLE = "(SELECT * FROM work WHERE reason IS NULL)"
CHOSEN = "(SELECT * FROM work WHERE selected)"
HISTORY_ROWS = ("(SELECT * FROM rollouts WHERE prompt_id IN "
                "(SELECT prompt_id FROM work WHERE reason IS NULL))")  # the prompts that reach step 2
# With replay, a window row at its use cap still counts in its group's statistics: a replayed row
# keeps the advantage of its group as generated (docs/replay.md).
AS_GENERATED = "(SELECT * FROM work WHERE reason IS NULL OR (replayed AND reason = 'reused'))"
# A row carries its sampling policy's log-probs unless its only ones were recomputed at import
# (`rollstore import --score-model`, recorded in meta.import.lossy).
BEHAVIOUR = ("(old_logprobs IS NOT NULL OR coalesce(json_extract_string(meta, '$.import.lossy'), '') "
             "NOT LIKE '%gen_logprobs recomputed%')")


@dataclass(frozen=True)
class Step:
    sql: str                                    # queries/<sql>.sql, "custom" (the user's SELECT), or the kernel's name
    phase: str
    scope: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    fragments: tuple[tuple[str, str], ...] = ()
    relations: tuple[str, ...] = ()             # fragments an engine binds to its own input
    merge: str | None = None                    # GLOBAL steps: the registered merge (`curate.merges`)
    text: str = ""                              # the step's SQL as hashed
    source: str = ""                            # the SQL file's text (engines render from it)
    result: str | None = None                   # GLOBAL steps: the name their merged result is kept under
    at: str = PER_PARTITION                     # where it runs (PLACES)
    kernel: str | None = None                   # a kernel step: its name in curate.kernels.KERNELS
    args: tuple[tuple[str, object], ...] = ()   # a kernel step's arguments (hashed)

    @property
    def kind(self) -> str:
        return "kernel" if self.kernel is not None else "sql"

    def render(self, **bound: str) -> str:
        """The SQL to run, with `bound` relations in place of their canonical ones."""
        unknown = set(bound) - set(self.relations)
        if unknown:
            raise KeyError(f"{self.sql}: {sorted(unknown)} are not relations of this step")
        if self.sql == "custom" or self.kernel is not None:
            return self.text
        return render(self.sql, {**dict(self.fragments), **bound}, text=self.source)

    @property
    def parameters(self) -> list[str]:
        return sorted(parameters_of(self.text))


@dataclass(frozen=True)
class Plan:
    recipe: str
    params: Params
    steps: tuple[Step, ...]
    values: dict = field(default_factory=dict)  # the $values every run binds (`Params.bindings`; more come at run time)

    def phase(self, name: str) -> list[Step]:
        return [s for s in self.steps if s.phase == name]

    def first(self, at: str) -> int:
        """Index of the first step placed `at`."""
        return next(i for i, s in enumerate(self.steps) if s.at == at)

    @property
    def token_stage(self) -> bool:
        return self.params["token"] != "none"

    @property
    def counts_budget(self) -> bool:
        """Whether the record's sample_budget is the number selected (a sample stage or a custom
        recipe chooses rows)."""
        return self.params["sample"] != "none" or any(s.merge == "custom" for s in self.steps)

    def sample_budget(self, n_selected: int) -> int | None:
        """The record's sample_budget: the number selected where a stage chooses rows, else None."""
        return n_selected if self.counts_budget else None

    @property
    def use_capped(self) -> bool:
        """Whether the run caps uses (replay, or `max_reuse`): its commit re-checks the uses it counted."""
        return self.params["replay"] != "none" or self.params["max_reuse"] is not None

    def sha256(self) -> str:
        """The hash of what the steps execute: their texts without comments, tokens one space
        apart, with each step's scope and merge."""
        parts = []
        for s in self.steps:
            text = s.text if s.kernel is not None else executable(s.text)
            parts.append(f"{s.scope}:{s.merge or ''}:{s.result or ''}\n{text}")
        return hashlib.sha256("\n;\n".join(parts).encode()).hexdigest()

    def curation_id(self, snapshot_seq: int) -> str:
        text = f"{snapshot_seq}\n{self.recipe}\n{self.params.to_json()}\n{self.sha256()}"
        return f"cur-{hashlib.sha256(text.encode()).hexdigest()[:20]}"


@functools.lru_cache(maxsize=64)  # (a loop's step texts differ by their `where`: a long run would fill a large one)
def executable(sql: str) -> str:
    """`sql` as DuckDB's tokenizer reads it, without comments, its tokens one space apart: a
    reworded comment or a re-indented line of a step file does not change any curation id, while
    any change to what runs (a keyword, a name, a literal, a fragment) does. Kept per text for the
    process (a loop's runs hash the same step texts again; the tokenizer cost ~25 ms a plan)."""
    raw = sql.encode()  # the tokenizer's positions are UTF-8 byte offsets
    tokens = duckdb.tokenize(sql)
    ends = [start for start, _ in tokens[1:]] + [len(raw)]
    return " ".join(raw[start:end].decode().strip() for (start, kind), end in zip(tokens, ends)
                    if kind != duckdb.token_type.comment)


def replay_window(where: str) -> str:
    """The replay window's predicate (docs/replay.md): rows of the batch's own run(s), sampled 1 to
    $replay_window policy versions before $current_version. The batch's runs are read from the whole
    snapshot (`rollouts`), as `where` is, whichever shard an engine reads."""
    return (f"(run_id IN (SELECT run_id FROM rollouts WHERE ({where})) AND policy_version BETWEEN "
            "$current_version - $replay_window AND $current_version - 1)")


class StepList(list):
    """The plan's steps as they are added, each rendered from its SQL file and fragments."""

    def add(self, sql: str, phase: str, scope: str, reads: tuple, writes: tuple, relations: tuple = (),
            merge: str | None = None, result: str | None = None, *, at: str, **fragments: str) -> None:
        frags = tuple(sorted(fragments.items()))
        source = load_sql(sql)
        self.append(_checked(Step(sql, phase, scope, reads, writes, frags, relations, merge,
                                  render(sql, dict(frags), text=source), source, result, at)))

    def kernel(self, name: str, phase: str, scope: str, *, at: str, merge: str | None = None,
               writes: tuple = (), **args: object) -> None:
        """A kernel step: reads its kernel's declared columns (a session kernel: its source table),
        writes the ones it adds (a session kernel: its table, or `writes`, the values its merge gives)."""
        k = KERNELS[name]
        frozen = tuple(sorted(args.items()))
        reads = ((k.source,) if k.source else k.reads) + tuple(f"rollouts.{c}" for c in k.shard_columns)
        writes = writes or ((k.into,) if k.into else tuple(n for n, _ in k.adds))
        self.append(_checked(Step(name, phase, scope, reads, writes, merge=merge,
                                  text=signature(name, frozen), at=at, kernel=name, args=frozen)))


def _checked(step: Step) -> Step:
    """A step whose placement fits its merge: a `whole` or `custom` merge runs where every row is."""
    if step.at not in PLACES:
        raise ValueError(f"{step.sql}: unknown placement {step.at!r}")
    if step.merge in ("whole", "custom") and step.at not in (ON_CLIENT, ONCE):
        raise ValueError(f"{step.sql}: a {step.merge} merge runs on the client or once, not {step.at}")
    return step


def build(params: Params, recipe: Recipe, custom_statement: str | None = None) -> Plan:
    """The plan of a run with these parameters (`where` and `current_version` resolved): the
    candidates, the group statistics and difficulty, the selection, the record, then tokens and
    output, in that order."""
    steps = StepList()
    _candidate_steps(steps, params)
    _group_steps(steps, params)
    _selection_steps(steps, params, recipe, custom_statement)
    _record_steps(steps)
    _token_and_output_steps(steps, params)
    return Plan(recipe.name, params, tuple(steps), params.bindings())


def _candidate_steps(steps: StepList, p: Params) -> None:
    """The candidates (the batch and the replay window, with their stored lengths), the history they need."""
    amplify = p["amplify"]
    replay = p["replay"] != "none"
    steps.add("curate_candidates", "candidates", ROW, ("rollouts",), ("work",),
              relations=("rollouts",), rollouts="rollouts", where=p["where"],
              window=replay_window(p["where"]) if replay else "false",
              behaviour=BEHAVIOUR if replay else "true", at=PER_SHARD)
    steps.add("curate_uses", "candidates", ROW, ("work", "selections"), ("work",),
              relations=("selections",), selections="selections", at=PER_SHARD)
    if amplify == "da3po":  # read with the candidates: the only other read of rollouts before the tokens
        steps.add("curate_history", "candidates", PROMPT, ("rollouts",), ("history_parts",), relations=("rows",),
                  rows=HISTORY_ROWS, out="history_parts", at=PER_SHARD)
    steps.add("curate_batch_size", "candidates", GLOBAL, ("work",), ("error if empty",),
              merge="nonempty", at=PER_PARTITION)
    steps.add("curate_non_finite", "candidates", GLOBAL, ("work",), ("error if a reward is not finite",),
              merge="first_non_finite", at=PER_PARTITION)
    if replay:
        steps.add("curate_replay_runs", "candidates", GLOBAL, ("work",), ("error if several runs",),
                  merge="one_run", at=PER_PARTITION)
        steps.add("curate_replay_behaviour", "candidates", GLOBAL, ("work",), ("error if no behaviour log-probs",),
                  merge="first_without_behaviour", at=PER_PARTITION)


def _group_steps(steps: StepList, p: Params) -> None:
    """Group statistics, advantages and the filter; the replay choice; the difficulty."""
    replay = p["replay"] != "none"
    stats_rows = AS_GENERATED if replay else ELIGIBLE
    steps.add("curate_advantages", "groups", GROUP, ("work",), ("full_adv",),
              rows=stats_rows, out="full_adv", at=PER_PARTITION)
    steps.add("curate_filter", "groups", GROUP, ("work", "full_adv"), ("work",), at=PER_PARTITION)
    if replay:
        steps.add("curate_replay", "replay", GLOBAL, ("work",), ("replay_choice",), merge="whole", at=ON_CLIENT)
        steps.add("curate_replay_apply", "replay", ROW, ("work", "replay_choice"), ("work",), at=PER_PARTITION)

    if p["amplify"] == "da3po":
        steps.add("curate_batch_accuracy", "difficulty", GLOBAL, ("work",), ("$mu",), merge="mu", at=PER_PARTITION)
        steps.add("curate_history_total", "difficulty", PROMPT, ("history_parts",), ("prompt_history",),
                  at=PER_PARTITION)
        steps.add("curate_difficulty", "difficulty", GROUP, ("work", "prompt_history"), ("difficulty",),
                  at=PER_PARTITION)
    elif p["amplify"] != "none" or p["sample"] == "pods":  # an amplify step runs (`_selection_steps`): it
        # joins the difficulty, none here (PODS amplifies the chosen subset's advantages, even with amplify=none)
        steps.add("curate_no_difficulty", "difficulty", GROUP, (), ("difficulty",), at=PER_PARTITION)


def _amplification(steps: StepList, phase: str) -> None:
    steps.add("curate_amplify", phase, GROUP, ("work", "subset_adv", "difficulty"), ("work",), at=PER_PARTITION)


def _selection_steps(steps: StepList, p: Params, recipe: Recipe, custom_statement: str | None) -> None:
    """Amplification, then the sample stage (built-in or the custom recipe's SELECT)."""
    sample = p["sample"]
    pods = sample == "pods"
    if not pods and p["amplify"] != "none":  # without amplification curate_filter.sql's values stand (w = 1)
        steps.add("curate_no_subset", "amplify", GROUP, (), ("subset_adv",), at=PER_PARTITION)
        _amplification(steps, "amplify")

    if recipe.sql is not None:
        steps.add("curate_custom_candidates", "select", ROW, ("work", "rollouts"), ("candidates",), at=PER_PARTITION)
        steps.append(_checked(Step("custom", "select", GLOBAL, ("candidates",), ("custom_choice",), merge="custom",
                                   text=custom_statement or "", at=ON_CLIENT)))
        steps.add("curate_custom_apply", "apply", ROW, ("work", "custom_choice"), ("work",), at=PER_PARTITION)
    else:
        if sample == "none":
            steps.add("curate_select_all", "select", ROW, ("work",), ("picked",), at=PER_PARTITION)
        else:
            if sample == "cross_group":  # one pool, the whole batch: in numpy (curate/selection.py)
                steps.kernel("max_variance", "select", GLOBAL, at=ON_CLIENT, merge="whole", value="advantage_final")
            else:
                steps.add("curate_select", "select", GROUP, ("work",), ("picked",), pool_key="group_id",
                          value="reward" if pods else "advantage_final", at=PER_PARTITION)
        steps.add("curate_apply_selection", "apply", ROW, ("work", "picked"), ("work",), at=PER_PARTITION)
        if pods:
            steps.add("curate_advantages", "apply", GROUP, ("work",), ("subset_adv",),
                      rows=CHOSEN, out="subset_adv", at=PER_PARTITION)
            _amplification(steps, "apply")


def _record_steps(steps: StepList) -> None:
    steps.add("curate_record", "record", GLOBAL, ("work",), ("record", "shards to open"),
              merge="whole", result="counts", at=ONCE)
    steps.add("curate_record_values", "record", GLOBAL, ("work",), ("record",),
              merge="whole", result="variances", at=ONCE)


def _token_and_output_steps(steps: StepList, p: Params) -> None:
    """The token threshold, the kept counts, the audit and the materialisation."""
    token = p["token"]
    if token != "none":
        # The selected rows with their input shard and position; the kernels read their entropies
        # from those shards (no Parquet read in SQL, no entropies in DuckDB): the input check, the
        # threshold and the kept counts over the entropies decoded once (curate.kernels, curate.tokens).
        steps.add("curate_selected_rows", "tokens", SHARD, ("work",), ("selected_rows",), at=PER_SELECTED)
        steps.kernel("missing_entropies", "tokens", GLOBAL, at=PER_SELECTED, merge="first_missing",
                     writes=("error if any",), token=token)
        steps.kernel("token_histogram", "tokens", GLOBAL, at=PER_SELECTED, merge="histogram",
                     writes=("$bucket", "$n"), token=token)
        steps.kernel("token_heads", "tokens", GLOBAL, at=PER_SELECTED, merge="heads",
                     writes=("$thr", "$thr_rollout", "$thr_pos"), token=token)
        steps.kernel("tokens_kept", "output", SHARD, at=PER_SELECTED, token=token)
    else:
        steps.add("curate_no_entropies", "tokens", SHARD, (), ("selected_entropies",), at=PER_SELECTED)
        steps.add("curate_tokens_kept", "output", SHARD, ("work", "selected_entropies"), ("kept_counts",),
                  kept=kept_expression(token), at=PER_SELECTED)
    steps.add("curate_kept_total", "output", GLOBAL, ("kept_counts",), ("$tokens_kept",), merge="kept", at=PER_SELECTED)
    steps.add("curate_audit", "output", GLOBAL, ("work", "kept_counts"), ("selections",),
              merge="whole", result="audit", at=ONCE)
    steps.add("curate_materialise", "materialise", SHARD, ("work",), ("curated",), at=PER_SELECTED)
    if token != "none":
        steps.kernel("entropies", "materialise", ROW, at=PER_SELECTED)
    steps.kernel("keep_runs", "materialise", ROW, at=PER_SELECTED, token=token)
    steps.kernel("fallback", "materialise", ROW, at=PER_SELECTED)


def explain(plan: Plan, tokens_selected: int | None = None) -> list[dict]:
    """The plan as rows for a person: step, phase, scope, what runs (an SQL file, or a kernel with
    its version), where, values and fragments (a kernel's arguments), reads → writes. A $value
    derived from several parameters (f, κ, K) is shown with its formula; K, the token budget, with
    its value when `tokens_selected` (N, a concrete curation's) is given."""
    rows = []
    for i, s in enumerate(plan.steps, 1):
        names = list(MERGES[s.merge].values) if s.merge else []
        shown: set = set()
        if s.kernel is not None:
            k = KERNELS[s.kernel]
            what = f"kernel {k.name} (version {k.version})"
            names = list(k.values) + names
            uses = ([f"{a}={v!r}" for a, v in s.args] + [_value(plan, n, tokens_selected, shown) for n in names]
                    + [k.doc]
                    + ([f"drops {', '.join(k.drops)}"] if k.drops else []))
        else:
            what = "custom SELECT (the recipe's SQL)" if s.sql == "custom" else f"queries/{s.sql}.sql"
            frags = [f"{{{k}}}={v}" for k, v in s.fragments if k not in s.relations or v != k]
            uses = [_value(plan, n, tokens_selected, shown) for n in s.parameters + names] + frags
        where = s.at + (f", merged on the client ({s.merge})" if s.merge and s.at not in (ON_CLIENT, ONCE)
                        else f" ({s.merge})" if s.merge else "")
        rows.append({
            "step": i, "phase": s.phase, "scope": s.scope, "kind": s.kind, "sql": what, "at": where,
            "uses": uses, "reads": list(s.reads), "writes": list(s.writes),
        })
    return rows


def _value(plan: Plan, name: str, tokens_selected: int | None, shown: set) -> str:
    """One $value as --explain shows it: its value (or "at run time"), and, the first time in a
    step, the derived value (f, κ) it comes from with its formula; K, the token budget, as ⌈κ·N⌉."""
    derived = derived_from(name)
    if name == "token_budget":
        kappa = plan.params.kappa
        if kappa is None:
            return "$token_budget=None (no token stage)"
        n = "N" if tokens_selected is None else str(tokens_selected)
        value = " (at run time)" if tokens_selected is None else f" = {plan.params.token_budget(tokens_selected)}"
        return (f"$token_budget: {TOKEN_BUDGET}; K = ⌈{_fraction(kappa)}·{n}⌉{value}, "
                f"κ = {DERIVED_BY_NAME['κ'].formula}")
    text = f"${name}={plan.values[name]!r}" if name in plan.values else f"${name} (at run time)"
    if derived is not None and derived.name not in shown:
        shown.add(derived.name)
        text += f" ({derived.name} = {_fraction(plan.params.derived[derived.name])}: {derived.formula})"
    return text


def _fraction(f) -> str:
    return str(f.numerator) if f.denominator == 1 else f"{f.numerator}/{f.denominator} ({float(f):g})"
