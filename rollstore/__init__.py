"""rollstore: an offline replay buffer and curation engine for GRPO-family RL.

The Python front door (docs/python.md)::

    import rollstore as rs
    buf = rs.open("buf", create=True)      # a buffer handle
    buf.generate(num_prompts=64)            # rollouts of builtin:tiny on builtin:arith
    cur = buf.curate("d3s", progress=0.3)   # a curation handle: .curated .audit .summary .why() ...
    buf.sql("SELECT * FROM groups").pl()    # read-only SQL with the command line's views

The names in `__all__` are the public API; every other module and name of the package may change
without notice. They are imported on first use, so `import rollstore` (and the command line) stays
quick.
"""

from __future__ import annotations

from rollstore.storage.lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it
_PUBLIC = {
    "open": "rollstore.handle",
    "Buffer": "rollstore.handle",
    "Curation": "rollstore.curation",
    "Comparison": "rollstore.curation",
    "Why": "rollstore.curation",
    "SqlResult": "rollstore.sqlresult",
    "RollstoreError": "rollstore.storage.errors",
    "NotABuffer": "rollstore.storage.errors",
    "ManifestError": "rollstore.storage.errors",
    "OptionError": "rollstore.rules",
    "UnknownName": "rollstore.storage.errors",
    "UnknownCuration": "rollstore.storage.errors",
    "ValidationError": "rollstore.storage.errors",
    "UnknownRecipe": "rollstore.curate.params",
    "UnknownParameter": "rollstore.curate.params",
    "ParamError": "rollstore.curate.params",
    "SqlRefused": "rollstore.queries.session",
    "SqlTimeout": "rollstore.queries.session",
    "SqlError": "rollstore.queries.session",
}

__all__ = sorted(_PUBLIC)


__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
