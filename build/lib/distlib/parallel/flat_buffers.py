"""Tensors laid out in one flat buffer per dtype, each seen through a view with its own strides.

GradSync keeps its gradient buckets here and Replicas its parameters and gradients: one
collective (or one ``torch.cuda.comm`` call) per buffer then moves every tensor of that dtype.
A view keeps the memory layout of the tensor it stands for (channels_last stays channels_last),
so fused/foreach optimizers keep their fast path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """Strides of a dense tensor with ``t``'s memory layout: ``t``'s own when it is dense (channels_last
    included), else those torch's ``empty_like`` picks for it."""
    return torch.empty_like(t, device="meta").stride()


class FlatBuffers:
    """One zero-filled flat buffer per dtype holding ``tensors`` in order, and a view of each.

    ``views[i]`` has ``tensors[i]``'s shape, dtype and layout and lives in ``flat[dtype]`` from
    element ``offsets[i]`` on. ``align`` > 1 rounds each tensor's slot up to a multiple of that
    many elements (aligned starts for the copy kernels); the padding stays zero. The tensors of
    one dtype are consecutive in the order given, so a run of them is one contiguous slice
    (``span``).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device | str, align: int = 1):
        if align < 1:
            raise ValueError(f"align must be >= 1, got {align!r}")
        self.offsets: list[int] = []
        sizes: dict[torch.dtype, int] = {}
        for t in tensors:
            start = sizes.get(t.dtype, 0)
            self.offsets.append(start)
            sizes[t.dtype] = start + math.ceil(t.numel() / align) * align
        self.flat: dict[torch.dtype, torch.Tensor] = {
            dt: torch.zeros(n, dtype=dt, device=device) for dt, n in sizes.items()
        }
        self.views: list[torch.Tensor] = [
            self.flat[t.dtype].as_strided(t.shape, dense_strides(t), off) for t, off in zip(tensors, self.offsets)
        ]

    def span(self, first: int, last: int) -> torch.Tensor:
        """The contiguous slice of the flat buffer from tensor ``first``'s start to tensor ``last``'s
        end (both of one dtype; ``last`` after ``first``)."""
        a, b = self.views[first], self.views[last]
        if a.dtype != b.dtype or last < first:
            raise ValueError(
                f"span needs two tensors of one dtype in order, got {first} ({a.dtype}), {last} ({b.dtype})"
            )
        return self.flat[a.dtype][self.offsets[first] : self.offsets[last] + b.numel()]

    def zero_(self) -> None:
        """Zero every buffer (one kernel per dtype)."""
        for flat in self.flat.values():
            flat.zero_()
