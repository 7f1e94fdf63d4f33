"""The commands of curation: curate, audit, report, compare, recipes.

Invariants: as `rollstore/cli/app.py`; `curate` prints the curation id alone on the last line of
stdout and calls the front door (`rollstore.open(BUF).curate`), as a Python user would.
"""

from __future__ import annotations

from typing import List, Optional

import typer

from rollstore import rules
from rollstore.cli.app import app, fail, front_door, guarded, open_buffer, out
from rollstore.cli.options import memory, ruled, seq
from rollstore.rules.defaults import CURATE
from rollstore.storage.errors import RollstoreError


@app.command("curate")
@guarded
def curate_(
    buffer: str,
    recipe: str = typer.Option(..., "--recipe", "-r", help="Built-in recipe, a .toml recipe file, or a .sql custom recipe."),
    set_: List[str] = typer.Option([], "--set", help="Override a parameter: name=value (repeatable)."),
    progress: Optional[str] = typer.Option(None, "--progress", help="Schedule position t in [0, 1] (= --set progress=T)."),
    snapshot: Optional[int] = ruled(None, "--snapshot", rule=rules.CURATE["snapshot"], help="Manifest sequence number to curate (default: latest)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Compute and print, commit nothing."),
    memory_limit: str = memory(CURATE.memory_limit, "--memory-limit", help="DuckDB memory limit; beyond it, it spills to BUFFER/tmp."),
    engine: str = typer.Option(CURATE.engine, "--engine", help="embedded (DuckDB in this process) or dask (dask.distributed; same result)."),
    scheduler: Optional[str] = typer.Option(None, "--scheduler", help="With --engine dask: a scheduler ADDRESS (tcp://host:8786) or local:N."),
    partitions: Optional[int] = ruled(None, "--partitions", rule=rules.CURATE["partitions"], help="With --engine dask: hash partitions of the batch (default 2 per worker)."),
    timeout: float = ruled(CURATE.timeout, "--timeout", rule=rules.CURATE["timeout"], help="Seconds the user SQL (where, a custom recipe) may run (0: no limit; on Dask: per task)."),
):
    """Run a curation recipe over a snapshot; prints a summary and the curation id last."""
    from rollstore.cli.curate import curation_values, print_summary

    cur = front_door(buffer).curate(recipe, snapshot=snapshot, dry_run=dry_run, memory_limit=memory_limit,
                                    timeout=timeout, engine=engine, scheduler=scheduler, partitions=partitions,
                                    sets=curation_values(set_, progress))
    print_summary(cur.result, out)
    if cur.result.refusal():  # the curation is committed (its audit says why per row); nothing of it can be trained
        fail(cur.result.refusal())


@app.command()
@guarded
def audit(
    buffer: str,
    curation_id: Optional[str] = typer.Argument(None, help="Curation id (default: the latest)."),
    rollout: Optional[str] = typer.Option(None, "--rollout", help="Show one rollout's tokens, scores and kept marks."),
    compare: Optional[str] = typer.Option(None, "--compare", help="A second curation id: both side by side, and what one kept that the other did not."),
    format: str = typer.Option("table", "--format", "-f", help="table|json|csv"),
    skips: bool = typer.Option(False, "--skips", help="A run's pre-rollout prompt selection, step by step."),
    run: Optional[str] = typer.Option(None, "--run", help="With --skips: the run (needed when several have one)."),
):
    """Reason counts and keep rates of a curation, one rollout's kept tokens, two curations compared,
    or a run's pre-rollout prompt selection (--skips)."""
    from rollstore.report.audit import run_audit

    with open_buffer(buffer) as buf:
        run_audit(buf, curation_id, rollout, out, format, compare, skips=skips, run_id=run)


@app.command()
@guarded
def report(
    buffer: str,
    out_file: str = typer.Option(..., "--out", "-o", help="The HTML file to write (replaced atomically)."),
    curation: Optional[str] = typer.Option(None, "--curation", help="Scope the candidate-level sections to this curation (default: all, one block per recipe)."),
    snapshot: Optional[int] = seq(None, "--snapshot", help="Manifest sequence number to report (default: latest)."),
):
    """One self-contained HTML report (charts, token views, the SQL behind each) of a buffer."""
    from rollstore.output.outfile import check_output_file
    from rollstore.report.page import build_report

    check_output_file(out_file)
    with open_buffer(buffer) as buf:
        info = build_report(buf, out_file, curation_id=curation, snapshot=snapshot)
    out.print(f"wrote {info.path} ({info.bytes / 1024:.0f} KiB, snapshot {info.snapshot_seq}, "
              f"{info.seconds:.2f} s)", highlight=False, markup=False)


@app.command()
@guarded
def compare(
    buffer: str,
    run_a: str = typer.Argument(..., help="A run id of the buffer (rollouts, checkpoints or evaluations)."),
    run_b: str = typer.Argument(..., help="Another run id of the same buffer."),
    snapshot: Optional[int] = seq(None, "--snapshot", help="Manifest sequence number to read (default: latest)."),
):
    """Two runs side by side: held-out curves, rollouts, learner tokens, loop time, settings that differ."""
    from rollstore.report.compare import compare_runs

    with open_buffer(buffer) as buf:
        result = compare_runs(buf, run_a, run_b, snapshot)
    out.print(result.text(), highlight=False, markup=False, soft_wrap=True)


@app.command()
@guarded
def recipes(
    name: Optional[str] = typer.Argument(None, metavar="[RECIPE]", help="Explain this recipe (= --explain RECIPE)."),
    explain: Optional[str] = typer.Option(None, "--explain", metavar="RECIPE",
                                          help="Print this recipe's plan: each step's SQL file, values, reads and writes."),
    set_: List[str] = typer.Option([], "--set", help="name=value parameter override (with --explain), repeatable."),
):
    """List the built-in recipes, or explain one as the plan it runs."""
    from rollstore.curate.params import builtin_recipes, load_recipe

    if name is not None and explain is not None and name != explain:
        raise RollstoreError(f"recipes: two recipes named ({name} and --explain {explain}); name one")
    explain = explain if explain is not None else name
    if explain is None:
        if set_:
            raise RollstoreError("--set goes with --explain RECIPE")
        names = builtin_recipes()
        width = max(len(n) for n in names)
        for name in names:
            r = load_recipe(name)
            mark = ""
            if r.recommended:
                meant = ", ".join(f"{k} {v:g}" for k, v in (("epochs", r.epochs), ("lr", r.lr)) if v is not None)
                mark = ("  [recommended" + (f" for {r.recommended_for}" if r.recommended_for else "")
                        + (f": {meant}" if meant else "") + "]")
            out.print(f"{name:{width}s}  {r.description}{mark}", highlight=False, markup=False)
        return
    from rollstore.cli.explain import print_plan

    print_plan(explain, set_, out)
