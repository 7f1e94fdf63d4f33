"""README.md's Python quick start runs as printed, and the README stays a front page.

The quick start is executed verbatim (its one `python` block under "## Quick start") on a buffer
named `buf` in a scratch directory holding two synthetic groups-steps of rollouts; it must curate
them and leave `rows` with exactly the rows that curation kept (through the front door, `rollstore.open`).
"""

from __future__ import annotations

import os

from rollstore.builtin.synthetic import rollouts_table
from rollstore.storage.buffer import Buffer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def _section(title: str) -> str:
    with open(README) as fh:
        return fh.read().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_python_quick_start_runs(tmp_path, monkeypatch):
    code = _section("Quick start").split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    with Buffer.init(str(tmp_path / "buf")) as buf:
        buf.append_rollouts(rollouts_table(n_groups=12, group_size=8, seed=3, run_id="qs"))
    scope: dict = {}
    exec(compile(code, README, "exec"), scope)
    cur, rows = scope["cur"], scope["rows"].to_dicts()
    assert cur.committed and rows
    assert len(rows) == cur.summary["n_selected"][0] == dict(cur.reasons.select("reason", "candidates").iter_rows())["selected"]
    assert {r["curation_id"] for r in rows} == {cur.id}
    assert all(len(r["loss_mask"]) == len(r["response_token_ids"]) for r in rows)
    # the comment after print(...) shows what the line prints: an id, then {reason: candidates} with
    # the reasons a dapo curation of the quick start's buffer gives (its numbers are that buffer's;
    # this synthetic buffer also has invalid rows)
    import ast
    import re

    comment = code.split("print(cur.id", 1)[1].split("# ", 1)[1].splitlines()[0]
    shown_id, shown = re.fullmatch(r"(cur-[0-9a-f]+)…\s+(\{.*\})", comment.strip()).groups()
    printed = dict(cur.reasons.select("reason", "candidates").iter_rows())
    assert cur.id.startswith("cur-") and len(shown_id) > 4
    assert set(ast.literal_eval(shown)) <= set(printed), (shown, printed)
    assert all(isinstance(v, int) for v in ast.literal_eval(shown).values())


def _broken_links(path: str) -> list[str]:
    import re

    with open(path) as fh:
        text = fh.read()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    return [t for t in targets if "://" not in t
            and not os.path.exists(os.path.join(os.path.dirname(path), t))]


def test_docs_links_resolve():
    docs = os.path.join(ROOT, "docs")
    broken = {name: _broken_links(os.path.join(docs, name)) for name in os.listdir(docs) if name.endswith(".md")}
    assert not {k: v for k, v in broken.items() if v}


def test_readme_is_a_front_page():
    """At most 200 lines, every relative link resolves, and nothing points outside the repository."""
    with open(README) as fh:
        text = fh.read()
    assert len(text.splitlines()) <= 200
    assert "../" not in text
    assert not _broken_links(README)
