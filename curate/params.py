"""Curation parameters (docs/curation.md §Parameters), recipes as presets, `--set` parsing, schedules.

Invariants:
- Each parameter is defined once, in `PARAMETERS` (name, type, range, default, enum, doc line, and
  the `$values` it binds in the plan's SQL and merges): the defaults, `coerce`'s range rules,
  `resolve`, the bindings (`Params.bindings`), the docs' table (`parameter_table`, checked by
  tests/test_params.py) and the reference implementation's defaults (tests/reference.py) read it.
- The values derived from several parameters (f, κ: `DERIVED`) are computed once, when a `Params`
  is made (`Params.derived`), and bind what they bind from there; the token budget K = ⌈κ·N⌉ is
  `Params.token_budget` (N is known at run time). Nothing else computes f, κ or K.
- Every recipe accepts every parameter; a recipe only sets defaults. Unknown names, a name given
  twice, values out of range and fractions of the other schedule are errors (one line each).
- Fractions and `progress` are exact rationals (`Fraction`) from the decimal text as written; budgets
  are computed in rational arithmetic, and "round" is half up: floor(x + 1/2).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from importlib import resources
from typing import Callable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from rollstore.storage.errors import RollstoreError, UnknownName, did_you_mean
from rollstore.storage.snapshot import sql_string


class ParamError(RollstoreError):
    """A parameter or recipe was unknown, repeated or out of range."""


class UnknownParameter(ParamError, UnknownName):
    """A curation parameter name that no recipe knows."""


class UnknownRecipe(ParamError, UnknownName):
    """A recipe that is neither built in nor a file."""


class CurationError(RollstoreError):
    """The run cannot proceed (empty batch, missing entropies, bad custom SQL, ...)."""


class EmptyBatch(CurationError):
    """The batch has no rows: the snapshot has none, or none matches `where`. Its line is made by `of`
    only (raised before the plan runs, by `curate.steps.batch_files` and `Params.with_defaults`, and by
    the `nonempty` merge)."""

    @classmethod
    def of(cls, where: str | None) -> "EmptyBatch":
        return cls("empty batch: the snapshot has no rollouts" if where is None
                   else f"empty batch: no rollouts match where = {where}")


@dataclass(frozen=True)
class Param:
    """One curation parameter, defined once: `resolve`, its range check (`coerce`), the defaults,
    docs/curation.md §Parameters (`parameter_table`) and the reference tests read this.

    `kind`: "sql" (a predicate), "enum" (one of `values`), "int" or "number" (an exact rational),
    within [`low`, `high`] (`low_open`: the low end excluded); `nullable`: `none` is a value too."""

    name: str
    kind: str
    default: object
    doc: str
    values: tuple[str, ...] = ()
    low: Fraction | None = None
    high: Fraction | None = None
    low_open: bool = False
    nullable: bool = False
    default_doc: str | None = None  # the docs' words for a default computed at run time
    binds: tuple[tuple[str, Callable], ...] = ()  # the $values it binds: (name, value of the parameter → value)

    def range_text(self) -> str:
        """The values it takes, as the docs and the errors say them."""
        if self.kind == "sql":
            return "SQL predicate"
        if self.kind == "enum":
            return " / ".join(f"`{v}`" for v in self.values)
        if self.high is not None:
            return f"{'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}]"
        text = f"{'int ' if self.kind == 'int' else ''}≥ {_num(self.low)}"
        return text + (" or `none`" if self.nullable else "")

    def default_text(self) -> str:
        if self.default_doc is not None:
            return self.default_doc
        if self.default is None or self.kind == "enum":
            return f"`{'none' if self.default is None else self.default}`"
        return _num(self.default)


def _same(v):
    return v


def _flag(word: str) -> Callable:
    """A boolean $value: whether the parameter is `word` (`!word`: is not)."""
    if word.startswith("!"):
        return lambda v: v != word[1:]
    return lambda v: v == word


def _num(f) -> str:
    """An exact number as its shortest decimal (0.25, 3)."""
    f = Fraction(f)
    return str(f.numerator) if f.denominator == 1 else format(Decimal(f.numerator) / Decimal(f.denominator), "f")


_UNIT = dict(low=Fraction(0), high=Fraction(1), low_open=True)  # (0, 1]
_SHARE = dict(low=Fraction(0), high=Fraction(1))  # [0, 1]
PARAMETERS: tuple[Param, ...] = (
    Param("where", "sql", None, "which snapshot rows form the batch. Default: `run_id = R AND step = S` of the "
          "row with the greatest (`created_at`, `run_id`, `step`)", nullable=True,
          default_doc="latest step of the latest run", binds=(("where_text", _same),)),
    Param("current_version", "int", None, "\"now\", for staleness and the difficulty window", low=Fraction(0),
          nullable=True, default_doc="the batch's own run's newest version: its newest checkpoint, else a "
          "learner-only run's, else the newest `policy_version` of its rows; [choices.md](choices.md) §Runs",
          binds=(("current_version", lambda v: 0 if v is None else v),)),
    Param("max_policy_lag", "int", None, "§Eligibility `stale`", low=Fraction(0), nullable=True,
          binds=(("max_policy_lag", _same),)),
    Param("max_reuse", "int", None, "§Eligibility `reused`", low=Fraction(1), nullable=True,
          binds=(("max_reuse", _same),)),
    Param("truncated", "enum", "keep", "§Eligibility `truncated`", ("keep", "drop"),
          binds=(("drop_truncated", _flag("drop")),)),
    Param("std", "enum", "sample", "§Advantages", ("sample", "population", "none"), binds=(("std_mode", _same),)),
    Param("filter", "enum", "none", "§Dynamic sampling", ("none", "dynamic"), binds=(("dynamic", _flag("dynamic")),)),
    Param("amplify", "enum", "none", "§Amplification", ("none", "da3po", "group"),
          binds=(("mode", _same), ("amplify_on", _flag("!none")))),
    Param("amplify_tau", "number", Fraction(1, 2), "hard-group threshold τ", **_UNIT,
          binds=(("tau_num", lambda v: v.numerator), ("tau_den", lambda v: v.denominator))),
    Param("amplify_max", "number", Fraction(3), "w_max", low=Fraction(1), binds=(("w_max", float),)),
    Param("difficulty_window", "int", 4, "policy versions of difficulty history W", low=Fraction(1),
          binds=(("window", _same),)),
    Param("difficulty_prior", "number", Fraction(2), "Beta prior strength s", low=Fraction(0),
          binds=(("prior", float),)),
    Param("sample", "enum", "none", "§Sample selection", ("none", "pods", "in_group", "cross_group"),
          binds=(("pods", _flag("pods")),)),
    Param("sample_fraction", "number", Fraction(1, 4), "f, with `schedule=static`", **_UNIT),
    Param("sample_fraction_start", "number", Fraction(1, 4), "f0, with `schedule=linear`", **_UNIT),
    Param("sample_fraction_end", "number", Fraction(1), "f1, with `schedule=linear`", **_UNIT),
    Param("token", "enum", "none", "§Token selection", ("none", "abs_adv_entropy", "entropy"),
          binds=(("token_mode", _same),)),
    Param("token_fraction", "number", Fraction(1, 5), "κ, with `schedule=static`", **_UNIT),
    Param("token_fraction_start", "number", Fraction(1, 5), "κ0, with `schedule=linear`", **_UNIT),
    Param("token_fraction_end", "number", Fraction(1), "κ1, with `schedule=linear`", **_UNIT),
    Param("schedule", "enum", "static", "§Schedule", ("static", "linear")),
    Param("progress", "number", Fraction(0), "training progress t", **_SHARE),
    Param("replay", "enum", "none", "[replay.md](replay.md)", ("none", "groups", "rollouts", "window"),
          binds=(("replay_on", _flag("!none")), ("replay_mode", _same))),
    Param("replay_window", "int", 2, "τ_max, in policy versions", low=Fraction(1), binds=(("replay_window", _same),)),
    Param("replay_max_uses", "int", 2, "uses of a rollout in all", low=Fraction(1),
          binds=(("replay_max_uses", _same),)),
    Param("replay_count", "int", None, "`rollouts` mode: replayed rows at most (`none`: as many as the fresh pool)",
          low=Fraction(1), nullable=True, binds=(("replay_count", _same),)),
    Param("replay_decay", "number", Fraction(1, 2), "priority × decay^(age − 1)", **_UNIT,
          binds=(("replay_decay", float),)),
    # pre-rollout prompt selection (docs/curation.md §Before generation; curate.prompts)
    Param("prompt_skip", "enum", "none", "§Before generation: pre-rollout prompt selection, run by the loop",
          ("none", "greso")),
    Param("skip_window", "int", 8, "a prompt's newest groups in the run that z is counted over", low=Fraction(1),
          binds=(("skip_window", _same),)),
    Param("skip_target", "number", Fraction(1, 4), "target share of zero-variance groups among the groups a step "
          "generates (the `greso` recipe presets 0.1)", **_SHARE),
    Param("skip_explore_start", "number", Fraction(1, 2), "the exploration rates p_e of both kinds at the run's "
          "first selection", **_UNIT),
    Param("skip_explore_min", "number", Fraction(1, 20), "the floor of the rates: no prompt is skipped with "
          "certainty", **_UNIT),
    Param("skip_step", "number", Fraction(1, 20), "how far a rate moves per step", **_UNIT),
)
# Rules between two parameters, checked on the resolved values (presets and settings together):
# (floor, value) — `value` must be ≥ `floor`.
ORDERED = (
    ("skip_explore_min", "skip_explore_start"),  # the rates start at or above their floor
)
PARAMS_BY_NAME = {p.name: p for p in PARAMETERS}
DEFAULTS: dict[str, object] = {p.name: p.default for p in PARAMETERS}
ENUMS = {p.name: p.values for p in PARAMETERS if p.kind == "enum"}
STATIC_ONLY = ("sample_fraction", "token_fraction")
LINEAR_ONLY = ("sample_fraction_start", "sample_fraction_end", "token_fraction_start", "token_fraction_end")


def parameter_table() -> str:
    """docs/curation.md §Parameters' table, generated from `PARAMETERS` (a test checks the docs)."""
    lines = ["| parameter | values (default) | meaning | binds |", "|---|---|---|---|"]
    lines += [f"| `{p.name}` | {p.range_text()} ({p.default_text()}) | {p.doc} | {_binds_text(p)} |"
              for p in PARAMETERS]
    return "\n".join(lines)


def _binds_text(p: Param) -> str:
    """The table's `binds` cell: the $values the parameter binds, and the derived values it enters."""
    names = [f"`${n}`" for n, _ in p.binds] + [f"{d.name} ({', '.join(f'`${n}`' for n, _ in d.binds) or 'K'})"
                                              for d in DERIVED if p.name in d.of]
    return ", ".join(names) or "–"


# Every number a parameter takes is at most 10^18 in magnitude and has at most 18 decimal places:
# its numerator and denominator fit 64-bit integers, so every value binds to DuckDB as BIGINT or
# DOUBLE, never overflows a query's arithmetic (`--set current_version=1e30` was an INT128 SQL
# error) and never becomes infinite as a float (`difficulty_prior=1e400`).
NUMBER_LIMIT = 10**18


def exact(text: object, name: str) -> Fraction:
    """A decimal literal (or TOML number) as an exact rational, within `NUMBER_LIMIT`."""
    f = _decimal(text, name)
    if abs(f) > NUMBER_LIMIT:
        raise ParamError(f"parameter {name}: must be at most 1e18 in magnitude, got {text!r}")
    if f.denominator > NUMBER_LIMIT:
        raise ParamError(f"parameter {name}: at most 18 decimal places, got {text!r}")
    return f


def _decimal(text: object, name: str) -> Fraction:
    if isinstance(text, bool):
        raise ParamError(f"parameter {name}: expected a number, got {text!r}")
    if isinstance(text, Fraction):
        return text
    if isinstance(text, int):
        return Fraction(text)
    try:
        value = Decimal(repr(text) if isinstance(text, float) else str(text).strip())
    except InvalidOperation:
        raise ParamError(f"parameter {name}: expected a decimal number, got {text!r}") from None
    if not value.is_finite():
        raise ParamError(f"parameter {name}: expected a finite number, got {text!r}")
    return Fraction(value)


def _int(value: object, name: str, low: int | None = None) -> int:
    f = exact(value, name)
    if f.denominator != 1:
        raise ParamError(f"parameter {name}: expected an integer, got {value!r}")
    if low is not None and f < low:
        raise ParamError(f"parameter {name}: must be ≥ {low}, got {value!r}")
    return int(f)


def _is_none(value: object) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() == "none")


def coerce(name: str, value: object) -> object:
    """Parse and range-check one parameter value (its `Param` says how)."""
    p = PARAMS_BY_NAME.get(name)
    if p is None:
        raise UnknownParameter(f"unknown parameter {name!r}{did_you_mean(name, DEFAULTS)} (known: {', '.join(DEFAULTS)})")
    if p.nullable and _is_none(value):
        return None
    if p.kind == "sql":
        if not isinstance(value, str) or not value.strip():
            raise ParamError(f"parameter {name}: expected an SQL predicate")
        return value.strip()
    if p.kind == "enum":
        word = "none" if value is None else str(value).strip()
        if word not in p.values:
            raise ParamError(f"parameter {name}: {value!r} is not one of {', '.join(p.values)}")
        return word
    if p.kind == "int":
        return _int(value, name, int(p.low))
    f = exact(value, name)
    below = f <= p.low if p.low_open else f < p.low
    if below or (p.high is not None and f > p.high):
        raise ParamError(f"parameter {name}: must be {'in ' if p.high is not None else ''}{p.range_text()}, "
                         f"got {value}")
    return f


@dataclass(frozen=True)
class Recipe:
    """A recipe: parameter presets (or a custom SELECT), and the training it is meant for: `epochs`
    (μ, passes per curated batch) and `lr`, used by the loop unless `--epochs` / `--lr` are given;
    `recommended` marks a recipe the README recommends, and `recommended_for` says for which tasks
    (recipes are recommended by the shape of the task: bench/RESULTS.md, "The reasoning testbed")."""

    name: str
    description: str
    presets: dict[str, object]
    sql: str | None = None  # custom recipe: a user SELECT over `candidates`
    epochs: int | None = None
    lr: float | None = None
    recommended: bool = False
    recommended_for: str | None = None


def builtin_recipes() -> list[str]:
    folder = resources.files(__package__).joinpath("recipes")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


# The keys a recipe file may hold at its top level, and the type of each (`params` is a table
# whose keys are parameter names, checked by `coerce`). Anything else is refused, naming the key.
RECIPE_KEYS = {"name": str, "description": str, "params": dict, "sql": str, "sql_file": str, "epochs": int,
               "lr": (int, float), "recommended": bool, "recommended_for": str}
_KIND_WORDS = {str: "string", dict: "table", int: "positive integer", (int, float): "positive number",
               bool: "boolean (true or false)"}


def check_epochs(value: object, origin: str) -> int:
    """μ, the passes per curated batch: a positive integer (a boolean or a float is refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParamError(f"{origin}: epochs must be a positive integer, got {value!r}")
    return value


def check_lr(value: object, origin: str) -> float:
    """A learning rate: a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ParamError(f"{origin}: lr must be a finite number > 0, got {value!r}")
    return float(value)


def _recipe_from_toml(name: str, text: str, origin: str) -> Recipe:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ParamError(f"{origin}: invalid TOML ({exc})") from None
    for key, value in data.items():
        kind = RECIPE_KEYS.get(key)
        if kind is None:
            what = "table" if isinstance(value, dict) else "key"
            raise ParamError(f"{origin}: unknown {what} {key!r} (a recipe holds {', '.join(RECIPE_KEYS)}; "
                             "parameters go under [params])")
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ParamError(f"{origin}: {key!r} must be a {_KIND_WORDS[kind]}, got {value!r}")
    presets = {}
    for k, v in data.get("params", {}).items():
        try:
            presets[k] = coerce(k, v)
        except ParamError as exc:
            raise ParamError(f"{origin}: [params] {exc}") from None
    if "sql" in data and "sql_file" in data:
        raise ParamError(f"{origin}: give either 'sql' or 'sql_file', not both")
    sql = data.get("sql")
    if "sql_file" in data:
        sql = _read_text(recipe_sql_path(origin, data["sql_file"]))
    epochs = check_epochs(data["epochs"], origin) if "epochs" in data else None
    lr = check_lr(data["lr"], origin) if "lr" in data else None
    if "recommended_for" in data and not data.get("recommended", False):
        raise ParamError(f"{origin}: 'recommended_for' goes with recommended = true")
    return Recipe(data.get("name", name), data.get("description", ""), presets, sql, epochs, lr,
                  data.get("recommended", False), data.get("recommended_for"))


def recipe_sql_path(origin: str, sql_file: str) -> str:
    """The file a recipe's `sql_file` names: a relative path ending in `.sql`, resolved against the
    recipe file's folder and staying inside it (symlinks followed). Anything else is refused
    before it is read, so no other file's text can reach an error message."""
    if not sql_file.endswith(".sql"):
        raise ParamError(f"{origin}: sql_file {sql_file!r} must name a .sql file")
    if os.path.isabs(sql_file):
        raise ParamError(f"{origin}: sql_file {sql_file!r} must be relative to the recipe's folder")
    folder = os.path.realpath(os.path.dirname(os.path.abspath(origin)))
    path = os.path.realpath(os.path.join(folder, sql_file))
    if os.path.commonpath([folder, path]) != folder:
        raise ParamError(f"{origin}: sql_file {sql_file!r} leaves the recipe's folder")
    if not os.path.isfile(path):
        raise ParamError(f"{origin}: sql_file {sql_file!r} not found next to the recipe")
    return path


def _read_text(path: str) -> str:
    """A recipe file's text; undecodable bytes are one error line naming the file."""
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ParamError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def load_recipe(ref: str) -> Recipe:
    """A built-in name, a TOML recipe file, or a custom `.sql` file."""
    if ref.endswith((".sql", ".toml")) and os.path.exists(ref) and not os.path.isfile(ref):
        raise ParamError(f"{ref}: a recipe must be a regular file")  # never read a FIFO or a device
    if ref.endswith(".sql"):
        if not os.path.exists(ref):
            raise ParamError(f"{ref}: custom recipe SQL file not found")
        return Recipe(f"custom:{os.path.basename(ref)}", "custom SQL recipe", {}, _read_text(ref))
    if ref.endswith(".toml"):
        if not os.path.exists(ref):
            raise ParamError(f"{ref}: recipe file not found")
        return _recipe_from_toml(os.path.basename(ref)[:-5], _read_text(ref), ref)
    names = builtin_recipes()
    if ref not in names:
        raise UnknownRecipe(f"unknown recipe {ref!r}{did_you_mean(ref, names)} (built-in: {', '.join(names)}; "
                            "or a .toml / .sql file)")
    text = resources.files(__package__).joinpath("recipes", f"{ref}.toml").read_text()
    return _recipe_from_toml(ref, text, f"recipes/{ref}.toml")


def parse_sets(items: list[str]) -> dict[str, str]:
    """`name=value` strings → dict; a name given twice is an error."""
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise ParamError(f"--set {item!r}: expected name=value")
        name, value = item.split("=", 1)
        name = name.strip()
        if name in out:
            raise ParamError(f"parameter {name!r} given twice")
        out[name] = value
    return out


def _scheduled(stem: str) -> Callable[[dict], Fraction]:
    """A fraction under the schedule: `stem` (static), or start + (end − start)·progress (linear)."""
    def value(v: dict) -> Fraction:
        if v["schedule"] == "linear":
            return v[f"{stem}_start"] + (v[f"{stem}_end"] - v[f"{stem}_start"]) * v["progress"]
        return v[stem]
    return value


@dataclass(frozen=True)
class Derived:
    """A value derived from several parameters, computed once per `Params` (`Params.derived`);
    `binds` are the $values it binds, `formula` what `--explain` and the docs say of it."""

    name: str
    formula: str
    of: tuple[str, ...]
    fn: Callable[[dict], Fraction]
    binds: tuple[tuple[str, Callable], ...] = ()


DERIVED: tuple[Derived, ...] = (
    Derived("f", "sample_fraction, or sample_fraction_start + (end − start)·progress with schedule=linear",
            ("schedule", "sample_fraction", "sample_fraction_start", "sample_fraction_end", "progress"),
            _scheduled("sample_fraction"), binds=(("f_num", lambda f: f.numerator), ("f_den", lambda f: f.denominator))),
    Derived("κ", "token_fraction, or token_fraction_start + (end − start)·progress with schedule=linear",
            ("schedule", "token_fraction", "token_fraction_start", "token_fraction_end", "progress"),
            _scheduled("token_fraction")),
)
# The token budget: known once the selection is (N), bound as $token_budget by the engines.
TOKEN_BUDGET = "K = ⌈κ·N⌉, N = the selected rows' response tokens"


@dataclass(frozen=True)
class Params:
    """The resolved parameters, with the values derived from them (`derived`: f, κ), computed once here."""

    values: dict[str, object]
    user_set: frozenset[str] = field(default_factory=frozenset)
    derived: dict[str, Fraction] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "derived", {d.name: d.fn(self.values) for d in DERIVED})

    def __getitem__(self, name: str):
        return self.values[name]

    def sample_fraction(self) -> Fraction:
        """f (`DERIVED`)."""
        return self.derived["f"]

    def token_fraction(self) -> Fraction:
        """κ under the schedule (`DERIVED`), whether or not a token stage runs."""
        return self.derived["κ"]

    @property
    def kappa(self) -> Fraction | None:
        """κ where a token stage runs (what the record keeps), else None."""
        return None if self["token"] == "none" else self.derived["κ"]

    def token_budget(self, n_tokens: int) -> int | None:
        """K = ⌈κ·N⌉ of the N response tokens of the selected rows (`TOKEN_BUDGET`); None without a token stage."""
        kappa = self.kappa
        return None if kappa is None else token_budget(n_tokens, kappa)

    def bindings(self) -> dict:
        """Every $value the parameters fix, as each `Param` and `Derived` names it (the run adds μ,
        the token budget, the threshold and the curation id)."""
        out = {name: fn(self.values[p.name]) for p in PARAMETERS for name, fn in p.binds}
        out.update({name: fn(self.derived[d.name]) for d in DERIVED for name, fn in d.binds})
        return out

    def with_defaults(self, latest: tuple | None, version: int | None) -> "Params":
        """These parameters with `where` (the latest step: `latest` = (created_at, run_id, step) of
        the newest rollout, None when the snapshot holds none) and `current_version` (`version`)
        filled where the user left them unset; the copy derives f and κ from the same table."""
        values = dict(self.values)
        if values["where"] is None:
            if latest is None:  # its rollouts shards hold no row
                raise EmptyBatch.of(None)
            values["where"] = step_where(latest[1], latest[2])
        if values["current_version"] is None:
            values["current_version"] = version
        return Params(values, self.user_set)

    def to_json(self) -> str:
        def plain(v):
            if isinstance(v, Fraction):
                return v.numerator if v.denominator == 1 else float(Decimal(v.numerator) / Decimal(v.denominator))
            return v

        return json.dumps({k: plain(v) for k, v in sorted(self.values.items())}, sort_keys=True)


DERIVED_BY_NAME = {d.name: d for d in DERIVED}


def derived_from(name: str) -> Derived | None:
    """The derived value (f, κ) that binds $value `name`, or None."""
    return next((d for d in DERIVED if any(n == name for n, _ in d.binds)), None)


def resolve(recipe: Recipe, sets: dict[str, object]) -> Params:
    """Recipe presets, then user settings; checks the schedule rule on user settings only."""
    values = dict(DEFAULTS)
    values.update(recipe.presets)
    for name, raw in sets.items():
        values[name] = coerce(name, raw)
    schedule = values["schedule"]
    wrong = LINEAR_ONLY if schedule == "static" else STATIC_ONLY
    for name in sets:
        if name in wrong:
            raise ParamError(
                f"parameter {name} belongs to the {'linear' if schedule == 'static' else 'static'} "
                f"schedule, but schedule={schedule}"
            )
    for floor, name in ORDERED:
        if values[floor] is not None and values[name] is not None and values[name] < values[floor]:
            raise ParamError(f"parameter {name}={_shown(values[name])} is below {floor}={_shown(values[floor])}: "
                             f"{name} must be ≥ {floor}")
    return Params(values, frozenset(sets))


def _shown(v) -> str:
    return f"{float(v):g}" if isinstance(v, Fraction) else str(v)


def round_half_up(x: Fraction) -> int:
    return math.floor(x + Fraction(1, 2))


def budget(n: int, f: Fraction) -> int:
    """min(n, max(2, round(n·f))) — the cross-group M and the in-group m_g of step 6."""
    return min(n, max(2, round_half_up(n * f)))


def token_budget(n_tokens: int, kappa: Fraction) -> int:
    """K = ⌈κ·N⌉ tokens of the N response tokens of the selected rows."""
    return math.ceil(kappa * n_tokens)


def step_where(run_id: str, step: int) -> str:
    """The `where` predicate of one step of one run: the batch a trainer curates after sampling it."""
    return f"run_id = {sql_string(run_id)} AND step = {int(step)}"


_STEP_WHERE = re.compile(r"run_id = '((?:[^']|'')*)' AND step = (\d+)")


def run_of_where(where: str) -> str | None:
    """The run a `where` of `step_where`'s exact form selects (its rows can belong to no other run),
    else None: the loop's curations learn their run without a query (curate.steps.batch_runs)."""
    m = _STEP_WHERE.fullmatch(where)
    return None if m is None else m.group(1).replace("''", "'")


def step_of_where(where: str | None) -> tuple[str, int] | None:
    """(run, step) of a `where` of `step_where`'s exact form (its rows are that run's step only), else None."""
    m = None if where is None else _STEP_WHERE.fullmatch(where)
    return None if m is None else (m.group(1).replace("''", "'"), int(m.group(2)))
