"""Every validation rule of docs/schema.md §Validation at append, fed as a bad JSONL or Parquet
file through `rollstore import`.

Each rejected import must exit non-zero with ONE error line naming the file, the offending row's
rollout_id and the column, and must leave the buffer exactly as it was (same manifest shards, same
row count, no new file in rollouts/ or tmp/).
"""

from __future__ import annotations

import math
import os
import subprocess

import pyarrow as pa
import pytest

from conftest import ROLLSTORE_BIN
from rollstore.builtin.synthetic import RowOptions, rollouts_table
from rollstore.storage.buffer import Buffer
from rollstore.storage.schema import ROLLOUTS

# A schema with every field nullable, so that bad files (nulls where banned) can be written.
LOOSE = pa.schema([f.with_nullable(True) for f in ROLLOUTS])


def good_rows(n_groups: int = 3, group_size: int = 4, prefix: str = "new") -> list[dict]:
    return rollouts_table(n_groups=n_groups, group_size=group_size, mean_tokens=6, seed=1,
                          options=RowOptions(id_prefix=prefix)).to_pylist()


def seed(root: str) -> str:
    """A buffer holding one shard: groups old-g0 and old-g1 (rollouts old-g<g>-<i>)."""
    with Buffer.init(root) as buf:
        buf.append_rollouts(rollouts_table(n_groups=2, group_size=4, mean_tokens=6, options=RowOptions(id_prefix="old")))
    return root


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """One seeded buffer shared by the tests whose imports must all be rejected (so it never changes)."""
    return seed(str(tmp_path_factory.mktemp("validation") / "buf"))


@pytest.fixture
def fresh(tmp_path):
    """A seeded buffer of its own, for tests whose imports are accepted."""
    return seed(str(tmp_path / "buf"))


def state(root: str):
    with Buffer.open(root) as buf:
        shards = [(s.shard_id, s.path, s.rows, s.sha256) for s in buf.manifest.shards()]
        seq = buf.manifest.latest_seq()
        ids = buf.manifest.con.execute("SELECT count(*) FROM rollout_ids").fetchone()[0]
    files = sorted(os.listdir(os.path.join(root, "rollouts"))) + sorted(os.listdir(os.path.join(root, "tmp")))
    return shards, seq, ids, files


def write(rows: list[dict], tmp_path, fmt: str, schema: pa.Schema | None = None, name: str = "bad"):
    from conftest import write_jsonl, write_parquet

    path = tmp_path / f"{name}.{fmt}"
    if fmt == "jsonl":
        return write_jsonl(rows, path)
    return write_parquet(pa.Table.from_pylist(rows, schema=schema or LOOSE), path)


def assert_rejected(cli, root, path, rid, column, words=()):
    before = state(root)
    res = cli("import", root, path)
    assert res.code != 0, res.stdout
    line = res.stderr.strip()
    assert "\n" not in line, f"not one line: {res.stderr!r}"
    assert line.startswith("error:"), line
    assert path in line, line
    if rid is not None:
        assert f"rollout_id={rid!r}" in line, line
    assert f"column {column!r}" in line, line
    for w in words:
        assert w.lower() in line.lower(), line
    assert state(root) == before, "a rejected import changed the buffer"
    return line


# ---- mutations: (rows) -> (expected rollout_id, expected column) -----------------------------

def drop_column(col):
    def f(rows):
        for r in rows:
            del r[col]
        return None, col
    return f


def set_value(row, col, value):
    def f(rows):
        rows[row][col] = value
        return rows[row]["rollout_id"], col
    return f


def shorten(row, col):
    def f(rows):
        rows[row][col] = rows[row][col][:-1]
        return rows[row]["rollout_id"], col
    return f


def set_token(row, col, value, pos=0):
    def f(rows):
        rows[row][col] = list(rows[row][col])
        rows[row][col][pos] = value
        return rows[row]["rollout_id"], col
    return f


def null_element_beside_null_list(rows):
    rows[0]["old_logprobs"] = None  # a nullable list column with a null list AND a null element
    return set_token(3, "old_logprobs", None)(rows)


def dup_rollout_in_file(rows):
    rows[5]["rollout_id"] = rows[1]["rollout_id"]
    return rows[1]["rollout_id"], "rollout_id"


def dup_rollout_in_buffer(rows):
    rows[6]["rollout_id"] = "old-g1-2"
    return "old-g1-2", "rollout_id"


def dup_sample_idx(rows):
    rows[2]["sample_idx"] = rows[0]["sample_idx"]  # rows 0..3 are group 0
    return rows[2]["rollout_id"], "sample_idx"


def group_in_buffer(rows):
    # group 1 of the file (rows 4..7) claims to be the buffer's group old-g1 with new sample_idx
    for i, r in enumerate(rows[4:8]):
        r["group_id"], r["sample_idx"] = "old-g1", 4 + i
    return rows[4]["rollout_id"], "group_id"


def disagree(col, value):
    def f(rows):
        rows[6][col] = value  # row 6 is in group 1 (rows 4..7)
        return rows[6]["rollout_id"], col
    return f


CASES = {
    "missing required column reward": (drop_column("reward"), ("jsonl", "parquet"), ["missing"]),
    "missing required column gen_logprobs": (drop_column("gen_logprobs"), ("jsonl", "parquet"), ["missing"]),
    "wrong type reward string": (set_value(5, "reward", "high"), ("jsonl", "parquet"), []),
    "wrong type sample_idx fractional": (set_value(3, "sample_idx", 1.5), ("jsonl", "parquet"), []),
    "wrong type token ids strings": (set_token(7, "response_token_ids", "x"), ("jsonl",), []),
    "wrong type created_at": (set_value(2, "created_at", "yesterday"), ("jsonl",), []),
    "null rollout_id": (set_value(4, "rollout_id", None), ("jsonl", "parquet"), ["null"]),
    "null prompt_id": (set_value(6, "prompt_id", None), ("jsonl", "parquet"), ["null"]),
    "null gen_logprobs": (set_value(3, "gen_logprobs", None), ("jsonl", "parquet"), ["null"]),
    "null reward": (set_value(9, "reward", None), ("jsonl", "parquet"), ["null"]),
    "null finish_reason": (set_value(1, "finish_reason", None), ("parquet",), ["null"]),
    "null element in old_logprobs": (set_token(2, "old_logprobs", None), ("jsonl", "parquet"), ["null"]),
    "null element next to a null list": (null_element_beside_null_list, ("jsonl", "parquet"), ["null element"]),
    "length gen_logprobs": (shorten(2, "gen_logprobs"), ("jsonl", "parquet"), ["response_token_ids"]),
    "length old_logprobs": (shorten(4, "old_logprobs"), ("jsonl", "parquet"), ["response_token_ids"]),
    "length entropies": (shorten(7, "entropies"), ("jsonl", "parquet"), ["response_token_ids"]),
    "NaN reward": (set_value(3, "reward", math.nan), ("jsonl", "parquet"), ["nan"]),
    "inf reward": (set_value(8, "reward", math.inf), ("jsonl", "parquet"), ["infinity"]),
    "NaN gen_logprobs": (set_token(5, "gen_logprobs", math.nan, 1), ("jsonl", "parquet"), ["nan"]),
    "-inf old_logprobs": (set_token(6, "old_logprobs", -math.inf), ("jsonl", "parquet"), ["infinity"]),
    "inf entropies": (set_token(1, "entropies", math.inf), ("jsonl", "parquet"), ["infinity"]),
    "gen_logprob above 0": (set_token(4, "gen_logprobs", 0.25), ("jsonl", "parquet"), ["above 0"]),
    "old_logprob above 0": (set_token(10, "old_logprobs", 1e-6), ("jsonl", "parquet"), ["above 0"]),
    "negative entropy": (set_token(3, "entropies", -1e-4), ("jsonl", "parquet"), ["negative"]),
    "finish_reason outside set": (set_value(5, "finish_reason", "timeout"), ("jsonl", "parquet"), ["stop"]),
    "duplicate rollout_id in file": (dup_rollout_in_file, ("jsonl", "parquet"), ["duplicate"]),
    "duplicate rollout_id against buffer": (dup_rollout_in_buffer, ("jsonl", "parquet"), ["already"]),
    "duplicate (group_id, sample_idx)": (dup_sample_idx, ("jsonl", "parquet"), ["sample_idx"]),
    "group already in buffer": (group_in_buffer, ("jsonl", "parquet"), ["already in the buffer"]),
    "group disagrees on prompt_id": (disagree("prompt_id", "p-other"), ("jsonl", "parquet"), ["disagrees"]),
    "group disagrees on run_id": (disagree("run_id", "run-other"), ("jsonl", "parquet"), ["disagrees"]),
    "group disagrees on step": (disagree("step", 99), ("jsonl", "parquet"), ["disagrees"]),
    "group disagrees on policy_version": (disagree("policy_version", 7), ("jsonl", "parquet"), ["disagrees"]),
}

PARAMS = [pytest.param(name, fmt, id=f"{name}-{fmt}") for name, (_, fmts, _) in CASES.items() for fmt in fmts]


def parquet_schema_for(rows: list[dict]) -> pa.Schema:
    """LOOSE, except where a mutation changed a column's type (then let Arrow infer that column)."""
    fields = []
    for f in LOOSE:
        if f.name not in rows[0]:
            continue
        try:
            pa.array([r.get(f.name) for r in rows], type=f.type)
            fields.append(f)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
            values = [r.get(f.name) for r in rows]
            try:
                fields.append(pa.field(f.name, pa.array(values).type))
            except (pa.ArrowInvalid, pa.ArrowTypeError):  # mixed: the whole column becomes text
                for r in rows:
                    r[f.name] = None if r[f.name] is None else str(r[f.name])
                fields.append(pa.field(f.name, pa.string()))
    return pa.schema(fields)


@pytest.mark.parametrize("name, fmt", PARAMS)
def test_rule_rejects_bad_file(cli, seeded, tmp_path, name, fmt):
    mutate, _, words = CASES[name]
    rows = good_rows()
    rid, column = mutate(rows)
    schema = parquet_schema_for(rows) if fmt == "parquet" else None
    path = write(rows, tmp_path, fmt, schema)
    if schema is not None and column in schema.names and schema.field(column).type != ROLLOUTS.field(column).type \
            and pa.types.is_string(schema.field(column).type):
        rid = rows[0]["rollout_id"]  # the type rule: a text column is refused at its first value
    assert_rejected(cli, seeded, path, rid, column, words)


def test_good_file_is_accepted_in_both_formats(cli, fresh, tmp_path):
    for fmt, prefix in (("jsonl", "a"), ("parquet", "b")):
        path = write(good_rows(prefix=prefix), tmp_path, fmt, ROLLOUTS, name=f"good-{prefix}")
        res = cli("import", fresh, path)
        assert res.code == 0, res.stderr
    with Buffer.open(fresh) as buf:
        assert buf.snapshot().rows("rollouts") == 8 + 12 + 12


def test_negative_zero_and_zero_are_in_bounds(cli, fresh, tmp_path):
    rows = good_rows()
    rows[0]["entropies"] = [-0.0] * len(rows[0]["entropies"])
    rows[1]["gen_logprobs"] = [0.0] * len(rows[1]["gen_logprobs"])
    rows[1]["old_logprobs"] = [-0.0] * len(rows[1]["old_logprobs"])
    for fmt in ("jsonl", "parquet"):
        for r in rows:
            r["rollout_id"] += fmt
            r["group_id"] += fmt
        res = cli("import", fresh, write(rows, tmp_path, fmt, ROLLOUTS, name=f"zero-{fmt}"))
        assert res.code == 0, res.stderr


def test_nullable_columns_may_be_absent_or_null(cli, fresh, tmp_path):
    rows = good_rows()
    for r in rows:
        for col in ("old_logprobs", "entropies", "correct", "gold_answer", "verify_error", "source", "meta"):
            del r[col]
    rows[0]["old_logprobs"] = None
    res = cli("import", fresh, write(rows, tmp_path, "jsonl"))
    assert res.code == 0, res.stderr


# ---- order of the checks: the first failing rule of docs/schema.md's order is the one reported -------

def test_order_lengths_before_nan(cli, seeded, tmp_path):
    rows = good_rows()
    set_value(1, "reward", math.nan)(rows)                      # NaN at an earlier row
    rid, col = shorten(6, "gen_logprobs")(rows)                 # length mismatch at a later row
    line = assert_rejected(cli, seeded, write(rows, tmp_path, "jsonl"), rid, col)
    assert "NaN or infinity" not in line


def test_order_bounds_before_uniqueness_before_agreement(cli, seeded, tmp_path):
    rows = good_rows()
    disagree("step", 5)(rows)                                   # agreement fault, row 6
    dup_rollout_in_file(rows)                                   # uniqueness fault, row 5
    rid, col = set_token(9, "entropies", -2.0)(rows)            # bounds fault, row 9
    assert_rejected(cli, seeded, write(rows, tmp_path, "parquet", ROLLOUTS), rid, col, ["negative"])
    rows = good_rows()
    disagree("step", 5)(rows)
    rid, col = dup_rollout_in_file(rows)
    assert_rejected(cli, seeded, write(rows, tmp_path, "jsonl"), rid, col, ["duplicate"])


def test_order_type_before_lengths(cli, seeded, tmp_path):
    rows = good_rows()
    shorten(1, "entropies")(rows)
    rid, col = set_value(8, "reward", "high")(rows)
    assert_rejected(cli, seeded, write(rows, tmp_path, "jsonl"), rid, col)


def test_within_a_check_the_first_row_is_reported(cli, seeded, tmp_path):
    # two faults of the same check in different columns: the earlier row wins, whatever the column
    rows = good_rows()
    shorten(7, "gen_logprobs")(rows)
    rid, col = shorten(2, "entropies")(rows)
    assert_rejected(cli, seeded, write(rows, tmp_path, "jsonl"), rid, col)
    rows = good_rows()
    set_value(9, "reward", math.inf)(rows)
    rid, col = set_token(3, "old_logprobs", math.nan)(rows)
    assert_rejected(cli, seeded, write(rows, tmp_path, "parquet", ROLLOUTS), rid, col)
    rows = good_rows()
    set_token(8, "gen_logprobs", 0.5)(rows)
    rid, col = set_token(4, "entropies", -0.5)(rows)
    assert_rejected(cli, seeded, write(rows, tmp_path, "jsonl"), rid, col)
    rows = good_rows()
    rows[9]["rollout_id"] = "old-g0-1"                          # uniqueness against the buffer, row 9
    rid, col = dup_sample_idx(rows)                             # uniqueness within the file, row 2
    assert_rejected(cli, seeded, write(rows, tmp_path, "parquet", ROLLOUTS), rid, col)


def test_through_the_installed_command(seeded, tmp_path):
    """The same contract via the real `rollstore` executable: exit status and one stderr line."""
    rows = good_rows()
    rid, col = set_token(4, "gen_logprobs", 0.25)(rows)
    path = write(rows, tmp_path, "jsonl")
    before = state(seeded)
    proc = subprocess.run([ROLLSTORE_BIN, "import", seeded, path], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and path in lines[0] and repr(rid) in lines[0] and repr(col) in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert state(seeded) == before
