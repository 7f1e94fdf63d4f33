"""Threads beside a curation's commit: the next part built while the current one is written
(`ahead`), and one part written on a thread of its own under tmp/ (`Beside`).

Invariants:
- `ahead` yields the same items in the same order as without it; the producer's error is raised in
  the caller, and a caller that stops early stops the producer and closes its items.
- `Beside` leaves nothing of its folder behind, whether the commit linked its file into place or
  failed before; the folder is held as a catalog intent while it exists.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

from rollstore.storage.buffer import Part, WrittenPart, write_part
from rollstore.storage.catalog import holding
from rollstore.storage.owners import owned_name


def ahead(items):
    """Yield `items`, producing the next one on a background thread while the caller handles the
    current one (at most one item waits). Materialising a part (DuckDB) and writing the previous
    one (pyarrow's Parquet writer is single-threaded) then overlap; both release the GIL.

    The producer's exception is raised in the caller; when the caller stops early (an error while
    writing, or a close), the producer stops after its current item and `items` is closed."""
    slot: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()

    def put(message) -> bool:
        while not stop.is_set():
            try:
                slot.put(message, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(("item", item)):
                    break
            else:
                put(("done", None))
        except BaseException as exc:  # handed to the caller, raised there
            put(("error", exc))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    worker = threading.Thread(target=produce, name="rollstore-materialise", daemon=True)
    worker.start()
    try:
        while True:
            kind, value = slot.get()
            if kind == "done":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
        worker.join()


class Beside:
    """One part written under its own folder in tmp/ on a thread (`start`), beside the work that
    comes before its commit; `result` waits for it (a `WrittenPart`, or the writer's error).
    `close` waits for the writer, then removes the folder: nothing of it is left, whether the
    commit linked the file into place (its temp name is gone then) or failed before."""

    def __init__(self, root: str, part: Part, catalog=None):
        self.root, self.part = root, part
        self.folder = os.path.join("tmp", owned_name("curate"))  # gc keeps it while this process lives
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollstore-beside")
        self.future = None
        self.catalog = catalog
        self.held = ExitStack()  # a catalog's intent on the folder (storage.catalog.holding)

    def start(self) -> None:
        if self.future is None:
            self.held.enter_context(holding(self.catalog, self.folder))
            os.makedirs(os.path.join(self.root, self.folder))
            self.future = self.pool.submit(write_part, self.root, self.part, self.folder)

    def result(self) -> WrittenPart:
        self.start()
        return self.future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.future is not None:
            shutil.rmtree(os.path.join(self.root, self.folder), ignore_errors=True)
        self.held.close()
