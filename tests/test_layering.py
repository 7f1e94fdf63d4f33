"""The layering rule: imports only point down.

`rollstore` (the application) on top; `curate` → `queries` → `storage`; `rollout` → `storage`;
`learner` → `storage`. A layer is named either bare (`storage.buffer`, the folder's name) or
installed (`rollstore.storage.buffer`); both spellings are checked, so neither can hide an import
that points up or sideways. Every module of the product is parsed, including imports inside
functions and inside `if TYPE_CHECKING:` blocks.

Inside the application the same rule holds between its rooms (`rollstore/<room>/`, `ROOMS`): the
command line (`cli`) on top, a client of the front door (the modules directly in `rollstore/`:
`__init__`, `handle`, `curation`, `sqlresult`), then orchestration (`loop`), the report (`report`)
and the TRL plug-in (`trl`), then what they share (`output`, `builtin`, `importers`, and `rules`:
the option rules and defaults both doors apply). Only the command line imports the front door; the
front door imports every room but the command line; a room imports only the rooms it lists.
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
# The application's rooms and the rooms each may import (the front door may import every room).
ROOMS = {
    "cli": {"FRONT", "loop", "report", "trl", "output", "builtin", "importers", "rules"},
    "loop": {"output", "builtin", "rules"},
    "report": {"output", "builtin"},
    "trl": {"builtin"},
    "output": set(),
    "builtin": set(),
    "importers": set(),
    "rules": set(),
}
FRONT = "front door"
ROOMS["cli"] = (ROOMS["cli"] - {"FRONT"}) | {FRONT}
FRONT_DOOR = ["__init__.py", "__main__.py", "curation.py", "handle.py", "sqlresult.py"]


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


def room_of(module: str) -> str | None:
    """The application room a dotted import (`rollstore.loop.driver`, `from rollstore import cli`) names:
    a folder of `ROOMS`, `FRONT` for the modules directly in rollstore/, None for a layer or else."""
    parts = module.split(".")
    if parts[0] != "rollstore" or (len(parts) > 1 and parts[1] in ALLOWED):
        return None
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else FRONT


def room_imports(root: str = ROOT):
    """(file, line, room of the file, imported module) of every import of another app module under
    rollstore/, relative imports (`from .errors import ...`) resolved to their dotted name."""
    app = os.path.join(root, "rollstore")
    for folder, _, files in os.walk(app):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, app).split(os.sep)
            room = rel[0] if len(rel) > 1 else FRONT
            package = ["rollstore", *rel[:-1]]
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = package[:len(package) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                    found = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
                    yield from ((os.path.relpath(path, root), node.lineno, room, m) for m in found)
            for line, module in imported(tree):
                yield os.path.relpath(path, root), line, room, module


def room_violations(root: str = ROOT) -> list[str]:
    bad = []
    for path, line, room, module in room_imports(root):
        target = room_of(module)
        if room == FRONT:  # (`python -m rollstore`, rollstore/__main__.py, is the command line's entry)
            if target == "cli" and os.path.basename(path) != "__main__.py":
                bad.append(f"{path}:{line} imports {module}")
        elif target is not None and target != room and target not in ROOMS[room]:
            bad.append(f"{path}:{line} imports {module}")
    return bad


def test_imports_only_point_down():
    assert violations() == []


def test_the_rooms_of_the_application_import_only_down():
    assert room_violations() == []


def test_every_module_of_the_application_has_its_room():
    """Directly in rollstore/ only the front door; a new folder needs its place in `ROOMS` (and in
    pyproject's package list), a new module a room."""
    app = os.path.join(ROOT, "rollstore")
    folders = {d for d in os.listdir(app) if os.path.isfile(os.path.join(app, d, "__init__.py"))}
    assert folders == set(ROOMS)
    assert sorted(f for f in os.listdir(app) if f.endswith(".py")) == FRONT_DOOR
    try:
        import tomllib
    except ModuleNotFoundError:  # python 3.10
        import tomli as tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        packages = set(tomllib.load(fh)["tool"]["setuptools"]["packages"])
    assert {f"rollstore.{room}" for room in ROOMS} <= packages


def test_the_room_check_sees_each_spelling(tmp_path):
    """A room importing the front door or a room above it is caught, absolute or relative."""
    for room in ROOMS:
        (tmp_path / "rollstore" / room).mkdir(parents=True)
    (tmp_path / "rollstore" / "report" / "a.py").write_text("from rollstore.cli.commands import app\n")
    (tmp_path / "rollstore" / "loop" / "b.py").write_text("def f():\n    from rollstore import handle\n")
    (tmp_path / "rollstore" / "output" / "c.py").write_text("from ..report import page\nfrom . import outfile\n")
    (tmp_path / "rollstore" / "cli" / "d.py").write_text("from rollstore.loop.driver import LoopConfig\n"
                                                         "from rollstore.handle import open\n")  # allowed
    (tmp_path / "rollstore" / "handle.py").write_text("from rollstore.rules.defaults import SQL\n"  # allowed
                                                     "from rollstore.cli.commands import app\n")
    assert sorted(room_violations(str(tmp_path))) == [
        "rollstore/handle.py:2 imports rollstore.cli.commands",
        "rollstore/loop/b.py:2 imports rollstore.handle",
        "rollstore/output/c.py:1 imports rollstore.report",
        "rollstore/report/a.py:1 imports rollstore.cli.commands",
    ]


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
