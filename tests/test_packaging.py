"""The installed package: one top-level name, `rollstore`, that works with no file of the checkout.

`pip wheel .` builds the wheel (no build isolation: the test environment's setuptools); the wheel
must hold `rollstore/` and its dist-info only, with the layers as `rollstore.storage`, ... and
their data files (the SQL, the recipes, the shipped tiny policies). It is then installed with pip into a new virtual
environment outside the checkout, whose only other path is the test environment's site-packages
(for torch, duckdb, ...; an editable install of this checkout there is not activated, because
`.pth` files are read only from site directories). From a scratch directory, that environment runs
`rollstore recipes --explain d3s`, a one-iteration `rollstore demo` (from an empty model cache) and the TRL plug-in's import,
and no module it loads comes from the checkout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from rollstore.builtin.resolve import TINY_MODELS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ("storage", "queries", "curate", "rollout", "learner")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out)], check=True, capture_output=True, cwd=str(out))
    (name,) = [n for n in os.listdir(out) if n.endswith(".whl")]
    return str(out / name)


def test_the_wheel_holds_one_top_level_package(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"rollstore"}
    for layer in LAYERS:
        assert f"rollstore/{layer}/__init__.py" in names
    assert "rollstore/queries/curate_candidates.sql" in names
    assert "rollstore/curate/recipes/d3s.toml" in names
    assert "rollstore/importers/__init__.py" in names and "rollstore/rollout/backends/__init__.py" in names
    shipped = sorted(n for n in names if n.startswith("rollstore/builtin/models/"))
    policies = len(TINY_MODELS)  # builtin:tiny, builtin:tiny-carries, builtin:tiny-chains
    assert len(shipped) == policies * 7 and sum(n.endswith("/model.safetensors") for n in shipped) == policies, shipped


@pytest.mark.slow
def test_installed_wheel_runs_outside_the_checkout(wheel, tmp_path):
    """The demo starts from an empty cache (ROLLSTORE_CACHE, never ~/.cache), as on a fresh machine:
    it installs builtin:tiny from the copy the wheel ships."""
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = str(env / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "deps.pth"), "w") as fh:  # the dependencies, not the checkout
        fh.write(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q", wheel],
                   check=True, capture_output=True)
    work = tmp_path / "scratch"
    work.mkdir()
    cache = tmp_path / "fresh-cache"
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1",
                                                                          "ROLLSTORE_CACHE": str(cache)}

    def run(*args: str) -> str:
        res = subprocess.run(list(args), cwd=str(work), env=clean, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stderr[-2000:]
        return res.stdout

    rollstore = str(env / "bin" / "rollstore")
    assert "curate_candidates" in run(rollstore, "recipes", "--explain", "d3s")
    assert "held-out" in run(rollstore, "demo", "buf", "--iterations", "1")
    (tiny,) = os.listdir(cache)
    assert os.path.exists(cache / tiny / "SHIPPED.json")  # copied, not built
    probe = ("import sys, rollstore.trl.plugin, rollstore.cli.commands, rollstore.storage.buffer\n"
             f"src = {tuple(os.path.join(ROOT, d) + os.sep for d in ('rollstore', *LAYERS))!r}\n"
             "mods = [m for m in list(sys.modules.values()) if getattr(m, '__file__', None)]\n"
             "assert rollstore.storage.buffer.__file__.startswith(sys.prefix), rollstore.storage.buffer.__file__\n"
             "print([m.__name__ for m in mods if m.__file__.startswith(src)])\n")
    assert run(python, "-c", probe).strip() == "[]"
    generic = "import importlib.util as u; print([n for n in %r if u.find_spec(n)])" % (LAYERS,)
    assert run(python, "-c", generic).strip() == "[]"  # no generic top-level names on the path
