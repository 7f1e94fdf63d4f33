"""Checked options of the command line: one rule per kind of number, and one-line usage errors.

Every `int` or `float` option of every command is declared through one of the constructors here
(`count`, `seconds`, `positive`, `seq`, `ruled`, ...). Each attaches a `Rule` of the library
(`rollstore.rules`, which the Python front door applies too) as the option's callback,
which click runs while it parses the command line, before the command's body: a refused value
never opens a buffer, leases a shard or commits anything.

Invariants:
- Floats must be finite (`nan`, `inf` are refused everywhere); integers must fit a signed 64-bit
  integer (what SQLite and Arrow hold), so `--snapshot 99999999999999999999` is a usage error,
  not an OverflowError later.
- Each rule states its range (`low`/`high`, open or closed); a refused value is one line:
  `error: rollstore gc: --grace: nan is not a finite number (see rollstore gc --help)`, exit 2.
- `OneLineErrors` (the app's group class) renders every click usage error (a missing argument, an
  unknown option, a value that is not a number, a refused rule) as that one line on stderr.
- `tests/test_cli_options.py` checks that every numeric option of every command has a rule.
"""

from typing import Any, Optional

import click
import typer
from typer._click import exceptions as _typer_click  # typer >= 0.26 vendors its own click
from typer.core import TyperGroup

from rollstore import rules as _rules
from rollstore.rules import INT64_MAX, MAX_SECONDS, Rule  # noqa: F401 - the rules live in the library

# Usage errors come from typer's own click (missing arguments, values that are not numbers, our
# rules) or, from code written against click, from click itself: both are rendered as one line.
USAGE_ERRORS = (_typer_click.UsageError, click.UsageError)
HELP_ERRORS = (_typer_click.NoArgsIsHelpError, click.exceptions.NoArgsIsHelpError)


def _callback(rule: Rule):
    """`rule` as a click callback: click runs it while it parses, before the command's body."""

    def check(ctx: typer.Context, param: typer.CallbackParam, value: Any):
        if value is None or ctx.resilient_parsing:
            return value
        for v in value if isinstance(value, (list, tuple)) else [value]:
            why = rule.problem(v)
            if why is not None:
                raise typer.BadParameter(why, ctx=ctx, param=param)
        return value

    check.rule = rule  # the test of "every numeric option has a rule" looks for it
    return check


def ruled(default: Any, *names: str, rule: Rule, **kw) -> Any:
    """An option checked by `rule`: one of the library's tables (rollstore.rules.TRAIN, ...) where
    the front door takes the same keyword, so both doors apply the same object."""
    return typer.Option(default, *names, callback=_callback(rule), **kw)


def count(default: Any, *names: str, low: int = 1, **kw) -> Any:
    """An integer ≥ `low` (default 1): epochs, sizes, iterations, ranks."""
    return ruled(default, *names, rule=_rules.count(low), **kw)


def seq(default: Any, *names: str, **kw) -> Any:
    """A manifest sequence number (a snapshot): an integer ≥ 0 that fits SQLite."""
    return ruled(default, *names, rule=_rules.SEQ, **kw)


def seed(default: Any, *names: str, **kw) -> Any:
    """A random seed: 0 ≤ seed < 2^32 (what numpy accepts)."""
    return ruled(default, *names, rule=_rules.SEED, **kw)


def seconds(default: Any, *names: str, zero: str = "", **kw) -> Any:
    """A duration: finite, 0 ≤ s ≤ 1e9 (`zero`: what 0 means, e.g. "no limit")."""
    return ruled(default, *names, rule=_rules.seconds(zero), **kw)


def interval(default: Any, *names: str, **kw) -> Any:
    """A positive duration: finite, 0 < s ≤ 1e9 (a polling interval)."""
    return ruled(default, *names, rule=Rule(low=0, low_open=True, high=MAX_SECONDS, note=" (seconds)"), **kw)


def positive(default: Any, *names: str, high: Optional[float] = None, **kw) -> Any:
    """A finite number > 0 (a learning rate, a temperature, a size), at most `high` when given."""
    return ruled(default, *names, rule=_rules.positive(high), **kw)


def fraction(default: Any, *names: str, **kw) -> Any:
    """A finite number in (0, 1] (top-p)."""
    return ruled(default, *names, rule=_rules.FRACTION, **kw)


def real(default: Any, *names: str, **kw) -> Any:
    """Any finite number (a reward threshold may be negative)."""
    return ruled(default, *names, rule=Rule(), **kw)


def choice(default: Any, *names: str, choices, **kw) -> Any:
    """A word out of `choices` (a tuple, or a callable returning one, for lists known only late)."""

    def check(ctx: typer.Context, param: typer.CallbackParam, value: Any):
        if value is None or ctx.resilient_parsing:
            return value
        allowed = tuple(choices() if callable(choices) else choices)
        if value not in allowed:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(allowed)}", ctx=ctx, param=param)
        return value

    return typer.Option(default, *names, callback=check, **kw)


def memory(default: Any, *names: str, **kw) -> Any:
    """A memory size written like DuckDB's (`200MB`, `2GiB`), between 16 MiB and 1 PiB."""

    def check(ctx: typer.Context, param: typer.CallbackParam, value: Any):
        if value is None or ctx.resilient_parsing:
            return value
        from rollstore.queries.session import MemoryLimitError, parse_memory_limit

        try:
            parse_memory_limit(value)
        except MemoryLimitError as exc:
            raise typer.BadParameter(str(exc), ctx=ctx, param=param) from None
        return value

    return typer.Option(default, *names, callback=check, **kw)


def one_line_usage(exc) -> str:
    """A usage error as one line: the command, the option, the reason, where to read more."""
    ctx = exc.ctx
    path = ctx.command_path if ctx is not None else "rollstore"
    names = [n for n in getattr(getattr(exc, "param", None), "opts", None) or [] if n.startswith("--")]
    if names and type(exc).__name__ == "BadParameter":
        text = f"{names[0]}: {exc.message}"
    else:
        text = exc.format_message()
    text = " ".join(text.split())
    return f"{path}: {text} (see {path} --help)"


class OneLineErrors(TyperGroup):
    """The app's group: click's usage errors become one `error:` line on stderr (exit 2)."""

    def _fail(self, exc):
        from rich.console import Console
        from rich.markup import escape

        Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {escape(one_line_usage(exc))}",
                                                   highlight=False, markup=True)
        raise typer.Exit(2)

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except HELP_ERRORS:
            raise
        except USAGE_ERRORS as exc:
            self._fail(exc)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except HELP_ERRORS:
            raise
        except USAGE_ERRORS as exc:
            self._fail(exc)
