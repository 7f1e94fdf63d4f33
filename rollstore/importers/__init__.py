"""Importers of other frameworks' rollout dumps into the rollouts schema (`rollstore import --from`).

Each format module follows the writer of its project (cited in its docstring) and returns `Rows`;
`import_file` turns them into one append.

Invariants:
- One file is one all-or-nothing append, validated by `Buffer.append_rollouts` like any import;
  for prime-rl the unit is a step directory (all its rank files, `units`), so that a group split
  over data-parallel ranks stays one group.
- Rollout ids are content hashes: rows already in the buffer are dropped before the append, so
  importing the same file twice adds nothing (the second import reports 0 new rows).
- What a conversion had to guess (retokenised text, groups rebuilt from order, ...) is written into
  every row's `meta` (`meta.import.lossy`), into the shard's Parquet key-value metadata (key
  `rollstore.import`: JSON {"format", "file", "rows", "lossy"}), and returned to the caller.
  `rollstore compact` merges shards into new files without that key; the per-row copy stays.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from . import nemorl, primerl, trl, verl
from .common import ImportRefused, TextCodec, derive_correct, drop_present

FORMATS = {
    trl.FORMAT: trl.convert,
    verl.FORMAT: verl.convert,
    primerl.FORMAT: primerl.convert,
    nemorl.FORMAT: nemorl.convert,
}

METADATA_KEY = "rollstore.import"  # the Parquet key-value metadata an imported shard carries


@dataclass
class ImportResult:
    rows: int  # rows appended
    skipped: int  # rows already in the buffer (or repeated in the file)
    shard: object | None  # the new shard, None when nothing was new
    lossy: list[str]


def units(fmt: str, paths: list[str]) -> list[str]:
    """What to import, in order, once each: the paths themselves, except for prime-rl, where each
    rank file stands for its step directory."""
    if fmt != primerl.FORMAT:
        return list(paths)
    return list(dict.fromkeys(primerl.unit(p) for p in paths))


def import_file(buf, path: str, fmt: str, codec: TextCodec | None, run_id: str | None = None,
                compact: bool = False, correct_threshold: float | None = None,
                rewards: str | dict | None = None) -> ImportResult:
    """Convert and append one unit (`units`). `rewards` (prime-rl only): a `--rewards` JSONL path
    or its loaded table (`primerl.load_rewards`)."""
    convert = FORMATS.get(fmt)
    if convert is None:
        raise ImportRefused(f"--from {fmt}: unknown format (one of {', '.join(FORMATS)})")
    if rewards is not None:
        if fmt != primerl.FORMAT:
            raise ImportRefused(f"--rewards is for --from {primerl.FORMAT} (the {fmt} dump holds its rewards)")
        table = primerl.load_rewards(rewards) if isinstance(rewards, str) else rewards
        rows = primerl.convert(path, codec, run_id or fmt, rewards=table)
    else:
        rows = convert(path, codec, run_id or fmt)
    if correct_threshold is not None:
        derive_correct(rows, correct_threshold)
    table = rows.table()
    if "correct" not in table.column_names or table.column("correct").null_count == table.num_rows:
        raise ImportRefused(f"{path}: {fmt} gives no verdict (`correct`) for any row, so curation would count every "
                            "row invalid; pass --correct-threshold T (correct = reward >= T); nothing was written")
    n_file = table.num_rows
    table, present = drop_present(table, buf.manifest.existing_ids)
    if present:
        _same_verdicts(buf, path, rows.table(), correct_threshold)
    if table.num_rows == 0:
        return ImportResult(0, present, None, rows.lossy)
    note = {"format": fmt, "file": os.path.basename(path), "rows": table.num_rows, "lossy": list(rows.lossy)}
    shard = buf.append_rollouts(table, source=path, compact=compact,
                                metadata={METADATA_KEY: json.dumps(note, sort_keys=True, ensure_ascii=False)})
    return ImportResult(shard.rows, n_file - shard.rows, shard, rows.lossy)


def _same_verdicts(buf, path: str, table, threshold: float | None) -> None:
    """Refuse a re-import whose rows are already in the buffer with other verdicts (another
    `--correct-threshold`): a row is written once and never changed (docs/importers.md §Verdicts),
    so the new verdicts could not be stored; one line, nothing written."""
    from rollstore.queries import load_sql
    from rollstore.queries.session import Session

    new = dict(zip(table.column("rollout_id").to_pylist(), table.column("correct").to_pylist()))
    with buf.snapshot() as snap, Session(snap) as s:
        stored = s.table(load_sql("import_verdicts"), {"ids": list(new)}).to_pylist()
    differ = [r["rollout_id"] for r in stored if r["correct"] != new[r["rollout_id"]]]
    if differ:
        rule = "no --correct-threshold" if threshold is None else f"--correct-threshold {threshold:g}"
        raise ImportRefused(f"{path}: {len(differ)} of its rows are already in the buffer with other verdicts "
                            f"(`correct`; e.g. {differ[0]}) than {rule} gives; a row is written once and never "
                            "re-derived: import into a new buffer (or rerun with the first import's threshold); "
                            "nothing was written")
