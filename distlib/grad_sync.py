"""Gradient averaging over ranks: flat bucket buffers, all_reduce overlapped with backward.

Buckets are filled in the order backward produces gradients and all_reduced asynchronously, in
bucket order on every rank, round-robin over ``comm_groups`` communicators. Design and behaviour
(unused parameters, accumulation, compression, buffers): docs/grad_sync.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from distlib import collectives
from distlib.buckets import group_tensors
from distlib.flat_buffers import FlatBuffers
from distlib.model_check import ModelMismatchError, check_same_model
from distlib.state_broadcast import broadcast_module

__all__ = ["GradSync", "ModelMismatchError"]  # ModelMismatchError lives in distlib.model_check

_MB = 2**20


class _Slot:
    """One trainable parameter's place in the flat buffers."""

    __slots__ = ("param", "index", "bucket", "view", "ready_step")

    def __init__(self, param: nn.Parameter, index: int):
        self.param = param
        self.index = index  # registration index among the trainable parameters
        self.bucket: _Bucket | None = None
        self.view: torch.Tensor | None = None
        self.ready_step = -1


class _Bucket:
    __slots__ = ("index", "slots", "flat", "comp", "pending", "work")

    def __init__(self, index: int, slots: list[_Slot], flat: torch.Tensor, comp: torch.Tensor | None):
        self.index = index
        self.slots = slots
        self.flat = flat  # contiguous slice of the dtype's storage
        self.comp = comp  # bf16 copy that travels instead of flat (compression), or None
        self.pending = len(slots)
        self.work: dist.Work | None = None


class GradSync:
    """Averages gradients over all ranks with bucketed all_reduce overlapped with backward.

    Building it is a collective (every rank must build it, in the same order): the ranks check
    that their models match (names, shapes, dtypes, order; a mismatch raises
    ``ModelMismatchError`` on every rank naming the difference), then rank 0's parameters and
    buffers are broadcast so that all replicas start equal.

    Use: ``loss.backward(); sync.wait(); opt.step(); opt.zero_grad()``. ``wait()`` is a collective:
    every rank calls it after each synced backward, before the optimizer step. Inside
    ``with sync.no_sync():`` nothing is communicated and gradients accumulate; the next synced
    backward all_reduces the accumulated sum. ``compress="bf16"`` sends bf16 copies of the
    buckets (half the bytes, bf16 rounding of the average). ``comm_groups=n`` spreads the
    buckets round-robin over ``n`` communicators (``collectives.comm_groups``, created once per
    process and shared by every GradSync) so that consecutive buckets' all_reduces overlap. At
    world size 1 nothing is done (and no group is created).
    """

    def __init__(
        self,
        model: nn.Module,
        bucket_mb: float = 25.0,
        *,
        first_bucket_mb: float = 1.0,
        compress: Literal["none", "bf16"] = "none",
        broadcast: bool = True,
        comm_groups: int = 1,
    ):
        if bucket_mb <= 0 or first_bucket_mb <= 0:
            raise ValueError(f"bucket sizes must be > 0, got bucket_mb={bucket_mb}, first_bucket_mb={first_bucket_mb}")
        if compress not in ("none", "bf16"):
            raise ValueError(f"compress must be 'none' or 'bf16', got {compress!r}")
        if isinstance(comm_groups, bool) or not isinstance(comm_groups, int) or comm_groups < 1:
            raise ValueError(f"comm_groups must be an integer >= 1, got {comm_groups!r}")
        self.model = model
        self.bucket_bytes = int(bucket_mb * _MB)
        self.first_bucket_bytes = int(first_bucket_mb * _MB)
        self.compress = compress
        self.world_size = collectives.world_size()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._skip = False
        self._step = 0
        self._next_bucket = 0
        self._rebuilt = False
        self._arrival: list[int] | None = []  # registration indices in the first backward's order
        self.buckets: list[_Bucket] = []
        self._storages: list[torch.Tensor] = []
        self._slots = [_Slot(p, i) for i, p in enumerate(self.params)]
        self._hooks: list = []
        self.comm_groups = comm_groups
        if self.world_size == 1:
            return
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"GradSync needs the model on one device; parameters on {sorted(map(str, devices))}")
        self._preflight()
        if broadcast:
            self._broadcast_state()
        # new_group is a collective: here, on every rank, once (shared with other GradSyncs)
        collectives.comm_groups(comm_groups)  # a collective when it creates them: now, on every rank
        backend = dist.get_backend()
        # NCCL averages inside the kernel; gloo has no AVG, so buckets are pre-divided.
        self._op = dist.ReduceOp.AVG if backend == "nccl" else dist.ReduceOp.SUM
        self._prediv = backend != "nccl"
        if self.params:
            self._layout([len(self.params) - 1 - i for i in range(len(self.params))])
        for slot in self._slots:
            self._hooks.append(slot.param.register_post_accumulate_grad_hook(self._hook_for(slot.index)))

    # ---- construction ----------------------------------------------------------------
    def _preflight(self) -> None:
        """Every rank compares a hash of its model's description with the others'."""
        check_same_model(self.model, "GradSync")

    def _broadcast_state(self) -> None:
        """Rank 0's parameters and buffers to every rank."""
        broadcast_module(self.model)

    def _layout(self, order: list[int]) -> None:
        """Flat storages and buckets for the trainable parameters in ``order`` (registration indices)."""
        slots = [self._slots[i] for i in order]
        params = [s.param for s in slots]
        flat = FlatBuffers(params, params[0].device)
        self._storages = list(flat.flat.values())
        self.buckets = []
        for group in group_tensors(params, self.bucket_bytes, self.first_bucket_bytes):
            span = flat.span(group[0], group[-1])
            comp = None
            if self.compress == "bf16" and span.dtype in (torch.float32, torch.float64):
                comp = torch.empty(span.numel(), dtype=torch.bfloat16, device=span.device)
            bucket = _Bucket(len(self.buckets), [slots[i] for i in group], span, comp)
            for i in group:
                slots[i].view = flat.views[i]
                slots[i].bucket = bucket
            self.buckets.append(bucket)

    def _hook_for(self, index: int):
        def hook(_: torch.Tensor) -> None:
            self._on_ready(self._slots[index])

        return hook

    # ---- per step --------------------------------------------------------------------
    def _on_ready(self, slot: _Slot) -> None:
        """A parameter's gradient is complete for this backward (called from autograd)."""
        if self._arrival is not None:
            self._arrival.append(slot.index)
        if self._skip:
            return
        if slot.ready_step == self._step:
            raise RuntimeError(
                f"GradSync: gradient of {self._names.get(id(slot.param), '?')!r} produced twice before "
                "sync.wait(); call wait() after every synced backward and use `with sync.no_sync():` "
                "for accumulation steps"
            )
        slot.ready_step = self._step
        bucket = slot.bucket
        bucket.pending -= 1
        if bucket.pending == 0:
            # launch in bucket order only: collectives must be issued in the same order on every rank
            while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
                self._launch(self.buckets[self._next_bucket])
                self._next_bucket += 1

    def _launch(self, bucket: _Bucket) -> None:
        """Gather the bucket's gradients into its flat buffer and start its all_reduce."""
        srcs, dsts, zeros = [], [], []
        for s in bucket.slots:
            g = s.param.grad
            if g is s.view:
                continue  # accumulated in place by autograd
            if g is None:
                zeros.append(s.view)  # no gradient here (yet): contributes zeros
            else:
                srcs.append(g)
                dsts.append(s.view)
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        if zeros:
            torch._foreach_zero_(zeros)
        if self._prediv:
            bucket.flat.div_(self.world_size)
        payload = bucket.flat
        if bucket.comp is not None:
            bucket.comp.copy_(bucket.flat)
            payload = bucket.comp
        # Bucket i always goes to group i % n, and buckets launch in index order: every rank issues
        # the same collectives on each group in the same order (NCCL and gloo match them by order).
        # Extra groups are looked up, not kept: distlib.shutdown() drops them, and a group still
        # referenced keeps gloo's worker threads (and the abort at exit) alive. None = default group.
        group = None
        if self.comm_groups > 1:
            group = collectives.comm_groups(self.comm_groups)[bucket.index % self.comm_groups]
        bucket.work = dist.all_reduce(payload, op=self._op, group=group, async_op=True)

    def wait(self) -> None:
        """Leave every gradient averaged over the ranks (``p.grad`` a view into its bucket).

        A collective: every rank must call it after each synced backward, before the optimizer
        step. A no-op inside ``no_sync()`` and at world size 1.
        """
        if self._skip or self.world_size == 1:
            return
        while self._next_bucket < len(self.buckets):  # buckets whose gradients did not all arrive
            self._launch(self.buckets[self._next_bucket])
            self._next_bucket += 1
        for b in self.buckets:  # every group's work (on NCCL the current stream waits for each)
            b.work.wait()
            b.work = None
            if b.comp is not None:
                b.flat.copy_(b.comp)
            b.pending = len(b.slots)
        for s in self._slots:
            if s.param.grad is not s.view:
                s.param.grad = s.view
        self._next_bucket = 0
        self._step += 1
        if not self._rebuilt:
            self._rebuild()

    def _rebuild(self) -> None:
        """Once, after the first synced step: lay buckets out in rank 0's gradient arrival order."""
        self._rebuilt = True
        seen: dict[int, None] = dict.fromkeys(self._arrival or [])
        self._arrival = None
        order = list(seen) + [i for i in reversed(range(len(self.params))) if i not in seen]
        order = collectives.broadcast_object(order, src=0)
        current = [s.index for b in self.buckets for s in b.slots]
        if order == current:
            return
        grads = [s.view for s in self._slots]
        self._layout(order)
        torch._foreach_copy_([s.view for s in self._slots], grads)
        for s in self._slots:
            s.param.grad = s.view

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip communication: the backward passes inside accumulate gradients locally."""
        previous = self._skip
        self._skip = True
        try:
            yield
        finally:
            self._skip = previous

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Zero every gradient in place, keeping the bucket views (one kernel per dtype).

        ``opt.zero_grad()`` (set_to_none=True) is equally correct: ``wait()`` re-attaches the views.
        """
        if self.world_size == 1 or not self.buckets:
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)
            return
        for storage in self._storages:
            storage.zero_()
        for s in self._slots:
            if s.param.grad is not s.view:
                s.param.grad = s.view

    @torch.no_grad()
    def sync_buffers(self) -> None:
        """Average the floating-point buffers (BatchNorm running statistics) over the ranks and take
        rank 0's other buffers, e.g. before evaluating. A collective: every rank must call it."""
        collectives.sync_buffers(self.model)

    def bucket_sizes(self) -> list[int]:
        """Bytes of each bucket, in launch order."""
        return [b.flat.numel() * b.flat.element_size() for b in self.buckets]

    def close(self) -> None:
        """Remove the hooks (the gradients stay where they are)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
