"""Gradient averaging over ranks with bucketed all_reduce (not a DDP wrapper).

This is the simple, correct version: after backward, ``wait()`` packs the
gradients into buckets, all_reduces each and unpacks the averages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn


class GradSync:
    """Averages gradients over all ranks.

    Built once per model on every rank (a collective: every rank must build it,
    in the same order); broadcasts rank 0's parameters and buffers so that all
    replicas start equal. Call ``wait()`` after ``loss.backward()`` and before
    ``optimizer.step()`` on every rank; inside ``with sync.no_sync():`` gradients
    accumulate locally and nothing is communicated.
    """

    def __init__(self, model: nn.Module, bucket_mb: float = 25.0):
        self.model = model
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._skip = False
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        if self.world_size > 1:
            with torch.no_grad():
                for t in list(model.parameters()) + list(model.buffers()):
                    dist.broadcast(t.data, src=0)
        self.buckets = self._make_buckets()

    def _make_buckets(self) -> list[list[nn.Parameter]]:
        buckets: list[list[nn.Parameter]] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(self.params):  # backward produces the last layers' gradients first
            if current and (size + p.numel() * p.element_size() > self.bucket_bytes or p.dtype != current[0].dtype):
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            buckets.append(current)
        return buckets

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip communication: gradients of the backward passes inside accumulate locally."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def wait(self) -> None:
        """Leave every gradient averaged over the ranks. A collective: every rank must call it."""
        if self._skip or self.world_size == 1:
            return
        for bucket in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])
            flat.div_(self.world_size)
            dist.all_reduce(flat)
            offset = 0
            for p, g in zip(bucket, grads):
                n = g.numel()
                p.grad = flat[offset : offset + n].view_as(p).clone()
                offset += n
