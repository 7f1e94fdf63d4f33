"""`rollstore info`: a summary of a buffer from its manifest and a DuckDB pass over `rollouts`.

Invariant: the shard, row, token and byte counts come from the catalog (no file is opened for them);
the DuckDB pass reads the `rollouts` shards only (`partial_session`), not every table's files.
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text
from rich.table import Table

from rollstore.report.partial import partial_session
from rollstore.storage.buffer import Buffer
from rollstore.storage.schema import TABLES


def buffer_info(buf: Buffer) -> dict:
    with buf.snapshot(pin=True) as snap:
        tables = {}
        for name in TABLES:
            shards = snap.shards(name)
            tables[name] = {
                "shards": len(shards),
                "rows": sum(s.rows for s in shards),
                "tokens": sum(s.tokens for s in shards),
                "bytes": sum(s.bytes for s in shards),
            }
        with partial_session(snap, ["rollouts"]) as s:
            versions = [r[0] for r in s.execute(
                "SELECT DISTINCT policy_version FROM rollouts ORDER BY 1").fetchall()]
            groups, prompts = s.one(
                "SELECT count(DISTINCT group_id), count(DISTINCT prompt_id) FROM rollouts")
    r = tables["rollouts"]
    return {
        "buffer": buf.root,
        "snapshot_seq": snap.seq,
        "tables": tables,
        "groups": groups,
        "prompts": prompts,
        "policy_versions": versions,
        "bytes_per_token": (r["bytes"] / r["tokens"]) if r["tokens"] else None,
    }


def render_info(data: dict, console: Console) -> None:
    view = Table(title=Text(f"{data['buffer']} @ snapshot {data['snapshot_seq']}"))
    for col in ("table", "shards", "rows", "tokens", "bytes"):
        view.add_column(col, justify="right" if col != "table" else "left")
    for name, t in data["tables"].items():
        view.add_row(name, str(t["shards"]), str(t["rows"]), str(t["tokens"]), str(t["bytes"]))
    console.print(view)
    bpt = data["bytes_per_token"]
    console.print(f"groups: {data['groups']}  prompts: {data['prompts']}  "
                  f"policy versions: {data['policy_versions']}  "
                  f"bytes per token (rollouts): {'n/a' if bpt is None else f'{bpt:.2f}'}", highlight=False)
