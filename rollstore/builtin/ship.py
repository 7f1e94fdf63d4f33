"""Rebuild the shipped default builds of the built-in tiny policies (`make tiny-models`):
`python -m rollstore.builtin.ship [REF ...]` builds each in an empty cache with its default settings
and writes it, with its manifest (`SHIPPED.json`: each file's sha256, the library versions and the
machine), under rollstore/builtin/models/ (`rollstore.builtin.shipped` reads them back).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile

from rollstore.builtin import resolve
from rollstore.builtin.shipped import MANIFEST, SHIPPED_ROOT, _files, _sha256


def ship(ref: str, root: str = SHIPPED_ROOT) -> str:
    """Build `ref` with its default settings in an empty cache and write it, with its manifest, under root."""
    import torch
    import transformers

    task = resolve.TINY_MODELS[ref]
    old = os.environ.get("ROLLSTORE_CACHE")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["ROLLSTORE_CACHE"] = cache
        try:
            built = resolve.build_tiny_cached(task=task, shipped=False)
        finally:
            if old is None:
                os.environ.pop("ROLLSTORE_CACHE", None)
            else:
                os.environ["ROLLSTORE_CACHE"] = old
        dest = os.path.join(root, os.path.basename(built))
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(built, dest)
    manifest = {
        "ref": ref,
        "built_by": "rollstore.builtin.resolve.build_tiny_cached, default settings (python -m rollstore.builtin.ship)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "sha256": {name: _sha256(os.path.join(dest, name)) for name in _files(dest)},
    }
    with open(os.path.join(dest, MANIFEST), "w") as fh:
        json.dump(manifest, fh, indent=2, sort_keys=True)
        fh.write("\n")
    return dest


def main(argv: list[str]) -> None:
    refs = argv or list(resolve.TINY_MODELS)
    keep = {os.path.basename(ship(ref)) for ref in refs}
    if not argv:  # a full rebuild: drop copies of keys that no longer exist
        for name in os.listdir(SHIPPED_ROOT):
            if name not in keep:
                shutil.rmtree(os.path.join(SHIPPED_ROOT, name))
    print(f"shipped: {', '.join(sorted(keep))} in {SHIPPED_ROOT}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
