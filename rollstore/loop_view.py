"""Rich progress display for `rollstore loop` and the demo: one table row per iteration."""

from __future__ import annotations

from rich.console import Console
from rich.live import Live
from rich.table import Table

from rollstore.loop import IterationReport, LoopConfig, run_loop


def _table(cfg: LoopConfig, rows: list[IterationReport], evals: list[tuple[int, int, float]]) -> Table:
    held = ", ".join(f"it {i}: {a:.1%}" for i, _v, a in evals[-4:])
    t = Table(title=f"{cfg.recipe} on {cfg.model} × {cfg.prompts}   held-out greedy accuracy: {held or '…'}",
              title_justify="left")
    for col in ("iter", "version", "batch acc", "rollouts", "samples kept", "tokens kept", "loss", "held-out", "s"):
        t.add_column(col, justify="right")
    for r in rows[-25:]:
        t.add_row(
            str(r.iteration), str(r.version), f"{r.batch_accuracy:.1%}",
            str(r.rollouts) + (f" ({r.gen_batches}b)" if r.gen_batches > 1 else ""),
            f"{r.samples_kept}/{r.rollouts}",
            f"{r.tokens_kept}/{r.tokens_candidate}",
            "" if r.loss is None else f"{r.loss:.4f}",
            "" if r.heldout is None else f"{r.heldout:.1%}",
            f"{r.seconds:.1f}",
        )
    return t


def run_with_display(cfg: LoopConfig, console: Console) -> dict:
    rows: list[IterationReport] = []
    evals: list[tuple[int, int, float]] = []
    with Live(_table(cfg, rows, evals), console=console, refresh_per_second=4, transient=False) as live:
        def on_iteration(rep: IterationReport) -> None:
            rows.append(rep)
            live.update(_table(cfg, rows, evals))
            if rep.note:
                console.print(f"[yellow]iteration {rep.iteration}: {rep.note}[/yellow]")

        def on_eval(it: int, version: int, acc: float) -> None:
            evals.append((it, version, acc))
            live.update(_table(cfg, rows, evals))

        summary = run_loop(cfg, on_iteration, on_eval)
    return summary
