"""Barrier, reduce, all_reduce, broadcast and all_gather_object; extra communicators.

Every function here is a collective: every rank must call it, in the same
order, with tensors of the same shape and dtype. At world size 1 (no process
group) each is a no-op that returns its input.
"""

from __future__ import annotations

import datetime
import weakref
from typing import Any

import torch
import torch.distributed as dist

from distlib.errors import ArgumentError

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def active(group: dist.ProcessGroup | None = None) -> bool:
    """True when there is a process group and ``group`` (default: the whole world) has more than one
    process: the collectives then communicate; otherwise they are no-ops."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def _op(op: str, t: torch.Tensor) -> dist.ReduceOp:
    try:
        reduce_op = _OPS[op]
    except KeyError:
        raise ArgumentError(f"op must be one of {', '.join(_OPS)}, got {op!r}") from None
    if op == "mean" and not (t.is_floating_point() or t.is_complex()):
        raise ArgumentError(f"op='mean' needs a floating-point tensor, got {t.dtype}")
    return reduce_op


def barrier() -> None:
    """Wait until every rank gets here. Every rank must call it, in the same order."""
    if active():
        dist.barrier()


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce ``t`` in place over all ranks and return it; every rank gets the result.

    ``op`` is "sum", "mean", "max" or "min". Every rank must call it, in the same
    order, with a tensor of the same shape and dtype.
    """
    reduce_op = _op(op, t)
    if not active():
        return t
    dist.all_reduce(t, op=reduce_op)
    if op == "mean":
        t.div_(dist.get_world_size())
    return t


def reduce(t: torch.Tensor, dst: int = 0, op: str = "sum") -> torch.Tensor:
    """Reduce ``t`` onto rank ``dst`` in place (other ranks' ``t`` is left undefined).

    Every rank must call it, in the same order, with a tensor of the same shape and dtype.
    """
    reduce_op = _op(op, t)
    if not active():
        return t
    dist.reduce(t, dst=dst, op=reduce_op)
    if op == "mean" and dist.get_rank() == dst:
        t.div_(dist.get_world_size())
    return t


def broadcast(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Copy rank ``src``'s ``t`` into every rank's ``t`` in place and return it.

    Every rank must call it, in the same order, with a tensor of the same shape and dtype.
    """
    if active():
        dist.broadcast(t, src=src)
    return t


def all_gather_object(obj: Any) -> list[Any]:
    """Gather one picklable object from each rank; returns the list in rank order.

    Every rank must call it, in the same order.
    """
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank. Every rank must call it, in the same order."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


# (the default group they were created under, the extra groups over all ranks); reset when the
# default group changes (destroyed and initialized again)
_EXTRA_GROUPS: tuple[Any, list[dist.ProcessGroup]] | None = None


def _world_timeout() -> datetime.timedelta | None:
    """The default group's timeout, or None where this torch does not expose it. New groups get
    torch's own default otherwise (10 minutes on NCCL, 30 on gloo), and a hang on them would
    outlast the job's ``dist.timeout_s``."""
    try:
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        return dist.group.WORLD._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def comm_groups(n: int) -> list[dist.ProcessGroup | None]:
    """``n`` process groups over all ranks, each with its own communicator: the default group
    (``None``) and ``n - 1`` more. Collectives on different groups may run at the same time (on
    NCCL each group has its own CUDA stream); collectives on one group run one after another.

    A collective when it creates groups (``dist.new_group``): every rank must call it, with the
    same ``n``, in the same order. Groups are created once per process group and shared by every
    caller: ``comm_groups(3)`` then ``comm_groups(2)`` creates two groups in all, and the second
    call returns the first two of the first. They take the default group's timeout. Each NCCL
    communicator holds its own GPU buffers.
    At world size 1 nothing is created: ``[None] * n``.
    """
    global _EXTRA_GROUPS
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ArgumentError(f"comm_groups: n must be an integer >= 1, got {n!r}")
    if not active():
        return [None] * n
    world = dist.group.WORLD
    if _EXTRA_GROUPS is None or _EXTRA_GROUPS[0]() is not world:
        # weak: the cache must not keep the default group alive; once it is gone (a caller's own
        # dist.destroy_process_group(), without distlib.shutdown()) the extra groups are dropped too
        _EXTRA_GROUPS = (weakref.ref(world, _world_gone), [])
    extra = _EXTRA_GROUPS[1]
    while len(extra) < n - 1:  # the same number of new_group calls on every rank: the same n
        desc = f"distlib_comm_group_{len(extra) + 1}"
        extra.append(dist.new_group(timeout=_world_timeout(), group_desc=desc))
    return [None] + extra[: n - 1]


def _world_gone(ref: weakref.ref) -> None:
    global _EXTRA_GROUPS
    if _EXTRA_GROUPS is not None and _EXTRA_GROUPS[0] is ref:
        _EXTRA_GROUPS = None


def forget_groups() -> None:
    """Drop the groups ``comm_groups`` made (``distlib.shutdown()`` calls it): a group that is
    still referenced keeps its gloo worker threads alive after the process group is destroyed."""
    global _EXTRA_GROUPS
    _EXTRA_GROUPS = None


def sync_buffers(module: torch.nn.Module, *, group: dist.ProcessGroup | None = None, replicas: int = 1) -> None:
    """Average ``module``'s floating-point buffers (BatchNorm running statistics) over the ranks
    of ``group`` (default: all) and take its first rank's other buffers, so that every rank
    evaluates the same model.

    ``replicas`` > 1: each rank's floating-point buffers already hold the sum of that many
    replicas' values (Replicas sums its GPUs' first), so the average divides by
    ``replicas`` times the number of ranks. Every rank of ``group`` must call it, in the same order.
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ArgumentError(f"sync_buffers: replicas must be an integer >= 1, got {replicas!r}")
    buffers = [b.detach() for b in module.buffers()]
    floats = [b for b in buffers if b.is_floating_point()]
    if not active(group):
        if replicas > 1:
            for b in floats:
                b.div_(replicas)
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    count = replicas * dist.get_world_size(group)
    for dtype in sorted({b.dtype for b in floats}, key=str):
        same = [b for b in floats if b.dtype == dtype]
        flat = torch.cat([b.reshape(-1) for b in same])
        dist.all_reduce(flat, group=group)  # SUM, divided afterwards: gloo has no AVG
        flat.div_(count)
        for b, part in zip(same, flat.split([b.numel() for b in same])):
            b.copy_(part.view(b.shape))
    for b in buffers:
        if not b.is_floating_point():
            dist.broadcast(b, src=src, group=group)
