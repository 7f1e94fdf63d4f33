"""One set of rules for both doors (issue 47): every public method of the Python front door, walked
with hostile values by hypothesis, refuses each with one `rs.RollstoreError` line and writes
nothing; the command line's options and the front door's keywords of the same name share one
rule object (rollstore.rules)."""

from __future__ import annotations

import inspect
import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rollstore as rs
from rollstore import rules
from rollstore.builtin.synthetic import rollouts_table
from rollstore.storage.buffer import Buffer

NAN, INF = math.nan, math.inf
NOT_TEXT = [None, 3, 2.5, b"bytes", ["x"], object(), "a\x00b"]
NOT_FLAG = [None, 1, "yes", 0.0]
COUNT = [0, -1, 10**30, -(10**30), NAN, INF, True, "3", 2.5, b"x", [], None]
ZERO_OK = [-1, 10**30, NAN, INF, True, "3", 2.5, b"x"]
POSITIVE = [0, 0.0, -1.0, -1e-9, NAN, INF, -INF, True, "1e-5", b"x", None, 10**400]
SECONDS = [-1, -0.5, NAN, INF, 1e10, True, "60", None]
SNAPSHOT = [-1, 10**30, NAN, 1.5, True, "1", b"1"]
SEED = [-1, 2**32, 10**30, NAN, True, "0", 1.5, None]
FRACTION = [0, -0.1, 1.5, NAN, True, "1", None]
MEMORY = ["lots", "", "1KB", None, 3, "99999PB"]

# method -> {keyword: hostile values}; `required` keywords get a valid value when another is tested
HOSTILE = {
    "open": {"path": NOT_TEXT + [""], "create": NOT_FLAG},
    "sql": {"query": NOT_TEXT, "snapshot": SNAPSHOT, "timeout": SECONDS, "memory_limit": MEMORY},
    "curation": {"curation_id": [3, 2.5, b"x", ["x"], "cur-nope", "a\x00b"]},
    "curations": {},
    "generate": {"prompts": NOT_TEXT + ["/no/such/prompts.jsonl"], "model": NOT_TEXT + ["/no/such/model"],
                 "num_prompts": [0, -1, 10**30, NAN, True, "3", 2.5], "group_size": COUNT, "steps": COUNT,
                 "max_new_tokens": COUNT, "temperature": POSITIVE, "top_p": FRACTION, "seed": SEED,
                 "run_id": NOT_TEXT, "policy_version": ZERO_OK, "backend": NOT_TEXT + ["nope"],
                 "template": [3, b"x", ["x"], "a\x00b"], "compact_entropies": NOT_FLAG, "follow": NOT_FLAG,
                 "max_policy_lag": [-1, NAN, 2.5, 10**30, True, "1", None], "recipe": NOT_TEXT,
                 "sets": [3, "x", ["x"], {"sample_fraction": 0.5}]},
    "curate": {"recipe": NOT_TEXT + ["no-such-recipe"], "progress": [NAN, INF, -0.1, 1.5, True, "x", b"x"],
               "snapshot": SNAPSHOT, "dry_run": NOT_FLAG, "memory_limit": MEMORY, "timeout": SECONDS,
               "engine": NOT_TEXT + ["nope"], "scheduler": [3, b"x", ["x"], "a\x00b", "local:2"],
               "partitions": [0, -1, 10**30, NAN, INF, True, "3", 2.5, b"x", 2],
               "sets": [3, "x", ["x"], {"no_such_parameter": 1}, {3: 1}, {"sample_fraction": NAN}]},
    "train": {"curation": [3, 2.5, b"x", ["cur-nope"], [3], "cur-nope", object()], "model": NOT_TEXT,
              "loss": NOT_TEXT + ["nope"], "lr": POSITIVE, "epochs": COUNT, "micro_batch_size": COUNT,
              "grad_accum": COUNT, "run_id": NOT_TEXT, "keep_checkpoints": [0, -1, 10**30, NAN, True, "3", 2.5],
              "follow": NOT_FLAG, "poll": [0, -1, NAN, INF, 1e10, True, "1", None], "max_idle": SECONDS,
              "parallel": NOT_TEXT + ["nope"]},
    "compare_runs": {"a": NOT_TEXT + ["no-such-run"], "b": NOT_TEXT + ["no-such-run"], "snapshot": SNAPSHOT},
}
# the curation handle's methods (rs.Curation), called on the buffer's latest curation
ON_CURATION = {
    "batches": {"batch_size": COUNT, "shuffle_seed": [-1, 2**32, NAN, True, "0", 1.5],
                "pad_id": [-1, NAN, 10**30, "x", None, 1.5]},
    "compare": {"other": [None, 3, b"x", "cur-nope", "a\x00b"]},
    "why": {"rollout_id": [None, 3, b"x", ["x"], "no-such-rollout"]},
}
HOSTILE.update(ON_CURATION)
# a recipe parameter passed as a keyword of `curate` (**params): hostile values of a few
RECIPE_PARAMS = {"sample_fraction": [NAN, INF, -1, 2, True, "x"], "skip_explore_min": [NAN, -1, 2],
                 "max_policy_lag": [-1, NAN, 2.5, 10**30], "where": [3, "no_such_column > 1", "1; DROP TABLE x"],
                 "no_such_parameter": [1]}
VALID = {"sql": {"query": "SELECT 1"}, "curate": {"recipe": "grpo"}, "batches": {"batch_size": 4},
         "compare_runs": {"a": "fd", "b": "fd2"}}


def _calls():
    out = [(m, k, i) for m, kws in HOSTILE.items() for k, vals in kws.items() for i in range(len(vals))]
    return out + [("curate", k, i) for k, vals in RECIPE_PARAMS.items() for i in range(len(vals))]


CALLS = _calls()


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("rules") / "buf")
    with Buffer.init(root) as buf:
        buf.append_rollouts(rollouts_table(n_groups=4, group_size=4, seed=1, run_id="fd"))
        buf.append_rollouts(rollouts_table(n_groups=4, group_size=4, seed=2, run_id="fd2"))  # compare_runs' second
    rs.open(root).curate("grpo")
    return root


def state(root: str) -> tuple:
    """What a refused call must leave unchanged: every file outside tmp/ but the SQLite manifest's
    own files (size and mtime), and the manifest's latest commit."""
    files = []
    for d, dirs, names in os.walk(root):
        rel = os.path.relpath(d, root)
        if rel.split(os.sep)[0] == "tmp":
            continue
        for n in names:
            if n.startswith("manifest.sqlite"):
                continue
            st = os.stat(os.path.join(d, n))
            files.append((os.path.join(rel, n), st.st_size, st.st_mtime_ns))
    with Buffer.open(root) as buf:
        return buf.manifest.latest_seq(), sorted(files)


def test_every_keyword_of_every_public_method_has_hostile_values():
    methods = {"open": rs.open, **{m: getattr(rs.Curation if m in ON_CURATION else rs.Buffer, m)
                                   for m in HOSTILE if m != "open"}}
    for cls in (rs.Buffer, rs.Curation):
        public = {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")
                  and [p for p in inspect.signature(v).parameters if p != "self"]}  # (those with keywords)
        assert public <= set(HOSTILE), f"public methods of {cls.__name__} without hostile values: {public - set(HOSTILE)}"
    for name, fn in methods.items():
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.name != "self" and p.kind is not p.VAR_KEYWORD]
        missing = [p.name for p in params if p.name not in HOSTILE[name]]
        assert not missing, f"{name}: keywords without hostile values: {missing}"


def refused(root: str, tmp_path_factory, method: str, kwargs: dict) -> str:
    """Call `method` with `kwargs`; assert one RollstoreError line and nothing written; its text."""
    before = state(root)
    with pytest.raises(rs.RollstoreError) as exc:
        if method == "open":
            rs.open(**{"path": str(tmp_path_factory.mktemp("open") / "new"), **kwargs})
        else:
            target = rs.open(root).curation() if method in ON_CURATION else rs.open(root)
            getattr(target, method)(**{**VALID.get(method, {}), **kwargs})
    text = str(exc.value)
    assert text and "\n" not in text, (method, kwargs, text)
    assert state(root) == before, f"{method}({kwargs!r}) wrote something"
    return text


def test_every_hostile_value_of_every_keyword(filled, tmp_path_factory):
    """The whole table, each value alone: all of them, not a sample."""
    for method, keyword, i in CALLS:
        value = (HOSTILE[method].get(keyword) or RECIPE_PARAMS[keyword])[i]
        refused(filled, tmp_path_factory, method, {keyword: value})


@st.composite
def hostile_calls(draw):
    """A method and 1-3 of its keywords, each with a hostile value (the others: their defaults)."""
    method = draw(st.sampled_from([m for m, kws in HOSTILE.items() if kws]))
    table = {**HOSTILE[method], **(RECIPE_PARAMS if method == "curate" else {})}
    keys = draw(st.lists(st.sampled_from(sorted(table)), min_size=1, max_size=3, unique=True))
    return method, {k: draw(st.sampled_from(table[k])) for k in keys}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(call=hostile_calls())
def test_hostile_values_together_are_one_rollstore_error_and_write_nothing(filled, tmp_path_factory, call):
    method, kwargs = call
    refused(filled, tmp_path_factory, method, kwargs)


def test_the_two_doors_share_each_rule():
    """Every option of `rollstore train/generate/curate/sql` named like a front-door keyword that has
    a rule carries the library's rule object."""
    from typer.main import get_command

    from rollstore.cli import app

    tables = {"train": rules.TRAIN, "generate": rules.GENERATE, "curate": rules.CURATE, "sql": rules.SQL}
    group = get_command(app)
    names = {"seq": "snapshot"}
    for command, table in tables.items():
        cmd = group.commands[command]
        seen = set()
        for param in cmd.params:
            key = names.get(param.name, param.name)
            if key in table:
                assert getattr(param.callback, "rule", None) is table[key], (command, param.name)
                seen.add(key)
        assert seen == set(table), (command, set(table) - seen)


def test_train_epochs_zero_publishes_nothing(filled):
    buf = rs.open(filled)
    cur = buf.curation()
    before = state(filled)
    for bad in (0, -1, 1.5, NAN):
        with pytest.raises(rules.OptionError, match="epochs"):
            buf.train(cur, epochs=bad)
    assert state(filled) == before
