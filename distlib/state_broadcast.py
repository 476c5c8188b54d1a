"""Rank 0's parameters and buffers to every rank, so that all replicas start equal.

Tensors are coalesced per (device, dtype) into flat chunks of at most 64 MiB: a few large
broadcasts instead of one per tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from distlib import collectives

_CHUNK_BYTES = 64 * 2**20


@torch.no_grad()
def broadcast_module(
    model: nn.Module, *, group: dist.ProcessGroup | None = None, chunk_bytes: int = _CHUNK_BYTES
) -> None:
    """Copy the parameters and buffers of ``group``'s first rank (default: rank 0) into every
    rank's ``model``, in place. A no-op at world size 1. A collective: every rank of ``group``
    must call it, in the same order, with the same model."""
    if not collectives.active(group):
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    is_src = dist.get_rank() == src
    tensors = [p.detach() for p in model.parameters()] + [b.detach() for b in model.buffers()]
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    for same in by_kind.values():
        chunk: list[torch.Tensor] = []
        size = 0
        for t in same + [None]:
            if t is not None and (not chunk or size + t.numel() * t.element_size() <= chunk_bytes):
                chunk.append(t)
                size += t.numel() * t.element_size()
                continue
            flat = torch.cat([c.reshape(-1) for c in chunk])
            dist.broadcast(flat, src=src, group=group)
            if not is_src:
                for c, part in zip(chunk, flat.split([c.numel() for c in chunk])):
                    c.copy_(part.view(c.shape))
            if t is not None:
                chunk, size = [t], t.numel() * t.element_size()
