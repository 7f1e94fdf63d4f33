"""The `rollstore` command line (typer + rich).

Invariants:
- Every user-facing failure is one line on stderr (`error: ...`) and a non-zero exit; no traceback.
  An unexpected exception is one line too, with a hint to rerun with `rollstore --debug ...`, which
  re-raises it with its traceback.
- Results go to stdout; progress and chatter go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
from typing import List, Optional

import typer
from rich.console import Console

from rollstore.cli.defaults import CURATE, GENERATE, SQL, TRAIN
from rollstore import rules
from rollstore.cli.options import (OneLineErrors, choice, count, fraction, interval, memory, positive, real, ruled,
                               seconds, seed as seed_, seq)
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


@app.command()
@guarded
def init(
    buffer: str = typer.Argument(..., help="Directory of the new (or existing) buffer."),
    catalog: Optional[str] = typer.Option(None, "--catalog", help="postgresql://[user@]host[:port]/db: keep the catalog there (hosts that mount BUFFER share it; docs/multihost.md). Default: BUFFER/manifest.sqlite."),
    data: Optional[str] = typer.Option(None, "--data", help="s3://bucket/prefix: keep the shards in S3-compatible storage (needs --catalog; BUFFER is then this host's read cache; docs/multihost.md)."),
):
    """Create a buffer directory with its manifest (or, with --catalog, its PostgreSQL catalog)."""
    from rollstore.storage.buffer import Buffer

    buf = Buffer.init(buffer, catalog=catalog, data=data)
    where = "" if catalog is None else f" (catalog {buf.manifest.path})"
    buf.close()
    out.print(f"initialised {os.path.abspath(buffer)}{where}", highlight=False, markup=False)


@app.command("import")
@guarded
def import_(
    buffer: str,
    files: List[str] = typer.Argument(..., help="JSONL or Parquet files of rows in the rollouts schema (or in --from's format)."),
    compact_entropies: bool = typer.Option(False, "--compact-entropies", help="Store entropies at bf16 precision."),
    from_: Optional[str] = typer.Option(None, "--from", help="trl-completions | verl-jsonl | prime-rl | nemo-rl (default: rollstore's own schema)."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="With --from: local tokenizer directory (retokenises text, decodes ids)."),
    score_model: Optional[str] = typer.Option(None, "--score-model", help="With --from a text format: local model directory that recomputes gen_logprobs."),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="With --from: run_id of the imported rows (default: the format's name)."),
    correct_threshold: Optional[float] = real(None, "--correct-threshold", help="With --from: where the format gives no verdict, correct = reward >= this (else null: curation counts the row invalid)."),
    rewards: Optional[str] = typer.Option(None, "--rewards", help="With --from prime-rl: JSONL of rewards for an export without them (docs/importers.md)."),
):
    """Append rollouts from files: one all-or-nothing append per file. With --from, convert another
    framework's dump (docs/importers.md); importing the same file twice adds nothing."""
    from rollstore.storage.importer import read_rows_file

    if from_ is None:
        if tokenizer or score_model or run_id or rewards or correct_threshold is not None:
            fail("--tokenizer, --score-model, --run-id, --rewards and --correct-threshold need --from FORMAT")
        with open_buffer(buffer) as buf:
            for path in files:
                table = read_rows_file(path)
                shard = buf.append_rollouts(table, source=path, compact=compact_entropies)
                out.print(f"{path}: {shard.rows} rows, {shard.tokens} tokens -> {shard.path}", highlight=False, markup=False)
        return
    from rollstore.importers import FORMATS, import_file, units
    from rollstore.importers.codec import load_codec

    if from_ not in FORMATS:
        fail(f"--from {from_}: unknown format (one of {', '.join(FORMATS)})")
    from rollstore.builtin.resolve import resolve_model

    builtin = lambda ref: resolve_model(ref) if ref and ref.startswith("builtin:") else ref  # noqa: E731
    codec = load_codec(builtin(tokenizer), builtin(score_model))  # builtin:tiny, as every other command takes
    if rewards is not None and from_ == "prime-rl":
        from rollstore.importers.primerl import load_rewards

        rewards = load_rewards(rewards)
    with open_buffer(buffer) as buf:
        for path in units(from_, files):
            res = import_file(buf, path, from_, codec, run_id, compact=compact_entropies,
                              correct_threshold=correct_threshold, rewards=rewards)
            where = f" -> {res.shard.path}" if res.shard is not None else ""
            out.print(f"{path}: {res.rows} new rows, {res.skipped} already present{where}", highlight=False, markup=False)
            if res.lossy:
                out.print(f"  lossy: {'; '.join(res.lossy)}", highlight=False, markup=False)


@app.command()
@guarded
def export(
    buffer: str,
    to: str = typer.Option(..., "--to", help="A new (or empty) directory for the Parquet dataset and its README card."),
    snapshot: Optional[int] = seq(None, "--snapshot", help="Manifest sequence number to export (default: latest)."),
):
    """Write a snapshot's tables as a plain Parquet dataset with a dataset card (README.md) that
    DuckDB, Polars, pandas and Hugging Face datasets open without rollstore."""
    from rollstore.output.export import export_snapshot

    with open_buffer(buffer) as buf:
        info = export_snapshot(buf, to, snapshot)
    counts = ", ".join(f"{name} {n}" for name, n in info.rows.items()) or "no rows"
    out.print(f"exported snapshot {info.snapshot_seq} to {info.path} ({counts})", highlight=False, markup=False)


@app.command()
@guarded
def sql(
    buffer: str,
    query: str = typer.Argument(..., help="SELECT statement(s) over the buffer's tables and views."),
    format: str = typer.Option("table", "--format", "-f", help="table|csv|json|parquet"),
    out_file: Optional[str] = typer.Option(None, "--out", "-o", help="Write the result to this file."),
    timeout: float = ruled(SQL.timeout, "--timeout", rule=rules.SQL["timeout"], help="Seconds before the query is stopped (0: no limit)."),
    memory_limit: str = memory(SQL.memory_limit, "--memory-limit"),
    seq: Optional[int] = ruled(None, "--snapshot", rule=rules.SQL["snapshot"], help="Manifest sequence number to read (default: latest)."),
):
    """Run sandboxed, read-only SQL over a snapshot of the buffer (in a worker process whose memory
    and time are bounded by --memory-limit and --timeout)."""
    from rollstore.queries.bounded import run_bounded
    from rollstore.output.formats import write_result

    if format not in ("table", "csv", "json", "parquet"):
        fail(f"--format must be table, csv, json or parquet, not {format!r}")
    if format == "parquet" and not out_file:
        fail("--format parquet needs --out FILE")
    if out_file:
        from rollstore.output.outfile import check_output_file

        check_output_file(out_file)
    with open_buffer(buffer) as buf, buf.snapshot(seq, pin=True) as snap:
        table = run_bounded(snap, query, timeout, memory_limit)
    write_result(table, format, out_file, out)


@app.command()
@guarded
def info(buffer: str, format: str = typer.Option("table", "--format", "-f", help="table|json")):
    """Shards, rows, tokens, bytes per token and policy versions of a buffer."""
    from rollstore.cli.info import buffer_info, render_info

    with open_buffer(buffer) as buf:
        data = buffer_info(buf)
    if format == "json":
        out.print_json(json.dumps(data))
    else:
        render_info(data, out)


@app.command("gc")
@guarded
def gc_(buffer: str, grace: float = seconds(3600.0, "--grace", help="Seconds an orphan must be old before removal."),
        cache_max: Optional[str] = memory(None, "--cache-max", help="A buffer in object storage: also trim this "
                                          "host's cache to this size (e.g. 50GB), least recently used first."),
        keep_checkpoints: Optional[int] = count(None, "--keep-checkpoints", help="Also prune the files of all but "
                                                "the newest K checkpoints of each run (their rows stay); refused if "
                                                "that prunes one a follower holds or --replay-window needs."),
        replay_window: int = count(0, "--replay-window", low=0, help="With --keep-checkpoints: each run's newest "
                                   "W+1 versions are needed by a replay window.")):
    """Remove orphaned files (crashed writes) and files of compacted shards no snapshot needs."""
    from rollstore.queries.session import parse_memory_limit
    from rollstore.storage.maintenance import gc, trim_cache

    with open_buffer(buffer) as buf:
        if keep_checkpoints is not None:
            from rollstore.learner.retention import prune_checkpoints

            pruned = prune_checkpoints(buf, keep_checkpoints, replay_window=replay_window)
            out.print(f"pruned the files of {len(pruned)} checkpoint versions"
                      + (f" (v{pruned[0]}..v{pruned[-1]})" if pruned else ""), highlight=False)
        r = gc(buf, grace)
        if cache_max is not None:
            t = trim_cache(buf, parse_memory_limit(cache_max), grace)
            out.print(f"cache: removed {t.files_removed} cached copies ({t.bytes_freed} bytes); {t.bytes_left} bytes "
                      "cached")
    out.print(f"removed {r.orphans_removed} orphan files, {r.retired_removed} retired shards, "
              f"{r.checkpoints_removed} pruned checkpoint folders and {r.spill_dirs_removed} spill folders "
              f"({r.bytes_freed} bytes)")
    if r.retired_skipped:
        err.print(f"note: retired shards are left for the next gc: the manifest cannot be written "
                  f"({r.retired_skipped})", highlight=False, markup=False)
    if r.data_dirs_skipped:
        err.print("note: orphans under the data folders are left for the next gc (writers held the "
                  "writers' lock throughout, or it could not be opened)", highlight=False)


@app.command()
@guarded
def verify(
    buffer: str,
    quarantine: bool = typer.Option(False, "--quarantine", help="Retire every shard whose bytes were read and found "
                                    "wrong (moved to BUFFER/quarantine/); refused on a host that does not see the data."),
    restore: bool = typer.Option(False, "--restore", help="Un-retire every quarantined shard whose bytes verify again."),
    incremental: bool = typer.Option(False, "--incremental", help="Hash only the shards no verify hashed good "
                                     "before (the others: exists, place, size); docs/integrity.md."),
    since: Optional[int] = seq(None, "--since", help="Hash only the shards committed after this commit (seq)."),
    full: bool = typer.Option(False, "--full", help="Hash every live shard (the default: a full scrub)."),
):
    """Check every live shard against the manifest (exists, size, sha256); name each bad file."""
    from rollstore.storage import verify as v

    if quarantine and restore:
        fail("--quarantine and --restore go one at a time")
    if full and (incremental or since is not None):
        fail("verify: --full hashes every shard; leave out --incremental and --since")
    with open_buffer(buffer) as buf:
        if restore:
            restored, left = v.restore(buf.root, buf.manifest)
            for line in left:
                err.print(line, highlight=False, markup=False)
            out.print(f"restored {len(restored)} quarantined shard(s); {len(left)} left quarantined", highlight=False,
                      markup=False)
            return
        shards = buf.manifest.shards()
        only = None  # the shard ids to hash (None: all)
        if since is not None:
            latest = buf.manifest.latest_seq()
            if since > latest:
                fail(f"verify --since {since}: {buf.root}'s newest commit is {latest}; nothing was verified")
            only = {s.shard_id for s in shards if s.added_seq > since}
        elif incremental:
            only = {s.shard_id for s in shards} - v.verified_ids(buf.manifest)
        problems = v.scan(buf.root, buf.manifest, only)
        for p in problems:
            err.print(p.describe(buf.root), highlight=False, markup=False)
        if not problems:
            dangling = v.scan_references(buf.root, buf.manifest, only)
            for line in dangling:
                err.print(line, highlight=False, markup=False)
            if not dangling:
                v.record_verified(buf.manifest, [s.shard_id for s in shards if only is None or s.shard_id in only])
                hashed = len(shards) if only is None else len(only)
                out.print(f"{len(shards)} shards verified ({hashed} hashed), all match the manifest; every "
                          "curated reference " + ("resolves" if only is None else "of those hashed resolves"),
                          highlight=False)
                return
            fail(f"{len(dangling)} curated shards refer to rollouts rows that do not resolve; curate again "
                 "(their curations cannot be trained)")
        if quarantine:
            chosen = v.quarantinable(buf.root, buf.manifest, shards, problems)
            if not chosen:
                fail(f"none of the {len(problems)} bad shards was read here (missing files of a buffer whose data folder "
                     "has no identity marker): nothing was quarantined; restore the files")
            seq = v.quarantine(buf.root, buf.manifest, chosen)
            out.print(f"quarantined {len(chosen)} of {len(shards)} shards (commit {seq}); "
                      f"their files are under {os.path.join(buf.root, v.QUARANTINE_DIR)}; "
                      f"`rollstore verify {buf.root} --restore` brings back those that verify again",
                      highlight=False, markup=False)
            if len(chosen) < len(problems):
                fail(f"{len(problems) - len(chosen)} missing shard(s) left live: this folder has no identity marker "
                     "to tell a missing file from one this host cannot see; restore them")
            return
    fail(f"{len(problems)} of {len(shards)} shards do not match the manifest; {v.advice(os.path.abspath(buffer))}")


@app.command()
@guarded
def compact(
    buffer: str,
    table: str = typer.Option("rollouts", "--table"),
    small_mb: float = positive(16.0, "--small-mb", high=2**40, help="Shards smaller than this are merged."),
    target_mb: float = positive(128.0, "--target-mb", high=2**40, help="Size of merged shards."),
):
    """Merge small shards into large ones in one manifest transaction."""
    from rollstore.storage.maintenance import compact as run

    with open_buffer(buffer) as buf:
        r = run(buf, table, int(small_mb * 2**20), int(target_mb * 2**20))
    out.print(f"merged {r.merged_shards} shards into {r.new_shards} ({r.rows} rows)")


@app.command()
@guarded
def migrate(buffer: str):
    """Bring the buffer's rollouts shards to the current schema version (3: each row's stored
    response_length) in one manifest commit; references into them follow; leased shards stay as
    they are (read with the length computed)."""
    from rollstore.storage.maintenance import migrate as run

    with open_buffer(buffer) as buf:
        r = run(buf)
    out.print(f"rewrote {r.rewritten} rollouts shards ({r.rows} rows) with response_length"
              + (f"; left as they are: {r.leased} leased (read with the length computed)" if r.leased else ""),
              highlight=False, markup=False)


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
    partitions: Optional[int] = count(None, "--partitions", help="With --engine dask: hash partitions of the batch (default 2 per worker)."),
    timeout: float = ruled(CURATE.timeout, "--timeout", rule=rules.CURATE["timeout"], help="Seconds the user SQL (where, a custom recipe) may run (0: no limit; on Dask: per task)."),
):
    """Run a curation recipe over a snapshot; prints a summary and the curation id last."""
    from rollstore.curate.options import Limits, engine_option
    from rollstore.curate.params import load_recipe
    from rollstore.curate.run import curate
    from rollstore.cli.curate import curation_values, print_summary

    chosen = engine_option(engine, scheduler, partitions)
    with open_buffer(buffer) as buf:
        result = curate(buf, load_recipe(recipe), curation_values(set_, progress), snapshot, dry_run=dry_run,
                        limits=Limits(memory_limit, timeout=timeout or None), engine=chosen)
    print_summary(result, out)
    if result.refusal():  # the curation is committed (its audit says why per row); nothing of it can be trained
        fail(result.refusal())


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
def generate(
    buffer: str,
    prompts: str = typer.Option(GENERATE.prompts, "--prompts", help="JSONL/Parquet prompts file or builtin:arith[:split]."),
    model: str = typer.Option(GENERATE.model, "--model", help="A local transformers model directory, builtin:tiny, or checkpoint:latest | checkpoint:N (a checkpoint of this buffer)."),
    backend: str = typer.Option(GENERATE.backend, "--backend", help="hf | vllm"),
    group_size: int = ruled(GENERATE.group_size, "--group-size", "-G", rule=rules.GENERATE["group_size"]),
    num_prompts: Optional[int] = ruled(GENERATE.num_prompts, "--num-prompts", "-n", rule=rules.GENERATE["num_prompts"]),
    policy_version: Optional[int] = ruled(None, "--policy-version", rule=rules.GENERATE["policy_version"], help="Default: the checkpoint's version, else 0."),
    seed: int = ruled(GENERATE.seed, "--seed", rule=rules.GENERATE["seed"]),
    steps: int = ruled(GENERATE.steps, "--steps", rule=rules.GENERATE["steps"], help="Generation steps to run (one shard each)."),
    run_id: str = typer.Option(GENERATE.run_id, "--run-id"),
    max_new_tokens: int = ruled(GENERATE.max_new_tokens, "--max-new-tokens", rule=rules.GENERATE["max_new_tokens"]),
    temperature: float = ruled(GENERATE.temperature, "--temperature", rule=rules.GENERATE["temperature"]),
    top_p: float = ruled(GENERATE.top_p, "--top-p", rule=rules.GENERATE["top_p"]),
    template: Optional[str] = typer.Option(None, "--template", help="Chat template: a format string with {prompt}."),
    follow: bool = typer.Option(False, "--follow", help="Keep generating; load each newly published checkpoint."),
    max_policy_lag: int = count(1, "--max-policy-lag", low=0, help="With --follow: wait while the learner is this many versions behind."),
    compact_entropies: bool = typer.Option(False, "--compact-entropies"),
    recipe: str = typer.Option("d3s", "--recipe", help="With --follow: the recipe that curates each step."),
    set_: List[str] = typer.Option([], "--set", help="With --follow: curation parameter overrides."),
):
    """Sample groups of responses, judge them with math-verify, score them, append one shard per step."""
    from rollstore.curate.params import parse_sets
    from rollstore.cli.defaults import generation_config
    from rollstore.loop.generator import Follow, PromptSource, run_generate

    config = generation_config(backend=backend, group_size=group_size, max_new_tokens=max_new_tokens,
                               temperature=temperature, top_p=top_p, seed=seed)
    run_generate(buffer, model, PromptSource(prompts, num_prompts, template), config, run_id, steps, err,
                 policy_version=policy_version, compact=compact_entropies,
                 follow=Follow(max_policy_lag, recipe, parse_sets(set_)) if follow else None)


@app.command()
@guarded
def train(
    buffer: str,
    curation: List[str] = typer.Option([], "--curation", help="Curation id(s) to train on (default: all pending)."),
    model: str = typer.Option(TRAIN.model, "--model"),
    loss: str = choice(TRAIN.loss, "--loss", choices=_losses, help="grpo | dapo | gspo | dr_grpo"),
    lr: float = ruled(TRAIN.lr, "--lr", rule=rules.TRAIN["lr"]),
    epochs: int = ruled(TRAIN.epochs, "--epochs", rule=rules.TRAIN["epochs"]),
    micro_batch_size: int = ruled(TRAIN.micro_batch_size, "--micro-batch-size", rule=rules.TRAIN["micro_batch_size"]),
    grad_accum: int = ruled(TRAIN.grad_accum, "--grad-accum", rule=rules.TRAIN["grad_accum"]),
    run_id: str = typer.Option(TRAIN.run_id, "--run-id"),
    follow: bool = typer.Option(False, "--follow", help="Keep leasing curations as they appear."),
    poll: float = interval(1.0, "--poll", help="Seconds between polls with --follow."),
    max_idle: float = seconds(0.0, "--max-idle", help="With --follow: stop after this many idle seconds (0 = never)."),
    parallel: str = choice("none", "--parallel", choices=("none", "ddp", "fsdp"), help="none | ddp | fsdp (under torchrun, or with --nproc)."),
    nproc: int = count(0, "--nproc", low=0, help="Launch this many ranks with torchrun (default --parallel ddp)."),
    keep_checkpoints: int = count(3, "--keep-checkpoints", help="Only the newest K checkpoints of the run keep "
                                  "their files (their rows, lineage and ledger stay; docs/loop.md)."),
):
    """Train on curated shards exactly once each; publish a checkpoint per curation.

    --micro-batch-size x --grad-accum is the global batch of one optimiser step, whatever the
    number of ranks; each rank trains its block of it in micro-batches of --micro-batch-size."""
    from rollstore.cli.defaults import train_config
    from rollstore.loop.trainer import check_curations, launch_torchrun, run_train

    if curation and "LOCAL_RANK" not in os.environ:
        check_curations(buffer, curation)
    if nproc > 1 and "LOCAL_RANK" not in os.environ:
        raise typer.Exit(launch_torchrun(nproc, "ddp" if parallel == "none" else parallel))
    config = train_config(loss=loss, lr=lr, epochs=epochs, micro_batch_size=micro_batch_size, grad_accum=grad_accum)
    run_train(buffer, model, config, run_id, curation, out, follow=follow, poll=poll, max_idle=max_idle,
              parallel=parallel, keep_checkpoints=keep_checkpoints)


@app.command()
@guarded
def loop(
    buffer: str,
    model: Optional[str] = typer.Option(None, "--model", help="Default: the built-in policy of a built-in task "
                                        "(builtin:tiny-carries for builtin:carries), else builtin:tiny."),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="Default builtin:arith (builtin:carries: the "
                                          "harder task)."),
    iterations: Optional[int] = count(None, "--iterations", "-k", show_default="40"),
    recipe: Optional[str] = typer.Option(None, "--recipe", "-r", help="Default d3s (recommended for long reasoning chains; grpo for short answers: `rollstore recipes`)."),
    set_: List[str] = typer.Option([], "--set", help="Curation parameter override name=value (repeatable)."),
    prompts_per_iter: Optional[int] = count(None, "--prompts-per-iter", show_default="128"),
    pool_size: Optional[int] = count(None, "--pool-size", low=0, help="Train on a pool of N prompts in epochs (0: fresh prompts).", show_default="2048"),
    group_size: Optional[int] = count(None, "--group-size", "-G", show_default="8"),
    max_new_tokens: Optional[int] = count(None, "--max-new-tokens", show_default="8",
                                         help="Tokens sampled per response (a built-in task's own budget: builtin:chains 40)."),
    loss: Optional[str] = choice(None, "--loss", choices=_losses, show_default="grpo"),
    lr: Optional[float] = ruled(None, "--lr", rule=rules.TRAIN["lr"], help="Learning rate (default: the recipe's `lr`, else 5e-5)."),
    epochs: Optional[int] = ruled(None, "--epochs", rule=rules.TRAIN["epochs"], help="Passes over each curated batch, μ (default: the recipe's "
                                  "`epochs`, else 1)."),
    warmup_steps: Optional[int] = count(None, "--warmup-steps", low=0, show_default="5"),
    micro_batch_size: Optional[int] = ruled(None, "--micro-batch-size", rule=rules.TRAIN["micro_batch_size"], show_default="512"),
    grad_accum: Optional[int] = ruled(None, "--grad-accum", rule=rules.TRAIN["grad_accum"], help="Micro-batches per optimiser step.", show_default="1"),
    max_policy_lag: Optional[int] = count(None, "--max-policy-lag", low=0, show_default="none: no bound"),
    max_gen_batches: Optional[int] = count(None, "--max-gen-batches", show_default="8"),
    eval_every: Optional[int] = count(None, "--eval-every", low=0, help="Held-out evaluation every N iterations (0 = never).", show_default="5"),
    eval_prompts: Optional[int] = count(None, "--eval-prompts", help="Distinct held-out prompts per evaluation.", show_default="500"),
    eval_samples: int = count(0, "--eval-samples", low=0, help="Also sample N per prompt for pass@1 / pass@N."),
    seed: int = seed_(0, "--seed"),
    run_id: Optional[str] = typer.Option(None, "--run-id", show_default="loop-RECIPE-sSEED"),
    backend: Optional[str] = typer.Option(None, "--backend", show_default="hf"),
    threads: Optional[int] = count(None, "--threads", help="torch threads (default 1: see docs/loop.md, Threads)."),
    learner_ranks: int = count(1, "--learner-ranks", help="Train with N torch.distributed ranks (DDP, torchrun)."),
    keep_checkpoints: int = count(3, "--keep-checkpoints", help="Only the newest K checkpoints keep their files "
                                  "(and those a replay window needs; rows, lineage and ledger stay; docs/loop.md)."),
):
    """The near-on-policy loop: generate → score → append → curate → train → publish → repeat.

    Options left out take the defaults of `rollstore.loop.LoopConfig` (the demo's settings)."""
    from dataclasses import replace

    from rollstore.curate.params import parse_sets
    from rollstore.loop.run import LoopConfig
    from rollstore.loop.view import run_with_display
    from rollstore.storage.buffer import Buffer

    def given(**kw):
        return {k: v for k, v in kw.items() if v is not None}

    defaults = LoopConfig(buffer=buffer, **given(prompts=prompts))  # a built-in task's token budget
    if model is None and prompts is not None:
        from rollstore.builtin.resolve import task_model

        model = task_model(prompts)
    cfg = LoopConfig(
        buffer=buffer, sets=parse_sets(set_), eval_samples=eval_samples, seed=seed,
        eval_ks=(1, eval_samples) if eval_samples else (1,),
        generation=replace(defaults.generation, **given(group_size=group_size, max_new_tokens=max_new_tokens,
                                                        backend=backend)),
        train=replace(defaults.train, **given(loss=loss, warmup_steps=warmup_steps,
                                              micro_batch_size=micro_batch_size, grad_accum=grad_accum)),
        **given(lr=lr, epochs=epochs, model=model, prompts=prompts, iterations=iterations, recipe=recipe, prompts_per_iter=prompts_per_iter,
                pool_size=pool_size, max_policy_lag=max_policy_lag, max_gen_batches=max_gen_batches,
                eval_every=eval_every, eval_prompts=eval_prompts, run_id=run_id, threads=threads,
                keep_checkpoints=keep_checkpoints))
    cfg.check()  # before the buffer is created and anything is loaded
    Buffer.init(buffer).close()
    if learner_ranks > 1:
        from rollstore.loop.ranks import run_loop_with_ranks

        version = run_loop_with_ranks(cfg, learner_ranks, err)
        out.print(f"{cfg.iterations} iterations; the {learner_ranks}-rank learner published v{version}", highlight=False)
        return
    run_with_display(cfg, out)


@app.command("eval")
@guarded
def eval_(
    model: str = typer.Option("builtin:tiny", "--model"),
    prompts: str = typer.Option("builtin:arith:heldout", "--prompts"),
    samples: int = count(8, "--samples", "-n"),
    k: str = typer.Option("1,8", "--k", help="Comma-separated k values for pass@k."),
    num_prompts: Optional[int] = count(200, "--num-prompts"),
    temperature: float = positive(1.0, "--temperature"),
    max_new_tokens: int = count(12, "--max-new-tokens"),
    seed: int = seed_(0, "--seed"),
    buffer: Optional[str] = typer.Option(None, "--buffer", help="Store the results in this buffer's evaluations table."),
    format: str = typer.Option("table", "--format", "-f", help="table|json"),
):
    """pass@k (unbiased estimator) and avg@n of a model on a prompt set."""
    from rollstore.loop.evaluate import run_eval
    from rollstore.loop.generate import GenerationConfig

    ks = []
    for word in k.split(","):
        word = word.strip()
        if word and (not word.isdigit() or not 1 <= int(word) <= samples):
            fail(f"--k {k}: each k must be an integer in [1, --samples={samples}], not {word!r}", code=2)
        if word:
            ks.append(int(word))
    if not ks:
        fail("--k: give at least one k (e.g. 1,8)", code=2)
    config = GenerationConfig(group_size=samples, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    run_eval(model, prompts, num_prompts, config, ks, buffer, format, out)


@app.command()
@guarded
def demo(
    buffer: str = typer.Argument("demo-buffer", help="Where to put the demo buffer (replaced if it is a previous demo's)."),
    iterations: int = count(40, "--iterations", "-k"),
    recipe: str = typer.Option("d3s", "--recipe"),
    model: str = typer.Option("builtin:tiny", "--model"),
    seed: int = seed_(0, "--seed", help="Seed of the prompts and samples (the warm start is shared)."),
):
    """The loop on builtin:tiny + builtin:arith with the d3s recipe, in a few minutes on a CPU."""
    from rollstore.cli.demo import run_demo

    run_demo(buffer, iterations, recipe, out, model=model, seed=seed)


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


def _one_line_summaries() -> None:
    """`rollstore --help` lists each command with its docstring's first paragraph as one sentence
    (a docstring wrapped at 110 columns would otherwise break mid-sentence in the list)."""
    for info in app.registered_commands:
        if info.short_help is None and info.callback is not None and info.callback.__doc__:
            first = info.callback.__doc__.strip().split("\n\n", 1)[0]
            info.short_help = " ".join(first.split())


_one_line_summaries()


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
