"""Checkpoints, stop signals and failure handling on two real gloo ranks.

The scenarios run in one pair of rank processes (spawning ranks costs seconds
on a busy CI machine); each test below checks one of them.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal

import pytest
import torch
import torch.distributed as dist

from distlib.checkpoint.checkpointer import Checkpointer, CheckpointError, fingerprint
from distlib.reliability.failures import describe, shared_errors
from distlib.reliability.stop import StopSignal
from distlib.runner.data.errors import DataError
from tests.conftest import run_ranks
from tests.library.test_checkpoint import make, objects


class _Position:
    """A RankStateful object: ``shared`` is saved once (rank 0's), ``own`` for each rank."""

    def __init__(self, shared: int, own: torch.Tensor):
        self.shared, self.own = shared, own

    def state_dict(self) -> dict:
        return {"shared": self.shared}

    def load_state_dict(self, state: dict) -> None:
        self.shared = state["shared"]

    def rank_state_dict(self) -> dict:
        return {"own": self.own}

    def load_rank_state_dict(self, state: dict) -> None:
        self.own = state["own"]


def _per_rank_checkpoint(ctx, directory: str) -> dict:
    model, opt, sched = make()
    position = _Position(5 + ctx.rank, torch.tensor(20.0 + ctx.rank))
    fp = fingerprint(model)
    ck = Checkpointer(directory, is_main=ctx.is_main)
    torch.manual_seed(100 + ctx.rank)  # RNG states differ per rank
    bn = model[0][1]
    bn.running_mean.fill_(float(ctx.rank))  # so do BatchNorm statistics, from each rank's own batches
    path = ck.save({**objects(model, opt, sched), "position": position}, epoch=1, step=3, global_step=7, fingerprint=fp,
                   rank_extra={"loss_sum": torch.tensor(10.0 + ctx.rank)})  # fmt: skip
    expected = torch.rand(2)
    torch.manual_seed(999)
    bn.running_mean.fill_(-1.0)
    position = _Position(-1, torch.tensor(-1.0))
    resumed = Checkpointer(directory, is_main=ctx.is_main).load(
        {**objects(model, opt, sched), "position": position}, fingerprint=fp
    )
    return {
        "position": (position.shared, position.own.item()),
        "path": path,
        "directory_exists": os.path.isdir(directory),
        "loss_sum": resumed.rank_extra["loss_sum"].item(),
        "rng": torch.equal(torch.rand(2), expected),
        "bn": bn.running_mean.tolist(),
    }


def _failed_write(ctx, directory: str) -> str:
    model, opt, sched = make()
    try:
        Checkpointer(directory, is_main=ctx.is_main).save(
            objects(model, opt, sched), epoch=1, step=0, global_step=1, fingerprint=fingerprint(model)
        )
    except CheckpointError as e:
        return str(e)
    return "saved"


def _stop_agreement(ctx, ranks: tuple[int, ...] = (1,)) -> dict:
    before = signal.getsignal(signal.SIGTERM)
    stop = StopSignal(timeout_s=60)
    step = 0
    while not stop.check():
        step += 1
        if ctx.rank in ranks and step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # one rank only, as a scheduler may do; or every rank
        assert step < 50, "the ranks never agreed to stop"
    stop.close()
    return {
        "step": step,
        "name": stop.name,
        "code": stop.exit_code,
        "restored": signal.getsignal(signal.SIGTERM) is before,
    }


def _shared_error(ctx) -> str:
    try:
        with shared_errors(DataError):
            if ctx.rank == 1:
                raise DataError("data/x.png: corrupt")
    except DataError as e:
        return str(e)
    return "no error"


def _real_timeout(ctx) -> str | None:
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
    message = None
    if ctx.rank == 0:  # rank 1 never joins this all_reduce: rank 0 must time out, not hang
        try:
            dist.all_reduce(torch.ones(1), group=group)
        except RuntimeError as e:
            message = describe(e, rank=0, timeout_s=2)
    dist.barrier()
    return message


def _scenarios(ctx, tmp: str) -> dict:
    blocker = os.path.join(tmp, "a-file")
    if ctx.is_main:
        open(blocker, "w").write("a file where a directory should be")
    dist.barrier()
    return {
        # each rank names its own directory, as on two nodes: only rank 0's need exist
        "checkpoint": _per_rank_checkpoint(ctx, os.path.join(tmp, "ck" if ctx.is_main else "ck-of-rank-1")),
        "failed_write": _failed_write(ctx, os.path.join(blocker, "checkpoints")),
        "stop": _stop_agreement(ctx),
        "stop_all": _stop_agreement(ctx, (0, 1)),
        "shared_error": _shared_error(ctx),
        "timeout": _real_timeout(ctx),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(_scenarios, 2, str(tmp_path_factory.mktemp("ranks")), timeout=180)


def test_each_rank_gets_back_its_own_rng_buffers_and_values(two_ranks):
    r0, r1 = (r["checkpoint"] for r in two_ranks)
    assert r0["path"] is not None and r1["path"] is None  # only rank 0 writes
    # rank 0 alone writes and reads the files, the others get the state from it: another rank's
    # directory (on its own node) is never created, and its rank still resumes
    assert r0["directory_exists"] and not r1["directory_exists"]
    assert (r0["loss_sum"], r1["loss_sum"]) == (10.0, 11.0)
    assert (r0["position"], r1["position"]) == ((5, 20.0), (5, 21.0))  # state_dict rank 0's, rank_state_dict own
    assert r0["rng"] and r1["rng"]
    assert set(r0["bn"]) == {0.0} and set(r1["bn"]) == {1.0}


def test_at_another_world_size_every_rank_takes_rank_0s_state_and_no_per_rank_state(two_ranks):
    """The two ranks' checkpoint resumed here, in one process: shared state and buffers are rank 0's,
    per-rank RNG states and values are not restored, and a warning says so."""
    path = two_ranks[0]["checkpoint"]["path"]
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logging.getLogger("distlib").addHandler(handler)
    try:
        model, opt, sched = make()
        position = _Position(-1, torch.tensor(-1.0))
        resumed = Checkpointer(os.path.dirname(path)).load(
            {**objects(model, opt, sched), "position": position}, fingerprint=fingerprint(model)
        )
    finally:
        logging.getLogger("distlib").removeHandler(handler)
    assert resumed.path == path and (resumed.epoch, resumed.step) == (1, 3)
    assert resumed.rank_extra == {} and position.shared == 5 and position.own.item() == -1.0
    assert set(model[0][1].running_mean.tolist()) == {0.0}  # rank 0's BatchNorm statistics
    assert any("checkpoint written by 2 rank(s), this run has 1" in r for r in records), records


def test_a_failed_write_fails_every_rank_instead_of_hanging(two_ranks):
    for r in two_ranks:
        assert r["failed_write"].startswith("rank 0 could not write checkpoint"), r["failed_write"]


def test_a_signal_to_one_rank_stops_all_at_the_same_step(two_ranks):
    s0, s1 = (r["stop"] for r in two_ranks)
    assert s0 == s1, (s0, s1)
    assert s0["step"] == 4  # signal before step 4's check; agreed one check later
    assert (s0["name"], s0["code"], s0["restored"]) == ("SIGTERM", 143, True)
    # every rank signalled at once (a scheduler stopping the job): the same signal and exit code
    a0, a1 = (r["stop_all"] for r in two_ranks)
    assert a0 == a1 == s0, (a0, a1)


def test_an_expected_error_on_one_rank_is_raised_on_every_rank(two_ranks):
    assert two_ranks[1]["shared_error"] == "data/x.png: corrupt"
    assert two_ranks[0]["shared_error"] == "(on rank 1) data/x.png: corrupt"


def test_a_collective_timeout_is_explained(two_ranks):
    message = two_ranks[0]["timeout"]
    assert message is not None
    assert message.startswith("rank 0 timed out waiting for the other ranks in all_reduce (called from ")
    assert "tests/library/test_reliability_ranks.py" in message and "after 2 s (dist.timeout_s)" in message
