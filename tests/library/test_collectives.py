"""Each collective on real gloo ranks (2 and 3 processes), compared with the values
computed here in one process from every rank's input."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import distlib
from distlib.distributed.state_broadcast import broadcast_module
from tests.conftest import run_ranks

DTYPES = [torch.float32, torch.float64, torch.int64]


def rank_input(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """A different tensor on every rank, with entries where different ranks hold the max and min."""
    g = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(3, 5, generator=g) * 100).to(dtype)


def _exercise(ctx, sync_dir: str):
    out: dict = {}
    last = ctx.world_size - 1
    for dtype in DTYPES:
        for op in ("sum", "mean", "max", "min"):
            if op == "mean" and not dtype.is_floating_point:
                continue
            t = rank_input(ctx.rank, dtype)
            assert distlib.all_reduce(t, op=op) is t  # in place
            out[("all_reduce", op, dtype)] = t
            for dst in (0, last):
                t = rank_input(ctx.rank, dtype)
                distlib.reduce(t, dst=dst, op=op)
                if ctx.rank == dst:  # other ranks' tensors are left undefined
                    out[("reduce", op, dtype, dst)] = t
        for src in (0, last):
            t = rank_input(ctx.rank, dtype)
            assert distlib.broadcast(t, src=src) is t
            out[("broadcast", dtype, src)] = t
    out["gathered"] = distlib.all_gather_object({"rank": ctx.rank, "name": f"r{ctx.rank}", "list": [ctx.rank] * 2})
    out["broadcast_object"] = distlib.broadcast_object(("from", ctx.rank, {"x": ctx.rank}), src=last)

    # barrier: every rank wrote its file before any rank leaves it; rank 0 is late on purpose
    if ctx.rank == 0:
        time.sleep(0.5)
    open(os.path.join(sync_dir, f"rank{ctx.rank}"), "w").close()
    distlib.barrier()
    out["seen_after_barrier"] = sorted(os.listdir(sync_dir))

    # a bad op fails on every rank before any communication, so nothing hangs
    for bad in ("prod", "avg"):
        try:
            distlib.all_reduce(torch.ones(2), op=bad)
        except ValueError as e:
            out[("bad op", bad)] = str(e)
    try:
        distlib.all_reduce(torch.ones(2, dtype=torch.int64), op="mean")
    except ValueError as e:
        out["int mean"] = str(e)
    t = torch.ones(2)
    distlib.all_reduce(t)  # still in step after the errors
    out["after errors"] = t

    if ctx.world_size == 3:  # a group of ranks 1 and 2: its first rank, global rank 1, is their source
        group = dist.new_group([1, 2])  # a collective of every rank
        if ctx.rank in (1, 2):
            bn = nn.BatchNorm1d(2)
            bn.running_mean.fill_(float(ctx.rank))
            bn.num_batches_tracked.fill_(10 + ctx.rank)
            distlib.sync_buffers(bn, group=group)
            out["group sync_buffers"] = (bn.running_mean.tolist(), bn.num_batches_tracked.item())
            lin = nn.Linear(2, 2)
            with torch.no_grad():
                lin.weight.fill_(float(ctx.rank))
            broadcast_module(lin, group=group)
            out["group broadcast_module"] = lin.weight.tolist()
    return out


def expected(world_size: int, op: str, dtype: torch.dtype) -> torch.Tensor:
    xs = torch.stack([rank_input(r, dtype) for r in range(world_size)])
    if op == "sum":
        return xs.sum(0)
    if op == "mean":
        return xs.sum(0) / world_size
    if op == "max":
        return xs.max(0).values
    return xs.min(0).values


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_match_single_process_reference(world_size, tmp_path):
    results = run_ranks(_exercise, world_size, str(tmp_path))
    last = world_size - 1
    for rank, out in enumerate(results):
        for dtype in DTYPES:
            for op in ("sum", "mean", "max", "min"):
                if op == "mean" and not dtype.is_floating_point:
                    continue
                want = expected(world_size, op, dtype)
                got = out[("all_reduce", op, dtype)]
                assert got.dtype == dtype
                torch.testing.assert_close(got, want, msg=f"all_reduce {op} {dtype} rank {rank}")
                for dst in {0, last}:
                    if rank == dst:
                        torch.testing.assert_close(out[("reduce", op, dtype, dst)], want)
            for src in (0, last):
                torch.testing.assert_close(out[("broadcast", dtype, src)], rank_input(src, dtype))
        assert out["gathered"] == [{"rank": r, "name": f"r{r}", "list": [r, r]} for r in range(world_size)]
        assert out["broadcast_object"] == ("from", last, {"x": last})
        assert out["seen_after_barrier"] == sorted(f"rank{r}" for r in range(world_size))
        assert out[("bad op", "prod")] == "op must be one of sum, mean, max, min, got 'prod'"
        assert out[("bad op", "avg")] == "op must be one of sum, mean, max, min, got 'avg'"
        assert out["int mean"] == "op='mean' needs a floating-point tensor, got torch.int64"
        assert out["after errors"].tolist() == [world_size, world_size]
        if world_size == 3 and rank > 0:  # floats averaged over the group, the rest from its first rank
            assert out["group sync_buffers"] == ([1.5, 1.5], 11)
            assert out["group broadcast_module"] == [[1.0, 1.0], [1.0, 1.0]]


def test_reference_inputs_differ_per_rank():
    """Guard: the comparison above would prove nothing if every rank had the same input."""
    a, b, c = (rank_input(r, torch.float32) for r in range(3))
    assert not torch.equal(a, b) and not torch.equal(b, c)
    mx = torch.stack([a, b, c]).argmax(0)
    assert len(set(mx.flatten().tolist())) == 3  # each rank holds some of the maxima


def test_comm_groups_are_dropped_with_the_default_group_they_were_made_under():
    """A caller that destroys the process group itself (not distlib.shutdown()): the extra groups
    comm_groups made go with it, instead of staying referenced (a gloo group kept alive keeps its
    worker threads, and the abort at exit) until the next call."""
    import gc

    from torch.testing._internal.distributed.fake_pg import FakeStore

    from distlib.distributed import collectives

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        groups = collectives.comm_groups(2)
        assert groups[0] is None and groups[1] is not None and collectives._EXTRA_GROUPS is not None
    finally:
        dist.destroy_process_group()
    del groups
    gc.collect()
    assert collectives._EXTRA_GROUPS is None
