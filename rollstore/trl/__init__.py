"""The TRL plug-in (docs/trl.md): `from rollstore.trl import RollstoreGRPOTrainer`.

`plugin` is the trainer subclass that records (and curates) each generation batch; `replay` puts
replayed rows into TRL's batch; `errors` holds the one error both raise. The public names are
imported on first use, so `rollstore.trl.replay` loads without TRL's trainer.
"""

from __future__ import annotations

from rollstore.storage.lazy import lazy_exports

_PUBLIC = {
    "CorrectRule": "rollstore.trl.plugin",
    "RollstoreGRPOTrainer": "rollstore.trl.plugin",
    "TRLPluginError": "rollstore.trl.errors",
}

__all__ = sorted(_PUBLIC)


__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
