"""A buffer whose shards live in S3-compatible storage (issue 36, item 5, a first slice): a
PostgreSQL catalog, objects written with put-if-absent (If-None-Match: *) against moto's server on
127.0.0.1, the writer's sha256 in the catalog, and a host-local read cache verified by sha256.

Each simulated host is its own buffer folder (descriptor + cache) joined to one catalog and bucket.
Skips with one line when PostgreSQL or moto's server is missing.
"""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest

import s3_server
from conftest import serving
from multihost import check_invariants
from rollstore.storage.buffer import Buffer, Part
from rollstore.storage.descriptor import read as read_descriptor
from rollstore.storage.errors import ManifestError
from rollstore.builtin.synthetic import rollouts_table


@pytest.fixture(scope="module")
def s3():
    yield from serving(s3_server, "S3 store tests")


@pytest.fixture
def env(s3, monkeypatch):
    for k, v in s3_server.environment(s3).items():
        monkeypatch.setenv(k, v)
    return s3


def _rollouts(step: int, run_id: str = "run0"):
    return rollouts_table(n_groups=2, group_size=2, mean_tokens=4, step=step, run_id=run_id)


def _objects(s3, url: str) -> dict[str, bytes]:
    bucket, prefix = url[5:].split("/", 1)
    c = s3.client()
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=bucket).get("Contents", [])]
    return {k[len(prefix) + 1:]: c.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys if k.startswith(prefix + "/")}


def test_appends_go_to_the_store_and_another_host_reads_them_through_its_verified_cache(pg, env, cli, tmp_path):
    dsn, url = pg.fresh_dsn(), env.fresh_url()
    a, b = str(tmp_path / "host-a"), str(tmp_path / "host-b")
    res = cli("init", a, "--catalog", dsn, "--data", url)
    assert res.code == 0, res.stderr
    assert read_descriptor(a).data == url
    with Buffer.open(a) as buf:
        shards = [buf.append_rollouts(_rollouts(step)) for step in range(3)]
    objects = _objects(env, url)
    import hashlib

    for s in shards:  # each object is the writer's file, its sha256 the catalog's
        assert hashlib.sha256(objects[s.path]).hexdigest() == s.sha256 and len(objects[s.path]) == s.bytes
    assert cli("init", b, "--catalog", dsn, "--data", url).code == 0  # another host joins the buffer
    assert read_descriptor(b).buffer_uuid == read_descriptor(a).buffer_uuid
    assert not os.path.exists(os.path.join(b, shards[0].path))
    with Buffer.open(b) as buf:
        snap = buf.snapshot()
        files = snap.files("rollouts")  # downloaded into b's cache, verified
        assert [open(f, "rb").read() for f in files] == [objects[s.path] for s in shards]
        assert snap.arrow("rollouts").to_table().num_rows == 12
        buf.append_rollouts(_rollouts(0, run_id="from-b"))
    res = cli("sql", a, "SELECT count(*) AS n FROM rollouts", "--format", "csv")  # b's shard reaches a's cache
    assert res.code == 0 and res.stdout.split()[-1] == "16", res.stdout + res.stderr
    assert check_invariants(b) == []


def test_a_changed_object_is_never_cached(pg, env, tmp_path):
    dsn, url = pg.fresh_dsn(), env.fresh_url()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with Buffer.init(a, catalog=dsn, data=url) as buf:
        shard = buf.append_rollouts(_rollouts(0))
    bucket, prefix = url[5:].split("/", 1)
    env.client().put_object(Bucket=bucket, Key=f"{prefix}/{shard.path}", Body=b"PAR1 not what was committed")
    with Buffer.init(b, catalog=dsn, data=url) as buf:
        with pytest.raises(ManifestError, match="the catalog records .* not cached") as err:
            buf.snapshot().files("rollouts")
        assert len(str(err.value).splitlines()) == 1
    assert not os.path.exists(os.path.join(b, shard.path)) and os.listdir(os.path.join(b, "tmp")) == []


def test_two_writers_of_one_key_one_wins_and_its_object_stays(pg, env, tmp_path):
    """Two hosts finishing one deterministic path (a curation's): put-if-absent lets one object in;
    the second writer gets FileExistsError and commits nothing; an object no row names (a crashed
    writer's) is replaced by the writer that holds the key's intent."""
    dsn, url = pg.fresh_dsn(), env.fresh_url()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    table = _rollouts(0)
    rids, gids = table.column("rollout_id").to_pylist(), table.column("group_id").to_pylist()

    def register(buf):
        return lambda con, seq, ids: buf.manifest.register_rollouts(con, ids[0], zip(rids, gids), sorted(set(gids)))

    with Buffer.init(a, catalog=dsn, data=url) as one, Buffer.init(b, catalog=dsn, data=url) as two:
        bucket, prefix = url[5:].split("/", 1)
        env.client().put_object(Bucket=bucket, Key=f"{prefix}/rollouts/same.parquet", Body=b"a crashed writer's")
        _, (shard,) = one.commit([Part("rollouts", table, name="same")], "e", on_commit=register(one))
        first = _objects(env, url)["rollouts/same.parquet"]
        with pytest.raises(FileExistsError):
            two.commit([Part("rollouts", table.slice(0, 2), name="same")], "e", on_commit=register(two))
        assert two.manifest.latest_seq() == 1 and _objects(env, url)["rollouts/same.parquet"] == first
        import hashlib

        assert hashlib.sha256(first).hexdigest() == shard.sha256
        assert not os.path.exists(os.path.join(b, "rollouts", "same.parquet"))
    assert check_invariants(b) == []


def test_a_bucket_without_conditional_writes_is_refused_before_anything_is_written(pg, env, cli, tmp_path, monkeypatch):
    import rollstore.storage.store as store

    real = store.S3Store.put_if_absent

    def ignores_the_condition(self, rel, local):
        with open(local, "rb") as body:
            self.client.put_object(Bucket=self.bucket, Key=self.key(rel), Body=body)

    monkeypatch.setattr(store.S3Store, "put_if_absent", ignores_the_condition)
    folder = tmp_path / "b"
    with pytest.raises(ManifestError, match="does not refuse a second put-if-absent"):
        Buffer.init(str(folder), catalog=pg.fresh_dsn(), data=env.fresh_url())
    assert not folder.exists()
    monkeypatch.setattr(store.S3Store, "put_if_absent", real)
    res = cli("init", folder, "--catalog", pg.fresh_dsn(), "--data", "s3://no-such-bucket-rs/x")
    assert res.code == 1 and len(res.stderr.strip().splitlines()) == 1 and "nothing was written" in res.stderr
    res = cli("init", folder, "--data", env.fresh_url())
    assert res.code == 1 and "needs a catalog" in res.stderr
    assert not folder.exists()


def test_d3s_on_an_s3_buffer_from_a_cold_cache_is_the_embedded_buffers_curation(pg, env, tmp_path):
    """The same rows in an embedded buffer and in a PostgreSQL + S3 buffer, curated on another host
    whose cache is empty: the same curation id, byte-identical audit shards, the same curated rows,
    and the curated and audit objects in the bucket are the files the catalog names."""
    import hashlib

    import pyarrow as pa

    import rollstore as rs

    tables = [rollouts_table(n_groups=4, group_size=2, mean_tokens=4, step=step, run_id="run0") for step in range(3)]
    dsn, url = pg.fresh_dsn(), env.fresh_url()
    embedded, writer, curator = str(tmp_path / "embedded"), str(tmp_path / "writer"), str(tmp_path / "curator")
    results = {}
    for root, where in ((embedded, embedded), (writer, curator)):
        Buffer.init(root, catalog=None if root == embedded else dsn, data=None if root == embedded else url).close()
        with Buffer.open(root) as buf:
            order = [buf.append_rollouts(t).path for t in tables]
        if where != root:
            Buffer.init(where, catalog=dsn, data=url).close()  # another host joins: its cache is empty
        cur = rs.open(where).curate("d3s")
        with Buffer.open(where) as buf:
            audit = sorted(s.sha256 for s in buf.manifest.shards("selections"))
            files = buf.snapshot().files("curated")
            curated = pa.concat_tables(pq.read_table(f) for f in files)
            named = {s.path: s.sha256 for s in buf.manifest.shards() if s.table_name in ("curated", "selections")}
        position = pa.array([order.index(p) for p in curated.column("rollouts_shard").to_pylist()])
        curated = curated.set_column(curated.schema.get_field_index("rollouts_shard"), "rollouts_shard", position)
        results[root] = (cur.id, audit, curated.replace_schema_metadata(None), named)
    (id_e, audit_e, cur_e, _), (id_s, audit_s, cur_s, named) = results[embedded], results[writer]
    assert id_e == id_s and audit_e == audit_s and audit_e
    assert cur_e.num_rows > 0 and cur_e.equals(cur_s)
    objects = _objects(env, url)
    assert {p: hashlib.sha256(objects[p]).hexdigest() for p in named} == named
    assert check_invariants(writer) == []


def test_a_checkpoint_publishes_to_the_store_and_another_host_loads_it_verified(pg, env, tmp_path):
    """A checkpoint of an S3 buffer: its files go to the store with put-if-absent under keys of their
    own (never renamed), each with the writer's sha256 named in the publishing commit; another host
    loads it through its cache bit-exactly; a changed object is refused (one line, nothing cached);
    gc keeps the named objects and deletes a crashed save's (no row, no live intent)."""
    import hashlib

    import torch

    import rollstore.storage.maintenance as maintenance
    from learner_util import tiny_llama
    from rollstore.learner.checkpoint import CheckpointError, Publish, list_checkpoints, load_checkpoint, save_checkpoint
    from rollstore.storage.store import ObjectDamaged

    dsn, url = pg.fresh_dsn(), env.fresh_url()
    a, b, c = (str(tmp_path / h) for h in "abc")
    model = tiny_llama(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Buffer.init(a, catalog=dsn, data=url) as buf:
        ck = save_checkpoint(buf, model, opt, publish=Publish(version=1, run_id="run", consumed=[], step=7))
        named = buf.manifest.objects_under(ck.path + "/")
    assert ck.path.startswith("checkpoints/v1-") and not os.path.exists(os.path.join(a, "tmp", "ckpt"))
    objects = _objects(env, url)
    assert {"model.safetensors", "trainer_state.pt", "ledger.json"} <= {k.rsplit("/", 1)[1] for k, _, _ in named}
    for key, digest, nbytes in named:  # each object is the file the writer hashed
        assert hashlib.sha256(objects[key]).hexdigest() == digest and len(objects[key]) == nbytes
    with Buffer.init(b, catalog=dsn, data=url) as buf:  # another host, a cold cache
        (listed,) = list_checkpoints(buf)
        fresh = tiny_llama(1)
        got = load_checkpoint(buf, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3), version=1)
        assert got.step == 7 and os.path.isdir(os.path.join(b, listed.path))
        assert all(torch.equal(x, y) for x, y in zip(model.state_dict().values(), fresh.state_dict().values()))
    bucket, prefix = url[5:].split("/", 1)
    ledger_key = next(k for k, _, _ in named if k.endswith("ledger.json"))
    env.client().delete_object(Bucket=bucket, Key=f"{prefix}/{ledger_key}")
    env.client().put_object(Bucket=bucket, Key=f"{prefix}/{ledger_key}", Body=b'{"version": 1, "consumed": []}')
    with Buffer.init(c, catalog=dsn, data=url) as buf:  # a third host: the changed object is never cached
        with pytest.raises(ObjectDamaged) as err:
            load_checkpoint(buf, tiny_llama(2), version=1)
        assert len(str(err.value).splitlines()) == 1 and ledger_key in str(err.value)
        assert not os.path.exists(os.path.join(c, ledger_key))
        # a save that crashed after its uploads (no row names them, its intents expired): gc deletes them
        env.client().put_object(Bucket=bucket, Key=f"{prefix}/checkpoints/v2-crashed/model.safetensors", Body=b"x")
        maintenance.gc(buf, grace_s=0)
        left = _objects(env, url)
        assert "checkpoints/v2-crashed/model.safetensors" not in left
        assert {k for k, _, _ in named} <= set(left)
        with pytest.raises(CheckpointError, match="already exists"):
            save_checkpoint(buf, model, publish=Publish(version=1, run_id="other", consumed=[]))
        assert [k.path for k in list_checkpoints(buf)] == [ck.path]


def test_train_and_generate_on_other_hosts_of_an_s3_buffer(pg, env, cli, tmp_path):
    """The commands on three hosts of one PostgreSQL + S3 buffer: a curation made on host a is trained
    on host b from its cold cache (curated and referenced rollouts shards fetched, verified), and
    host c generates from that checkpoint by name (`--model checkpoint:latest`), stamped with its
    version."""
    dsn, url = pg.fresh_dsn(), env.fresh_url()
    a, b, c = (str(tmp_path / h) for h in "abc")
    for host in (a, b, c):
        assert cli("init", host, "--catalog", dsn, "--data", url).code == 0
    assert cli("generate", a, "--num-prompts", "4", "--group-size", "4").code == 0
    res = cli("curate", a, "-r", "grpo")
    assert res.code == 0, res.stderr
    res = cli("train", b, "--micro-batch-size", "8")
    assert res.code == 0, res.stderr
    assert "v1: trained 1 shard(s)" in res.stdout
    res = cli("generate", c, "--model", "checkpoint:latest", "--num-prompts", "2", "--group-size", "2")
    assert res.code == 0, res.stderr
    with Buffer.open(c) as buf:
        rows = buf.snapshot().arrow("rollouts").to_table(columns=["policy_version"]).column(0).to_pylist()
    assert sorted(set(rows)) == [0, 1]
    res = cli("generate", c, "--model", "checkpoint:9", "--num-prompts", "2")
    assert res.code != 0 and "no such checkpoint" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_gc_deletes_orphan_objects_and_retired_shards_objects(pg, env, tmp_path):
    """gc of an S3 buffer: an object no row names and no live intent holds (a crashed writer's) is
    deleted, as are the objects of shards compaction retired (no pin holds them); every committed
    object stays, and the merged shard reads the same rows from another host's cold cache."""
    import rollstore.storage.maintenance as maintenance

    dsn, url = pg.fresh_dsn(), env.fresh_url()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with Buffer.init(a, catalog=dsn, data=url) as buf:
        old = [buf.append_rollouts(_rollouts(step)) for step in range(3)]
        rows = buf.snapshot().arrow("rollouts").to_table().num_rows
    bucket, prefix = url[5:].split("/", 1)
    env.client().put_object(Bucket=bucket, Key=f"{prefix}/rollouts/orphan.parquet", Body=b"PAR1 a crashed writer's")
    with Buffer.init(b, catalog=dsn, data=url) as buf:
        assert maintenance.compact(buf).merged_shards == 3  # from b's cold cache
        report = maintenance.gc(buf, grace_s=0.0)
        assert report.retired_removed == 3 and report.orphans_removed >= 1
        live = {s.path for s in buf.manifest.shards()}
    objects = _objects(env, url)
    objects.pop("buffer.id")  # the prefix's identity marker (storage/verify.py), never collected
    assert set(objects) == live and not {s.path for s in old} & set(objects)
    with Buffer.init(str(tmp_path / "c"), catalog=dsn, data=url) as buf:
        assert buf.snapshot().arrow("rollouts").to_table().num_rows == rows
    assert check_invariants(b) == []


def test_verify_on_another_host_checks_the_objects_through_its_cache(pg, env, cli, tmp_path):
    """`rollstore verify` on a host whose cache is empty downloads and checks every shard (clean);
    an object changed in the bucket is reported (never cached), and an unreachable store is one
    line, never a shard reported missing (so --quarantine never retires a healthy shard)."""
    dsn, url = pg.fresh_dsn(), env.fresh_url()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with Buffer.init(a, catalog=dsn, data=url) as buf:
        shards = [buf.append_rollouts(_rollouts(step)) for step in range(2)]
    assert cli("init", b, "--catalog", dsn, "--data", url).code == 0
    res = cli("verify", b)
    assert res.code == 0, res.stdout + res.stderr
    bucket, prefix = url[5:].split("/", 1)
    env.client().put_object(Bucket=bucket, Key=f"{prefix}/{shards[1].path}", Body=b"PAR1 changed")
    c = str(tmp_path / "c")
    assert cli("init", c, "--catalog", dsn, "--data", url).code == 0
    res = cli("verify", c)
    assert res.code != 0 and shards[1].path in res.stdout + res.stderr
    import os as _os

    d = str(tmp_path / "d")
    assert cli("init", d, "--catalog", dsn, "--data", url).code == 0
    old = _os.environ["AWS_ENDPOINT_URL"]
    _os.environ["AWS_ENDPOINT_URL"] = "http://127.0.0.1:1"
    try:
        res = cli("verify", d, "--quarantine")
    finally:
        _os.environ["AWS_ENDPOINT_URL"] = old
    assert res.code == 1 and "cannot read" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    with Buffer.open(a) as buf:
        assert len(buf.manifest.shards("rollouts")) == 2  # nothing retired


def test_the_cache_is_trimmed_least_recently_used_first_and_refetched_verified(pg, env, cli, tmp_path):
    """`trim_cache` (`rollstore gc --cache-max`): cached copies of the store's files go, least recently
    used first, never one used within the grace period nor a file no row names (gc's); a read after
    it fetches them again, verified, and reads the same rows. An embedded buffer has no cache: one line."""
    import time

    import rollstore.storage.maintenance as maintenance
    from rollstore.storage.errors import RollstoreError

    dsn, url = pg.fresh_dsn(), env.fresh_url()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with Buffer.init(a, catalog=dsn, data=url) as buf:
        shards = [buf.append_rollouts(_rollouts(step)) for step in range(4)]
    with Buffer.init(b, catalog=dsn, data=url) as buf:
        before = buf.snapshot().arrow("rollouts").to_table().sort_by("rollout_id")
        copies = [os.path.join(b, s.path) for s in shards]
        for age, path in zip((400, 300, 200, 100), copies):  # the first was used longest ago
            os.utime(path, (time.time() - age, time.time() - age))
        stray = os.path.join(b, "rollouts", "not-named.parquet")
        open(stray, "wb").close()
        os.utime(stray, (time.time() - 1000, time.time() - 1000))
        keep = sum(s.bytes for s in shards[2:])
        r = maintenance.trim_cache(buf, keep, grace_s=150)
        assert (r.files_removed, r.bytes_left) == (2, keep)
        assert [os.path.exists(p) for p in copies] == [False, False, True, True] and os.path.exists(stray)
        r = maintenance.trim_cache(buf, 0, grace_s=150)  # the one used 100 s ago is within the grace period
        assert [os.path.exists(p) for p in copies] == [False, False, False, True]
        assert r.bytes_left == shards[3].bytes
        after = buf.snapshot().arrow("rollouts").to_table().sort_by("rollout_id")
        assert after.equals(before) and all(os.path.exists(p) for p in copies)
    res = cli("gc", b, "--cache-max", "1GB")
    assert res.code == 0 and "cache: removed 0 cached copies" in res.stdout
    with Buffer.init(str(tmp_path / "embedded")) as buf:
        with pytest.raises(RollstoreError, match="no cache to trim"):
            maintenance.trim_cache(buf, 0)
