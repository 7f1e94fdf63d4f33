"""The `rollstore` command line's application: the typer app, its two consoles and the guard that
turns every failure into one line. The commands themselves are declared in `store_commands`,
`curation_commands` and `loop_commands`; `commands` assembles them.

Invariants:
- Every user-facing failure is one line on stderr (`error: ...`) and a non-zero exit; no traceback.
  An unexpected exception is one line too, with a hint to rerun with `rollstore --debug ...`, which
  re-raises it with its traceback.
- Results go to stdout (`out`); progress and chatter go to stderr (`err`).
"""

from __future__ import annotations

import os
import sys

import typer
from rich.console import Console

from rollstore.cli.options import OneLineErrors
from rollstore.storage.errors import RollstoreError

# transformers' own progress bars and notices would interleave with ours on stderr.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
if "transformers" in sys.modules:  # imported before us (a notebook, a test): the variables above came too late
    sys.modules["transformers"].utils.logging.disable_progress_bar()
    sys.modules["transformers"].utils.logging.set_verbosity_error()

app = typer.Typer(cls=OneLineErrors, add_completion=True, no_args_is_help=True, help="Offline replay buffer and curation engine for GRPO-family RL.",
                  pretty_exceptions_enable=False)
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def _losses() -> tuple:
    """The learner's loss names (read when a command that takes --loss is parsed; imports torch)."""
    from rollstore.learner.losses import LOSSES

    return tuple(sorted(LOSSES))


DEBUG = {"on": os.environ.get("ROLLSTORE_DEBUG", "") not in ("", "0")}


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"rollstore {version('rollstore')}")
        raise typer.Exit(0)


@app.callback()
def _options(debug: bool = typer.Option(False, "--debug", help="On an unexpected error, show the traceback."),
             version: bool = typer.Option(False, "--version", is_eager=True, callback=_version,
                                          help="Print rollstore's version and exit.")):
    """Offline replay buffer and curation engine for GRPO-family RL."""
    # set per invocation: an in-process caller (a test, a notebook) that once passed --debug does not
    # keep raw tracebacks for every later command
    DEBUG["on"] = debug or os.environ.get("ROLLSTORE_DEBUG", "") not in ("", "0")


def fail(message: str, code: int = 1) -> None:
    from rich.markup import escape

    err.print(f"[red]error:[/red] {escape(message)}", highlight=False, markup=True)
    raise typer.Exit(code)


def guarded(fn):
    """Turn RollstoreError (the catalog's errors among them), OS errors into one error line and exit
    1; anything else unexpected into one line with a hint to rerun with --debug (the traceback)."""
    import functools

    import click

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RollstoreError as exc:
            fail(one_line(str(exc)))
        except OSError as exc:
            if exc.filename is None or exc.strerror is None:
                fail(one_line(str(exc)))
            fail(f"{exc.filename}: {exc.strerror}")
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort, typer.Exit):
            raise
        except Exception as exc:
            if DEBUG["on"]:
                raise
            fail(f"unexpected {type(exc).__name__}: {one_line(str(exc))} "
                 f"(rerun with `rollstore --debug ...` for the traceback)")

    return wrapper


def one_line(text: str) -> str:
    """The first line of `text`, clipped; escape anything that a terminal would interpret."""
    text = " ".join(part.strip() for part in str(text).splitlines() if part.strip()) or "no details"
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= 500 else text[:497] + "..."


def open_buffer(path: str):
    from rollstore.storage.buffer import Buffer

    return Buffer.open(path)


def front_door(path: str, console=None):
    """The front door's handle of the buffer at `path` (`rollstore.open`), printing to `console`
    (default: stdout's): `curate`, `train` and `generate` are its methods, called as a user would."""
    from rollstore.handle import Buffer, open as open_handle

    return Buffer(open_handle(path).root, console=out if console is None else console)
