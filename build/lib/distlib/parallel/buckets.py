"""How gradients are cut into buckets for all_reduce, and the bucketed all_reduce of a flat buffer.

One rule everywhere: the first bucket holds at most ``first_bucket_bytes`` (small, so that
communication starts early in backward), every later one at most ``bucket_bytes``. GradSync
cuts whole tensors (``group_tensors``: a tensor is never split, a bucket holds one dtype);
a flat buffer is cut at element boundaries (``bounds``: Replicas' inter-node all_reduce and the
benchmark's imitation of GradSync).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from distlib.distributed import collectives

MB = 2**20


def _check(bucket_bytes: int, first_bucket_bytes: int) -> None:
    if bucket_bytes <= 0 or first_bucket_bytes <= 0:
        raise ValueError(f"bucket sizes must be > 0 bytes, got {bucket_bytes} and first {first_bucket_bytes}")


def group_tensors(
    tensors: Sequence[torch.Tensor], bucket_bytes: int, first_bucket_bytes: int | None = None
) -> list[list[int]]:
    """Indices of ``tensors`` (in the given order) grouped into buckets: consecutive tensors of one
    dtype while the bucket stays within its cap. A tensor larger than the cap gets a bucket of its own."""
    first = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
    _check(bucket_bytes, first)
    groups: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        cap = first if len(groups) == 1 else bucket_bytes
        if groups and tensors[groups[-1][0]].dtype == t.dtype and size + nbytes <= cap:
            groups[-1].append(i)
            size += nbytes
        else:
            groups.append([i])
            size = nbytes
    return groups


def bounds(
    numel: int, element_size: int, bucket_bytes: int, first_bucket_bytes: int | None = None
) -> list[tuple[int, int]]:
    """(start, stop) element ranges that cut a flat buffer of ``numel`` elements into buckets."""
    first = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
    _check(bucket_bytes, first)
    out, start = [], 0
    cap = max(1, first // element_size)
    while start < numel:
        stop = min(numel, start + cap)
        out.append((start, stop))
        start = stop
        cap = max(1, bucket_bytes // element_size)
    return out


def allreduce_buckets(
    flat: torch.Tensor, bucket_mb: float = 25.0, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Sum the 1-D tensor ``flat`` in place over the processes of ``group`` and return it.

    ``flat`` is cut into buckets of at most ``bucket_mb`` MiB, each all_reduced
    asynchronously; all are waited for before returning. A no-op without a process
    group or at world size 1. A collective: every process of ``group`` must call it, in the
    same order, with a tensor of the same size and dtype.
    """
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}")
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"allreduce_buckets needs a contiguous 1-D tensor, got shape {tuple(flat.shape)}")
    if not collectives.active(group):
        return flat
    cut = bounds(flat.numel(), flat.element_size(), int(bucket_mb * MB))
    works = [dist.all_reduce(flat[a:b], group=group, async_op=True) for a, b in cut]
    for w in works:
        w.wait()
    return flat
