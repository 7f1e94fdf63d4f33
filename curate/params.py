"""Curation parameters (docs/curation.md §Parameters), recipes as presets, `--set` parsing, schedules.

Invariants:
- Every recipe accepts every parameter; a recipe only sets defaults. Unknown names, a name given
  twice, values out of range and fractions of the other schedule are errors (one line each).
- Fractions and `progress` are exact rationals (`Fraction`) from the decimal text as written; budgets
  are computed in rational arithmetic, and "round" is half up: floor(x + 1/2).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from importlib import resources

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


ENUMS = {
    "truncated": ("keep", "drop"),
    "std": ("sample", "population", "none"),
    "filter": ("none", "dynamic"),
    "amplify": ("none", "da3po", "group"),
    "sample": ("none", "pods", "in_group", "cross_group"),
    "token": ("none", "abs_adv_entropy", "entropy"),
    "schedule": ("static", "linear"),
    "replay": ("none", "groups", "rollouts", "window"),
    "prompt_skip": ("none", "greso"),
}
FRACTIONS = (
    "sample_fraction", "sample_fraction_start", "sample_fraction_end",
    "token_fraction", "token_fraction_start", "token_fraction_end",
)
DEFAULTS: dict[str, object] = {
    "where": None,
    "current_version": None,
    "max_policy_lag": None,
    "max_reuse": None,
    "truncated": "keep",
    "std": "sample",
    "filter": "none",
    "amplify": "none",
    "amplify_tau": Fraction(1, 2),
    "amplify_max": Fraction(3),
    "difficulty_window": 4,
    "difficulty_prior": Fraction(2),
    "sample": "none",
    "sample_fraction": Fraction(1, 4),
    "sample_fraction_start": Fraction(1, 4),
    "sample_fraction_end": Fraction(1),
    "token": "none",
    "token_fraction": Fraction(1, 5),
    "token_fraction_start": Fraction(1, 5),
    "token_fraction_end": Fraction(1),
    "schedule": "static",
    "progress": Fraction(0),
    "replay": "none",
    "replay_window": 2,
    "replay_max_uses": 2,
    "replay_count": None,
    "replay_decay": Fraction(1, 2),
    # pre-rollout prompt selection (docs/curation.md §Before generation; curate.prompts)
    "prompt_skip": "none",
    "skip_window": 8,
    "skip_target": Fraction(1, 4),
    "skip_explore_start": Fraction(1, 2),
    "skip_explore_min": Fraction(1, 20),
    "skip_step": Fraction(1, 20),
}
SKIP_FRACTIONS = ("skip_explore_start", "skip_explore_min", "skip_step")
STATIC_ONLY = ("sample_fraction", "token_fraction")
LINEAR_ONLY = ("sample_fraction_start", "sample_fraction_end", "token_fraction_start", "token_fraction_end")


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
    """Parse and range-check one parameter value."""
    if name not in DEFAULTS:
        raise UnknownParameter(f"unknown parameter {name!r}{did_you_mean(name, DEFAULTS)} (known: {', '.join(DEFAULTS)})")
    if name == "where":
        if _is_none(value):
            return None
        if not isinstance(value, str) or not value.strip():
            raise ParamError("parameter where: expected an SQL predicate")
        return value.strip()
    if name in ENUMS:
        word = "none" if value is None else str(value).strip()
        if word not in ENUMS[name]:
            raise ParamError(f"parameter {name}: {value!r} is not one of {', '.join(ENUMS[name])}")
        return word
    if name in ("max_policy_lag", "max_reuse", "current_version"):
        if _is_none(value):
            return None
        return _int(value, name, {"max_policy_lag": 0, "max_reuse": 1, "current_version": 0}[name])
    if name in ("difficulty_window", "replay_window", "replay_max_uses", "skip_window"):
        return _int(value, name, 1)
    if name == "replay_count":
        return None if _is_none(value) else _int(value, name, 1)
    f = exact(value, name)
    if name in FRACTIONS or name == "amplify_tau" or name in SKIP_FRACTIONS:
        if not (0 < f <= 1):
            raise ParamError(f"parameter {name}: must be in (0, 1], got {value}")
    elif name in ("progress", "skip_target"):
        if not (0 <= f <= 1):
            raise ParamError(f"parameter {name}: must be in [0, 1], got {value}")
    elif name == "amplify_max":
        if f < 1:
            raise ParamError(f"parameter amplify_max: must be ≥ 1, got {value}")
    elif name == "replay_decay":
        if not (0 < f <= 1):
            raise ParamError(f"parameter replay_decay: must be in (0, 1], got {value}")
    elif name == "difficulty_prior":
        if f < 0:
            raise ParamError(f"parameter difficulty_prior: must be ≥ 0, got {value}")
    return f


@dataclass(frozen=True)
class Recipe:
    """A recipe: parameter presets (or a custom SELECT), and the training it is meant for: `epochs`
    (μ, passes per curated batch) and `lr`, used by the loop unless `--epochs` / `--lr` are given;
    `recommended` marks the recipe the README recommends for fewer generated rollouts."""

    name: str
    description: str
    presets: dict[str, object]
    sql: str | None = None  # custom recipe: a user SELECT over `candidates`
    epochs: int | None = None
    lr: float | None = None
    recommended: bool = False


def builtin_recipes() -> list[str]:
    folder = resources.files(__package__).joinpath("recipes")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


# The keys a recipe file may hold at its top level, and the type of each (`params` is a table
# whose keys are parameter names, checked by `coerce`). Anything else is refused, naming the key.
RECIPE_KEYS = {"name": str, "description": str, "params": dict, "sql": str, "sql_file": str, "epochs": int,
               "lr": (int, float), "recommended": bool}
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
    return Recipe(data.get("name", name), data.get("description", ""), presets, sql, epochs, lr,
                  data.get("recommended", False))


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


@dataclass(frozen=True)
class Params:
    values: dict[str, object]
    user_set: frozenset[str] = field(default_factory=frozenset)

    def __getitem__(self, name: str):
        return self.values[name]

    def sample_fraction(self) -> Fraction:
        if self["schedule"] == "linear":
            f0, f1 = self["sample_fraction_start"], self["sample_fraction_end"]
            return f0 + (f1 - f0) * self["progress"]
        return self["sample_fraction"]

    def token_fraction(self) -> Fraction:
        if self["schedule"] == "linear":
            k0, k1 = self["token_fraction_start"], self["token_fraction_end"]
            return k0 + (k1 - k0) * self["progress"]
        return self["token_fraction"]

    def to_json(self) -> str:
        def plain(v):
            if isinstance(v, Fraction):
                return v.numerator if v.denominator == 1 else float(Decimal(v.numerator) / Decimal(v.denominator))
            return v

        return json.dumps({k: plain(v) for k, v in sorted(self.values.items())}, sort_keys=True)


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
    return Params(values, frozenset(sets))


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
