"""The commands that keep the store: init, import, export, sql, info, gc, verify, compact, migrate.

Invariants: as `rollstore/cli/app.py` (one line per failure; results on stdout).
"""

from __future__ import annotations

import json
import os
from typing import List, Optional

import typer

from rollstore import rules
from rollstore.cli.app import app, err, fail, guarded, open_buffer, out
from rollstore.cli.options import count, memory, positive, real, ruled, seconds, seq
from rollstore.rules.defaults import SQL


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
