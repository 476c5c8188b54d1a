"""Warm-up before the clock: run a few real training steps so that cuDNN's
autotuning, lazy CUDA/NCCL set-up and CUDA-graph capture happen outside the
timed training, then put the model and optimizer back exactly as they were.

Everything is restored in place (``copy_``/``zero_``), never by replacing
tensors: a captured CUDA graph keeps reading and writing the same memory.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import nn


@torch.no_grad()
def _snapshot(modules: list[nn.Module]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every tensor a step may change: the buffers, and the parameters, but for the frozen ones
    (``requires_grad=False``) of a module that trains others (a LoRA model's base: no step changes
    it). A module none of whose parameters trains (a weight average, moved outside autograd) is
    copied whole, but for those frozen parameters, which it shares (``distlib.EMA``)."""
    trains = [any(p.requires_grad for p in m.parameters()) for m in modules]
    frozen = {id(p) for m, t in zip(modules, trains) if t for p in m.parameters() if not p.requires_grad}
    out = []
    for m, t in zip(modules, trains):
        params = [p for p in m.parameters() if (p.requires_grad or not t) and id(p) not in frozen]
        out += [(x, x.detach().clone()) for x in itertools.chain(params, m.buffers())]
    return out


def warm_up(step: Callable[[], object], modules: list[nn.Module], optimizer: torch.optim.Optimizer, steps: int) -> None:
    """Call ``step()`` ``steps`` times, then restore parameters and buffers of ``modules``
    and reset the optimizer's state to its start.

    Zeroed momentum equals a fresh SGD's first step (its buffer starts as the first
    gradient: 0 * momentum + grad). On a GPU, ``step`` must run the same kernels as
    training does, which is the point. Every rank must call it (``step`` communicates).
    """
    if steps <= 0:
        return
    saved = _snapshot(modules)
    for _ in range(steps):
        step()
    with torch.no_grad():
        for t, s in saved:
            t.copy_(s)
        inner = getattr(optimizer, "inner", None)  # a ShardedOptimizer's state is its inner optimizer's
        states = [*optimizer.state.values(), *(inner.state.values() if inner is not None else [])]
        for state in states:
            for v in state.values():
                if torch.is_tensor(v):
                    v.zero_()
    optimizer.zero_grad(set_to_none=False)
