"""The layering rule: imports only point down.

`rollstore` (the application) on top; `curate` → `queries` → `storage`; `rollout` → `storage`;
`learner` → `storage`. A layer is named either bare (`storage.buffer`, the folder's name) or
installed (`rollstore.storage.buffer`); both spellings are checked, so neither can hide an import
that points up or sideways. Every module of the product is parsed, including imports inside
functions and inside `if TYPE_CHECKING:` blocks.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALLOWED = {
    "storage": set(),
    "queries": {"storage"},
    "curate": {"queries", "storage"},
    "rollout": {"storage"},
    "learner": {"storage"},
    "rollstore": {"storage", "queries", "curate", "rollout", "learner"},
}


def layer_of(module: str) -> str | None:
    """The layer a dotted import names, in either spelling; None for anything else."""
    parts = module.split(".")
    if parts[0] == "rollstore" and len(parts) > 1 and parts[1] in ALLOWED:
        return parts[1]
    return parts[0] if parts[0] in ALLOWED else None


def imported(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "rollstore":  # `from rollstore import storage` names the layer
                out += [(node.lineno, f"rollstore.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
    return out


def imports_under(root: str, top: str):
    """(file relative to root, line, module) of every import in the Python files under root/top."""
    for folder, _, files in os.walk(os.path.join(root, top)):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as fh:
                    tree = ast.parse(fh.read(), path)
                for line, module in imported(tree):
                    yield os.path.relpath(path, root), line, module


def violations(root: str = ROOT) -> list[str]:
    bad = []
    for pkg, ok in ALLOWED.items():
        for path, line, module in imports_under(root, pkg):
            layer = layer_of(module)
            if layer is not None and layer != pkg and layer not in ok:
                bad.append(f"{path}:{line} imports {module}")
    return bad


def test_imports_only_point_down():
    assert violations() == []


def test_the_check_sees_both_spellings(tmp_path):
    """A storage module importing curate, once per spelling, is caught both times."""
    for pkg in ALLOWED:
        (tmp_path / pkg).mkdir()
    (tmp_path / "storage" / "a.py").write_text("from curate.run import curate\n")
    (tmp_path / "storage" / "b.py").write_text("def f():\n    import rollstore.curate.run\n")
    (tmp_path / "storage" / "c.py").write_text("from rollstore import learner\nfrom rollstore import storage\n")
    (tmp_path / "curate" / "d.py").write_text("from rollstore.queries.session import Session\n")  # allowed
    assert sorted(violations(str(tmp_path))) == [
        "storage/a.py:1 imports curate.run",
        "storage/b.py:2 imports rollstore.curate.run",
        "storage/c.py:1 imports rollstore.learner",
    ]


def test_every_import_uses_the_installed_names():
    """`storage`, `queries`, ... are folders of the checkout but install as `rollstore.storage`, ...
    (the wheel has one top-level package). A bare `import storage` works only from the checkout,
    and beside `rollstore.storage` it would load a second copy of every module (two classes of each
    error, two buffers' caches), so none is left anywhere: product, tests, benchmarks, examples."""
    bare = [f"{path}:{line} imports {module}"
            for top in ("rollstore", *[k for k in ALLOWED if k != "rollstore"], "tests", "bench", "examples")
            for path, line, module in imports_under(ROOT, top)
            if module.split(".")[0] in ALLOWED and module.split(".")[0] != "rollstore"]
    assert bare == []
