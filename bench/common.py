"""Plumbing shared by the benchmarks: generated buffers, child processes, tables, RESULTS.md.

Invariants:
- Every contender that reports a peak RSS runs in a fresh child process (`run_child`), and the
  peak is that child's own high-water mark (VmHWM, which starts afresh at exec — unlike
  `ru_maxrss`, which a child inherits from its parent): measurements never contaminate each other.
- A section appended to RESULTS.md always carries its command, machine, versions, date and the
  load average at its start (others may share the machine: only ratios measured side by side in
  one run are meant to be compared).
- Generated buffers are deterministic in (tokens, shard size, seed): step k holds
  `rollouts_table(..., seed, step=k, policy_version=k // 4, n_prompts=2000)`.
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from typing import Callable, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "RESULTS.md")
MEAN_TOKENS = 256
GROUP_SIZE = 8
N_PROMPTS = 2000

if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# ---------------------------------------------------------------------------------------------
# machine, versions, memory
# ---------------------------------------------------------------------------------------------

def machine() -> str:
    import psutil

    mem = psutil.virtual_memory().total / 2**30
    return f"{platform.machine()}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}"


def versions(*names: str) -> str:
    out = [f"python {platform.python_version()}"]
    for name in names or ("duckdb", "pyarrow", "numpy"):
        try:
            mod = __import__(name)
            out.append(f"{name} {getattr(mod, '__version__', '?')}")
        except ImportError:
            out.append(f"{name} (absent)")
    return ", ".join(out)


def load_avg() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def peak_rss_mib() -> float:
    """Peak resident set of this process, in MiB.

    On Linux this is VmHWM of /proc/self/status, which starts afresh at exec. `ru_maxrss` does
    not: a child started by a parent holding 400 MiB reports at least 400 MiB, whatever it used.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 if sys.platform != "darwin" else 2**20)


def reset_peak_rss() -> bool:
    """Start `peak_rss_mib` afresh from the current resident set (Linux: "5" to /proc/self/clear_refs);
    False where it cannot (the peak then stays the process's)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def arrow_peak_mib() -> float:
    """Peak bytes allocated from pyarrow's default memory pool in this process."""
    import pyarrow as pa

    return pa.default_memory_pool().max_memory() / 2**20


def warm_libraries() -> None:
    """Load what the libraries load on first use, outside any measured span (like the imports): pyarrow
    imports pandas at its first conversion from or to Python or numpy values (~0.3-0.5 s here), which
    rollstore no longer does at import; a child would otherwise charge it to whichever run converts
    first (the curation, not the scan floor)."""
    import pyarrow as pa

    pa.array([0]).to_numpy()


def rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def commit() -> str:
    """The code measured: `git describe` of ROOT (+ "dirty" when tracked files differ), else $ROLLSTORE_COMMIT."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip() + (" (working tree with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("ROLLSTORE_COMMIT", "unknown")


def command_line() -> str:
    argv = sys.argv[:]
    if argv and argv[0].endswith(".py"):
        mod = os.path.relpath(os.path.abspath(argv[0]), ROOT)[:-3].replace(os.sep, ".")
        argv = ["-m", mod] + argv[1:]
    return "python " + " ".join(shlex.quote(a) for a in argv)


# ---------------------------------------------------------------------------------------------
# child processes
# ---------------------------------------------------------------------------------------------

def run_child(module: str, args: Sequence[str], timeout: float | None = None) -> dict:
    """`python -m module *args` in a fresh process; its last stdout line is a JSON object."""
    cmd = [sys.executable, "-m", module, *map(str, args)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"child {' '.join(cmd[2:])} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    lines = [ln for ln in res.stdout.strip().splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"child {' '.join(cmd[2:])} printed no result:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return json.loads(lines[-1])


def child_result(out: dict) -> None:
    """Print a child's result as its last stdout line (with its own peak RSS)."""
    out.setdefault("peak_rss_mib", peak_rss_mib())
    print(json.dumps(out), flush=True)


def best_of(fn: Callable[[], dict], repeat: int, key: str = "seconds") -> dict:
    """Run `fn` `repeat` times; keep the fastest (least disturbed by other load), note the spread."""
    runs = [fn() for _ in range(max(1, repeat))]
    best = min(runs, key=lambda r: r[key])
    best = dict(best)
    best["runs"] = [round(r[key], 3) for r in runs]
    best["peak_rss_mib"] = max(r.get("peak_rss_mib", 0.0) for r in runs)
    return best


# ---------------------------------------------------------------------------------------------
# generated buffers
# ---------------------------------------------------------------------------------------------

def groups_per_shard(shard_tokens: int, mean_tokens: int = MEAN_TOKENS, group_size: int = GROUP_SIZE) -> int:
    return max(1, round(shard_tokens / (mean_tokens * group_size)))


def step_table(step: int, shard_tokens: int, seed: int = 0, mean_tokens: int = MEAN_TOKENS):
    """The generated rollouts of step `step` (about `shard_tokens` response tokens)."""
    from rollstore.builtin.synthetic import rollouts_table

    return rollouts_table(n_groups=groups_per_shard(shard_tokens, mean_tokens), group_size=GROUP_SIZE,
                          mean_tokens=mean_tokens, seed=seed, step=step, policy_version=step // 4,
                          n_prompts=N_PROMPTS)


def build_buffer(root: str, tokens: int, shard_tokens: int = 1_000_000, seed: int = 0) -> dict:
    """Create (or extend) a buffer until it holds at least `tokens` response tokens."""
    from rollstore.storage.buffer import Buffer

    info = describe(root) if os.path.exists(os.path.join(root, "manifest.sqlite")) else None
    buf = Buffer.open(root) if info else Buffer.init(root)
    total, step = (info["tokens"], info["shards"]) if info else (0, 0)
    try:
        while total < tokens:
            shard = buf.append_rollouts(step_table(step, shard_tokens, seed), f"bench-step-{step}")
            total += shard.tokens
            step += 1
    finally:
        buf.close()
    return describe(root)


def measured_buffer(root: str | None, prefix: str, tokens: int, shard_tokens: int, measure: Callable[[str], dict]) -> dict:
    """`measure(root)` of a generated buffer of `tokens` tokens: `root` when given (created or
    extended, and kept), else a temporary folder removed afterwards."""
    import shutil
    import tempfile

    path = root or tempfile.mkdtemp(prefix=prefix)
    try:
        build_buffer(path, tokens, shard_tokens)
        return measure(path)
    finally:
        if not root:
            shutil.rmtree(path, ignore_errors=True)


def describe(root: str) -> dict:
    """Tokens, rows, shards and bytes of the buffer's rollouts table (latest snapshot)."""
    from rollstore.storage.buffer import Buffer

    with Buffer.open(root) as buf, buf.snapshot() as snap:
        shards = snap.shards("rollouts")
    return {"tokens": sum(s.tokens for s in shards), "rows": sum(s.rows for s in shards), "shards": len(shards),
            "bytes": sum(s.bytes for s in shards), "largest_shard_bytes": max((s.bytes for s in shards), default=0)}


def rollout_files(root: str) -> list[str]:
    from rollstore.storage.buffer import Buffer

    with Buffer.open(root) as buf, buf.snapshot() as snap:
        return list(snap.files("rollouts"))


# ---------------------------------------------------------------------------------------------
# tables and RESULTS.md
# ---------------------------------------------------------------------------------------------

def fmt(x, digits: int = 2) -> str:
    if x is None or x == "":
        return ""
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if math.isnan(x):
            return ""
        return f"{x:,.{digits}f}"
    return str(x)


def md_table(headers: Sequence[str], rows: Sequence[Sequence], digits: int = 2) -> str:
    """A GitHub markdown table; the first column is left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(c, digits) for c in row) + " |")
    return "\n".join(lines)


def header(title: str, command: str | None = None, extra: Sequence[str] = (), level: int = 3,
           libs: Sequence[str] = ("duckdb", "pyarrow", "numpy")) -> str:
    lines = [f"{'#' * level} {title} — {time.strftime('%Y-%m-%d %H:%M')}", ""]
    lines.append(f"Command: `{command or command_line()}`  ")
    lines.append(f"Machine: {machine()}; load average at start {load_avg()} (1/5/15 min)  ")
    lines.append(f"Versions: {versions(*libs)}" + ("  " if extra else ""))
    lines.extend(f"{x}  " for x in extra[:-1])
    if extra:
        lines.append(extra[-1])
    return "\n".join(lines)


def append_results(text: str, path: str = RESULTS) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write("\n" + text.rstrip() + "\n")


def publish(text: str, record: bool = True) -> None:
    """Print a benchmark's section and, unless told not to, append it to RESULTS.md."""
    print(text)
    if record:
        append_results(text)


# ---------------------------------------------------------------------------------------------
# profiles
# ---------------------------------------------------------------------------------------------

def profile(fn: Callable[[], object], top: int = 12, tree_lines: int = 45) -> tuple[object, str]:
    """Run `fn` under pyinstrument; return its result and a text profile.

    The text holds the call tree (frames of at least 3 % of the time) and the top functions by self
    time. Time spent inside DuckDB or Arrow C++ is charged to the Python frame that called into
    it (`Session.execute`, `to_arrow_table`, `write_table`, ...), which is what tells a query from
    Python overhead apart.
    """
    from pyinstrument import Profiler

    prof = Profiler(interval=0.002)
    prof.start()
    try:
        result = fn()
    finally:
        prof.stop()
    tree = prof.output_text(unicode=False, color=False, show_all=False, short_mode=False,
                            processor_options={"filter_threshold": 0.03})
    tlines = [ln.rstrip() for ln in tree.splitlines()]
    duration = next((ln.split("Duration:")[1].strip() for ln in tlines if "Duration:" in ln), "?")
    first = next((i for i, ln in enumerate(tlines) if ln[:1].isdigit()), len(tlines))
    tlines = [ln for ln in tlines[first:] if ln.strip()][:tree_lines]
    flat = prof.output_text(unicode=False, color=False, flat=True, flat_time="self", short_mode=False)
    body = [ln.strip() for ln in flat.splitlines() if ln.strip()[:1].isdigit() and "[self]" not in ln]
    return result, "\n".join([f"pyinstrument call tree (seconds; frames >= 3 %); duration {duration}"] + tlines
                             + ["", "top functions by self time (seconds)"] + body[:top])


def method(doc: str) -> str:
    """A module docstring as a RESULTS.md method note: without its title line and its usage line."""
    paras = [p for p in doc.strip().split("\n\n")]
    body = [p for p in paras[1:] if not p.startswith("    ")]
    return "**Method.** " + "\n\n".join(body)
