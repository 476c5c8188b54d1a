"""Reading torchrun's environment, choosing the backend, world size 1 without torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import distlib
from distlib.distributed.process_group import Context, EnvError, parse_env, resolve_backend

FULL = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "h",
    "MASTER_PORT": "1",
}
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def without(*keys: str) -> dict[str, str]:
    return {k: v for k, v in FULL.items() if k not in keys}


def test_nothing_set_means_one_process():
    assert parse_env({}) is None
    assert parse_env({"PATH": "/bin", "OMP_NUM_THREADS": "1"}) is None


def test_full_environment():
    info = parse_env(FULL)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (1, 1, 4, 2)
    assert parse_env(without("LOCAL_WORLD_SIZE")).local_world_size == 4  # optional: defaults to WORLD_SIZE
    assert parse_env({**FULL, "MASTER_PORT": "65535"}).master_port == 65535
    # the node of a rank: ranks 0-3 on node 0, 4-7 on node 1 (4 per node)
    cpu = torch.device("cpu")
    nodes = [Context(r, r % 4, 8, 4, cpu, "gloo").node_rank for r in range(8)]
    assert nodes == [0, 0, 0, 0, 1, 1, 1, 1]
    # is_main is global rank 0 only, not the first process of every node
    assert [Context(r, r % 4, 8, 4, cpu, "gloo").is_main for r in range(8)] == [True] + [False] * 7


def test_half_set_names_what_is_missing():
    with pytest.raises(EnvError) as err:
        parse_env({"RANK": "0", "WORLD_SIZE": "2"})
    msg = str(err.value)
    assert "RANK, WORLD_SIZE present but LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing" in msg
    assert "torchrun" in msg
    with pytest.raises(EnvError, match=r"but MASTER_PORT missing"):
        parse_env(without("MASTER_PORT"))
    with pytest.raises(EnvError, match=r"MASTER_ADDR present but RANK, WORLD_SIZE, LOCAL_RANK, MASTER_PORT missing"):
        parse_env({"MASTER_ADDR": "h"})


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("RANK", "one", "RANK='one' is not an integer"),
        ("WORLD_SIZE", "2.0", "WORLD_SIZE='2.0' is not an integer"),
        ("LOCAL_RANK", "", "LOCAL_RANK='' is not an integer"),
        ("LOCAL_WORLD_SIZE", "x", "LOCAL_WORLD_SIZE='x' is not an integer"),
    ],
)
def test_non_integers(key, value, message):
    with pytest.raises(EnvError) as err:
        parse_env({**FULL, key: value})
    assert str(err.value) == message


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"RANK": "4"}, "RANK=4 must be in [0, WORLD_SIZE=4)"),
        ({"RANK": "-1"}, "RANK=-1 must be in [0, WORLD_SIZE=4)"),
        ({"WORLD_SIZE": "0", "RANK": "0", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}, "WORLD_SIZE=0 must be >= 1"),
        ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2 must be in [0, LOCAL_WORLD_SIZE=2)"),
        ({"LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE=8 must be <= WORLD_SIZE=4"),
        ({"MASTER_PORT": "0"}, "MASTER_PORT=0 is not a TCP port (1-65535)"),
        ({"MASTER_PORT": "65536"}, "MASTER_PORT=65536 is not a TCP port (1-65535)"),
    ],
)
def test_out_of_range(changes, message):
    with pytest.raises(EnvError) as err:
        parse_env({**FULL, **changes})
    assert message in str(err.value)


def test_out_of_range_problems_reported_together():
    with pytest.raises(EnvError) as err:
        parse_env({**FULL, "RANK": "9", "LOCAL_RANK": "5"})
    assert "RANK=9" in str(err.value) and "LOCAL_RANK=5" in str(err.value)


def test_resolve_backend():
    assert resolve_backend("gloo") == "gloo"
    assert resolve_backend("auto") == ("nccl" if torch.cuda.is_available() else "gloo")
    with pytest.raises(ValueError, match=r"backend must be 'auto', 'nccl' or 'gloo', got 'mpi'"):
        resolve_backend("mpi")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this process sees a GPU")
def test_nccl_without_gpu_is_a_clear_error():
    with pytest.raises(EnvError, match=r"backend 'nccl' needs a GPU, and this process sees none; use 'gloo' or 'auto'"):
        resolve_backend("nccl")


@pytest.fixture
def no_torchrun(monkeypatch):
    for key in TORCHRUN_VARS:
        monkeypatch.delenv(key, raising=False)


def test_init_without_torchrun_is_world_size_1(no_torchrun):
    ctx = distlib.init("gloo")
    try:
        assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size) == (0, 0, 1, 1)
        assert ctx.backend == "none" and ctx.device == torch.device("cpu") and ctx.is_main
        assert not torch.distributed.is_initialized()  # no process group at all
        t = torch.tensor([1.0, -2.0])
        for op in ("sum", "mean", "max", "min"):
            assert distlib.all_reduce(t, op=op) is t and t.tolist() == [1.0, -2.0]
            assert distlib.reduce(t, dst=0, op=op) is t and t.tolist() == [1.0, -2.0]
        assert distlib.broadcast(t, src=0) is t
        distlib.barrier()
        assert distlib.all_gather_object({"a": 1}) == [{"a": 1}]
        assert distlib.broadcast_object("x") == "x"
    finally:
        distlib.shutdown()


def test_bad_op_name_is_an_error_even_at_world_size_1(no_torchrun):
    t = torch.ones(2)
    with pytest.raises(distlib.ArgumentError, match=r"op must be one of sum, mean, max, min, got 'avg'") as e:
        distlib.all_reduce(t, op="avg")
    assert isinstance(e.value, ValueError) and isinstance(e.value, distlib.DistlibError)
    with pytest.raises(ValueError, match=r"got 'prod'"):
        distlib.reduce(t, op="prod")
    with pytest.raises(distlib.ArgumentError, match=r"op='mean' needs a floating-point tensor, got torch.int64"):
        distlib.all_reduce(torch.ones(2, dtype=torch.int64), op="mean")
    z = torch.ones(2, dtype=torch.complex64)  # complex tensors average like floating-point ones
    assert distlib.all_reduce(z, op="mean") is z and distlib.reduce(z, op="mean") is z


def test_init_with_half_set_environment_fails_before_anything_starts(no_torchrun, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(EnvError, match=r"LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing"):
        distlib.init()
    assert not torch.distributed.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this process sees a GPU")
def test_init_nccl_without_gpu(no_torchrun):
    with pytest.raises(EnvError, match=r"needs a GPU"):
        distlib.init("nccl")


def test_init_at_world_size_1_leaves_the_environment_alone(no_torchrun):
    """No RANK or WORLD_SIZE invented: a child process that tests `"RANK" in os.environ` (nanoGPT's
    idiom, the GPT baseline's) must not take itself for a torchrun worker and wait for a rendezvous."""
    before = dict(os.environ)
    distlib.init("gloo")
    try:
        assert dict(os.environ) == before
        code = "import os; print('RANK' in os.environ)"
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert child.returncode == 0 and child.stdout.strip() == "False", child.stderr
    finally:
        distlib.shutdown()


def test_one_process_variables_are_world_size_1_but_a_world_of_two_is_not():
    one = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    assert parse_env(one) is None
    with pytest.raises(EnvError, match="MASTER_ADDR, MASTER_PORT missing"):
        parse_env({**one, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})


def test_init_method_needs_rank_and_world_size(no_torchrun):
    with pytest.raises(EnvError, match=r"init\(\) got init_method but not all of init_method, rank and world_size"):
        distlib.init("gloo", init_method="tcp://127.0.0.1:1234")
    with pytest.raises(EnvError, match=r"rank must be in \[0, world_size\)"):
        distlib.init("gloo", init_method="tcp://127.0.0.1:1234", rank=2, world_size=2)
    assert not torch.distributed.is_initialized()


def _spawned(ctx, port: int) -> list[float]:
    """An mp.spawn script's start: its own rank and --dist-url, no launcher's environment."""
    distlib.shutdown()  # run_ranks' own init() found no launcher: world size 1
    ctx = distlib.init("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(os.environ["SPAWN_RANK"]), world_size=2)
    assert (ctx.world_size, ctx.local_world_size, ctx.local_rank) == (2, 2, ctx.rank)
    return distlib.all_reduce(torch.tensor([float(ctx.rank + 1)])).tolist()


def test_init_method_rank_and_world_size_as_mp_spawn_gives_them():
    from tests.conftest import free_port, run_ranks

    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    envs = [{**base, "SPAWN_RANK": str(r)} for r in range(2)]
    assert run_ranks(_spawned, 2, free_port(), rank_envs=envs) == [[3.0], [3.0]]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_never_starts_is_reported_within_the_timeout(no_torchrun, monkeypatch, rank):
    from tests.conftest import free_port

    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1"}
    for k, v in {**env, "MASTER_PORT": free_port()}.items():
        monkeypatch.setenv(k, str(v))
    t0 = time.monotonic()
    # rank 0 hosts the rendezvous and counts who came; rank 1 finds no host
    said = r"only 1 of 2 ranks joined the rendezvous" if rank == 0 else r"rank 1 could not reach the rendezvous host"
    with pytest.raises(EnvError, match=said + r".* within timeout_s=2 s .*Check that every rank was started"):
        distlib.init("gloo", timeout_s=2)
    assert time.monotonic() - t0 < 10
    assert not torch.distributed.is_initialized()
