"""The `rollstore` command line (typer + rich).

Invariants:
- Every user-facing failure is one line on stderr (`error: ...`) and a non-zero exit; no traceback.
- Results go to stdout; progress and chatter go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
from typing import List, Optional

import typer
from rich.console import Console

from storage.errors import RollstoreError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Offline replay buffer and curation engine for GRPO-family RL.")
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def fail(message: str, code: int = 1) -> None:
    from rich.markup import escape

    err.print(f"[red]error:[/red] {escape(message)}", highlight=False, markup=True)
    raise typer.Exit(code)


def guarded(fn):
    """Turn RollstoreError (and a few OS errors) into one error line and exit 1."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RollstoreError as exc:
            fail(str(exc).replace("\n", " "))
        except (FileNotFoundError, PermissionError, IsADirectoryError) as exc:
            fail(f"{exc.filename}: {exc.strerror}")

    return wrapper


def open_buffer(path: str):
    from storage.buffer import Buffer

    return Buffer.open(path)


@app.command()
@guarded
def init(buffer: str = typer.Argument(..., help="Directory of the new (or existing) buffer.")):
    """Create a buffer directory with its manifest."""
    from storage.buffer import Buffer

    Buffer.init(buffer).close()
    out.print(f"initialised {os.path.abspath(buffer)}", highlight=False)


@app.command("import")
@guarded
def import_(
    buffer: str,
    files: List[str] = typer.Argument(..., help="JSONL or Parquet files of rows in the rollouts schema."),
    compact_entropies: bool = typer.Option(False, "--compact-entropies", help="Store entropies at bf16 precision."),
):
    """Append rollouts from files: one all-or-nothing append per file."""
    from storage.importer import read_rows_file

    with open_buffer(buffer) as buf:
        for path in files:
            table = read_rows_file(path)
            shard = buf.append_rollouts(table, source=path, compact=compact_entropies)
            out.print(f"{path}: {shard.rows} rows, {shard.tokens} tokens -> {shard.path}", highlight=False)


@app.command()
@guarded
def sql(
    buffer: str,
    query: str = typer.Argument(..., help="SELECT statement(s) over the buffer's tables and views."),
    format: str = typer.Option("table", "--format", "-f", help="table|csv|json|parquet"),
    out_file: Optional[str] = typer.Option(None, "--out", "-o", help="Write the result to this file."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds before the query is stopped."),
    memory_limit: str = typer.Option("2GB", "--memory-limit"),
    seq: Optional[int] = typer.Option(None, "--snapshot", help="Manifest sequence number to read (default: latest)."),
):
    """Run sandboxed, read-only SQL over a snapshot of the buffer."""
    from queries.session import Session
    from rollstore.output import write_result

    if format not in ("table", "csv", "json", "parquet"):
        fail(f"--format must be table, csv, json or parquet, not {format!r}")
    if format == "parquet" and not out_file:
        fail("--format parquet needs --out FILE")
    with open_buffer(buffer) as buf, buf.snapshot(seq, pin=True) as snap, Session(snap, memory_limit=memory_limit) as s:
        table = s.run_user_sql(query, timeout=timeout)
    write_result(table, format, out_file, out)


@app.command()
@guarded
def info(buffer: str, format: str = typer.Option("table", "--format", "-f", help="table|json")):
    """Shards, rows, tokens, bytes per token and policy versions of a buffer."""
    from rollstore.inspect import buffer_info, render_info

    with open_buffer(buffer) as buf:
        data = buffer_info(buf)
    if format == "json":
        out.print_json(json.dumps(data))
    else:
        render_info(data, out)


@app.command("gc")
@guarded
def gc_(buffer: str, grace: float = typer.Option(3600.0, "--grace", help="Seconds an orphan must be old before removal.")):
    """Remove orphaned files (crashed writes) and files of compacted shards no snapshot needs."""
    from storage.maintenance import gc

    with open_buffer(buffer) as buf:
        r = gc(buf, grace)
    out.print(f"removed {r.orphans_removed} orphan files and {r.retired_removed} retired shards ({r.bytes_freed} bytes)")


@app.command()
@guarded
def compact(
    buffer: str,
    table: str = typer.Option("rollouts", "--table"),
    small_mb: float = typer.Option(16.0, "--small-mb", help="Shards smaller than this are merged."),
    target_mb: float = typer.Option(128.0, "--target-mb", help="Size of merged shards."),
):
    """Merge small shards into large ones in one manifest transaction."""
    from storage.maintenance import compact as run

    with open_buffer(buffer) as buf:
        r = run(buf, table, int(small_mb * 2**20), int(target_mb * 2**20))
    out.print(f"merged {r.merged_shards} shards into {r.new_shards} ({r.rows} rows)")


@app.command("curate")
@guarded
def curate_(
    buffer: str,
    recipe: str = typer.Option(..., "--recipe", "-r", help="Built-in recipe, a .toml recipe file, or a .sql custom recipe."),
    set_: List[str] = typer.Option([], "--set", help="Override a parameter: name=value (repeatable)."),
    progress: Optional[str] = typer.Option(None, "--progress", help="Schedule position t in [0, 1] (= --set progress=T)."),
    snapshot: Optional[int] = typer.Option(None, "--snapshot", help="Manifest sequence number to curate (default: latest)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Compute and print, commit nothing."),
    memory_limit: str = typer.Option("2GB", "--memory-limit", help="DuckDB memory limit; beyond it, it spills to BUFFER/tmp."),
):
    """Run a curation recipe over a snapshot; prints a summary and the curation id last."""
    from rollstore.curation_cli import print_summary, run_curate

    with open_buffer(buffer) as buf:
        result = run_curate(buf, recipe, set_, progress, snapshot, dry_run, memory_limit)
    print_summary(result, out)


@app.command()
@guarded
def audit(
    buffer: str,
    curation_id: Optional[str] = typer.Argument(None, help="Curation id (default: the latest)."),
    rollout: Optional[str] = typer.Option(None, "--rollout", help="Show one rollout's tokens, scores and kept marks."),
):
    """Reason counts and keep rates of a curation, or one rollout's kept tokens."""
    from rollstore.curation_cli import run_audit

    with open_buffer(buffer) as buf:
        run_audit(buf, curation_id, rollout, out)


@app.command()
def recipes():
    """List the built-in recipes."""
    from curate.params import builtin_recipes, load_recipe

    for name in builtin_recipes():
        out.print(f"{name:12s} {load_recipe(name).description}", highlight=False)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
