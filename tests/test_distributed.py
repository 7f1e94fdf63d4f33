"""The learner under torch.distributed on CPU (gloo, 2 ranks): the same weights as one process,
exactly-once through a SIGKILL of one rank, a restart with another number of ranks, FSDP2.

Ranks are forked children (no re-import of torch/transformers) that meet at a TCP store the test
process hosts for the whole job (as torchrun's agent does), so no rank's exit can pull the store
from under another rank's shutdown. (A file store did that once in CI: rank 0 finished, rank 1
hung in `destroy_process_group` until the job's deadline.) A rank that dies takes the others down,
as torchrun does; a rank still alive after `WATCHDOG_S` prints every thread's stack and exits 1,
so a hang fails with its place, never as an anonymous SIGKILL.

Tolerance: a 2-rank step sums the same per-row gradient terms as one process but in another
order (each rank's micro-batches, then the all-reduce), and micro-batches padded to other widths; float32
sums in another order differ by ~1e-7 relative per step, and Adam's normalised update can amplify
a difference in a near-zero gradient entry up to ~lr. We require every weight within
1e-5 · max|w| + 1e-5 of the single-process one (lr 3e-3 here: a real divergence, e.g. a row
trained twice or a per-rank normaliser, moves weights by ~1e-3).
"""

from __future__ import annotations

import datetime as dt
import faulthandler
import os
import signal
import time

import pytest
import torch

from rollstore.learner.checkpoint import consumed_ledger, list_checkpoints
from rollstore.learner.config import RunPosition, TrainConfig, TrainContext
from rollstore.learner.consume import pending_shards, resume, train_pending
from rollstore.learner.parallel import SINGLE, close, current, passes, rank_micro, wrap
from rollstore.learner.trainer import deterministic_cpu, make_optimizer
from learner_util import one_thread, tiny_llama
from rollstore.storage.buffer import Buffer
from test_checkpoint import RUN, TRAIN, final_state, fork, make_buffer

_threads = pytest.fixture(autouse=True)(one_thread)

RTOL = ATOL = 1e-5
COLLECTIVE_TIMEOUT = dt.timedelta(seconds=60)
WATCHDOG_S = 150  # > the collective timeout: a rank blocked in a collective fails on its own first
DEADLINE_S = WATCHDOG_S + 30


def rank_process(root: str, rank: int, world: int, port: int, parallel: str, kill_at: int | None) -> None:
    """One learner rank: join the group, resume the run, train what is pending."""
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    deterministic_cpu(0, threads=1)
    dist = SINGLE
    if world > 1:
        store = torch.distributed.TCPStore("127.0.0.1", port, world, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        torch.distributed.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT,
        )
        dist = current(parallel)
    buf = Buffer.open(root)
    model = tiny_llama(0)
    opt, sched = make_optimizer(model, lr=3e-3, warmup_steps=3)
    version, step = resume(buf, model, opt, sched, RUN)
    model, opt = wrap(model, opt, sched, dist)

    def on_step(row):
        if row["step"] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    train_pending(buf, model, opt, sched, TrainConfig(**TRAIN), at=RunPosition(RUN, version, step),
                  context=TrainContext(dist=dist, on_step=on_step if kill_at else None))
    buf.close()
    close(dist)
    # Leave without tearing the rank's objects down: once in CI, rank 0 sat in the 150 s watchdog
    # after close() had returned and its peer had exited 0, with no Python frame left but the
    # caller's (a destructor of the wrapped model or its gloo group). What this module checks is on
    # disk by now; the exit status stays the test's signal.
    os._exit(0)


def run_job(root: str, world: int, parallel: str = "ddp", kill: tuple[int, int] | None = None) -> list[int]:
    """Run `world` ranks to the end; `kill=(rank, step)`: that rank SIGKILLs itself after that step,
    and the survivors are killed (as torchrun does). Returns the exit statuses."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                                       timeout=COLLECTIVE_TIMEOUT)  # port 0: a free one; lives until the job ends
    pids = [
        fork(rank_process, root, r, world, store.port, parallel, kill[1] if kill and kill[0] == r else None)
        for r in range(world)
    ]
    status: dict[int, int] = {}
    deadline = time.time() + DEADLINE_S
    while len(status) < world and time.time() < deadline:
        for pid in pids:
            if pid in status:
                continue
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status[pid] = st
                if os.WIFSIGNALED(st) or os.WEXITSTATUS(st):
                    for other in pids:  # one rank is gone: the job is over
                        if other not in status:
                            os.kill(other, signal.SIGKILL)
        time.sleep(0.01)
    for pid in pids:
        if pid not in status:
            os.kill(pid, signal.SIGKILL)
            status[pid] = os.waitpid(pid, 0)[1]
    del store
    return [status[p] for p in pids]


def ok(statuses: list[int]) -> bool:
    return all(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in statuses)


def max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) / max(float(b[k].abs().max()), 1e-12) for k in a)


def assert_close(a: dict, b: dict) -> None:
    for name in b:
        bound = RTOL * float(b[name].abs().max()) + ATOL
        assert float((a[name] - b[name]).abs().max()) <= bound, name


def assert_exactly_once(root: str, shards: list[str]) -> None:
    cks, _, training = final_state(root)
    assert [(c.version, c.parent_version) for c in cks] == [(1, 0), (2, 1), (3, 2), (4, 3)]
    assert [e["shard"] for c in cks for e in c.consumed] == shards  # each curated shard once, in order
    assert [r["step"] for r in training] == list(range(1, 9))  # each step's metrics row once
    with Buffer.open(root) as b:
        assert pending_shards(b, consumed_ledger(b, 4)) == []


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process trains the whole buffer: the reference."""
    root = str(tmp_path_factory.mktemp("single") / "buf")
    shards = make_buffer(root)
    assert ok(run_job(root, 1))
    return shards, final_state(root)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, single):
    root = str(tmp_path_factory.mktemp("ddp") / "buf")
    assert make_buffer(root) == single[0]
    assert ok(run_job(root, 2))
    return final_state(root)


def test_rank_shares_split_every_step_disjointly():
    for n in range(0, 9):
        for world in (1, 2, 3):
            shares = [list(rank_micro(n, r, world)) for r in range(world)]
            assert sorted(i for s in shares for i in s) == list(range(n))  # disjoint, covering
            assert max(len(s) for s in shares) == passes(n, world)
    assert passes(4, 2) == 2 and passes(5, 2) == 3 and passes(1, 2) == 1


def test_two_ranks_give_the_weights_of_one_process(single, two_ranks):
    shards, (_, ref_weights, ref_training) = single
    cks, weights, training = two_ranks
    assert [e["shard"] for c in cks for e in c.consumed] == shards
    assert [r["tokens"] for r in training] == [r["tokens"] for r in ref_training]  # global, not per rank
    assert [r["samples"] for r in training] == [r["samples"] for r in ref_training]
    assert [r["loss"] for r in training] == pytest.approx([r["loss"] for r in ref_training], rel=1e-5, abs=1e-6)
    print(f"max relative weight difference, 2 ranks vs 1 process: {max_rel_diff(weights, ref_weights):.3g}")
    assert_close(weights, ref_weights)


def test_sigkill_of_one_rank_then_restart_trains_every_shard_once(tmp_path, single, two_ranks):
    shards = single[0]
    root = str(tmp_path / "buf")
    make_buffer(root)
    statuses = run_job(root, 2, kill=(1, 3))  # rank 1 dies after step 3: v1 published, v2 not
    assert os.WIFSIGNALED(statuses[1]) and os.WTERMSIG(statuses[1]) == signal.SIGKILL
    with Buffer.open(root) as b:
        assert [c.version for c in list_checkpoints(b)] == [1]
    assert ok(run_job(root, 2))
    assert_exactly_once(root, shards)
    _, weights, _ = final_state(root)
    ref_weights = two_ranks[1]
    print(f"max relative weight difference, killed+resumed vs uninterrupted: {max_rel_diff(weights, ref_weights):.3g}")
    assert_close(weights, ref_weights)


def test_restart_with_another_number_of_ranks(tmp_path, single):
    shards, (_, ref_weights, _) = single
    root = str(tmp_path / "buf")
    make_buffer(root)
    statuses = run_job(root, 2, kill=(0, 5))  # rank 0 dies after step 5: v1, v2 published
    assert os.WIFSIGNALED(statuses[0])
    with Buffer.open(root) as b:
        assert [c.version for c in list_checkpoints(b)] == [1, 2]
    assert ok(run_job(root, 1))  # resumed by a single process
    assert_exactly_once(root, shards)
    assert_close(final_state(root)[1], ref_weights)


def _has_fsdp2() -> str | None:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no FSDP2 fully_shard"
    return None


@pytest.mark.skipif(_has_fsdp2() is not None, reason=_has_fsdp2() or "")
def test_fsdp2_on_two_ranks_gives_the_weights_of_one_process_and_resumes_on_one(tmp_path, single):
    shards, (_, ref_weights, ref_training) = single
    root = str(tmp_path / "buf")
    make_buffer(root)
    statuses = run_job(root, 2, "fsdp", kill=(1, 5))
    assert os.WIFSIGNALED(statuses[1])
    with Buffer.open(root) as b:
        assert [c.version for c in list_checkpoints(b)] == [1, 2]
    assert ok(run_job(root, 2, "fsdp"))
    assert_exactly_once(root, shards)
    _, weights, training = final_state(root)
    assert [r["tokens"] for r in training] == [r["tokens"] for r in ref_training]
    print(f"max relative weight difference, FSDP2 2 ranks vs 1 process: {max_rel_diff(weights, ref_weights):.3g}")
    assert_close(weights, ref_weights)
