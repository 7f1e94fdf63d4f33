"""Packages whose public names are imported on first use: one helper for every such `__init__`.

It lives in the lowest layer so that every package of every layer and room may use it.

Invariants: `lazy_exports(__name__, PUBLIC)` gives a package its `__getattr__` and `__dir__`; a
public name is imported from the module `PUBLIC` names for it on first access and kept in the
package's namespace (later accesses are plain lookups); any other name is an `AttributeError`
naming the package. Importing this module imports nothing else.
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import Callable


def lazy_exports(package: str, public: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `package`, whose names `public` maps to their modules."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str):
        if name in public:
            value = getattr(import_module(public[name]), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(public))

    return __getattr__, __dir__
