"""examples/python_front_door.ipynb runs top to bottom in a kernel of this venv (nbclient), on the
built-in task, so the front door of docs/python.md cannot silently break; its run time is printed."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
from rollout_helpers import default_tiny, tiny_cache  # noqa: F401  (fixtures)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "examples", "python_front_door.ipynb")


def test_example_notebook_runs(tmp_path, default_tiny, capsys):  # noqa: F811
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the kernel inherits the environment (ROLLSTORE_CACHE too)
    # a kernel of this very interpreter (a system-wide "python3" kernel spec must not be picked up)
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec = tmp_path / "kernels" / "rollstore-venv"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "rollstore (test venv)", "language": "python"}))
    km = KernelManager(kernel_name="rollstore-venv",
                       kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")]))
    t0 = time.perf_counter()
    nbclient.NotebookClient(nb, km=km, timeout=600, resources={"metadata": {"path": str(tmp_path)}}).execute()
    seconds = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\nexamples/python_front_door.ipynb ran in {seconds:.1f} s")
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert len(code) == 9  # the nine jobs of docs/python.md
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors

    def text(cell) -> str:
        return "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in cell.outputs
                       if o.output_type != "stream" or o.get("name") == "stdout")

    assert "rollstore.Buffer" in text(code[0])
    assert "ranks" in text(code[6]) and "budget" in text(code[6])
    import rollstore as rs

    stamped = rs.open(tmp_path / "nb-buf").sql("SELECT step, min(policy_version) AS lo, max(policy_version) AS hi "
                                               "FROM rollouts GROUP BY step ORDER BY step").fetchall()
    assert stamped == [(0, 0, 0), (1, 0, 0), (2, 1, 1)]  # step 2 sampled by checkpoints/v1: stamped version 1
    assert "torch.Size([8," in text(code[8])
    # nothing printed on stdout by the front door itself (results are values, shown as cell results)
    assert not [o for c in code for o in c.outputs if o.output_type == "stream" and o.get("name") == "stdout"
                and "rollouts" in o.get("text", "")]
