"""Barrier, reduce, all_reduce, broadcast and all_gather_object.

Every function here is a collective: every rank must call it, in the same
order, with tensors of the same shape and dtype. At world size 1 (no process
group) each is a no-op that returns its input.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if _active() else 1


def rank() -> int:
    return dist.get_rank() if _active() else 0


def _op(op: str, t: torch.Tensor) -> dist.ReduceOp:
    try:
        reduce_op = _OPS[op]
    except KeyError:
        raise ValueError(f"op must be one of {', '.join(_OPS)}, got {op!r}") from None
    if op == "mean" and not (t.is_floating_point() or t.is_complex()):
        raise ValueError(f"op='mean' needs a floating-point tensor, got {t.dtype}")
    return reduce_op


def barrier() -> None:
    """Wait until every rank gets here. Every rank must call it, in the same order."""
    if _active():
        dist.barrier()


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce ``t`` in place over all ranks and return it; every rank gets the result.

    ``op`` is "sum", "mean", "max" or "min". Every rank must call it, in the same
    order, with a tensor of the same shape and dtype.
    """
    reduce_op = _op(op, t)
    if not _active():
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
    if not _active():
        return t
    dist.reduce(t, dst=dst, op=reduce_op)
    if op == "mean" and dist.get_rank() == dst:
        t.div_(dist.get_world_size())
    return t


def broadcast(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Copy rank ``src``'s ``t`` into every rank's ``t`` in place and return it.

    Every rank must call it, in the same order, with a tensor of the same shape and dtype.
    """
    if _active():
        dist.broadcast(t, src=src)
    return t


def all_gather_object(obj: Any) -> list[Any]:
    """Gather one picklable object from each rank; returns the list in rank order.

    Every rank must call it, in the same order.
    """
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank. Every rank must call it, in the same order."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
