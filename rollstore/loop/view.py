"""Rich progress display for `rollstore loop` and the demo: one table row per iteration."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.live import Live
from rich.table import Table

from rollstore.loop.driver import IterationReport, LoopConfig, run_loop


def _table(cfg: LoopConfig, rows: list[IterationReport], evals: list[tuple[int, int, float]]) -> Table:
    """The progress table; fits 80 columns (counts are compact, the model and prompts go in a caption)."""
    shown = evals if len(evals) <= 4 else [evals[0], None, *evals[-3:]]  # the start (iteration 0) stays in view
    held = "  ".join("…" if e is None else f"it {e[0]}: {e[2]:.1%}" for e in shown)
    t = Table(title=f"{cfg.recipe}: held-out greedy {held or '…'}", title_justify="left",
              box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1))
    for col in ("it", "ver", "acc", "n", "kept", "tokens", "loss", "held-out", "s"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in rows[-25:]:
        t.add_row(
            str(r.iteration), str(r.version), f"{r.batch_accuracy:.1%}",
            str(r.rollouts) + (f"/{r.gen_batches}b" if r.gen_batches > 1 else ""),
            _count(r.samples_kept),
            f"{_count(r.tokens_kept)}/{_count(r.tokens_candidate)}",
            "" if r.loss is None else f"{r.loss:+.3f}",
            "" if r.heldout is None else f"{r.heldout:.1%}",
            f"{r.seconds:.1f}",
        )
    return t


def _count(n: int) -> str:
    """A count in at most 5 characters: 812, 9.4k, 12k, 1.2M."""
    if n < 1000:
        return str(n)
    if n < 10_000:
        return f"{n / 1000:.1f}k"
    if n < 1_000_000:
        return f"{n // 1000}k"
    return f"{n / 1e6:.1f}M"


def settings_line(cfg: LoopConfig) -> str:
    """The run's training settings in one line, printed before its first iteration."""
    s = cfg.settings()
    pool = f"pool {s['pool_size']} prompts" if s["pool_size"] else "fresh prompts (no pool)"
    return (f"run {s['run_id']}: recipe {s['recipe']}, μ {s['epochs']} ({s['epochs_from']}), lr {s['lr']:g} "
            f"({s['lr_from']}), loss {s['loss']}, {s['prompts_per_iter']} prompts × {s['group_size']} an iteration, "
            f"{pool}, {s['iterations']} iterations, seed {s['seed']}")


def legend(cfg: LoopConfig) -> str:
    """What the table's columns mean, printed once above it (wrapped, never cut at the terminal's width)."""
    return (f"{cfg.model} on {cfg.prompts}. acc: the batch's sampled accuracy; n: rollouts (/Nb: N generation "
            "batches); kept: samples trained on; tokens: kept/candidate; held-out: greedy accuracy after the iteration")


def run_with_display(cfg: LoopConfig, console: Console) -> dict:
    console.print(settings_line(cfg), highlight=False, markup=False, soft_wrap=True)
    console.print(legend(cfg), highlight=False, markup=False, soft_wrap=True)
    for warning in cfg.warnings():
        console.print(f"warning: {warning}", style="yellow", highlight=False, markup=False, soft_wrap=True)
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
