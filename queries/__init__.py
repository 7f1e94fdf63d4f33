"""SQL of rollstore as readable `.sql` files, and the DuckDB session that runs it over a snapshot.

One templating style for every statement:
- `{name}` is a fragment of SQL text (a relation, a column expression, a checked user predicate),
  filled by `render` before the statement runs; every placeholder must be filled, and only those.
- `$name` is a value, bound by DuckDB itself at run time (`parameters_of` lists what a text needs).
"""

from __future__ import annotations

import os
import re
from importlib import resources

_FRAGMENT = re.compile(r"\{([a-z_]+)\}")
_PARAMETER = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")


_TEXTS: dict[tuple[str, int, int], str] = {}


def load_sql(name: str) -> str:
    """Text of queries/<name>.sql (read once per process and version of the file: a loop builds
    its plan from the same ~20 files every iteration)."""
    path = resources.files(__name__).joinpath(f"{name}.sql")
    try:
        st = os.stat(path)
    except (OSError, TypeError):  # not a plain file (a zipped package): read it every time
        return path.read_text()
    key = (str(path), st.st_mtime_ns, st.st_size)
    text = _TEXTS.get(key)
    if text is None:
        text = _TEXTS[key] = path.read_text()
    return text


def render(name: str, fragments: dict[str, str] | None = None, text: str | None = None) -> str:
    """queries/<name>.sql (or `text`) with each `{fragment}` replaced; a placeholder left unfilled
    or a fragment the text does not use is a programming error."""
    sql = load_sql(name) if text is None else text
    fragments = fragments or {}
    wanted = set(_FRAGMENT.findall(_strip_comments(sql)))
    if wanted != set(fragments):
        raise KeyError(f"{name}.sql takes fragments {sorted(wanted)}, got {sorted(fragments)}")
    return _FRAGMENT.sub(lambda m: fragments[m.group(1)] if m.group(1) in fragments else m.group(0), sql)


def parameters_of(sql: str) -> set[str]:
    """The `$name` values a statement needs (comments ignored)."""
    return set(_PARAMETER.findall(_strip_comments(sql)))


def needed_values(sql: str, values: dict) -> dict:
    """The values of `values` that `sql` needs; a missing one is a programming error."""
    needed = parameters_of(sql)
    missing = needed - set(values)
    if missing:
        raise KeyError(f"SQL needs values {sorted(missing)}")
    return {k: values[k] for k in needed}


def _strip_comments(sql: str) -> str:
    """The text without comments and string literals (a `$x` or `{x}` inside them is not one)."""
    return re.sub(r"'(?:[^']|'')*'", "''", re.sub(r"--[^\n]*", "", sql))
