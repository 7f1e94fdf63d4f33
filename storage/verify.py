"""Shard verification: a shard file is used for anything committed only if it still is the file
the manifest recorded (same size, same sha256).

Invariants:
- `check_present` is cheap (one lstat per file and per folder) and catches deleted, emptied,
  truncated shards and shards that are not regular files inside the buffer (a symbolic link);
  `verify_shards` also hashes, and caches a good result per process by (path, size, mtime_ns,
  ctime_ns, inode), so a file is hashed once per process unless it changes (a rewrite in place at
  the same size with its mtime set back still changes the ctime, which no utime() can restore);
  several files are hashed in parallel, and
  the error names the first bad shard in manifest order, as a serial check would.
- `verify_training_inputs` checks what a learner reads: the curated shards and every rollouts
  shard they refer to (live, in place, size and sha256), each hashed once per process.
- `scan_references` follows thin curated shards' references: each must name a live rollouts shard
  (or one whose rows compaction moved into a live one: `references.locate`) and, at the row
  position it names (there), the rollout_id it names.
- A bad shard raises one `ShardError` line naming the file and what to do about it; nothing here
  writes, except `quarantine`, which retires bad shards in ONE manifest commit and moves their
  files (when present) under `quarantine/` — never deleting them, and `restore`, which un-retires
  quarantined shards whose bytes verify again in ONE commit.
- A host never retires what it merely cannot see (`quarantinable`): a shard is quarantined when its
  bytes were read and found wrong (size, sha256, a link, a store object changed or one the store
  says it does not hold); a missing local file only when this folder is the buffer's data folder
  (its identity marker, `buffer.id`, holds the token the catalog recorded when the buffer was made,
  which the descriptor does not hold, so a copied descriptor cannot fake it) and at least one shard
  was read here. A data folder that is absent, a marker that is missing or different, or a scan
  that read none of the shards refuses the whole quarantine with one line.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .errors import RollstoreError
from .catalog import Catalog, Shard
from .references import check_references, locate, read_references, referenced_shards
from .shardio import READ_THREADS, fsync_dir, sha256_file
from .store import MARKER, ObjectDamaged, ObjectMissing, cache_shards

QUARANTINE_DIR = "quarantine"

_verified: set[tuple[str, int, int, int, int]] = set()


class ShardError(RollstoreError):
    """A live shard's file is missing or differs from its manifest row."""


@dataclass(frozen=True)
class Problem:
    shard: Shard
    reason: str  # "missing", "link", "size", "sha256"

    def describe(self, root: str) -> str:
        path = os.path.join(root, self.shard.path)
        what = {
            "missing": "missing",
            "link": "not a regular file inside the buffer (a symbolic link, or under a linked folder)",
            "size": "size differs from the manifest (truncated or changed)",
            "sha256": "sha256 differs from the manifest (corrupted)",
            "changed": "object in the store differs from the catalog (size or sha256: changed or damaged)",
            "gone": "object missing from the store (deleted)",
        }[self.reason]
        return f"{path}: shard {what}"


def advice(root: str) -> str:
    return f"restore the file from a backup, or run `rollstore verify {root} --quarantine` to retire it"


def _stat(path: str):
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def check_shard(root: str, shard: Shard, full: bool = True, folders: dict | None = None) -> Problem | None:
    """The problem of one shard, or None. `full=False` checks existence, place and size only:
    the rule every reader applies before it opens a file, and `verify` applies too. A shard is a
    regular file at its own path inside the buffer: never a symbolic link, nor reached through a
    linked folder (whatever the bytes it leads to). `folders`: the folders checked so far by the
    caller's pass over many shards (each once per pass, `_plain_folder`; the file itself is checked
    by `lstat`, which does not follow a link)."""
    problem, key = _placed(root, shard, folders if folders is not None else {})
    if problem is not None or not full or key in _verified:
        return problem
    return _hashed(shard, key)


def _placed(root: str, shard: Shard, folders: dict) -> tuple[Problem | None, tuple | None]:
    """(the problem of the shard's existence, place or size, or None; the file's identity key as it
    is now: path, size, mtime, ctime (no utime() can set it back) and inode), from one lstat."""
    path = os.path.join(root, shard.path)
    st = _stat(path)
    if st is None:
        return Problem(shard, "missing"), None
    if not stat.S_ISREG(st.st_mode) or not _in_place(root, shard.path, folders):
        return Problem(shard, "link"), None
    if st.st_size != shard.bytes:
        return Problem(shard, "size"), None
    return None, (path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def _hashed(shard: Shard, key: tuple) -> Problem | None:
    """Hash the file (`key[0]`) against the shard's sha256; a good result is kept for the process."""
    if sha256_file(key[0]) != shard.sha256:
        return Problem(shard, "sha256")
    _verified.add(key)
    return None


def _raise(root: str, problem: Problem | None) -> None:
    if problem is not None:
        raise ShardError(f"{problem.describe(root)}; {advice(root)}")


def _in_place(root: str, relpath: str, folders: dict) -> bool:
    """Whether root/relpath, a regular file (`lstat`: not a link itself), has the real path
    realpath(root)/relpath — no linked folder, no `..`, nothing to normalise on the way: each folder
    of `relpath` a directory, not a link (`_plain_folder`), resolved once per pass (`folders`)."""
    folder, name = os.path.split(relpath)
    if name in ("", ".", ".."):
        return False
    return _plain_folder(root, folder, folders)


def _plain_folder(root: str, folder: str, folders: dict) -> bool:
    """Whether every component of `folder` (relative to `root`) is a plain name of a directory that
    is not a symbolic link, i.e. realpath(root/folder) == realpath(root)/folder; one `lstat` per
    folder per pass (`folders`, shared by the pass's files: a loop's buffer holds a folder per
    curation, and a realpath of each cost ~0.1 ms of Python a check)."""
    if folder == "":
        return True
    if folder not in folders:
        parent, leaf = os.path.split(folder)
        ok = leaf not in ("", ".", "..") and os.path.join(parent, leaf) == folder
        if ok and parent:
            ok = _plain_folder(root, parent, folders)
        if ok:
            st = _stat(os.path.join(root, folder))
            ok = st is not None and stat.S_ISDIR(st.st_mode)
        folders[folder] = ok
    return folders[folder]


def check_present(root: str, shards: list[Shard], folders: dict | None = None) -> None:
    """Raise for the first shard that is missing or has the wrong size (no hashing). `folders`: a
    pass's checked folders, shared by the caller across several calls (`_in_place`)."""
    folders = {} if folders is None else folders
    for shard in shards:
        _raise(root, check_shard(root, shard, full=False, folders=folders))


def verify_shards(root: str, shards: list[Shard], folders: dict | None = None) -> None:
    """Raise for the first shard (in the given order) whose file is not the one the manifest
    recorded. Each shard's place and size are checked here (each folder resolved once: `folders`,
    shared by the caller across calls); the files not hashed yet by this process (same path, size,
    times and inode) are hashed on one thread per core (hashlib releases the GIL). A loop verifies
    its inputs every iteration: only the files new since the last one are read."""
    folders = {} if folders is None else folders
    problems: list[Problem | None] = []
    unhashed: list[tuple[int, tuple]] = []
    for shard in shards:
        problem, key = _placed(root, shard, folders)
        problems.append(problem)
        if problem is None and key not in _verified:
            unhashed.append((len(problems) - 1, key))
    if len(unhashed) > 1 and READ_THREADS > 1:
        with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(unhashed))) as pool:
            found = list(pool.map(lambda item: _hashed(shards[item[0]], item[1]), unhashed))
    else:
        found = [_hashed(shards[i], key) for i, key in unhashed]
    for (i, _key), problem in zip(unhashed, found):
        problems[i] = problem
    for problem in problems:
        _raise(root, problem)


def scan(root: str, manifest: Catalog, hash_only: set[int] | None = None) -> list[Problem]:
    """Every live shard of the buffer checked in full; returns the problems (empty: all good).
    `hash_only` (an incremental verify): only these shard ids are hashed; the others are checked
    for existence, place and size (one lstat each)."""
    problems = []
    store = manifest.store  # shards in object storage: checked through this host's cache
    folders: dict = {}
    for shard in manifest.shards():
        if hash_only is not None and shard.shard_id not in hash_only:
            problem = check_shard(root, shard, full=False, folders=folders)
            if problem is not None:
                problems.append(problem)
            continue
        if store is not None:
            try:
                store.fetch(root, shard.path, shard.sha256, shard.bytes, manifest.holding)
            except ObjectDamaged:  # read, and wrong: never cached (an unreachable store raises instead)
                problems.append(Problem(shard, "changed"))
                continue
            except ObjectMissing:  # the store answered that it holds no such object
                problems.append(Problem(shard, "gone"))
                continue
        problem = check_shard(root, shard, full=True)
        if problem is not None:
            problems.append(problem)
    return problems


def scan_references(root: str, manifest: Catalog, only: set[int] | None = None) -> list[str]:
    """Every live thin curated shard's references checked (`only`: the curated shards of these ids):
    each names a live rollouts shard, a row inside it, and the rollout_id at that row. Returns one
    line per bad curated shard (empty: all resolve). Curated shards whose own file is bad are left
    to `scan`. Each rollouts shard's rollout_id column is read once for all the references into it
    (a compacted shard holds many steps' rows)."""
    live = [s.path for s in manifest.shards("rollouts")]
    moves = manifest.moves()
    problems = []
    ids = OrderedDict()  # the rollout_id columns read in this pass (`check_references`)
    for shard in manifest.shards("curated"):
        if only is not None and shard.shard_id not in only:
            continue
        path = os.path.join(root, shard.path)
        if check_shard(root, shard, full=False) is not None:
            continue
        for refs in read_references([path]):
            problem = check_references(root, refs, live, path, moves, ids)
            if problem is not None:
                problems.append(f"{problem}; the curation cannot be trained: curate again")
    return problems


def verify_references(root: str, manifest: Catalog, shards: list[Shard]) -> None:
    """Raise one `ShardError` line for the first of the curated `shards` whose references do not
    resolve (before training on them: a quarantined rollouts shard makes its curations refuse).
    The files are verified first (`verify_training_inputs`), so a damaged rollouts shard is its
    documented line (size, link, sha256), not a read error."""
    verify_training_inputs(root, manifest, shards)
    live = [s.path for s in manifest.shards("rollouts")]
    moves = manifest.moves()
    for refs_path in [os.path.join(root, s.path) for s in shards]:
        for refs in read_references([refs_path]):
            problem = check_references(root, refs, live, refs_path, moves)
            if problem is not None:
                raise ShardError(f"{problem}; this curation cannot be trained: curate again")


def verify_training_inputs(root: str, manifest: Catalog, shards: list[Shard]) -> None:
    """Everything training on the curated `shards` reads, checked as `verify_shards` checks a
    curation's inputs: the curated shards, then every rollouts shard their references name (each
    must be live in `manifest`, or moved into a live one by compaction, which is then checked; its
    file a regular file at its own path inside the buffer, with the recorded size and sha256).
    Hashes are cached per process (`check_shard`), so a learner that trains many curations over the
    same rollouts shards hashes each of them once. Raises one
    `ShardError` line naming the first bad file. (A store's buffer: each file is fetched into this
    host's cache first, verified as it downloads.)"""
    cache_shards(root, manifest, shards)
    verify_shards(root, shards)
    live = {s.path: s for s in manifest.shards("rollouts")}
    moves = manifest.moves()
    live_paths = set(live)
    wanted: dict[str, Shard] = {}
    for shard in shards:
        path = os.path.join(root, shard.path)
        for rel in sorted(referenced_shards([path])):
            at = locate(rel, root, live_paths, moves)  # a compacted shard: the one its rows are in now
            if at is None:
                raise ShardError(f"{path}: refers to rollouts shard {rel}, which is not live (quarantined or "
                                 "removed); this curation cannot be trained: curate again")
            wanted[at[0]] = live[at[0]]
    cache_shards(root, manifest, wanted.values())
    verify_shards(root, sorted(wanted.values(), key=lambda s: s.shard_id))


# ---- incremental verification: which shards a verify hashed good (made on first use) ------
def verified_ids(manifest: Catalog) -> set[int]:
    """The shards a verify found good (by hash) at least once; a shard's bytes never change under
    its id, so `verify --incremental` hashes only the others (`--full`, the default, hashes all)."""
    return manifest.verified_ids()


def record_verified(manifest: Catalog, shard_ids: list[int]) -> bool:
    """Record these shards as hashed good now (in a transaction that does not wait for the disk:
    losing it only means hashing them again). False when the manifest cannot be written."""
    if manifest.read_only is not None or not shard_ids:
        return False
    manifest.record_verified(shard_ids)
    return True


def retire(manifest: Catalog, shards: list[Shard], kind: str, detail: dict | None = None) -> int:
    """Retire `shards` in one manifest commit of `kind` (their rollout and group ids are released;
    their files are left where they are). Returns the commit seq."""
    ids = [s.shard_id for s in shards]
    with manifest.transaction() as con:
        seq = manifest.new_commit(con, kind, {"shards": ids, "paths": [s.path for s in shards], **(detail or {})})
        manifest.retire_shards(con, seq, ids)
        manifest.forget_prompt_state(con)  # rows leave the history (storage.prompt_state)
    return seq


def quarantine(root: str, manifest: Catalog, problems: list[Problem]) -> int:
    """Retire the shards of `problems` in one manifest commit (their rollout and group ids are
    released) and move their files, when present, to `quarantine/<path>`. Returns the commit seq."""
    seq = retire(manifest, [p.shard for p in problems], "quarantine")
    for p in problems:
        src = os.path.join(root, p.shard.path)
        if os.path.exists(src):
            dst = os.path.join(root, QUARANTINE_DIR, p.shard.path)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(src, dst)
            fsync_dir(os.path.dirname(dst))
    return seq


# ---- a host never retires what it cannot see; and the way back ----------------------------------

READ_AND_WRONG = ("size", "sha256", "link", "changed", "gone")


def write_marker(root: str, data: str | None, token: str) -> None:
    """Write the data folder's identity marker (`buffer.id`, holding `token`) where the shards live:
    `root` (a shared folder) or the store at `data`. Called once, when the buffer is made."""
    body = (token + "\n").encode()
    if data is not None:
        from .store import S3Store

        store = S3Store(data)
        try:
            store.client.put_object(Bucket=store.bucket, Key=store.key(MARKER), Body=body)
        except Exception as exc:  # noqa: BLE001 - botocore's errors, as one line
            raise store._fail(f"cannot write {MARKER}", exc) from None
        return
    path = os.path.join(root, MARKER)
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(body)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(root)


def recorded_marker(manifest: Catalog) -> str | None:
    """The marker token the catalog recorded when the buffer was made (None: an embedded manifest,
    which lives in its data folder, or a catalog made before markers)."""
    return manifest.data_marker()


def _found_marker(root: str, manifest: Catalog) -> str | None:
    if manifest.store is not None:
        body = manifest.store.read_small(MARKER)
    else:
        try:
            with open(os.path.join(root, MARKER), "rb") as fh:
                body = fh.read(4096)
        except OSError:
            return None
    return None if body is None else body.decode(errors="replace").strip()


def quarantinable(root: str, manifest: Catalog, shards: list[Shard], problems: list[Problem]) -> list[Problem]:
    """The problems `verify --quarantine` retires, or one `ShardError` line refusing them all: when
    this host does not see the buffer's data (its folder absent, its identity marker missing or not
    the catalog's, no shard read at all). A missing local file is retired only beside a marker that
    matches (a buffer made before markers: only shards read and found wrong are retired)."""
    store = manifest.store
    where = store.url if store is not None else root
    if store is None and not all(os.path.isdir(os.path.join(root, d)) for d in ("rollouts", "curated")):
        raise ShardError(f"{root}: the buffer's data folders (rollouts/, curated/) are absent here: this host does not "
                         "see the shards (a shared folder not mounted, or a descriptor copied elsewhere); nothing "
                         "was quarantined")
    token = recorded_marker(manifest)
    if token is not None and _found_marker(root, manifest) != token:
        raise ShardError(f"{where}: its identity marker ({MARKER}) is missing or is not this buffer's: this host does "
                         "not see the buffer's data (a shared folder not mounted, or a descriptor copied "
                         "elsewhere); nothing was quarantined")
    unseen = [p for p in problems if p.reason == "missing"]
    if unseen and len(unseen) == len(shards):
        raise ShardError(f"{where}: none of the {len(shards)} shards could be read here: this host does not see the "
                         "buffer's data, or every file is gone; nothing was quarantined (restore the files, or "
                         "mount the folder)")
    if token is None and manifest.multi_host:  # a catalog made before markers
        return [p for p in problems if p.reason in READ_AND_WRONG]
    return problems


def quarantined(manifest: Catalog) -> list[tuple[Shard, int]]:
    """(shard, the seq of the quarantine that retired it) of every shard retired by a quarantine."""
    seqs = dict(manifest.quarantined())
    return [(s, seqs[s.shard_id]) for s in manifest.shards_by_id(list(seqs))]


def restore(root: str, manifest: Catalog) -> tuple[list[Shard], list[str]]:
    """Un-retire, in ONE manifest commit, every quarantined shard whose bytes verify again (size and
    sha256; its file back in place from `quarantine/`, or again at its own path; a store's object
    downloaded and checked) and whose rollout and group ids no live shard took meanwhile. Returns
    (the shards restored, one line per shard left retired and why). Snapshots taken since the
    quarantine see a restored shard again, as if it had never been retired."""
    good: list[tuple[Shard, int]] = []
    left: list[str] = []
    store = manifest.store
    for shard, seq in quarantined(manifest):
        path = os.path.join(root, shard.path)
        moved = os.path.join(root, QUARANTINE_DIR, shard.path)
        try:
            if store is not None:
                store.fetch(root, shard.path, shard.sha256, shard.bytes)
            elif _stat(path) is None and _stat(moved) is not None:
                aside = dataclasses.replace(shard, path=os.path.join(QUARANTINE_DIR, shard.path))
                if _placed(root, aside, {})[0] is None and sha256_file(moved) == shard.sha256:
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    os.replace(moved, path)
                    fsync_dir(os.path.dirname(path))
        except ObjectMissing:
            left.append(f"{store.url}/{shard.path}: the object is still missing from the store; left quarantined")
            continue
        except ObjectDamaged:
            left.append(f"{store.url}/{shard.path}: the object still differs from the catalog; left quarantined")
            continue
        problem = check_shard(root, shard, full=True)
        if problem is not None:
            left.append(problem.describe(root) + "; left quarantined")
            continue
        good.append((shard, seq))
    if not good:
        return [], left
    restored: list[Shard] = []
    with manifest.transaction() as con:
        manifest.new_commit(con, "restore", {"shards": [s.shard_id for s, _ in good],
                                                   "paths": [s.path for s, _ in good]})
        for shard, seq in good:
            if shard.table_name == "rollouts":
                import pyarrow.parquet as pq

                t = pq.read_table(os.path.join(root, shard.path), columns=["rollout_id", "group_id"])
                pairs = list(zip(t.column("rollout_id").to_pylist(), t.column("group_id").to_pylist()))
                try:
                    manifest.register_rollouts(con, shard.shard_id, pairs, sorted({g for _r, g in pairs}))
                except Exception as exc:  # noqa: BLE001 - an id taken meanwhile (either catalog's integrity error)
                    left.append(f"{os.path.join(root, shard.path)}: its rollout or group ids were taken by a shard "
                                f"appended since the quarantine ({type(exc).__name__}); left quarantined")
                    continue
            manifest.unretire(con, shard.shard_id, seq)
            manifest.forget_prompt_state(con)  # rows come back into the history (storage.prompt_state)
            restored.append(shard)
        if not restored:
            raise ShardError("; ".join(left))  # rolls the empty commit back
    return restored, left
