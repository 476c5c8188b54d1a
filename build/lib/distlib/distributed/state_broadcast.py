"""Rank 0's parameters and buffers to every rank, so that all replicas start equal; and any list of
tensors from one rank to the others in as few broadcasts as possible.

Tensors are coalesced per device into flat byte chunks of at most 64 MiB: one broadcast for all the
dtypes of a module's buffers (BatchNorm's float statistics and its int64 counter travel together).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from distlib.distributed import collectives

_CHUNK_BYTES = 64 * 2**20


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a flat uint8 tensor (a view when ``t`` is contiguous)."""
    return t.reshape(-1).view(torch.uint8)


@torch.no_grad()
def broadcast_tensors(
    tensors: Sequence[torch.Tensor],
    src: int = 0,
    *,
    group: dist.ProcessGroup | None = None,
    chunk_bytes: int = _CHUNK_BYTES,
) -> None:
    """Copy global rank ``src``'s ``tensors`` into every rank's, in place: one broadcast per device
    and chunk of ``chunk_bytes``, whatever their dtypes. A no-op at world size 1. A collective:
    every rank of ``group`` must call it, in the same order, with tensors of the same shapes and
    dtypes in the same order."""
    if not collectives.active(group):
        return
    is_src = dist.get_rank() == src
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t.detach())
    for same in by_device.values():
        chunk: list[torch.Tensor] = []
        size = 0
        for t in same + [None]:
            if t is not None and (not chunk or size + t.numel() * t.element_size() <= chunk_bytes):
                chunk.append(t)
                size += t.numel() * t.element_size()
                continue
            flat = torch.cat([_bytes(c.contiguous()) for c in chunk])
            dist.broadcast(flat, src=src, group=group)
            if not is_src:
                for c, part in zip(chunk, flat.split([c.numel() * c.element_size() for c in chunk])):
                    if c.is_contiguous():
                        _bytes(c).copy_(part)  # byte for byte: no alignment needed
                    else:
                        c.copy_(part.clone().view(c.dtype).view(c.shape))
            if t is not None:
                chunk, size = [t], t.numel() * t.element_size()


def broadcast_module(
    model: nn.Module, *, group: dist.ProcessGroup | None = None, chunk_bytes: int = _CHUNK_BYTES
) -> None:
    """Copy the parameters and buffers of ``group``'s first rank (default: rank 0) into every
    rank's ``model``, in place. A no-op at world size 1. A collective: every rank of ``group``
    must call it, in the same order, with the same model."""
    if not collectives.active(group):
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    tensors = list(model.parameters()) + list(model.buffers())
    broadcast_tensors(tensors, src, group=group, chunk_bytes=chunk_bytes)
