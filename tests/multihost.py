"""Simulated hosts for the tests of a buffer cataloged in PostgreSQL, and the invariant checker run
after every trial.

A simulated host is a process with its own host id (`ROLLSTORE_HOST_ID`), its own catalog
connection, appending to one buffer folder; `appender_script` is what it runs.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq

from rollstore.storage.buffer import Buffer
from rollstore.storage.maintenance import DATA_DIRS, gc

APPENDER = """
import os, sys, time
sys.path.insert(0, {root!r})
os.environ.setdefault("OMP_NUM_THREADS", "1")
from rollstore.builtin.synthetic import rollouts_table
from rollstore.storage.buffer import Buffer
host = os.environ["ROLLSTORE_HOST_ID"]
buf = Buffer.open({buffer!r})
lat = []
for step in range({n}):
    table = rollouts_table(n_groups=1, group_size={group}, mean_tokens=4, step=step, run_id=host, seed={seed})
    t = time.perf_counter()
    buf.append_rollouts(table, source=f"{{host}}:{{step}}")
    lat.append(time.perf_counter() - t)
buf.close()
print(" ".join(f"{{x:.6f}}" for x in lat), flush=True)
"""


def appender_script(root: str, buffer: str, n: int, group: int = 2, seed: int = 0) -> str:
    return APPENDER.format(root=root, buffer=buffer, n=n, group=group, seed=seed)


# Appends until killed; each incarnation has its own run_id (host and pid), so a restart never
# reuses an id. Prints "ready" once its buffer is open.
LOOPER = """
import os, sys
sys.path.insert(0, {root!r})
from rollstore.builtin.synthetic import rollouts_table
from rollstore.storage.buffer import Buffer
run = os.environ["ROLLSTORE_HOST_ID"] + "-" + str(os.getpid())
buf = Buffer.open({buffer!r})
inject = float(os.environ.get("ROLLSTORE_TRIAL_INJECT", "0"))
if inject:  # kill -9 itself at a chosen point of an append, with probability `inject` per append
    import contextlib, random, signal
    rng = random.Random(os.getpid())
    point = [None]

    def die(where):
        if point[0] == where:
            print("killed", where, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    man, real_transaction, real_register = buf.manifest, buf.manifest.transaction, buf.manifest.register_rollouts

    @contextlib.contextmanager
    def transaction():
        die("files-linked-before-transaction")
        with real_transaction() as con:
            yield con

    def register(*args):
        die("inside-transaction-before-commit")
        return real_register(*args)

    class Raw:
        def __init__(self, raw):
            self.raw = raw
        def __getattr__(self, name):
            return getattr(self.raw, name)
        def execute(self, query, *args, **kwargs):
            out = self.raw.execute(query, *args, **kwargs)
            if query == "COMMIT":
                die("after-commit-before-the-caller-knows")
            return out

    real_intend = man.intend

    def intend(paths):
        real_intend(paths)
        die("after-intent-before-the-file")

    man.transaction, man.register_rollouts = transaction, register
    if man.multi_host:  # a catalog with write intents
        man.intend = intend
    man.con.raw = Raw(man.con.raw)
print("ready", flush=True)
step = 0
tolerate = os.environ.get("ROLLSTORE_TRIAL_LOG")  # stall trials: a fenced commit is logged, then go on
while True:
    if inject:
        point[0] = rng.choice(["after-intent-before-the-file", "files-linked-before-transaction",
                               "inside-transaction-before-commit", "after-commit-before-the-caller-knows"]
                              ) if rng.random() < inject else None
    table = rollouts_table(n_groups=1, group_size=2, mean_tokens=4, step=step, run_id=run)
    step += 1
    if not tolerate:
        buf.append_rollouts(table)
        continue
    try:
        buf.append_rollouts(table)
    except Exception as exc:  # fenced (its intents expired), or its session cut off inside the commit
        with open(tolerate, "a") as log:
            log.write(f"{{run}} refused {{str(exc).splitlines()[0]}}\\n")
        buf.close()
        buf = Buffer.open({buffer!r})
"""

# A learner of run "trial-run": leases one rollouts shard in group "learn" (stand-ins for curated
# shards), "trains" on it for a while, then publishes a checkpoint that consumes it and acks its
# lease in the same commit. Logs every outcome to ROLLSTORE_TRIAL_LOG.
LEARNER = """
import os, sys, time
sys.path.insert(0, {root!r})
from rollstore.storage.buffer import Buffer
from rollstore.learner.checkpoint import CheckpointError, Publish, consumed_entry, save_checkpoint
me = os.environ["ROLLSTORE_HOST_ID"] + "-" + str(os.getpid())
ttl, train_s = float(os.environ["ROLLSTORE_TRIAL_LEASE_TTL"]), float(os.environ["ROLLSTORE_TRIAL_TRAIN_S"])
log = os.environ["ROLLSTORE_TRIAL_LOG"]


class Tiny:  # the weights of a model, as save_checkpoint asks for them
    def save_pretrained(self, folder, safe_serialization=True):
        with open(os.path.join(folder, "weights.bin"), "wb") as f:
            f.write(b"w")


def note(line):
    with open(log, "a") as f:
        f.write(me + " " + line + "\\n")


buf = Buffer.open({buffer!r})
print("ready", flush=True)
n = 0
while True:
    try:
        _, shards = buf.lease("rollouts", 1, me, group="learn", ttl=ttl)
    except Exception as exc:  # its catalog session cut off while it was stopped inside the lease
        note("lease-failed " + str(exc).splitlines()[0])
        buf.close()
        buf = Buffer.open({buffer!r})
        continue
    if not shards:
        time.sleep(0.05)
        continue
    time.sleep(train_s)  # training on it (a stall trial stops the process here, or anywhere)
    n += 1
    version = os.getpid() * 100000 + n
    try:
        save_checkpoint(buf, Tiny(), publish=Publish(version=version, run_id="trial-run",
                        consumed=[consumed_entry("c", s.path) for s in shards], lease=(me, "learn")))
        note("published " + " ".join(s.path for s in shards))
    except CheckpointError as exc:
        note("refused " + str(exc).splitlines()[0])
    except Exception as exc:  # its catalog session cut off while it was stopped inside the commit
        note("refused " + str(exc).splitlines()[0])
        buf.close()
        buf = Buffer.open({buffer!r})
"""


# Leases rollouts shards in consumer group "trial" (a short TTL, so a killed consumer's leases come
# back soon) and acks them one by one, logging each acked shard id once its ack returned.
CONSUMER = """
import os, sys, time
sys.path.insert(0, {root!r})
from rollstore.storage.buffer import Buffer
me = os.environ["ROLLSTORE_HOST_ID"] + "-" + str(os.getpid())
buf = Buffer.open({buffer!r})
log = open(os.path.join({logdir!r}, "acks-" + me), "a")
print("ready", flush=True)
while True:
    _, shards = buf.lease("rollouts", 2, me, group="trial", ttl=2.0)
    for s in shards:
        if buf.ack([s], me, group="trial") == 1:
            log.write(f"{{s.shard_id}}\\n")
            log.flush()
    if not shards:
        time.sleep(0.05)
"""

# Curates the latest snapshot with d3s, again and again.
CURATOR = """
import sys, time
sys.path.insert(0, {root!r})
import rollstore as rs
print("ready", flush=True)
while True:
    rs.open({buffer!r}).curate("d3s")
    time.sleep(0.1)
"""


def double_acks(logdir: str) -> list[str]:
    """Shard ids that two consumer logs (or one, twice) record as acked in group "trial"."""
    seen: dict[str, str] = {}
    bad = []
    for name in sorted(os.listdir(logdir)):
        if name.startswith("acks-"):
            with open(os.path.join(logdir, name)) as f:
                for line in f:
                    sid = line.strip()
                    if sid in seen:
                        bad.append(f"shard {sid} acked by {seen[sid]} and {name[5:]}")
                    seen[sid] = name[5:]
    return bad


def kill_trials(root: str, buffer: str, hosts: list[str], kills: int, seed: int = 0,
                check=None, collect: bool = True, consumers: int = 0, curators: int = 0,
                logdir: str | None = None, inject: float = 0.0,
                intent_ttl: float = 1.0) -> list[tuple[int, str, list[str]]]:
    """Simulated hosts append to `buffer` concurrently (with `consumers` leasing and acking and
    `curators` curating, each a process too); `kills` times, one process (at random) is sent
    SIGKILL at a random moment; then (`collect`) gc runs with no grace while the others go on, the
    invariants are checked (orphans too; no shard acked twice; snapshots recorded at earlier trials
    unchanged), and the killed process is restarted. Returns (trial, process killed, violations,
    orphans gc removed or -1 if it was kept out) for each trial. `inject` > 0: the appending hosts
    kill themselves instead, with that probability per append, at a point chosen at random (its
    intents taken, no byte written yet; files linked but no transaction yet; inside the
    transaction; right after COMMIT returned, before the caller knows); the trial's name is then
    "host@point". The processes' write intents live
    `intent_ttl` seconds without a heartbeat: each gc waits that long after a kill (the killed
    writer's intents expire on the database's clock, so gc must take them over and remove its
    files); a live writer fenced by a late heartbeat logs its refused commit and goes on
    (`logdir/outcomes`)."""
    rng = random.Random(seed)
    check = check or check_invariants
    scripts = {h: LOOPER for h in hosts}
    scripts.update({f"consumer{i}": CONSUMER for i in range(consumers)})
    scripts.update({f"curator{i}": CURATOR for i in range(curators)})
    if consumers and logdir is None:
        raise ValueError("consumers need a logdir for their ack logs")
    recorded: dict[int, list[str]] = {}

    def snapshots_unchanged() -> list[str]:
        with Buffer.open(buffer) as buf:
            latest = buf.manifest.latest_seq()
            bad = [f"snapshot {seq} changed" for seq, paths in recorded.items()
                   if [s.path for s in buf.manifest.shards(seq=seq)] != paths]
            recorded[latest] = [s.path for s in buf.manifest.shards(seq=latest)]
        return bad

    def start(host: str) -> subprocess.Popen:
        env = {**os.environ, "ROLLSTORE_HOST_ID": host, "OMP_NUM_THREADS": "1",
               "ROLLSTORE_INTENT_TTL_S": str(intent_ttl),
               "ROLLSTORE_TRIAL_LOG": os.path.join(logdir or os.path.dirname(buffer), "outcomes")}
        if inject and host in hosts:
            env["ROLLSTORE_TRIAL_INJECT"] = str(inject)
        p = subprocess.Popen([sys.executable, "-c", scripts[host].format(root=root, buffer=buffer, logdir=logdir)],
                             env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"simulated host {host} did not start: {p.stderr.read()[-2000:]}")
        return p

    procs = {h: start(h) for h in scripts}
    results = []
    try:
        for trial in range(kills):
            if inject:
                name = None
                while name is None:
                    for h in hosts:
                        if procs[h].poll() is not None:
                            if procs[h].returncode != -signal.SIGKILL:
                                raise RuntimeError(f"simulated host {h} failed: {procs[h].stderr.read()[-2000:]}")
                            said = procs[h].stdout.read().split()
                            host, name = h, f"{h}@{said[-1] if said else '?'}"
                            break
                    else:
                        time.sleep(0.05)
            else:
                host = name = rng.choice(sorted(scripts))
                time.sleep(rng.uniform(0.05, 0.4))
                victim = procs[host]
                if victim.poll() is not None:
                    raise RuntimeError(f"simulated host {host} died by itself: {victim.stderr.read()[-2000:]}")
                victim.send_signal(signal.SIGKILL)
                victim.wait()
            removed = 0
            if collect:
                time.sleep(intent_ttl * 1.2)  # the killed writer's intents expire (the others renew theirs)
            started = time.time()
            held = held_intents(buffer)  # files another dying host still held when this gc began: kept, rightly
            if collect:
                with Buffer.open(buffer) as buf:
                    report = gc(buf, grace_s=0.0)
                removed = -1 if report.data_dirs_skipped else report.orphans_removed
            bad = check(buffer, orphans=started if collect else False, spare=held) + snapshots_unchanged()
            if consumers:
                bad += double_acks(logdir)
            results.append((trial, name, bad, removed))
            if os.environ.get("ROLLSTORE_TRIAL_PROGRESS"):
                print(f"trial {trial}: {name} killed, gc removed {removed}, violations: {bad or 'none'}", flush=True)
            procs[host] = start(host)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    return results


def trained_twice(buffer: str) -> list[str]:
    """Shards trained into one run twice: in the catalog's consumed ledger, or in the checkpoints'
    own rows (their `consumed` JSON), among live checkpoints."""
    import json

    bad = []
    with Buffer.open(buffer) as buf:
        man = buf.manifest
        latest = man.latest_seq()  # the snapshot checked: learners may go on publishing meanwhile
        live = ("FROM consumed c JOIN shards s ON s.shard_id = c.checkpoint_shard_id WHERE c.seq <= ? "
                "AND (s.removed_seq IS NULL OR s.removed_seq > ?)")
        for run, shard, n in man.con.execute(
                f"SELECT c.run_id, c.shard, count(*) {live} GROUP BY c.run_id, c.shard HAVING count(*) > 1",
                (latest, latest)).fetchall():
            bad.append(f"{shard} trained {n} times into {run} (ledger)")
        seen: set[tuple[str, str]] = set()
        for shard in man.shards("checkpoints", seq=latest):
            for row in pq.read_table(os.path.join(buf.root, shard.path), columns=["run_id", "consumed"]).to_pylist():
                for e in json.loads(row["consumed"]):
                    key = (row["run_id"], e["shard"])
                    if key in seen:
                        bad.append(f"{e['shard']} trained twice into {row['run_id']} (checkpoint rows)")
                    seen.add(key)
        ledger = man.con.execute(f"SELECT count(*) {live}", (latest, latest)).fetchone()[0]
        if ledger != len(seen):
            bad.append(f"the consumed ledger holds {ledger} entries, the checkpoints' rows {len(seen)}")
    return bad


def stall_trials(root: str, buffer: str, hosts: list[str], stalls: int, logdir: str, learners: int = 2,
                 ttl: float = 1.0, seed: int = 0, check=None) -> list[tuple[int, str, list[str], int]]:
    """Simulated hosts append (`hosts`) and learners lease, train and publish (`learners`), with
    intents and leases of `ttl` seconds on the database's clock (and its stall cut-off for a
    session idle inside a transaction). `stalls` times one of them is stopped (SIGSTOP) at a random
    moment for longer than the TTL, while another gc runs with no grace; then it is continued
    (SIGCONT) and, after a pause, gc runs again and every invariant is checked (orphans, snapshots,
    no shard trained twice into the run, no shard acked twice). Returns (trial, process stopped,
    violations, orphans gc removed) per trial; the log `logdir/outcomes` says what each stopped
    process met (a fenced commit, a refused publish)."""
    rng = random.Random(seed)
    check = check or check_invariants
    log = os.path.join(logdir, "outcomes")
    scripts = {h: LOOPER for h in hosts}
    scripts.update({f"learner{i}": LEARNER for i in range(learners)})
    recorded: dict[int, list[str]] = {}

    def snapshots_unchanged() -> list[str]:
        with Buffer.open(buffer) as buf:
            latest = buf.manifest.latest_seq()
            bad = [f"snapshot {seq} changed" for seq, paths in recorded.items()
                   if [s.path for s in buf.manifest.shards(seq=seq)] != paths]
            recorded[latest] = [s.path for s in buf.manifest.shards(seq=latest)]
        return bad

    env_base = {**os.environ, "OMP_NUM_THREADS": "1", "ROLLSTORE_INTENT_TTL_S": str(ttl),
                "ROLLSTORE_PG_STALL_S": str(ttl), "ROLLSTORE_TRIAL_LOG": log,
                "ROLLSTORE_TRIAL_LEASE_TTL": str(ttl), "ROLLSTORE_TRIAL_TRAIN_S": str(ttl / 3)}

    def start(host: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", scripts[host].format(root=root, buffer=buffer)],
                             env={**env_base, "ROLLSTORE_HOST_ID": host},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"simulated host {host} did not start: {p.stderr.read()[-2000:]}")
        return p

    procs = {h: start(h) for h in scripts}
    results = []
    try:
        for trial in range(stalls):
            host = rng.choice(sorted(scripts))
            time.sleep(rng.uniform(0.05, 0.5))
            victim = procs[host]
            if victim.poll() is not None:
                raise RuntimeError(f"simulated host {host} died: {victim.stderr.read()[-2000:]}")
            victim.send_signal(signal.SIGSTOP)
            time.sleep(ttl * 1.2)
            with Buffer.open(buffer) as buf:  # another host's gc while it is stopped, past its TTL
                removed = gc(buf, grace_s=0.0).orphans_removed
            time.sleep(ttl * 0.6)
            victim.send_signal(signal.SIGCONT)
            time.sleep(ttl * 0.8)  # it resumes: fenced, refused, or it had nothing in flight
            started = time.time()
            with Buffer.open(buffer) as buf:
                removed += gc(buf, grace_s=0.0).orphans_removed
            bad = check(buffer, orphans=started) + snapshots_unchanged() + trained_twice(buffer) + double_acks(logdir)
            if victim.poll() is not None:
                bad.append(f"{host} died after SIGCONT: {victim.stderr.read()[-500:]}")
                procs[host] = start(host)
            results.append((trial, host, bad, removed))
            if os.environ.get("ROLLSTORE_TRIAL_PROGRESS"):
                print(f"trial {trial}: {host} stopped, gc removed {removed}, violations: {bad or 'none'}", flush=True)
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()
    return results


def stall_outcomes(logdir: str) -> dict[str, int]:
    """Counts of what the stopped processes met: appenders' refused (fenced) commits, learners'
    published and refused checkpoints."""
    counts = {"append refused": 0, "publish refused": 0, "published": 0}
    try:
        with open(os.path.join(logdir, "outcomes")) as f:
            for line in f:
                _who, what = line.split(" ", 2)[:2]
                if what == "published":
                    counts["published"] += 1
                elif what == "lease-failed":
                    counts["lease failed (session cut off)"] = counts.get("lease failed (session cut off)", 0) + 1
                elif line.split(" ", 1)[0].startswith("learner"):
                    counts["publish refused"] += 1
                else:
                    counts["append refused"] += 1
    except FileNotFoundError:
        pass
    return counts


def held_intents(buffer: str) -> set[str]:
    """The paths live intents hold now (a catalog with intents; else none)."""
    with Buffer.open(buffer) as buf:
        if not buf.manifest.multi_host:
            return set()
        return {r[0] for r in buf.manifest.con.execute(
            "SELECT path FROM intents WHERE expires_at > extract(epoch FROM clock_timestamp())")}


def unnamed_files(buf: Buffer, older_than: float | None = None, spare: set[str] | frozenset = frozenset()) -> list[str]:
    """The .parquet files of the data folders that no catalog row names, read under the writers' lock
    held exclusively (no writer is then between a file and its commit): orphans. `older_than`: only
    files last modified before then (a gc that started then keeps younger ones, rightly: another
    host may have died after it started; the next gc takes them)."""
    from rollstore.storage.writelock import collecting

    if buf.manifest.multi_host:
        # a catalog with write intents: files listed first, then the rows and live intents read (one
        # statement); a file neither names is an orphan (no live writer holds an intent on it)
        found = []
        for top in DATA_DIRS:
            for dirpath, _dirs, files in os.walk(os.path.join(buf.root, top)):
                found += [os.path.relpath(os.path.join(dirpath, n), buf.root) for n in files if n.endswith(".parquet")]
        held = buf.manifest.protected(found)
        return [f"{p}: no row names it and no live intent holds it" for p in found
                if p not in held and p not in spare
                and os.path.exists(os.path.join(buf.root, p))
                and (older_than is None or os.path.getmtime(os.path.join(buf.root, p)) < older_than)]
    with collecting(buf.root, 30.0, buf.manifest) as held:
        if not held:
            return ["(writers held the writers' lock for 30 s: orphans not checked)"]
        known = buf.manifest.all_paths()
        found = []
        for top in DATA_DIRS:
            for dirpath, _dirs, files in os.walk(os.path.join(buf.root, top)):
                found += [os.path.relpath(os.path.join(dirpath, n), buf.root) for n in files if n.endswith(".parquet")]
        return [f"{p}: no row names it" for p in found if p not in known
                and (older_than is None or os.path.getmtime(os.path.join(buf.root, p)) < older_than)]


_READ: dict[tuple, tuple[int, str, list[str]]] = {}  # (path, inode, size, mtime) -> (size, sha256, rollout ids)


def check_invariants(buffer: str, orphans: bool | float = False, spare: set[str] | None = None) -> list[str]:
    """Every violation found (empty: all hold):
    - every live row's file exists, with the size and sha256 the catalog records;
    - no rollout_id in two live rows (read from the shards), and `rollout_ids` names exactly them;
    - commit seqs are exactly 1..latest, and every shard's added/removed seq is one of them;
    - no shard path twice among the rows;
    - (`orphans`, right after a gc: True, or the time that gc started) no .parquet file of the data
      folders that no row names and no live intent holds (modified before that time; `spare`: the
      paths live intents held when that gc began, which it rightly kept: a host that died less
      than a TTL before it)."""
    bad: list[str] = []
    with Buffer.open(buffer) as buf:
        man = buf.manifest
        if orphans is not False:
            bad += unnamed_files(buf, None if orphans is True else float(orphans), spare or set())
        latest = man.latest_seq()  # the snapshot checked: writers may go on committing meanwhile
        if man.store is not None:  # shards in object storage: into this host's cache, verified
            from rollstore.storage.snapshot import TABLES

            snap = buf.snapshot(latest)
            for table in TABLES:
                snap.files(table)
        seqs = [r[0] for r in man.con.execute("SELECT seq FROM commits WHERE seq <= ? ORDER BY seq", (latest,))]
        if seqs != list(range(1, latest + 1)):
            bad.append(f"commit seqs not contiguous: {seqs[:5]}... ({len(seqs)} commits, max {max(seqs, default=0)})")
        rows = man.con.execute("SELECT path, added_seq, removed_seq FROM shards WHERE added_seq <= ?",
                               (latest,)).fetchall()
        paths = [r[0] for r in rows]
        if len(paths) != len(set(paths)):
            bad.append("a shard path is named twice")
        for path, added, removed in rows:
            if not 1 <= added <= latest or (removed is not None and removed <= added):
                bad.append(f"{path}: seqs {added}..{removed} outside 1..{latest}")
        seen: set[str] = set()
        for shard in man.shards(seq=latest):
            full = os.path.join(buf.root, shard.path)
            try:
                st = os.stat(full)
            except FileNotFoundError:
                bad.append(f"{shard.path}: live row, no file")
                continue
            # a file already read as it is now (same inode, size, mtime) is not hashed again
            key = (full, st.st_ino, st.st_size, st.st_mtime_ns)
            if key not in _READ:
                with open(full, "rb") as f:
                    data = f.read()
                ids = (pq.read_table(full, columns=["rollout_id"]).column("rollout_id").to_pylist()
                       if shard.table_name == "rollouts" else [])
                _READ[key] = (len(data), hashlib.sha256(data).hexdigest(), ids)
            size, digest, ids = _READ[key]
            if size != shard.bytes or digest != shard.sha256:
                bad.append(f"{shard.path}: size or sha256 differs from the catalog")
            if shard.table_name == "rollouts":
                for rid in ids:
                    if rid in seen:
                        bad.append(f"rollout_id {rid} twice")
                    seen.add(rid)
        registered = {r[0] for r in man.con.execute(
            "SELECT r.rollout_id FROM rollout_ids r JOIN shards s ON s.shard_id = r.shard_id WHERE s.added_seq <= ?",
            (latest,))}
        if registered != seen:
            bad.append(f"rollout_ids holds {len(registered)} ids, the live shards {len(seen)}")
        if man.store is not None:
            bad += _objects_hold(buf, latest, orphans, spare or set())
    return bad


_VERIFIED: set[tuple[str, str]] = set()  # (bucket url, path) of live objects already downloaded and verified
_CHECK_CACHE: list[str] = []


def _objects_hold(buf: Buffer, latest: int, orphans: bool | float, spare: set[str]) -> list[str]:
    """A store's buffer: every live row's object is in the bucket with the catalog's size and sha256
    (downloaded once into a cache of the checker's own, verified while it streams); with `orphans`,
    no object of the data folders that no row names and no live intent holds (modified before that
    time), listed before the catalog is read."""
    import tempfile

    from rollstore.storage.errors import ManifestError

    store, bad = buf.manifest.store, []
    if not _CHECK_CACHE:
        _CHECK_CACHE.append(tempfile.mkdtemp(prefix="rollstore-check-cache-"))
    listed = [(rel, modified) for rel, modified, _ in store.list()
              if rel.split("/", 1)[0] in DATA_DIRS and rel.endswith(".parquet")]
    for shard in buf.manifest.shards(seq=latest):
        if (store.url, shard.path) in _VERIFIED:
            continue
        try:
            store.fetch(_CHECK_CACHE[0], shard.path, shard.sha256, shard.bytes)
            _VERIFIED.add((store.url, shard.path))
        except ManifestError as exc:
            bad.append(f"object {shard.path}: {exc}")
    if orphans is not False:
        held = buf.manifest.protected([rel for rel, _ in listed])
        bad += [f"object {rel}: no row names it and no live intent holds it" for rel, modified in listed
                if rel not in held and rel not in spare and (orphans is True or modified < float(orphans))]
    return bad


if __name__ == "__main__":  # more trials than the suite runs: python tests/multihost.py --kills 30
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description="kill -9 trials of simulated hosts on a PostgreSQL-cataloged buffer")
    ap.add_argument("--kills", type=int, default=30)
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--consumers", type=int, default=0)
    ap.add_argument("--curators", type=int, default=0)
    ap.add_argument("--inject", type=float, default=0.0,
                    help="appenders kill themselves at chosen points with this probability per append")
    ap.add_argument("--stalls", type=int, default=0,
                    help="instead of kills: stop (SIGSTOP) an appender or a learner past its TTL this many times")
    ap.add_argument("--learners", type=int, default=2)
    ap.add_argument("--ttl", type=float, default=1.0, help="intent and lease TTL of the stall trials (seconds)")
    ap.add_argument("--s3", action="store_true",
                    help="the buffer's shards in S3 (moto's server on 127.0.0.1; the simulated hosts share one cache folder)")
    ap.add_argument("--progress", action="store_true", help="print each trial's outcome as it ends")
    args = ap.parse_args()
    if args.progress:
        os.environ["ROLLSTORE_TRIAL_PROGRESS"] = "1"
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import pg_server

    server = pg_server.start()
    s3 = None
    if args.s3:
        import s3_server

        s3 = s3_server.start()
        os.environ.update(s3_server.environment(s3))
    try:
        with tempfile.TemporaryDirectory(prefix="rollstore-trials-") as work:
            buffer = os.path.join(work, "buf")
            Buffer.init(buffer, catalog=server.fresh_dsn(), data=s3.fresh_url() if s3 else None).close()
            t0 = time.monotonic()
            if args.stalls:
                results = stall_trials(os.path.dirname(here), buffer, [f"h{i}" for i in range(args.hosts)],
                                       args.stalls, work, learners=args.learners, ttl=args.ttl, seed=args.seed)
                time.sleep(args.ttl * 1.2)  # every process is stopped: gc must then take every orphan
                with Buffer.open(buffer) as buf:
                    gc(buf, grace_s=0.0)
                final = check_invariants(buffer, orphans=True) + trained_twice(buffer)
                with Buffer.open(buffer) as buf:
                    commits = buf.manifest.latest_seq()
                    checkpoints = len(buf.manifest.shards("checkpoints"))
                failed = [(t, h, bad) for t, h, bad, _ in results if bad]
                kinds: dict[str, int] = {}
                for _, h, _, _ in results:
                    kinds[h.rstrip("0123456789")] = kinds.get(h.rstrip("0123456789"), 0) + 1
                print(f"stopped: {kinds}; what they met on SIGCONT: {stall_outcomes(work)}; "
                      f"{checkpoints} checkpoints published")
                print(f"{len(results)} stall trials over {args.hosts} simulated hosts + {args.learners} learners, "
                      f"{commits} commits, {time.monotonic() - t0:.0f} s: {len(failed)} with a violated invariant; "
                      f"gc removed {sum(r for *_, r in results)} orphans; final check: {final or 'all hold'}")
                for t, h, bad in failed:
                    print(f"  trial {t} ({h} stopped): {bad}")
                sys.exit(1 if failed or final else 0)
            results = kill_trials(os.path.dirname(here), buffer, [f"h{i}" for i in range(args.hosts)], args.kills,
                                  args.seed, consumers=args.consumers, curators=args.curators, logdir=work,
                                  inject=args.inject, intent_ttl=args.ttl)
            time.sleep(args.ttl * 1.2)  # every process is stopped: their intents expire, gc must take every orphan
            with Buffer.open(buffer) as buf:
                gc(buf, grace_s=0.0)
            final = check_invariants(buffer, orphans=True)
            with Buffer.open(buffer) as buf:
                commits = buf.manifest.latest_seq()
            failed = [(t, h, bad) for t, h, bad, _ in results if bad]
            removed = sum(r for *_, r in results if r > 0)
            skipped = sum(1 for *_, r in results if r < 0)
            kinds = {}
            for _, h, _, _ in results:
                kind = h.split("@")[1] if "@" in h else h.rstrip("0123456789")
                kinds[kind] = kinds.get(kind, 0) + 1
            with Buffer.open(buffer) as buf:
                curations = len(buf.manifest.shards("curations"))
                acked = buf.manifest.con.execute("SELECT count(*) FROM leases WHERE acked_at IS NOT NULL").fetchone()[0]
            print(f"killed: {kinds}; {curations} curations committed, {acked} shards acked; live appenders' "
                  f"commits refused as fenced (a heartbeat later than the TTL): {stall_outcomes(work)['append refused']}")
            print(f"{len(results)} kill trials over {args.hosts} simulated hosts, {commits} commits, "
                  f"{time.monotonic() - t0:.0f} s: {len(failed)} with a violated invariant; gc after each kill "
                  f"removed {removed} orphans ({skipped} times kept out by writers); final check: "
                  f"{final or 'all hold'}")
            for t, h, bad in failed:
                print(f"  trial {t} ({h} killed): {bad}")
            sys.exit(1 if failed or final else 0)
    finally:
        server.stop()
        if s3 is not None:
            s3.stop()
