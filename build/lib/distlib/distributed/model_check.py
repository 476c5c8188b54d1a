"""The cross-rank model check: every rank must hold the same model before gradients are averaged.

Building GradSync or Replicas runs it: each rank hashes a description of its model (every
parameter's and buffer's name, shape, dtype and requires_grad, in registration order) and the
hashes are compared. A mismatch raises ``ModelMismatchError`` on every rank, naming the
differences, instead of hanging (or silently averaging unrelated tensors) later.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch.distributed as dist
from torch import nn

from distlib.distributed import collectives
from distlib.errors import DistlibError

Row = tuple[str, str, tuple[int, ...], str, bool]


class ModelMismatchError(DistlibError, RuntimeError):
    """The model's parameters or buffers differ between ranks (raised on every rank)."""


def describe(model: nn.Module) -> list[Row]:
    """(kind, name, shape, dtype, requires_grad) of every parameter and buffer, in order."""
    rows = [("param", n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]
    rows += [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in model.named_buffers()]
    return rows


def differences(reference: list[Row], mine: list[Row], rank: int, limit: int = 8) -> list[str]:
    """Readable differences between rank 0's description and ``rank``'s (at most ``limit`` lines)."""
    ref = {(k, n): (s, d, g) for k, n, s, d, g in reference}
    own = {(k, n): (s, d, g) for k, n, s, d, g in mine}
    out = []
    for key in own.keys() - ref.keys():
        out.append(f"rank {rank}: {key[0]} {key[1]!r} {own[key][0]} does not exist on rank 0")
    for key in ref.keys() - own.keys():
        out.append(f"rank {rank}: {key[0]} {key[1]!r} {ref[key][0]} of rank 0 is missing")
    for key in ref.keys() & own.keys():
        (s0, d0, g0), (s1, d1, g1) = ref[key], own[key]
        if s0 != s1:
            out.append(f"rank {rank}: {key[0]} {key[1]!r} has shape {s1}, rank 0 has {s0}")
        if d0 != d1:
            out.append(f"rank {rank}: {key[0]} {key[1]!r} has dtype {d1}, rank 0 has {d0}")
        if g0 != g1:
            out.append(f"rank {rank}: {key[0]} {key[1]!r} has requires_grad={g1}, rank 0 has {g0}")
    if not out:  # same entries, another order
        for i, (a, b) in enumerate(zip(reference, mine)):
            if a != b:
                out.append(f"rank {rank}: registration order differs at position {i}: {b[1]!r}, rank 0 has {a[1]!r}")
                break
    out.sort()
    return out[:limit] + ([f"rank {rank}: ... and {len(out) - limit} more"] if len(out) > limit else [])


def _gather(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def check_same_model(
    model: nn.Module, who: str, *, group: dist.ProcessGroup | None = None, extra: Any = None
) -> list[Any]:
    """Raise ``ModelMismatchError`` on every rank of ``group`` (default: all) unless all hold the
    same model (see the module's docstring); ``who`` starts the message.

    ``extra`` (any picklable value) travels along in the same collective; returns every rank's
    ``extra``, in rank order, for checks of the caller's own (at world size 1: ``[extra]``).
    A collective: every rank of ``group`` must call it, in the same order.
    """
    if not collectives.active(group):
        return [extra]
    desc = describe(model)
    digest = hashlib.sha256(repr(desc).encode()).hexdigest()
    gathered = _gather((digest, extra), group)
    digests = [d for d, _ in gathered]
    if len(set(digests)) > 1:
        descs = _gather(desc, group)  # every rank saw the mismatch: a consistent second call
        lines = []
        for r in range(1, len(descs)):
            if digests[r] != digests[0]:
                lines += differences(descs[0], descs[r], r)
        raise ModelMismatchError(
            f"{who}: the model differs between ranks (every rank must build the same model):\n  " + "\n  ".join(lines)
        )
    return [e for _, e in gathered]
