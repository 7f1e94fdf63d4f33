"""No non-finite number reaches training through any path into the buffer (issue 35, item 3).

Every way rows reach a rollouts shard is tried with a NaN or an infinity: `rollstore import` (the
rollouts schema and a framework format), generation (`rollstore.loop.step.StepWriter`: the loop, `rollstore
generate`), compaction, `Buffer.commit` with a file written elsewhere, and a shard registered in the
manifest by hand. Import, generation, compaction and commit refuse before anything is committed; a
shard registered by hand is refused by curation (both engines, one line naming the file, the
rollout and the column, nothing committed). Commands go through the real command line."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollstore.storage.buffer import Buffer, Part, WrittenPart, write_part
from rollstore.storage.errors import ValidationError

from test_integrity_round2 import one_error_line, seq_of  # noqa: E402  (shared helpers)
from test_integrity_round3 import _with_nan, register_by_hand, tiny_rows  # noqa: E402

LISTS = ("gen_logprobs", "old_logprobs", "entropies")


def _nan_everywhere(table: pa.Table, column: str) -> pa.Table:
    for row in range(table.num_rows):
        table = _with_nan(table, column, row)
    return table


def _with_old_logprobs(table: pa.Table) -> pa.Table:
    field = table.schema.field("old_logprobs")
    return table.set_column(table.column_names.index("old_logprobs"), field,
                            table.column("gen_logprobs").cast(field.type))


def _rollout_files(root: str) -> list[str]:
    return sorted(f for f in os.listdir(os.path.join(root, "rollouts")) if f.endswith(".parquet"))


# ---- the paths in: each refuses before anything is committed --------------------------------------
@pytest.mark.parametrize("column", ["reward", *LISTS])
def test_import_refuses_a_non_finite_value(cli, buffer_dir, tmp_path, column):
    bad = _with_nan(_with_old_logprobs(tiny_rows(21)), column, 3)
    path = str(tmp_path / "bad.parquet")
    pq.write_table(bad, path)
    seq = seq_of(buffer_dir)
    line = one_error_line(cli("import", buffer_dir, path))
    assert path in line and bad.column("rollout_id")[3].as_py() in line and repr(column) in line, line
    assert "NaN or infinity" in line, line
    assert seq_of(buffer_dir) == seq and _rollout_files(buffer_dir) == []


def test_a_framework_import_refuses_a_non_finite_log_prob(cli, buffer_dir, tmp_path):
    """`--from nemo-rl` with a NaN in `prev_logprobs` (JSON's NaN token, as Python writes it)."""
    from rollstore.learner.tiny import build_tokenizer
    from test_importers import EOS, nemo_file

    tok = str(tmp_path / "tok")
    build_tokenizer().save_pretrained(tok)
    p1 = [1, 5, 14, 5, 18]
    path = nemo_file(tmp_path, 3, [(p1, [6, EOS], 1.0), (p1, [7, EOS], 0.0)])
    lines = [json.loads(line) for line in open(path)]
    lines[1]["prev_logprobs"][0][len(p1)] = float("nan")  # a response position (the rest is prompt and padding)
    with open(path, "w") as fh:
        fh.writelines(json.dumps(line) + "\n" for line in lines)
    seq = seq_of(buffer_dir)
    line = one_error_line(cli("import", buffer_dir, path, "--from", "nemo-rl", "--correct-threshold", "1", "--tokenizer", tok))
    assert path in line and "'old_logprobs'" in line and "NaN or infinity" in line, line
    assert seq_of(buffer_dir) == seq and _rollout_files(buffer_dir) == []


class _Backend:
    """A generation backend whose forward pass gives NaN log-probs (a broken kernel, fp16 overflow)."""

    name = "nan"
    model_dir = "unused"

    def generate(self, prompts, group_size, max_new_tokens, temperature=1.0, top_p=1.0, seed=0):
        from rollstore.rollout.backends import Generation

        out = []
        for p in prompts:
            group = []
            for k in range(group_size):
                logp = np.full(2, -0.5, np.float32)
                policy = logp.copy()
                policy[1] = np.nan
                group.append(Generation([1, 5], [6 + k, 2], str(k), logp, "stop", policy,
                                        np.full(2, 0.3, np.float32)))
            out.append(group)
        return out

    def load_weights(self, model_dir):
        pass


class _Pool:
    def rewards(self, golds, predictions, lengths=None, overlong=None):
        from rollstore.rollout.reward import Verdict

        return [Verdict(p == "0", 1.0 if p == "0" else 0.0, None) for p in predictions]


def test_generation_refuses_non_finite_log_probs(buffer_dir):
    """The loop and `rollstore generate` append through `StepWriter.generate`: validated like an import."""
    from rollstore.loop.generate import GenerationConfig
    from rollstore.rollout.build import StepStamp
    from rollstore.rollout.prompt_sources import Prompt
    from rollstore.loop.step import StepWriter

    seq = seq_of(buffer_dir)
    with Buffer.open(buffer_dir) as buf:
        writer = StepWriter(buf, _Backend(), _Pool(), GenerationConfig(group_size=2), "run-nan")
        with pytest.raises(ValidationError) as err:
            writer.generate([Prompt("p0", "1+1=", "2", "test")], StepStamp("run-nan", 0), 0, "gen:0")
    assert "'old_logprobs'" in str(err.value) and "NaN or infinity" in str(err.value)
    assert seq_of(buffer_dir) == seq and _rollout_files(buffer_dir) == []


def test_compaction_refuses_a_non_finite_shard_registered_by_hand(cli, buffer_dir):
    with Buffer.open(buffer_dir) as buf:
        buf.append_rollouts(tiny_rows(22, step=0))
    bad = _with_nan(_with_old_logprobs(tiny_rows(23, step=1)), "old_logprobs", 4)
    path = register_by_hand(buffer_dir, bad)
    seq = seq_of(buffer_dir)
    line = one_error_line(cli("compact", buffer_dir))
    assert bad.column("rollout_id")[4].as_py() in line and "'old_logprobs'" in line and "NaN" in line, line
    assert seq_of(buffer_dir) == seq
    with Buffer.open(buffer_dir) as buf:
        assert os.path.join(buffer_dir, "rollouts", "by-hand.parquet") == path
        assert len(buf.manifest.shards("rollouts")) == 2


def test_a_rollouts_shard_is_never_committed_from_a_file_written_elsewhere(buffer_dir):
    """A `WrittenPart` (a file another process wrote) is how curated shards travel; for rollouts it
    would skip the finite check, so `Buffer.commit` refuses it."""
    bad = _with_nan(tiny_rows(24), "reward", 0)
    with Buffer.open(buffer_dir) as buf:
        folder = os.path.join("tmp", "elsewhere")
        os.makedirs(os.path.join(buffer_dir, folder))
        written = write_part(buffer_dir, Part("rollouts", bad), folder)
        assert isinstance(written, WrittenPart)
        with pytest.raises(ValueError, match="never as a file written elsewhere"):
            buf.commit([written], "append")
        assert buf.manifest.shards("rollouts") == []
    assert _rollout_files(buffer_dir) == []


# ---- a shard registered by hand: curation refuses it, on both engines ------------------------------
@pytest.fixture(scope="module")
def scheduler():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as cluster:
        yield cluster.scheduler_address


def _by_hand_buffer(root: str, column: str) -> pa.Table:
    with Buffer.init(root) as buf:
        buf.append_rollouts(tiny_rows(12, step=0))
    bad = _nan_everywhere(_with_old_logprobs(tiny_rows(11, step=1)), column)
    register_by_hand(root, bad)
    return bad


@pytest.mark.parametrize("column,recipe", [("old_logprobs", "grpo"), ("gen_logprobs", "grpo"),
                                           ("old_logprobs", "d3s"), ("gen_logprobs", "pods"),
                                           ("entropies", "d3s"), ("reward", "grpo")])
def test_curation_refuses_non_finite_rows_on_both_engines(cli, tmp_path, scheduler, column, recipe):
    """Every row of the hand-registered shard holds a NaN (an infinity for `reward`): the line names
    the shard, the first offending row by rollout_id among those the check covers (every candidate
    for `reward`, the selected rows for the lists) and the column; the engines give the same line;
    nothing is committed."""
    lines = []
    for engine in ("embedded", "dask"):
        root = str(tmp_path / engine)
        bad = _by_hand_buffer(root, column)
        seq = seq_of(root)
        extra = ["--engine", "dask", "--scheduler", scheduler] if engine == "dask" else []
        res = cli("curate", root, "--recipe", recipe, "--set", "where=step = 1", *extra)
        line = one_error_line(res)
        assert repr(column) in line and os.path.join(root, "rollouts", "by-hand.parquet") in line, line
        assert ("NaN or infinity" in line) if column != "reward" else ("not a finite number" in line), line
        ids = sorted(bad.column("rollout_id").to_pylist())
        named = line.split("rollout_id='")[1].split("'")[0]
        assert named in ids, line
        if column == "reward":
            assert named == ids[0], line
        assert seq_of(root) == seq
        assert not os.path.exists(os.path.join(root, "curated")) or os.listdir(os.path.join(root, "curated")) == []
        lines.append(line.replace(root, "ROOT"))
    assert lines[0] == lines[1]


@pytest.mark.parametrize("column", ["old_logprobs", "gen_logprobs"])
def test_the_log_prob_check_names_the_first_selected_row(cli, tmp_path, column):
    """A NaN in one selected row and in one row that is not selected: the selected one is named
    (rows curation does not select are never trained, so they are not refused)."""
    root = str(tmp_path / "buf")
    clean = _with_old_logprobs(tiny_rows(11, step=1))
    with Buffer.init(root) as buf:
        buf.append_rollouts(tiny_rows(12, step=0))
    probe = str(tmp_path / "probe")
    with Buffer.init(probe) as buf:
        buf.append_rollouts(tiny_rows(12, step=0))
    register_by_hand(probe, clean)
    res = cli("curate", probe, "--recipe", "d3s", "--set", "where=step = 1")  # the same rows, clean
    assert res.code == 0, res.stderr
    audit = json.loads(cli("sql", probe, "SELECT rollout_id, selected FROM selections ORDER BY rollout_id",
                           "-f", "json").stdout)
    chosen = [a["rollout_id"] for a in audit if a["selected"]]
    dropped = [a["rollout_id"] for a in audit if not a["selected"]]
    assert chosen and dropped
    ids = clean.column("rollout_id").to_pylist()
    bad = _with_nan(_with_nan(clean, column, ids.index(chosen[-1])), column, ids.index(min(dropped)))
    register_by_hand(root, bad)
    seq = seq_of(root)
    line = one_error_line(cli("curate", root, "--recipe", "d3s", "--set", "where=step = 1"))
    assert f"rollout_id={chosen[-1]!r}" in line and repr(column) in line, line
    assert seq_of(root) == seq
    # the dry run reads no log-probs: it shows the what-if audit of the same rows
    assert cli("curate", root, "--recipe", "d3s", "--set", "where=step = 1", "--dry-run").code == 0


# ---- a file checked finite when committed is not decoded again ---------------------------------------
def test_a_shard_checked_finite_at_commit_is_not_decoded_again(buffer_dir, monkeypatch):
    """`Buffer.commit` records the sha256 of every rollouts file it checked finite (the manifest's `finite`);
    a full curation takes those files' fallback flags from the statistics and decodes none of their log-probs,
    with the same curated rows as when nothing is recorded (every shard decoded, as for one registered by hand)."""
    import rollstore.storage.references as refs
    from rollstore.curate.params import load_recipe
    from rollstore.curate.run import curate
    from rollstore.storage.manifest import Manifest

    with Buffer.open(buffer_dir) as buf:
        buf.append_rollouts(_with_old_logprobs(tiny_rows(21, step=0)))
        plain = tiny_rows(22, step=1)
        field = plain.schema.field("old_logprobs")  # no old_logprobs: every selected row of it falls back
        buf.append_rollouts(plain.set_column(plain.column_names.index("old_logprobs"), field,
                                             pa.nulls(plain.num_rows, field.type)))
        shards = buf.manifest.shards("rollouts")
        assert buf.manifest.finite_checked([s.sha256 for s in shards] + ["0" * 64]) == {s.sha256 for s in shards}
    decoded = []
    real = refs._row_group_facts
    monkeypatch.setattr(refs, "_row_group_facts", lambda *a, **k: (decoded.append(a[0]), real(*a, **k))[1])
    runs = []
    for recorded in (True, False):
        if not recorded:
            monkeypatch.setattr(Manifest, "finite_checked", lambda self, digests: set())
        decoded.clear()
        with Buffer.open(buffer_dir) as buf:
            out = curate(buf, load_recipe("grpo"), {"where": "true"}, commit=False)
        runs.append(out.curated.sort_by("rollout_id"))
        fallback = out.curated.column("fallback").to_pylist()
        assert True in fallback and False in fallback  # both kinds of rows are selected
        assert (decoded == []) if recorded else decoded, decoded
    assert runs[0].equals(runs[1])
