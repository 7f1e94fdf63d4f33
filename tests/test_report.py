"""`rollstore report`: the HTML report of a loop-built buffer, rendered in headless Chromium; its numbers
recomputed from the documented queries (queries/report_*.sql) and independently from the raw tables;
the 100k-rollout size check; errors."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import subprocess
import time
from collections import Counter, defaultdict
from html import unescape

import duckdb
import pytest
from rollout_helpers import default_tiny, tiny_cache  # noqa: F401  (fixtures)

from rollstore.queries import load_sql
from rollstore.report.page import QUERIES, SECTIONS, build_report, with_literals
from rollstore.report.svg import Series, fmt, line_chart, nice_ticks
from rollstore.storage.buffer import Buffer

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


# ---- fixtures and helpers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def loop_buffer(tmp_path_factory, default_tiny):  # noqa: F811
    """A buffer built by the real loop: 3 iterations of d3s + DA3PO amplification on builtin:tiny,
    with a held-out evaluation every iteration."""
    from rollstore.loop import LoopConfig, run_loop

    root = str(tmp_path_factory.mktemp("report") / "buf")
    Buffer.init(root).close()
    from rollstore.loop.generate import GenerationConfig

    run_loop(LoopConfig(buffer=root, model=default_tiny, iterations=3, recipe="d3s", sets={"amplify": "da3po"},
                        prompts_per_iter=16, generation=GenerationConfig(group_size=4, max_new_tokens=8), eval_every=1,
                        eval_prompts=24, run_id="rep", seed=3))
    return root


@pytest.fixture(scope="module")
def report_html(loop_buffer, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("report-out") / "report.html")
    with Buffer.open(loop_buffer) as buf:
        build_report(buf, path)
    with open(path, encoding="utf-8") as fh:
        return path, fh.read()


def data_blocks(html: str) -> dict[str, list[dict]]:
    """The JSON result of every query, as embedded in the page."""
    blocks = re.findall(r'<script type="application/json" id="data-([a-z_]+)">(.*?)</script>', html, re.DOTALL)
    return {name: json.loads(text) for name, text in blocks}


def documented(root: str, name: str, curation_id: str | None = None, recipe: str | None = None) -> list[dict]:
    """Run queries/<name>.sql straight with DuckDB over the buffer's latest snapshot (own connection,
    the snapshot's views and the user views of queries/views.sql), as a user would."""
    from rollstore.output.formats import jsonable

    with Buffer.open(root) as buf, buf.snapshot() as snap:
        con = duckdb.connect()
        snap.register_duckdb(con)
        con.execute(load_sql("views"))
        rows = con.sql(with_literals(load_sql(name), {"curation_id": curation_id, "recipe": recipe})).to_arrow_table().to_pylist()
        con.close()
    return [jsonable(r) for r in rows]


def raw(root: str, table: str) -> list[dict]:
    with Buffer.open(root) as buf, buf.snapshot() as snap:
        return snap.arrow(table).to_table().to_pylist()


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def table_cells(html: str, query: str, column: str) -> list[str]:
    """Text of one column of the page's table of `query`."""
    m = re.search(rf'<table data-query="{query}">(.*?)</table>', html, re.DOTALL)
    assert m, query
    return re.findall(rf'<td class="[a-z]+" data-col="{column}">(.*?)</td>', m.group(1))


def find_chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as fh:
        head = fh.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


# ---- the browser ------------------------------------------------------------------------------


def test_report_renders_in_headless_chromium(report_html, tmp_path):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium binary (chromium, chromium-browser or google-chrome) on PATH: "
                    "`make browser` installs Debian's chromium when run as root; the browser check is skipped")
    path, html = report_html
    # nothing to fetch: no remote or local resources, only inline CSS/SVG/script
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//|file:)""", html, re.IGNORECASE)
    assert "<link" not in html and "@import" not in html and "url(" not in html
    base = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,2400"]
    shot = str(tmp_path / "report.png")
    run = subprocess.run(base + [f"--screenshot={shot}", "--enable-logging=stderr", "--v=0", f"file://{path}"],
                         check=False, capture_output=True, text=True, timeout=120)
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    assert console == [], console  # the page writes nothing to the console: no error, no warning
    assert os.path.exists(shot), run.stderr[-2000:]
    assert png_size(shot) == (1280, 2400)
    assert os.path.getsize(shot) > 50_000  # a real page, not a blank one
    dom = subprocess.run(base + ["--dump-dom", f"file://{path}"], check=False, capture_output=True, text=True, timeout=120)
    root_tag = re.search(r"<html[^>]*>", dom.stdout)
    assert root_tag, dom.stderr[-2000:]
    rendered = re.search(r'data-rendered="([^"]*)"', root_tag.group(0))
    assert rendered, "the page's script did not run"
    assert rendered.group(1).split() == [sid for sid, _ in SECTIONS]  # every section laid out, in order
    assert "data-errors" not in root_tag.group(0)


@pytest.fixture(scope="module")
def two_recipe_report(tmp_path_factory):
    """A report of a buffer with two recipes, one of them a replay recipe: four steps of synthetic
    rollouts (policy version = step), each curated by d3s and by replay-d3s."""
    from rollstore.curate.params import load_recipe
    from rollstore.curate.run import curate
    from rollstore.builtin.synthetic import rollouts_table

    root = str(tmp_path_factory.mktemp("two-recipes") / "buf")
    with Buffer.init(root) as buf:
        for step in range(4):
            buf.append_rollouts(rollouts_table(n_groups=8, group_size=8, step=step, policy_version=step, seed=step,
                                               run_id="run"))
            for recipe in ("d3s", "replay-d3s"):
                curate(buf, load_recipe(recipe), {"where": f"step = {step}", "progress": step / 4})
        path = str(tmp_path_factory.mktemp("two-recipes-out") / "report.html")
        build_report(buf, path)
    with open(path, encoding="utf-8") as fh:
        return root, path, fh.read()


def legend_gaps(html: str) -> list[str]:
    """Every chart whose marks name a series its legend does not show, or whose legend runs past its
    right edge: `title: problem`."""
    gaps = []
    for svg in re.findall(r"<svg[^>]*class=\"chart\".*?</svg>", html, re.DOTALL):
        width = float(re.search(r'width="([0-9.]+)"', svg).group(1))
        title = re.search(r"<title>(.*?)</title>", svg).group(1)
        legend = re.findall(r'<g class="lgi" data-series="([^"]*)">.*?<text x="([0-9.]+)"[^>]*>(.*?)</text>', svg)
        names = {name for name, _, _ in legend}
        marks = set(re.findall(r'<(?:circle|polyline|rect|path)\b[^>]*\bdata-series="([^"]*)"', svg))
        if marks - names:
            gaps.append(f"{title}: {sorted(marks - names)} not in the legend")
        gaps += [f"{title}: {name} past the edge" for name, x, text in legend
                 if float(x) + 6.2 * len(unescape(text)) > width + 1]
    return gaps


def test_two_recipes_every_series_in_its_legend_and_one_block_per_recipe(two_recipe_report):
    root, _, html = two_recipe_report
    assert not legend_gaps(html), legend_gaps(html)
    charts = re.findall(r"<svg[^>]*class=\"chart\".*?</svg>", html, re.DOTALL)
    assert sum('data-series="replay-d3s · candidates"' in svg for svg in charts) == 1  # the series that went missing
    # candidate-level sections: one block per recipe, each its recipe's query, never pooled
    assert html.count('<h3 class="scope" data-scope="d3s">') == 3
    assert html.count('<h3 class="scope" data-scope="replay-d3s">') == 3
    blocks = {name: json.loads(text) for name, text in re.findall(
        r'<script type="application/json" id="data-([a-z_0-9]+)">(.*?)</script>', html, re.DOTALL)}
    for i, recipe in enumerate(("d3s", "replay-d3s"), 1):
        for name in ("report_bands", "report_advantages", "report_advantage_stats", "report_tokens"):
            assert same(blocks[f"{name}__{i}"], documented(root, name, recipe=recipe)), (name, recipe)
        assert {c["curation_id"] for c in blocks[f"report_tokens__{i}"]} <= {
            c["curation_id"] for c in blocks["report_curations"] if c["recipe"] == recipe}
    # replayed rows are marked on their token cards, with their age
    replayed = [c for c in blocks["report_tokens__2"] if c["replayed"]]
    assert replayed and all(f'data-rollout="{c["rollout_id"]}" data-replayed="true"' in html for c in replayed)
    assert all(c["age"] >= 1 for c in replayed) and "replayed · age" in html
    assert not any(c["replayed"] for c in blocks["report_tokens__1"])  # d3s does not replay


def expected_picks(rows: list[dict]) -> list[tuple[str, str]]:
    """report_tokens' picks, ranked in Python over every candidate in scope (the order its header
    documents): selected rows by (partly pruned first, md5), the first two replayed ones by md5 put
    ahead, six in all; rejected rows by md5 within each reason, taken in turn from each reason."""
    import hashlib

    def h(r):
        return hashlib.md5(f"{r['curation_id']}/{r['rollout_id']}".encode()).hexdigest()

    selected = sorted((r for r in rows if r["selected"]),
                      key=lambda r: (not 0 < r["tokens_kept"] < r["tokens_total"], h(r)))
    rank = {r["curation_id"] + r["rollout_id"]: i for i, r in enumerate(selected)}
    ahead = {r["curation_id"] + r["rollout_id"] for r in sorted(
        (r for r in selected if r["replayed"] is True), key=h)[:2]}
    kept = sorted(selected, key=lambda r: (r["curation_id"] + r["rollout_id"] not in ahead,
                                           rank[r["curation_id"] + r["rollout_id"]]))[:6]
    kept.sort(key=lambda r: rank[r["curation_id"] + r["rollout_id"]])
    by_reason = defaultdict(list)
    for r in rows:
        if not r["selected"]:
            by_reason[r["reason"]].append(r)
    rejected = [(i, reason, r) for reason, rs in by_reason.items() for i, r in enumerate(sorted(rs, key=h))]
    rejected = [r for _, _, r in sorted(rejected, key=lambda t: (t[0], t[1]))[:6]]
    return [(r["curation_id"], r["rollout_id"]) for r in kept + rejected]


def test_scoped_reports_equal_the_documented_queries_and_pick_in_the_documented_order(two_recipe_report, tmp_path):
    """The page reads its tables once (temp tables) and resolves only the picked curations' masks:
    for every scope (the whole buffer, each recipe, each curation) every embedded result equals its
    query run over the snapshot's plain views, and the token picks equal a ranking of every candidate
    in scope done in Python (replayed rows included: replay-d3s)."""
    root, _, html = two_recipe_report
    selections = raw(root, "selections")
    curations = raw(root, "curations")
    recipe_of = {c["curation_id"]: c["recipe"] for c in curations}
    blocks = data_blocks_keys(html)
    assert expected_picks(selections) and any(r["replayed"] for r in selections if r["selected"])
    for i, recipe in enumerate(("d3s", "replay-d3s"), 1):
        mine = [r for r in selections if recipe_of[r["curation_id"]] == recipe]
        assert [(c["curation_id"], c["rollout_id"]) for c in blocks[f"report_tokens__{i}"]] == expected_picks(mine)
    for c in curations:
        cid = c["curation_id"]
        out = str(tmp_path / f"{cid}.html")
        with Buffer.open(root) as buf:
            build_report(buf, out, curation_id=cid)
        with open(out, encoding="utf-8") as fh:
            page = data_blocks_keys(fh.read())
        assert set(page) == set(QUERIES)
        for name in QUERIES:
            assert same(page[name], documented(root, name, cid)), (cid, name)
        mine = [r for r in selections if r["curation_id"] == cid]
        assert [(p["curation_id"], p["rollout_id"]) for p in page["report_tokens"]] == expected_picks(mine)


def test_checkpoints_come_from_the_catalog_index_else_from_their_files(loop_buffer, report_html, tmp_path):
    """The page's checkpoints (counted, versions of each run, the newest tokenizer) are the catalog index's
    copy of the rows when every visible shard has one; a buffer whose shards lack index rows (published
    before the index) reads the files and gives the same page."""
    import sqlite3

    from rollstore.report.page import indexed_checkpoints

    with Buffer.open(loop_buffer) as buf, buf.snapshot() as snap:
        index = indexed_checkpoints(buf, snap.seq).to_pylist()
        files = snap.arrow("checkpoints").to_table(columns=["run_id", "version", "path"]).to_pylist()
    assert len(index) >= 3 and sorted(index, key=str) == sorted(files, key=str)
    copy = str(tmp_path / "unindexed")
    shutil.copytree(loop_buffer, copy)
    con = sqlite3.connect(os.path.join(copy, "manifest.sqlite"))
    con.execute("DELETE FROM checkpoint_index")  # as a rollstore before the index left it: no rows, no marker
    con.execute("DELETE FROM meta WHERE key = 'checkpoints_indexed_through'")
    con.commit()
    con.close()
    with Buffer.open(copy) as buf, buf.snapshot() as snap:
        assert indexed_checkpoints(buf, snap.seq) is None
        build_report(buf, str(tmp_path / "r.html"))
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "checkpoints/v3/tokenizer.json" in page
    before = data_blocks_keys(report_html[1])
    assert all(same(data_blocks_keys(page)[k], before[k]) for k in ("report_overview", "report_accuracy_by_version",
                                                                     "report_evaluations", "report_tokens"))


def test_report_of_a_compacted_buffer_equals_its_queries(two_recipe_report, tmp_path):
    """After compaction the curated references name retired rollouts shards: the token cards' masks,
    resolved against the shards the picked curations' references name (followed through the moves),
    are the plain `curated` view's."""
    from rollstore.storage.maintenance import compact

    root = str(tmp_path / "compacted")
    shutil.copytree(two_recipe_report[0], root)
    with Buffer.open(root) as buf:
        assert compact(buf, "rollouts").merged_shards >= 2
        build_report(buf, str(tmp_path / "r.html"))
    blocks = data_blocks_keys((tmp_path / "r.html").read_text(encoding="utf-8"))
    for i, recipe in enumerate(("d3s", "replay-d3s"), 1):
        cards = blocks[f"report_tokens__{i}"]
        assert any(sum(c["kept"]) for c in cards)  # masks found through the moves
        assert same(cards, documented(root, "report_tokens", recipe=recipe)), recipe


def data_blocks_keys(html: str) -> dict[str, list[dict]]:
    """Every JSON block of the page by its key (recipe blocks suffixed `__i`)."""
    return {name: json.loads(text) for name, text in re.findall(
        r'<script type="application/json" id="data-([a-z_0-9]+)">(.*?)</script>', html, re.DOTALL)}


def test_two_recipe_report_in_headless_chromium(two_recipe_report, tmp_path):
    """Opened in a real browser: no console message, every section laid out, every chart's legend
    naming every series drawn (read back from the rendered DOM), no table wider than its frame."""
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium binary (chromium, chromium-browser or google-chrome) on PATH: "
                    "`make browser` installs Debian's chromium when run as root; the browser check is skipped")
    _, path, _ = two_recipe_report
    base = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,2400"]
    run = subprocess.run(base + ["--enable-logging=stderr", "--v=0", "--dump-dom", f"file://{path}"], check=False,
                         capture_output=True, text=True, timeout=120)
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    assert console == [], console
    root_tag = re.search(r"<html[^>]*>", run.stdout)
    assert root_tag, run.stderr[-2000:]
    assert re.search(r'data-rendered="([^"]*)"', root_tag.group(0)).group(1).split() == [sid for sid, _ in SECTIONS]
    assert "data-errors" not in root_tag.group(0)
    assert "data-overflow" not in root_tag.group(0), root_tag.group(0)  # e.g. the curations table fits
    assert not legend_gaps(run.stdout), legend_gaps(run.stdout)
    assert 'data-replayed="true"' in run.stdout


# ---- the numbers ------------------------------------------------------------------------------


def test_every_embedded_result_equals_its_documented_query(report_html, loop_buffer):
    _, html = report_html
    blocks = data_blocks(html)
    assert set(blocks) == set(QUERIES)
    for name in QUERIES:
        expected = documented(loop_buffer, name)
        assert same(blocks[name], expected), name
        sql = re.search(rf"<summary>SQL: <code>queries/{name}.sql</code>.*?<pre>(.*?)</pre>", html, re.DOTALL).group(1)
        assert "$curation_id" not in sql and "SELECT" in sql  # the bound text, runnable as printed


def test_numbers_recomputed_from_the_raw_tables(report_html, loop_buffer):
    _, html = report_html
    blocks = data_blocks(html)
    rollouts = raw(loop_buffer, "rollouts")
    selections = raw(loop_buffer, "selections")
    curations = {c["curation_id"]: c for c in raw(loop_buffer, "curations")}
    assert len(curations) == 3

    # accuracy by policy version, and the page's table cells print it
    judged = defaultdict(list)
    for r in rollouts:
        if r["correct"] is not None:
            judged[r["policy_version"]].append(r["correct"])
    by_version = blocks["report_accuracy_by_version"]
    assert [r["policy_version"] for r in by_version] == sorted(judged)
    for row in by_version:
        assert row["accuracy"] == pytest.approx(sum(judged[row["policy_version"]]) / len(judged[row["policy_version"]]))
    assert table_cells(html, "report_accuracy_by_version", "accuracy") == [fmt(r["accuracy"]) for r in by_version]

    # held-out evaluations: one per iteration plus the initial one
    assert [e["iteration"] for e in blocks["report_evaluations"]] == [0, 1, 2, 3]

    # candidates by reason, Var(A) before / after, per curation
    for row in blocks["report_curations"]:
        sel = [s for s in selections if s["curation_id"] == row["curation_id"]]
        counts = Counter(s["reason"] for s in sel)
        assert {k: row[k] for k in counts} == dict(counts)
        assert sum(row[k] for k in ("selected", "not_selected", "zero_variance", "invalid", "truncated", "stale",
                                    "reused")) == len(sel) == row["n_candidates"]
        pool = [s["advantage_final"] for s in sel if s["reason"] in ("selected", "not_selected")]
        kept = [s["advantage_final"] for s in sel if s["selected"]]
        assert row["adv_var_before"] == pytest.approx(var_pop(pool), rel=1e-6)
        assert row["adv_var_after"] == pytest.approx(var_pop(kept), rel=1e-6)
        assert row["sample_budget"] == curations[row["curation_id"]]["sample_budget"]
        assert row["token_fraction"] == curations[row["curation_id"]]["token_fraction"]

    # keep rate by group-accuracy band
    band = {r["band"]: r for r in blocks["report_bands"] if r["measure"] == "group accuracy"}
    zero = [s for s in selections if s["group_accuracy"] == 0]
    assert band["acc = 0"]["candidates"] == len(zero)
    assert band["acc = 0"]["keep_rate"] == pytest.approx(sum(s["selected"] for s in zero) / len(zero))
    assert sum(r["candidates"] for r in band.values()) == len(selections)
    assert any(r["measure"] == "difficulty" for r in blocks["report_bands"])  # da3po records q̂

    # advantage distribution: counts and variance of the selected series
    stats = {r["series"]: r for r in blocks["report_advantage_stats"]}
    selected = [s["advantage_final"] for s in selections if s["selected"]]
    assert stats["selected"]["n"] == len(selected)
    assert stats["selected"]["var_pop"] == pytest.approx(var_pop(selected), rel=1e-6)
    hist = defaultdict(int)
    for r in blocks["report_advantages"]:
        hist[r["series"]] += r["n"]
    assert hist["selected"] == len(selected)
    assert hist["raw"] == sum(1 for s in selections if s["advantage_raw"] is not None)

    # training curves: every step of the training table
    assert len(blocks["report_training"]) == len(raw(loop_buffer, "training")) >= 3


def test_token_views_score_and_mark_tokens_as_the_audit_does(report_html, loop_buffer):
    _, html = report_html
    cards = data_blocks(html)["report_tokens"]
    assert 1 <= sum(c["selected"] for c in cards) <= 6 and 1 <= sum(not c["selected"] for c in cards) <= 6
    rollouts = {r["rollout_id"]: r for r in raw(loop_buffer, "rollouts")}
    curated = {(c["curation_id"], c["rollout_id"]): c for c in raw(loop_buffer, "curated")}
    for card in cards:
        r = rollouts[card["rollout_id"]]
        assert card["token_ids"] == r["response_token_ids"][:400]
        for h, score in zip(r["entropies"], card["scores"]):
            assert score == pytest.approx(abs(card["advantage_final"]) * h, rel=1e-6)
        mask = curated.get((card["curation_id"], card["rollout_id"]))
        assert card["kept"] == (mask["loss_mask"] if mask else [False] * len(r["response_token_ids"]))[:400]
        assert sum(card["kept"]) == card["tokens_kept"]
        # the card is on the page, and the char-level tokenizer of the checkpoints decoded its tokens
        assert f'data-rollout="{card["rollout_id"]}"' in html
    assert "checkpoints/v3/tokenizer.json" in html
    # the audit's per-rollout query gives the same scores and marks
    card = next(c for c in cards if c["selected"])
    audit = documented_audit_rollout(loop_buffer, card["curation_id"], card["rollout_id"])
    assert [t["kept"] for t in audit] == card["kept"]
    assert same([t["score"] for t in audit], card["scores"])


def documented_audit_rollout(root, curation_id, rollout_id):
    with Buffer.open(root) as buf, buf.snapshot() as snap:
        con = duckdb.connect()
        snap.register_duckdb(con)
        rows = con.sql(load_sql("audit_rollout"), params={"curation_id": curation_id, "rollout_id": rollout_id})
        out = rows.to_arrow_table().to_pylist()
        con.close()
    return out


def var_pop(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)


# ---- the command line -------------------------------------------------------------------------


def test_report_command_scope_and_errors(cli, loop_buffer, tmp_path, buffer_dir):
    cid = raw(loop_buffer, "curations")[0]["curation_id"]
    out = tmp_path / "one.html"
    res = cli("report", loop_buffer, "--out", out, "--curation", cid)
    assert res.code == 0 and "wrote" in res.stdout
    html = out.read_text(encoding="utf-8")
    blocks = data_blocks(html)
    n = next(c["n_candidates"] for c in blocks["report_curations"] if c["curation_id"] == cid)
    assert sum(r["candidates"] for r in blocks["report_bands"] if r["measure"] == "group accuracy") == n
    assert {c["curation_id"] for c in blocks["report_tokens"]} == {cid}
    assert len(blocks["report_curations"]) == 3  # the timeline keeps every curation
    assert same(blocks["report_bands"], documented(loop_buffer, "report_bands", cid))
    assert '<tr class="focus">' in html
    # the SQL printed beside the chart runs as printed through `rollstore sql` and gives the page's rows
    printed = re.search(r"<summary>SQL: <code>queries/report_bands.sql</code>.*?<pre>(.*?)</pre>", html,
                        re.DOTALL).group(1)
    res = cli("sql", loop_buffer, "--format", "json", "--", unescape(printed))
    assert res.code == 0, res.stderr
    assert same(json.loads(res.stdout), blocks["report_bands"])

    res = cli("report", loop_buffer, "--out", tmp_path / "x.html", "--curation", "cur-nope")
    assert res.code == 1 and "no curation 'cur-nope'" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = cli("report", buffer_dir, "--out", tmp_path / "y.html")
    assert res.code == 1 and "no rollouts" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = cli("report", loop_buffer, "--out", tmp_path / "missing" / "z.html")
    assert res.code == 1 and "does not exist" in res.stderr
    assert not (tmp_path / "x.html").exists() and not (tmp_path / "y.html").exists()


# ---- size at 100k rollouts --------------------------------------------------------------------


@pytest.mark.slow
def test_report_of_100k_rollouts_is_small(tmp_path):
    """10 steps × 10 000 rollouts (~3.2 M tokens), one d3s + DA3PO curation per step. The page stays
    a few hundred KB: token views are sampled and everything else is aggregated in SQL."""
    from rollstore.curate.params import load_recipe
    from rollstore.curate.run import curate
    from rollstore.builtin.synthetic import rollouts_table

    root = str(tmp_path / "big")
    with Buffer.init(root) as buf:
        for step in range(10):
            buf.append_rollouts(rollouts_table(n_groups=1250, group_size=8, mean_tokens=32, step=step,
                                               policy_version=step, seed=1, n_prompts=4000))
        for step in range(10):
            curate(buf, load_recipe("d3s"), {"where": f"step = {step}", "progress": str(step / 10),
                                             "amplify": "da3po", "filter": "dynamic"})
        t0 = time.perf_counter()
        info = build_report(buf, str(tmp_path / "big.html"))
        seconds = time.perf_counter() - t0
    print(f"\n100k-rollout report: {seconds:.2f} s, {info.bytes / 1024:.0f} KiB")  # measured, never asserted
    html = (tmp_path / "big.html").read_text(encoding="utf-8")
    blocks = data_blocks(html)
    assert blocks["report_overview"][0]["rollouts"] == 100_000
    assert len(blocks["report_curations"]) == 10
    assert len(blocks["report_tokens"]) <= 12
    assert info.bytes < 2 * 2**20


# ---- charts -----------------------------------------------------------------------------------


def test_charts_escape_text_and_skip_missing_values():
    svg = line_chart([Series("<b>&", [(0, 1.0), (1, None), (2, float("nan")), (3, 2.0)])],
                     title="a<b", x_label="x", y_label="y")
    assert "<b>" not in svg and "&lt;b&gt;&amp;" in svg and "a&lt;b" in svg
    assert svg.count("<circle") == 2 and "<polyline" not in svg  # the gap breaks the line
    assert nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(5, 5)  # a constant series still gets an axis
