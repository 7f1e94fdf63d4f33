"""Names that say which process owns a temporary file or folder, so that a cleaner can tell a live
writer's work in progress from the leftovers of a killed one.

A temporary name is `<kind>-<host>-<pid>-<hex>[.<ext>]` (`owned_name`): `kind` is a lower-case
word (tmp, ckpt, curate, duckdb, ...), `host` this machine's name with every character outside
[A-Za-z0-9.] replaced by `_` (so it holds no `-`), `pid` the writer's process id.

Invariants:
- `owner_gone(name)` is True only when the name is owned by a process of THIS host that no
  longer exists; a name of another host, or one that is not an owned name, is never judged gone
  here (the caller falls back to its grace period). A reused pid keeps a file longer, never less.
- Nothing here writes or deletes; it only names and judges.
"""

from __future__ import annotations

import os
import re
import socket
import uuid

_OWNED = re.compile(r"(?P<kind>[a-z]+)-(?P<host>[A-Za-z0-9._]+)-(?P<pid>[0-9]+)-(?P<rand>[0-9a-f]+)(?P<ext>\.[a-z]+)?")


def host() -> str:
    """This machine's name as it appears in owned names."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def owned_name(kind: str, ext: str = "") -> str:
    """A fresh name owned by this process: `<kind>-<host>-<pid>-<hex><ext>`."""
    return f"{kind}-{host()}-{os.getpid()}-{uuid.uuid4().hex[:16]}{ext}"


def owner_prefix(kind: str, pid: int | None = None) -> str:
    """The prefix shared by the names of `kind` that process `pid` (default: this one) owns."""
    return f"{kind}-{host()}-{os.getpid() if pid is None else pid}-"


def parse(name: str) -> tuple[str, str, int] | None:
    """(kind, host, pid) of an owned name, or None."""
    m = _OWNED.fullmatch(name)
    return None if m is None else (m.group("kind"), m.group("host"), int(m.group("pid")))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_gone(name: str) -> bool:
    """True iff `name` is owned by a process of this host that has ended (see the invariants)."""
    owner = parse(name)
    return owner is not None and owner[1] == host() and not pid_alive(owner[2])
