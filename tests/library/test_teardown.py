"""distlib.shutdown(): the gloo abort at exit must not happen.

The cause (see distlib.distributed.process_group.shutdown): a gloo worker thread releases
its last reference to a finished collective after the caller has moved on; if
the interpreter is finalizing by then, the thread is ended inside a noexcept
destructor and the process aborts ("terminate called without an active
exception"). shutdown() destroys the group for real, which joins those threads
while the interpreter is whole.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import sys
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import distlib
from distlib.distributed import process_group
from tests.conftest import run_ranks
from tests.library.teardown_stress import run_jobs

linux_only = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task")


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _shutdown_joins_threads(ctx):
    # like a training script: the first optimizer imports torch._dynamo, which imports
    # torch.distributed.nn.functional, whose defaults would capture the group
    torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    t = torch.ones(100)
    distlib.all_reduce(t)
    extra = distlib.distributed.collectives.comm_groups(2)[1]  # as GradSync(comm_groups=2) makes, the runner's default
    dist.all_reduce(t, group=extra)
    groups = [weakref.ref(dist.group.WORLD), weakref.ref(extra)]
    del extra
    before = _native_threads()
    distlib.shutdown()
    return all(g() is None for g in groups), before, _native_threads()


@linux_only
@pytest.mark.parametrize("world_size", [2, 3])
def test_shutdown_destroys_group_and_joins_gloo_threads(world_size):
    for destroyed, before, after in run_ranks(_shutdown_joins_threads, world_size):
        assert destroyed, "the ProcessGroup object outlived shutdown()"
        assert after <= before - 2, f"gloo worker threads still running: {before} threads before, {after} after"


def _group_held_by_ddp(ctx):
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    distlib.get_logger().addHandler(Collect())
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    distlib.shutdown()
    held = dist.is_initialized()
    del model
    gc.collect()  # now the group goes, and its threads are joined before this rank exits
    return held, records


def test_shutdown_reports_a_group_that_something_else_keeps_alive():
    for held, records in run_ranks(_group_held_by_ddp, 2):
        assert not held
        assert any("still referenced after shutdown" in r and "DistributedDataParallel" in r for r in records), records


def _peer_skips_final_barrier(ctx):
    if ctx.rank == 1:
        # stay connected past rank 0's 3 s barrier timeout: a peer that has already gone shows up as
        # "connection closed" instead, which names no rank
        time.sleep(8)
        distlib.shutdown(barrier=False)  # leaves without meeting rank 0


def test_final_barrier_is_bounded_and_names_the_missing_rank():
    with pytest.raises(AssertionError) as err:
        run_ranks(_peer_skips_final_barrier, 2, init_timeout_s=3)
    text = str(err.value)
    assert "not every rank reached the final barrier" in text and "Ranks 1 failed to pass monitoredBarrier" in text, (
        text
    )


@pytest.fixture
def one_rank_group():
    """A real gloo group of one rank in this process, so shutdown() has something to destroy."""
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_shutdown_barrier_unless_an_exception_is_propagating(one_rank_group, monkeypatch):
    calls = []
    monkeypatch.setattr(process_group, "_final_barrier", lambda: calls.append("barrier"))
    try:
        raise RuntimeError("a failed rank")
    except RuntimeError:
        distlib.shutdown()  # a peer may never arrive: no barrier
    assert calls == [] and not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    distlib.shutdown()
    assert calls == ["barrier"] and not dist.is_initialized()


def test_shutdown_twice_and_without_init_is_a_no_op():
    assert not dist.is_initialized()
    distlib.shutdown()
    distlib.shutdown(barrier=True)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="gloo multi-process on Linux")
def test_teardown_stress_short_jobs_exit_cleanly():
    """Real interpreters exiting right after their last collective, 2 and 3 ranks, two
    jobs at a time (each rank forked by its job's process after the imports, and ending
    with the interpreter's own exit). The plain-torch version of the same script
    (TEARDOWN=raw) aborted in 1-7 of 20-30 processes here; with WIDEN=1, which keeps gloo's
    worker thread busy with the finished collective while the main thread exits, in 8 of 10."""
    failures = run_jobs([2, 3], "shutdown", timeout=120)
    failures += run_jobs([3, 2], "shutdown", timeout=120, env={"WIDEN": "1"})
    failures += run_jobs([3], "atexit", timeout=120, env={"WIDEN": "1"})
    assert not failures, "\n\n".join(failures)


def _collective_fails(ctx):
    if ctx.rank == 1:
        distlib.shutdown(barrier=False)  # gone: rank 0's all_reduce fails
        return None
    group = weakref.ref(dist.group.WORLD)
    try:
        try:
            distlib.all_reduce(torch.ones(1))
        finally:
            distlib.shutdown()  # an exception in flight, whose frames hold the group
    except RuntimeError as e:
        return group() is None, _native_threads(), str(e)[:200]
    return None


@linux_only
def test_shutdown_after_a_failed_collective_still_destroys_the_group():
    destroyed, threads, error = run_ranks(_collective_fails, 2, init_timeout_s=5)[0]
    assert destroyed, f"group kept alive by the failed collective's frames ({error})"


def _functional_imported_after_init(ctx):
    import importlib

    # a module whose defaults captured the live group (as when a script imports it after init)
    sys.modules.pop("torch.distributed.nn.functional", None)
    functional = importlib.import_module("torch.distributed.nn.functional")
    captured = functional.all_reduce.__defaults__[-1] is dist.group.WORLD
    group = weakref.ref(dist.group.WORLD)
    distlib.shutdown()
    return captured, group() is None, functional.all_reduce.__defaults__[-1]


def test_shutdown_releases_group_defaults_captured_by_torch_distributed_nn():
    for captured, destroyed, default in run_ranks(_functional_imported_after_init, 2):
        assert captured  # the hazard is real
        assert destroyed and default is None


# ---- scripts that end as users' do: torchrun, a real interpreter exit -------------------------------
def _script(mode: str, ckpt_dir: str = "", **env: str) -> str:
    """tests/library/shutdown_rank.py at 2 gloo ranks under torchrun; its output (stdout and stderr)."""
    import subprocess

    from tests.conftest import ROOT

    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         os.path.join(ROOT, "tests", "library", "shutdown_rank.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "MODE": mode, "CKPT_DIR": ckpt_dir, **env},
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "terminate called" not in out, out[-3000:]
    return out


def test_shutdown_after_full_sharding_releases_the_group_fsdp2_keeps():
    """FSDP2's mesh info of every sharded module and torch's DeviceMesh keep the group after
    destroy_process_group(): shutdown() releases them, so no rank reports a group still held."""
    out = _script("fsdp")
    assert "still referenced after shutdown" not in out, out[-3000:]


def _saves_async_and_shuts_down(ctx, directory: str) -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    distlib.ShardedCheckpointer(directory).save(3, {"model": model, "optimizer": opt}, async_=True)
    distlib.shutdown()  # no wait(), no close()


def _committed_step(directory) -> int | None:
    """The step a resume finds in ``directory`` (this process, world size 1)."""
    return distlib.ShardedCheckpointer(str(directory)).resume({"model": torch.nn.Linear(4, 4)})


def test_an_async_save_in_flight_is_committed_by_shutdown(tmp_path):
    """save(..., async_=True) and then shutdown() without close(): the checkpoint is committed,
    not left partial, and a resume loads it."""
    run_ranks(_saves_async_and_shuts_down, 2, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["step000000003"], os.listdir(tmp_path)
    assert _committed_step(tmp_path) == 3


def test_an_async_save_in_flight_is_committed_by_the_exit_hook(tmp_path):
    """The same save, and the script ends without shutdown() or close(): distlib's exit hook commits it."""
    _script("async-atexit", str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["step000000003"], os.listdir(tmp_path)
    ck = distlib.ShardedCheckpointer(str(tmp_path))
    assert ck.resume({"model": shutdown_rank_net()}) == 3


def shutdown_rank_net() -> torch.nn.Module:
    """The model of shutdown_rank.py."""
    nn = torch.nn
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
