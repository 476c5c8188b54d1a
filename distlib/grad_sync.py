"""Gradient averaging over ranks: flat bucket buffers, all_reduce overlapped with backward.

How it works:

- The trainable parameters are laid out in flat buffers (one per dtype), in the order their
  gradients arrive in backward: reverse registration order at first, rank 0's observed order
  after the first synced step (rebuilt once, the same on every rank). The buffers are cut into
  buckets: a small first one (``first_bucket_mb``) so that communication starts early, then
  ``bucket_mb`` each.
- After ``wait()`` every ``p.grad`` is a view into its bucket, with the parameter's own strides
  (channels_last weights get channels_last gradient views, so fused/foreach optimizers keep
  their fast path).
- A post-accumulate-grad hook per parameter marks it ready. When a bucket is complete and every
  earlier bucket has been launched (all ranks must issue collectives in the same order), its
  asynchronous all_reduce is launched, overlapping the rest of backward. The division by the
  world size is folded in: ReduceOp.AVG on NCCL, a pre-division on gloo (which has no AVG).
- Collectives on one communicator run one after another, so a 25 MB bucket only reaches the
  ~25 MB point of NCCL's bandwidth curve. With ``comm_groups=n`` bucket i goes to process group
  i % n (each its own communicator and NCCL stream), so consecutive buckets' all_reduces run
  concurrently. Each group still sees the same collectives in the same order on every rank.
- Gradients that the backward produced as fresh tensors (after ``opt.zero_grad()``, which sets
  them to None) are copied into the bucket with one multi-tensor copy per bucket; gradients that
  are already bucket views were accumulated in place by autograd and need nothing.
- A parameter that got no gradient in a step does not hang the job: ``wait()`` launches the
  buckets that are still open, with zeros for missing gradients (its ``.grad`` ends as the
  average over ranks: zero if no rank used it, where DDP would leave None).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from distlib import collectives
from distlib.errors import DistlibError

_MB = 2**20


class ModelMismatchError(DistlibError, RuntimeError):
    """The model's parameters or buffers differ between ranks (raised on every rank)."""


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


def _is_dense(t: torch.Tensor) -> bool:
    """True when ``t``'s strides are a permutation of a contiguous layout (channels_last included)."""
    expected = 1
    for stride, size in sorted(zip(t.stride(), t.shape)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _describe(model: nn.Module) -> list[tuple[str, str, tuple[int, ...], str, bool]]:
    """(kind, name, shape, dtype, requires_grad) of every parameter and buffer, in order."""
    rows = [("param", n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]
    rows += [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in model.named_buffers()]
    return rows


def _diff(reference: list, mine: list, rank: int, limit: int = 8) -> list[str]:
    """Readable differences between rank 0's description and ``rank``'s."""
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
        desc = _describe(self.model)
        digest = hashlib.sha256(repr(desc).encode()).hexdigest()
        digests = collectives.all_gather_object(digest)
        if len(set(digests)) == 1:
            return
        descs = collectives.all_gather_object(desc)  # every rank knows of the mismatch: a consistent second call
        lines = []
        for r in range(1, len(descs)):
            if digests[r] != digests[0]:
                lines += _diff(descs[0], descs[r], r)
        raise ModelMismatchError(
            "GradSync: the model differs between ranks (every rank must build the same model):\n  " + "\n  ".join(lines)
        )

    @torch.no_grad()
    def _broadcast_state(self, chunk_bytes: int = 64 * _MB) -> None:
        """Rank 0's parameters and buffers to every rank, coalesced per dtype into few broadcasts."""
        tensors = [p.detach() for p in self.model.parameters()] + [b.detach() for b in self.model.buffers()]
        groups: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.device, t.dtype), []).append(t)
        for group in groups.values():
            chunk: list[torch.Tensor] = []
            size = 0
            for t in group + [None]:
                if t is not None and (not chunk or size + t.numel() * t.element_size() <= chunk_bytes):
                    chunk.append(t)
                    size += t.numel() * t.element_size()
                    continue
                flat = torch.cat([c.reshape(-1) for c in chunk])
                dist.broadcast(flat, src=0)
                if dist.get_rank() != 0:
                    for c, part in zip(chunk, flat.split([c.numel() for c in chunk])):
                        c.copy_(part.view(c.shape))
                if t is not None:
                    chunk, size = [t], t.numel() * t.element_size()

    def _layout(self, order: list[int]) -> None:
        """Flat storages and buckets for the trainable parameters in ``order`` (registration indices)."""
        slots = [self._slots[i] for i in order]
        groups: list[list[_Slot]] = []
        size = 0
        for s in slots:
            nbytes = s.param.numel() * s.param.element_size()
            cap = self.first_bucket_bytes if len(groups) == 1 else self.bucket_bytes
            if groups and groups[-1][0].param.dtype == s.param.dtype and size + nbytes <= cap:
                groups[-1].append(s)
                size += nbytes
            else:
                groups.append([s])
                size = nbytes
        totals: dict[torch.dtype, int] = {}
        for g in groups:
            totals[g[0].param.dtype] = totals.get(g[0].param.dtype, 0) + sum(s.param.numel() for s in g)
        device = self.params[0].device
        storages = {dt: torch.zeros(n, dtype=dt, device=device) for dt, n in totals.items()}
        self._storages = list(storages.values())
        offsets = dict.fromkeys(totals, 0)
        self.buckets = []
        for g in groups:
            dt = g[0].param.dtype
            start = offsets[dt]
            for s in g:
                p = s.param
                if p.is_contiguous() or not _is_dense(p):
                    s.view = storages[dt][offsets[dt] : offsets[dt] + p.numel()].view(p.shape)
                else:
                    s.view = storages[dt].as_strided(p.shape, p.stride(), offsets[dt])
                offsets[dt] += p.numel()
            flat = storages[dt][start : offsets[dt]]
            comp = None
            if self.compress == "bf16" and dt in (torch.float32, torch.float64):
                comp = torch.empty(flat.numel(), dtype=torch.bfloat16, device=device)
            bucket = _Bucket(len(self.buckets), g, flat, comp)
            for s in g:
                s.bucket = bucket
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
