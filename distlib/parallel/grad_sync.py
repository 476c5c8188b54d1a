"""Gradient averaging over ranks: flat bucket buffers, all_reduce overlapped with backward.

Buckets are filled in the order backward produces gradients and all_reduced asynchronously, in
bucket order on every rank, round-robin over ``comm_groups`` communicators. Each bucket ends with
one "used" mark per parameter, reduced by the same all_reduce: a parameter no rank used keeps its
``.grad`` (None), as DDP with ``find_unused_parameters=True``. Design and behaviour (unused
parameters, requires_grad changes, uneven inputs with ``join()``, accumulation, compression,
buffers): docs/grad_sync.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from distlib.distributed import collectives
from distlib.distributed.model_check import ModelMismatchError, check_same_model
from distlib.distributed.state_broadcast import broadcast_module, broadcast_tensors
from distlib.errors import ArgumentError, DistlibError
from distlib.parallel import sharded_optimizer
from distlib.parallel.buckets import group_tensors
from distlib.parallel.flat_buffers import FlatBuffers

# ModelMismatchError lives in distlib.distributed.model_check
__all__ = ["GradSync", "GradSyncError", "GradSyncTimeout", "ModelMismatchError"]

_MB = 2**20
_ABORT = 1 << 20  # join(): announced by a rank that stops (more than any number of active ranks)


class GradSyncError(DistlibError, RuntimeError):
    """GradSync used against its contract: a gradient produced twice before ``wait()`` (a forgotten
    ``no_sync``), ``requires_grad`` changed differently on the ranks, ``join()`` misused, a step some
    rank never reached (uneven inputs without ``join()``). A RuntimeError too, as these were before."""


class GradSyncTimeout(GradSyncError):
    """A gradient all_reduce timed out in ``wait()``: some rank did not run this step (uneven inputs
    without ``join()``, or a rank that stopped or died). Its ``__cause__`` is the collective's own error;
    ``distlib.reliability.failures.describe`` reports it as the collective timeout it is."""


def _stalled(e: RuntimeError) -> GradSyncTimeout:
    """A bucket's all_reduce timed out in ``wait()``: some rank did not run this step."""
    return GradSyncTimeout(
        f"GradSync.wait(): a gradient all_reduce timed out ({str(e).strip().splitlines()[0]}): some rank did not "
        "run this step. With uneven inputs (a rank has fewer batches), wrap the training loop in "
        "`with sync.join():`, or give every rank the same number of steps (distributed_loader pads so that "
        "they are equal); otherwise a rank stopped or is slower than the timeout (distlib.init(timeout_s=...))"
    )


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _Slot:
    """One trainable parameter's place in the flat buffers."""

    __slots__ = ("param", "index", "bucket", "view", "ready_step", "used")

    def __init__(self, param: nn.Parameter, index: int):
        self.param = param
        self.index = index  # registration index among the trainable parameters
        self.bucket: _Bucket | None = None
        self.view: torch.Tensor | None = None
        self.ready_step = -1
        self.used = False  # got a gradient since the last synced step (no_sync micro-steps included)


class _Bucket:
    __slots__ = ("index", "slots", "flat", "comp", "pending", "work", "used")

    def __init__(
        self,
        index: int,
        slots: list[_Slot],
        flat: torch.Tensor,
        comp: torch.Tensor | None,
        used: torch.Tensor | None = None,
    ):
        self.index = index
        self.slots = slots
        self.flat = flat  # contiguous slice of the dtype's storage: the gradients, then one "used" mark per slot
        # nonzero after the all_reduce iff some rank used the slot (sharded: a view of GradSync._marks)
        self.used = flat[flat.numel() - len(slots) :] if used is None else used
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

    Buffers (BatchNorm's running statistics) as DDP's default ``broadcast_buffers=True``: a forward
    pre-hook broadcasts rank 0's buffers before each forward that follows a synced forward (grad
    enabled, outside ``no_sync``), in one broadcast per device; ``broadcast_buffers=False`` leaves
    each rank its own (then ``sync_buffers()`` averages them, e.g. before evaluating).
    ``require_backward_grad_sync`` is DDP's attribute: set to False, backward passes accumulate
    locally as inside ``no_sync()``.

    As DDP with ``find_unused_parameters=True``: a parameter no rank used in a step keeps its
    ``.grad`` (None after ``opt.zero_grad()``), without an extra collective. ``requires_grad``
    changed after construction is followed at the next ``wait()``. ``with sync.join():`` around
    the training loop handles uneven inputs (ranks that run out of batches shadow the others).

    ``shard="optimizer"`` (ZeRO-1) reduce-scatters each bucket into this rank's slice instead, for
    the optimizer from ``sync.sharded_optimizer(...)``, which steps only that slice and all_gathers
    the parameters; ``sync.clip_grad_norm_`` clips by the global norm in both modes
    (distlib/parallel/sharded_optimizer.py; docs/grad_sync.md, "Optimizer sharding").
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
        shard: Literal["none", "optimizer"] = "none",
        broadcast_buffers: bool = True,
    ):
        if bucket_mb <= 0 or first_bucket_mb <= 0:
            raise ArgumentError(
                f"bucket sizes must be > 0, got bucket_mb={bucket_mb}, first_bucket_mb={first_bucket_mb}"
            )
        if compress not in ("none", "bf16"):
            raise ArgumentError(f"compress must be 'none' or 'bf16', got {compress!r}")
        if isinstance(comm_groups, bool) or not isinstance(comm_groups, int) or comm_groups < 1:
            raise ArgumentError(f"comm_groups must be an integer >= 1, got {comm_groups!r}")
        if shard not in ("none", "optimizer"):
            raise ArgumentError(f"shard must be 'none' or 'optimizer', got {shard!r}")
        self.shard = shard
        self.layout_version = 0  # bumped by every bucket layout (the sharded optimizer follows it)
        self._marks: torch.Tensor | None = None  # shard="optimizer": every slot's used mark, then the squared norm
        self._sharded_optimizer = None  # shard="optimizer": the ShardedOptimizer built on this GradSync
        self._grad_versions: tuple[int, ...] | None = None  # shard="optimizer": the buckets' versions after wait()
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
        self._frozen = [p for p in model.parameters() if not p.requires_grad]  # watched: unfrozen means a rebuild
        self._joining = False
        self._announced: dist.Work | None = None
        self._device = self.params[0].device if self.params else torch.device("cpu")
        self.comm_groups = comm_groups
        # NCCL averages inside the kernel; gloo has no AVG, so buckets are pre-divided.
        self._op, self._prediv = dist.ReduceOp.SUM, False
        if shard == "optimizer":
            # the same path at world size 1 (buckets, hooks, marks, the optimizer's pieces), without the
            # collectives and without copying gradients (see _layout); buckets keep their first layout
            # (reverse registration order): a rebuild after a reduce_scatter would move gradients that
            # only another rank has averaged
            self._rebuilt, self._arrival = True, None
        self.broadcast_buffers = broadcast_buffers
        # DDP's require_forward_param_sync: the last forward was a synced one (grad enabled, outside
        # no_sync), so the next forward broadcasts rank 0's buffers first. True: the first forward does.
        self._forward_sync = True
        self._forward_hook = None
        if self.world_size == 1:
            if shard == "optimizer" and self.params:
                self._layout([len(self.params) - 1 - i for i in range(len(self.params))])
                for slot in self._slots:
                    self._hooks.append(slot.param.register_post_accumulate_grad_hook(self._hook_for(slot.index)))
            return
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ArgumentError(f"GradSync needs the model on one device; parameters on {sorted(map(str, devices))}")
        self._preflight()
        if broadcast:
            self._broadcast_state()
        # new_group is a collective: here, on every rank, once (shared with other GradSyncs)
        collectives.comm_groups(comm_groups)  # a collective when it creates them: now, on every rank
        backend = dist.get_backend()
        self._op = dist.ReduceOp.AVG if backend == "nccl" else dist.ReduceOp.SUM
        self._prediv = backend != "nccl"
        if self.params:
            self._layout([len(self.params) - 1 - i for i in range(len(self.params))])
        for slot in self._slots:
            self._hooks.append(slot.param.register_post_accumulate_grad_hook(self._hook_for(slot.index)))
        if broadcast_buffers and next(model.buffers(), None) is not None:  # none (a GPT): nothing to do, as DDP
            # run eagerly under torch.compile (compile_for_sync): a collective and Python state, not graph code
            self._forward_hook = model.register_forward_pre_hook(torch.compiler.disable(self._pre_forward))

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
        groups = group_tensors(params, self.bucket_bytes, self.first_bucket_bytes)
        # each bucket's gradients, then its used marks (one element per parameter, same dtype):
        # one contiguous span, one all_reduce
        tensors: list[torch.Tensor] = []
        at: dict[int, int] = {}  # parameter index -> its index in tensors
        marks_at = []
        for group in groups:
            for i in group:
                at[i] = len(tensors)
                tensors.append(params[i])
            marks_at.append(len(tensors))
            if self.shard == "optimizer":  # no marks (they travel in _marks): padding to a multiple of world_size
                n = sum(params[i].numel() for i in group)
                tensors.append(torch.empty(-n % self.world_size, dtype=params[group[0]].dtype, device="meta"))
            else:
                tensors.append(torch.empty(len(group), dtype=params[group[0]].dtype, device="meta"))
        # At world size 1 nothing is communicated: each gradient stays where autograd put it (its own
        # .grad, which the sharded optimizer steps with) and the buckets are a layout without memory.
        # Copying 4 bytes a parameter into them and reading them back costs a 1.5B model ~3 ms a step.
        flat = FlatBuffers(tensors, params[0].device if self.world_size > 1 else "meta")
        self._storages = list(flat.flat.values())
        self.buckets = []
        self.layout_version += 1
        if self.shard == "optimizer":
            self._marks = torch.zeros(len(slots) + 1, dtype=torch.float32, device=params[0].device)
        done = 0
        for group, marks in zip(groups, marks_at):
            span = flat.span(at[group[0]], marks)
            comp = None
            if self.compress == "bf16" and span.dtype in (torch.float32, torch.float64):
                comp = torch.empty(span.numel(), dtype=torch.bfloat16, device=span.device)
            used = None
            if self._marks is not None:
                used, done = self._marks[done : done + len(group)], done + len(group)
            bucket = _Bucket(len(self.buckets), [slots[i] for i in group], span, comp, used)
            for i in group:
                slots[i].view = flat.views[at[i]]
                slots[i].bucket = bucket
            self.buckets.append(bucket)

    def _hook_for(self, index: int):
        def hook(_: torch.Tensor) -> None:
            self._on_ready(self._slots[index])

        return hook

    # ---- buffers (DDP's broadcast_buffers) ------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: object) -> None:
        """Before each forward of the model, as DDP's ``_pre_forward``: rank 0's buffers to every rank
        when the previous forward was a synced one (and before the first), in one broadcast per
        device. Then remember whether this forward is synced (grad enabled, outside ``no_sync``)."""
        if self._forward_sync and not self._joining:
            buffers = list(module.buffers())  # read each time: a module may reassign its buffers
            if buffers:
                # in place, as DDP does it: the version counters stay, so a graph that saved a buffer
                # (a no_sync micro-step's) is not reported as modified
                with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
                    broadcast_tensors(buffers, 0)
        self._forward_sync = torch.is_grad_enabled() and not self._skip

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's attribute: False makes the next backward passes accumulate locally, as inside
        ``no_sync()``; set it back to True for the synced backward (then ``wait()``)."""
        return not self._skip

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._skip = not value

    # ---- per step --------------------------------------------------------------------
    def _on_ready(self, slot: _Slot) -> None:
        """A parameter's gradient is complete for this backward (called from autograd)."""
        if self._arrival is not None:
            self._arrival.append(slot.index)
        slot.used = True  # in no_sync micro-steps too: the accumulated gradient counts as used
        if self._skip:
            return
        if slot.ready_step == self._step:
            if self.world_size == 1:
                # shard="optimizer" at world size 1 (the only case with hooks there): nothing was
                # communicated, so a second backward before wait() is accumulation, as plain GradSync
                # takes it there (a loop that sets require_backward_grad_sync only when distributed);
                # autograd summed it into .grad, where the gradient stays at world size 1
                return
            raise GradSyncError(
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
        if self._joining and bucket.index == 0:
            self._announce(1)  # inside join(): tell ranks that ran out of data that a step follows
        # The used marks travel with the gradients: a parameter's mark is nonzero after the
        # all_reduce iff some rank used it (exact under any rounding: only zeros sum to zero).
        if all(s.used for s in bucket.slots) or _capturing():
            bucket.used.fill_(1)  # a captured step uses every parameter (its old behaviour)
        else:
            bucket.used.copy_(torch.tensor([float(s.used) for s in bucket.slots], dtype=bucket.used.dtype))
        if self.world_size == 1:
            return  # shard="optimizer": the marks only; the gradients stay in .grad (see _layout)
        # autograd accumulated into the views (s.param.grad is s.view): nothing to move
        moved = [s for s in bucket.slots if s.param.grad is not None and s.param.grad is not s.view]
        zeros = [s.view for s in bucket.slots if s.param.grad is None]  # no gradient here (yet): zeros
        if moved:
            torch._foreach_copy_([s.view for s in moved], [s.param.grad for s in moved])
            # the bucket holds them now: autograd's own gradient tensors go at once, not at wait(),
            # so the backward never holds every gradient twice (after zero_grad(set_to_none=True)
            # autograd makes new ones each step); in stream order, so the copies have read them
            for s in moved:
                s.param.grad = s.view
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
        if self.shard == "optimizer":
            bucket.work = sharded_optimizer.reduce_scatter(payload, self._op, group)
            return
        bucket.work = dist.all_reduce(payload, op=self._op, group=group, async_op=True)

    def wait(self) -> None:
        """Leave every gradient averaged over the ranks (``p.grad`` a view into its bucket; a
        bucket's views are attached when it is launched during backward, autograd's own gradient
        tensors freed then: read gradients after ``wait()``).

        A parameter that no rank used since the last synced step keeps its ``.grad`` untouched
        (None after ``opt.zero_grad()``), as DDP with ``find_unused_parameters=True`` leaves it, so
        optimizers skip it; one used on some ranks gets the sum of their gradients divided by the
        world size. A parameter whose ``requires_grad`` changed since the last step is followed:
        the buckets are rebuilt (every rank must make the same change before the same step).

        A collective: every rank must call it after each synced backward, before the optimizer
        step. A no-op inside ``no_sync()`` and, replicated, at world size 1. With ``shard="optimizer"``
        only this rank's slice of each bucket is averaged (the sharded optimizer steps it).
        """
        if self._skip or (self.world_size == 1 and self.shard == "none"):
            return
        while self._next_bucket < len(self.buckets):  # buckets whose gradients did not all arrive
            self._launch(self.buckets[self._next_bucket])
            self._next_bucket += 1
        for b in self.buckets:  # every group's work (on NCCL the current stream waits for each)
            if b.work is not None:
                try:
                    b.work.wait()
                except RuntimeError as e:  # gloo: the collective timed out, or a peer is gone
                    if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                        raise _stalled(e) from e
                    raise  # a peer failed: its own error says why
                b.work = None
            if b.comp is not None:
                b.flat.copy_(b.comp)
            b.pending = len(b.slots)
        if self.shard == "optimizer":
            sharded_optimizer.reduce_marks(self)  # used marks and the squared norm of the averaged shard
        if self._announced is not None:
            self._announced.wait()
            self._announced = None
        unused = []
        attach = self.world_size > 1  # at world size 1 (sharded) each gradient stays in its .grad
        for s in self._slots:
            if s.used:
                s.used = False
                if attach and s.param.grad is not s.view:
                    s.param.grad = s.view
            else:
                unused.append(s)
        frozen = self._settle_unused(unused) if unused else []
        thawed = [p for p in self._frozen if p.requires_grad]  # usually an empty list: cheap
        self._next_bucket = 0
        self._step += 1
        if frozen or thawed:
            if self._joining:
                self._announce(_ABORT, wait=True)  # the ranks shadowing in join() raise too
                raise GradSyncError(
                    "GradSync: requires_grad changed inside sync.join() "
                    f"({', '.join(self._name(p) for p in frozen + thawed)}); change it outside join()"
                )
            if self.shard == "optimizer":
                sharded_optimizer.gather_grads(self)  # the rebuild moves whole gradients, not only this shard
            self._follow_requires_grad()
        if not self._rebuilt:
            self._rebuild()
        if self.shard == "optimizer":
            sharded_optimizer.watch_grads(self)

    def _name(self, p: torch.Tensor) -> str:
        return repr(self._names.get(id(p), "?"))

    def _settle_unused(self, unused: list[_Slot]) -> list[nn.Parameter]:
        """Gradients of the parameters this rank did not use: averaged where another rank used
        them, untouched where none did. Returns the unused parameters that no longer require grad
        (frozen since the buckets were built). Reads the reduced used marks: one device sync, only
        in steps with a locally unused parameter."""
        if _capturing():  # a captured step: every mark was 1 (see _launch), nothing to read
            for s in unused:  # stepped with a zero gradient (the bucket's zeros; at world size 1 its own)
                s.param.grad = s.view if self.world_size > 1 else torch.zeros_like(s.param)
            return []
        buckets = list({id(s.bucket): s.bucket for s in unused}.values())
        marks = torch.cat([b.used for b in buckets]).tolist()
        where = {id(s): i for i, s in enumerate(s for b in buckets for s in b.slots)}  # slot -> its mark
        frozen = []
        for s in unused:
            used_elsewhere = marks[where[id(s)]] != 0
            if used_elsewhere and s.param.grad is not s.view:
                s.param.grad = s.view  # the others' sum / world size
            if not s.param.requires_grad:
                if used_elsewhere:
                    raise GradSyncError(
                        f"GradSync: parameter {self._name(s.param)} no longer requires grad on this rank but "
                        "another rank still trains it; every rank must freeze the same parameters before the same step"
                    )
                frozen.append(s.param)
        return frozen

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
        attached = [s.param.grad is s.view for s in self._slots]  # None (unused) stays None
        self._layout(order)
        torch._foreach_copy_([s.view for s in self._slots], grads)
        for s, a in zip(self._slots, attached):
            if a:
                s.param.grad = s.view

    def _follow_requires_grad(self) -> None:
        """Rebuild the buckets for the parameters that require grad now. A collective: the ranks
        compare their lists (a difference raises on every rank, naming it), and the gradients of
        the newly trainable parameters, computed in this step, are averaged here."""
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        lists = collectives.all_gather_object(names)
        if any(other != lists[0] for other in lists):
            lines = []
            for r, other in enumerate(lists[1:], 1):
                only0, onlyr = sorted(set(lists[0]) - set(other)), sorted(set(other) - set(lists[0]))
                if only0 or onlyr:
                    lines.append(f"rank {r}: trainable only on rank 0: {only0}; only on rank {r}: {onlyr}")
            raise GradSyncError(
                "GradSync: requires_grad changed differently on different ranks:\n  " + "\n  ".join(lines)
            )
        old = {id(s.param): s for s in self._slots}
        kept = [s.param for b in self.buckets for s in b.slots]
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._frozen = [p for p in self.model.parameters() if not p.requires_grad]
        for p in self._frozen:  # a view into the old buffers: training it on would move a frozen weight
            if id(p) in old and p.grad is old[id(p)].view:
                p.grad = None
        self._slots = [_Slot(p, i) for i, p in enumerate(self.params)]
        index = {id(p): i for i, p in enumerate(self.params)}
        order = [index[id(p)] for p in kept if id(p) in index]
        order += [i for i in reversed(range(len(self.params))) if id(self.params[i]) not in old]
        self._rebuilt, self._arrival = True, None  # this layout is final, the same on every rank
        self.buckets, self._storages = [], []
        if self.params:
            self._layout(order)
        new = []
        for s in self._slots:
            prev = old.get(id(s.param))
            if prev is None:
                new.append(s)
            elif s.param.grad is prev.view:
                s.view.copy_(prev.view)
                s.param.grad = s.view
        self._reduce_now(new)
        for s in self._slots:
            self._hooks.append(s.param.register_post_accumulate_grad_hook(self._hook_for(s.index)))

    @torch.no_grad()
    def _reduce_now(self, slots: list[_Slot]) -> None:
        """Average these parameters' gradients now (blocking), with the same used-mark rule."""
        if self.world_size == 1:
            return  # each gradient is the average already, and stays in its .grad (see _layout)
        by_dtype: dict[torch.dtype, list[_Slot]] = {}
        for s in slots:
            by_dtype.setdefault(s.param.dtype, []).append(s)
        for group in by_dtype.values():
            parts = [s.param.grad if s.param.grad is not None else torch.zeros_like(s.param) for s in group]
            marks = torch.tensor([float(s.param.grad is not None) for s in group], dtype=group[0].param.dtype)
            flat = torch.cat([t.reshape(-1) for t in parts] + [marks.to(parts[0].device)])
            if self._prediv:
                flat.div_(self.world_size)
            if self.world_size > 1:
                dist.all_reduce(flat, op=self._op)
            sizes = [s.param.numel() for s in group] + [len(group)]
            *values, reduced_marks = flat.split(sizes)
            for s, v, m in zip(group, values, reduced_marks.tolist()):
                if m != 0:
                    s.view.copy_(v.view(s.param.shape))
                    s.param.grad = s.view

    # ---- uneven inputs ---------------------------------------------------------------
    def _announce(self, value: int, wait: bool = False) -> int:
        """All_reduce (sum) of one number over the ranks: 1 per rank that runs a synced step, 0 per
        rank that shadows, _ABORT per rank that gives up. Blocking only with ``wait``."""
        t = torch.full((1,), value, dtype=torch.int64, device=self._device)
        work = dist.all_reduce(t, async_op=True)
        if not wait:
            self._announced = work  # waited in wait(); the tensor lives in the work
            return 0
        work.wait()
        return int(t.item())

    @contextlib.contextmanager
    def join(self) -> Iterator[None]:
        """Train with uneven inputs: wrap the training loop (``with sync.join(): for x, y in data: ...``).

        A rank that leaves the block while others still train shadows their synced steps: it
        all_reduces zeros for each of their buckets until every rank has left (no timeout is
        involved). Gradients stay divided by the initial world size, so every sample weighs the
        same, as with DDP under ``torch.distributed.algorithms.Join`` (``divide_by_initial_world_size``).
        When all have left, every rank takes the parameters of the last rank to leave (the
        highest such rank), and with ``broadcast_buffers`` its buffers, as DDP does. Inside the
        block the forwards do not broadcast buffers (a rank that left could not match that
        broadcast): each rank keeps its own until the end, where DDP would broadcast the highest
        active rank's at each forward. Other collectives inside the block (``sync_buffers``,
        SyncBatchNorm, metrics) are not shadowed, and requires_grad must not change inside it.

        A collective: every rank must enter and leave it. An exception inside the block is raised
        at once, without shadowing (the other ranks then wait in their next collective).
        """
        if self.world_size == 1:
            yield
            return
        if self._joining:
            raise GradSyncError("GradSync.join(): already inside join()")
        self._joining = True
        try:
            yield
        finally:
            self._joining = False
        if self._next_bucket != 0 or any(b.work is not None for b in self.buckets):
            raise GradSyncError("GradSync.join(): a synced backward was not followed by sync.wait() before leaving")
        last = True
        while True:
            active = self._announce(0, wait=True)
            if active == 0:
                break
            if active >= _ABORT:
                raise GradSyncError("GradSync.join(): another rank changed requires_grad inside join() and stopped")
            last = False
            works = []
            for b in self.buckets:  # the active ranks' step: zeros for each bucket, in bucket order
                payload = b.comp if b.comp is not None else b.flat
                payload.zero_()
                group = None
                if self.comm_groups > 1:
                    group = collectives.comm_groups(self.comm_groups)[b.index % self.comm_groups]
                if self.shard == "optimizer":
                    works.append(sharded_optimizer.reduce_scatter(payload, self._op, group))
                else:
                    works.append(dist.all_reduce(payload, op=self._op, group=group, async_op=True))
            for w in works:
                w.wait()
            if self.shard == "optimizer":
                sharded_optimizer.shadow_step(self)  # the marks, then this rank's part of the optimizer step
            if not self._rebuilt:
                self._rebuild()  # the active ranks rebuild after their first synced step
        if self._sharded_optimizer is not None:
            self._sharded_optimizer.finish_param_gather()  # the parameters are read below
        self._take_last_joiner(last)
        # every rank broadcasts at its next forward, whatever its last forward in the block was (a rank
        # may have had none): the same collectives on every rank
        self._forward_sync = True

    @torch.no_grad()
    def _take_last_joiner(self, last: bool) -> None:
        """Every rank takes the parameters (and, with ``broadcast_buffers``, the buffers) of the highest
        rank among those that left join() last, as DDP's Join does."""
        t = torch.full((1,), dist.get_rank() if last else -1, dtype=torch.int64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        tensors = list(self.model.parameters())
        if self.broadcast_buffers:
            tensors += list(self.model.buffers())
        broadcast_tensors(tensors, int(t.item()))

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

        ``opt.zero_grad()`` (set_to_none=True) is equally correct: ``wait()`` re-attaches the views
        (except to parameters no rank used, which keep None). After ``zero_grad()`` a parameter that
        no rank uses keeps a zero gradient, as with DDP after ``opt.zero_grad(set_to_none=False)``.
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
        """Bytes of each bucket's gradients (without its used marks; sharded: with its padding), in launch order."""
        marks = 0 if self.shard == "optimizer" else 1
        return [(b.flat.numel() - marks * len(b.slots)) * b.flat.element_size() for b in self.buckets]

    def sharded_optimizer(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params,
        *,
        overlap_param_gather: bool = False,
        **kwargs,
    ) -> sharded_optimizer.ShardedOptimizer:
        """The optimizer for ``shard="optimizer"``: ``optimizer_class(params, **kwargs)`` stepping this
        rank's shard of fp32 parameters (see distlib.parallel.sharded_optimizer.ShardedOptimizer)."""
        return sharded_optimizer.ShardedOptimizer(
            self, optimizer_class, params, overlap_param_gather=overlap_param_gather, **kwargs
        )

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global L2 norm is at most ``max_norm``; returns the norm
        before clipping (a device tensor, as torch.nn.utils.clip_grad_norm_). Call it after ``wait()``.
        The norm is over every rank's gradients: replicated, the ranks' (equal) gradients; with
        ``shard="optimizer"``, every shard's, computed in ``wait()``. No host sync (capturable)."""
        if self.shard == "optimizer":
            return sharded_optimizer.clip_shards(self, max_norm)
        params = [p for p in self.params if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True if params else None)

    def close(self) -> None:
        """Remove the hooks (the gradients stay where they are)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
