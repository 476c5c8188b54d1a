"""Optimizer sharding (ZeRO-1) in GradSync's own buffers: each rank steps its slice of every bucket.

``GradSync(model, shard="optimizer")`` reduce-scatters each bucket into this rank's slice instead
of all_reducing it; ``sync.sharded_optimizer(torch.optim.AdamW, groups, lr=...)`` steps fp32 copies
of that slice (views of the parameters themselves when they are fp32) with the torch optimizer,
then all_gathers the parameters bucket by bucket. Design, memory formula and checkpoint format:
docs/grad_sync.md ("Optimizer sharding").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from distlib.distributed import collectives
from distlib.errors import DistlibError

if TYPE_CHECKING:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

__all__ = ["ShardedOptimizer", "ShardingError"]

# Optimizers whose update of an element reads only that element's parameter, gradient and state:
# they give the same result on any cut of the parameters into slices.
_ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Lion")


# torch 2.14 renamed the flat-tensor collectives (the old names warn); 2.11 has only the old ones
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardingError(DistlibError, ValueError):
    """A model or setting that sharding (``GradSync(shard="optimizer")``, ``shard_model``) cannot use,
    or a sharded optimizer that cannot be built or loaded as asked; the message says what to change."""


class GradSync(Protocol):
    """What a sharded optimizer reads of the ``distlib.GradSync(model, shard="optimizer")`` whose
    buckets it steps (declared here, so that this module does not import grad_sync, which builds on it)."""

    model: torch.nn.Module
    world_size: int
    shard: str
    comm_groups: int
    buckets: list[Any]  # grad_sync's buckets: .flat (the gradients), .params, .group
    layout_version: int  # bumped by every new bucket layout
    _marks: torch.Tensor | None
    _names: dict[int, str]
    _slots: list[Any]
    _storages: list[torch.Tensor]
    _sharded_optimizer: ShardedOptimizer | None
    _clip_max_norm: float | None

    def wait(self) -> None: ...

    def sharded_optimizer(self, optimizer_class: type, params: Any, **kwargs: Any) -> ShardedOptimizer: ...


# ---- the collectives GradSync calls with shard="optimizer" ------------------------------------
def reduce_scatter(payload: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> dist.Work:
    """Start the reduce_scatter of one bucket into this rank's slice of it (in place, as Megatron's
    buffers do). A collective: every rank calls it for the same buckets in the same order."""
    c = payload.numel() // dist.get_world_size(group)
    r = dist.get_rank(group)
    return _reduce_scatter(payload[r * c : (r + 1) * c], payload, op=op, group=group, async_op=True)


def _shards(sync: GradSync) -> list[torch.Tensor]:
    """This rank's slice of each bucket's gradients; at world size 1, where the gradients stay in the
    parameters' ``.grad`` (GradSync lays its buckets out without memory there), those."""
    if sync.world_size == 1:
        return [s.param.grad for s in sync._slots if s.param.grad is not None]
    r, w = collectives.rank(), sync.world_size
    out = []
    for b in sync.buckets:
        c = b.flat.numel() // w
        out.append(b.flat[r * c : (r + 1) * c])
    return out


@torch.no_grad()
def reduce_marks(sync: GradSync) -> None:
    """Sum the used marks over the ranks, with this rank's squared gradient norm as the last element:
    one small all_reduce per step gives both (the norm for ``clip_grad_norm_`` needs no other
    collective, and ranks shadowing in ``join()`` issue the same one). Blocking; capturable."""
    if sync._sharded_optimizer is None:
        raise ShardingError(
            "GradSync(model, shard='optimizer') averages only this rank's slice of each bucket: build the "
            "optimizer with sync.sharded_optimizer(torch.optim.AdamW, ...) before the first sync.wait()"
        )
    shards = [s for s in _shards(sync) if s.numel()]
    marks = sync._marks
    if shards:
        norms = torch.stack([torch.linalg.vector_norm(s, dtype=torch.float32) for s in shards])
        marks[-1:].copy_(norms.square().sum())
    else:
        marks[-1:].zero_()
    if sync.world_size > 1:
        dist.all_reduce(marks)


@torch.no_grad()
def gather_grads(sync: GradSync) -> None:
    """All_gather every bucket's averaged slice, so that whole gradients are averaged (before the
    buckets are laid out again). A collective."""
    if sync.world_size == 1:
        return
    for b in sync.buckets:
        c = b.flat.numel() // sync.world_size
        r = dist.get_rank()
        _all_gather(b.flat, b.flat[r * c : (r + 1) * c].clone())


# ---- gradients changed between wait() and step() -------------------------------------------------
# After wait(), each parameter's .grad is averaged only in this rank's slice; elsewhere it holds this
# rank's own gradient. Code that reads whole gradients and writes them back (torch's clip_grad_norm_
# on the model's parameters: each rank would clip by its own partial norm, the ranks would diverge)
# cannot be seen when it reads, but its write bumps the buckets' version counters (shared by every
# gradient view of a bucket's storage): wait() notes them, step() compares. Host-side integers only:
# no device sync, nothing in a captured graph. At world size 1 the slice is the whole gradient, and
# torch's clipping is right there: nothing is watched.
def _versions(sync: GradSync) -> tuple[int, ...]:
    return tuple(st._version for st in sync._storages)


def watch_grads(sync: GradSync) -> None:
    """Note the gradient buckets' version counters at the end of ``wait()`` (world size > 1)."""
    sync._grad_versions = _versions(sync) if sync.world_size > 1 else None


def check_grads(sync: GradSync, where: str) -> None:
    """Raise if the averaged gradients were changed in place since ``wait()`` by anything but distlib."""
    noted = sync._grad_versions
    if noted is None or noted == _versions(sync):
        return
    sync._grad_versions = None  # raised once; the step is not taken
    raise ShardingError(
        f"{where}: the gradients were changed in place after sync.wait(). With GradSync(shard='optimizer') "
        "each parameter's .grad is averaged only in this rank's slice (the sharded optimizer steps that "
        "slice; the rest is this rank's own gradient), so torch.nn.utils.clip_grad_norm_(model.parameters(), "
        "...) would clip each rank by a different, partial norm. Call sync.clip_grad_norm_(max_norm) "
        "instead (the global norm, computed in wait()); a GradScaler's unscale_ cannot check sharded "
        "gradients either (use bf16, or GradSync(model) without shard)"
    )


@torch.no_grad()
def clip_shards(sync: GradSync, max_norm: float) -> torch.Tensor:
    """Clip every rank's gradient slice by the global norm reduced in ``wait()`` (torch's formula)."""
    check_grads(sync, "sync.clip_grad_norm_()")
    sync._clip_max_norm = float(max_norm)  # the ranks shadowing in join() clip alike
    total = sync._marks[-1].sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    shards = [s for s in _shards(sync) if s.numel()]
    if shards:
        torch._foreach_mul_(shards, coef.to(shards[0].dtype))
    if sync._grad_versions is not None:
        watch_grads(sync)  # distlib's own change
    return total


@torch.no_grad()
def shadow_step(sync: GradSync) -> None:
    """The part of the active ranks' step that a rank shadowing in ``join()`` must mirror: the marks'
    all_reduce (it used nothing), the clipping they last asked for, its optimizer slice's step and the
    parameters' all_gathers."""
    sync._marks.zero_()
    reduce_marks(sync)
    opt = sync._sharded_optimizer
    if opt is None:
        return
    marks = sync._marks.tolist()
    for i, s in enumerate(s for b in sync.buckets for s in b.slots):  # the marks' order
        s.param.grad = s.view if marks[i] != 0 else None
    max_norm = getattr(sync, "_clip_max_norm", None)
    if max_norm is not None:
        clip_shards(sync, max_norm)
    opt.step()


def _memory_order(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad``'s elements flat, in ``param``'s memory order (a piece's order): a view when ``grad`` has
    ``param``'s strides (autograd gives a gradient its parameter's layout), else a copy in that layout."""
    if grad.stride() != param.stride():
        grad = torch.empty_like(param).copy_(grad)  # empty_like keeps the parameter's dense layout
    return grad.as_strided((grad.numel(),), (1,), grad.storage_offset())


class _Piece:
    """One parameter's part of this rank's slice: elements [lo, hi) of the parameter, in its memory order."""

    __slots__ = ("param", "name", "lo", "hi", "pslice", "gslice", "master", "grad32")

    def __init__(self, param, name, lo, hi, pslice, gslice, master, grad32):
        self.param = param
        self.name = name
        self.lo, self.hi = lo, hi
        self.pslice = pslice  # the parameter's elements in the flat parameter buffer
        self.gslice = gslice  # the averaged gradient's elements in GradSync's bucket
        self.master = master  # fp32: pslice itself for fp32 parameters, else an fp32 copy
        self.grad32 = grad32  # fp32 gradient copy for non-fp32 parameters, else None


class ShardedOptimizer(torch.optim.Optimizer):
    """A torch optimizer that steps only this rank's slice of the parameters (ZeRO-1).

    Built by ``GradSync.sharded_optimizer(optimizer_class, params, **kwargs)`` with the arguments
    ``optimizer_class`` takes (parameter groups with their own settings included), and
    ``overlap_param_gather`` (see ``finish_param_gather``). ``param_groups``
    are the model's parameters with the resolved settings: LR schedulers change them and each step
    passes them on to the inner optimizer, built over fp32 views of this rank's slice. The
    model's trainable parameters become views of one flat buffer per dtype laid out as GradSync's
    gradient buckets (do not move the model afterwards). ``step()`` is a collective (the bucketed
    all_gathers of the parameters): every rank calls it after ``sync.wait()``.

    Only elementwise optimizers (SGD, Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad, Lion)
    give the same result on a slice; others raise ``ShardingError``.
    """

    def __init__(
        self,
        sync: GradSync,
        optimizer_class: type[torch.optim.Optimizer],
        params: Iterable,
        *,
        overlap_param_gather: bool = False,
        **kwargs,
    ):
        if sync.shard != "optimizer":
            raise ShardingError(
                "sharded_optimizer() needs GradSync(model, shard='optimizer'); this GradSync all_reduces "
                "whole gradients: build a plain torch optimizer instead"
            )
        if optimizer_class.__name__ not in _ELEMENTWISE:
            raise ShardingError(
                f"{optimizer_class.__name__} is not an elementwise optimizer: a shard of the parameters would "
                f"step differently; use one of {', '.join(_ELEMENTWISE)} or GradSync(model) without shard"
            )
        if sync._sharded_optimizer is not None:
            raise ShardingError("this GradSync already has a sharded optimizer; build one per GradSync")
        probe = optimizer_class(params, **kwargs)  # resolves the defaults and checks the settings as torch does
        trainable = {id(p) for p in sync.model.parameters()}
        for g in probe.param_groups:
            for p in g["params"]:
                if id(p) not in trainable:
                    raise ShardingError(
                        "sharded_optimizer() got a parameter that is not one of the model's; pass the "
                        "GradSync model's parameters (or groups of them)"
                    )
        super().__init__([dict(g) for g in probe.param_groups], probe.defaults)
        del probe
        self.sync = sync
        self.optimizer_class = optimizer_class  # what steps the slice (CapturedStep checks its settings)
        self._kwargs = kwargs
        self._inner: torch.optim.Optimizer | None = None
        self._pieces: list[_Piece] = []
        self._pstores: dict[torch.dtype, torch.Tensor] = {}
        self._extra: list[torch.Tensor] = []  # fp32 masters and gradient copies of non-fp32 slices
        self._version = -1
        # overlap: step() returns with the all_gathers in flight; each module's forward pre-hook waits
        # for the buckets of its own parameters (Megatron's way). Off by default: code that reads the
        # parameters between step() and the next forward (an EMA, a checkpoint) would need finish_param_gather().
        self.overlap_param_gather = overlap_param_gather
        self._pending: dict[int, dist.Work] = {}
        self._hooks: list = []
        sync._sharded_optimizer = self
        self._build(None)

    @property
    def inner(self) -> torch.optim.Optimizer | None:
        """The ``optimizer_class`` instance stepping this rank's pieces (None when it holds none)."""
        return self._inner

    def add_param_group(self, param_group: dict) -> None:  # noqa: D102 (torch.optim.Optimizer)
        if hasattr(self, "sync"):
            raise ShardingError(
                "a ShardedOptimizer's slices are cut when it is built: pass every parameter group to "
                "sync.sharded_optimizer() instead of add_param_group()"
            )
        super().add_param_group(param_group)

    # ---- layout ------------------------------------------------------------------------------
    def _ranges(self, rank: int) -> dict[int, tuple[int, int, int]]:
        """id(param) -> (storage offset of its first element in rank's slice, lo, hi) for rank."""
        w, out = self.sync.world_size, {}
        for b in self.sync.buckets:
            start, c = b.flat.storage_offset(), b.flat.numel() // w
            a0, z0 = start + rank * c, start + (rank + 1) * c
            for s in b.slots:
                off, n = s.view.storage_offset(), s.param.numel()
                a, z = max(off, a0), min(off + n, z0)
                if a < z:
                    out[id(s.param)] = (a, a - off, z - off)
        return out

    @torch.no_grad()
    def _build(self, full: dict[int, dict[str, torch.Tensor]] | None) -> None:
        """Lay the parameters out as GradSync's buckets, cut this rank's pieces, build the inner
        optimizer; ``full`` (whole fp32 masters and states by id(param)) fills them after a relayout."""
        sync = self.sync
        self._version = sync.layout_version
        grads = {st.dtype: st for st in sync._storages}  # on the meta device at world size 1
        self._pstores = {dt: torch.zeros(st.shape, dtype=dt, device=sync._device) for dt, st in grads.items()}
        for s in sync._slots:  # every trainable parameter becomes a view of the flat parameter buffer
            v = s.view
            pv = self._pstores[v.dtype].as_strided(v.shape, v.stride(), v.storage_offset())
            pv.copy_(s.param.detach())
            s.param.data = pv
        names = sync._names
        ranges = self._ranges(collectives.rank())
        self._pieces, self._extra = [], []
        for s in (s for b in sync.buckets for s in b.slots):
            if id(s.param) not in ranges:
                continue
            a, lo, hi = ranges[id(s.param)]
            dt = s.view.dtype
            pslice = self._pstores[dt][a : a + hi - lo]
            gslice = grads[dt][a : a + hi - lo]
            if dt == torch.float32:
                master, grad32 = pslice, None
            else:
                master, grad32 = pslice.float(), torch.zeros(hi - lo, dtype=torch.float32, device=pslice.device)
                self._extra += [master, grad32]
            self._pieces.append(_Piece(s.param, names.get(id(s.param), "?"), lo, hi, pslice, gslice, master, grad32))
        by_param = {id(pc.param): pc for pc in self._pieces}
        groups = []
        for g in self.param_groups:
            inner = {k: v for k, v in g.items() if k != "params"}
            inner["params"] = [by_param[id(p)].master for p in g["params"] if id(p) in by_param]
            groups.append(inner)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.overlap_param_gather:
            where = {id(s.param): b.index for b in sync.buckets for s in b.slots}
            for module in sync.model.modules():
                mine = sorted({where[id(p)] for p in module.parameters(recurse=False) if id(p) in where})
                if mine:
                    self._hooks.append(module.register_forward_pre_hook(self._waiter(mine)))
        self._inner = None
        if any(g["params"] for g in groups):
            self._inner = self.optimizer_class(groups, **self._kwargs)
        if full:
            for pc in self._pieces:
                saved = full.get(id(pc.param))
                if not saved:
                    continue
                if "master" in saved and pc.grad32 is not None:
                    pc.master.copy_(saved["master"][pc.lo : pc.hi])
                    pc.pslice.copy_(pc.master)
                state = self._inner.state[pc.master]
                for k, t in saved.items():
                    if k != "master":
                        state[k] = t[pc.lo : pc.hi].clone() if t.dim() == 1 else t.clone()

    @torch.no_grad()
    def _full_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Whole fp32 masters and optimizer states of every parameter, summed over the ranks' pieces
        (a collective, for a new bucket layout: rare)."""
        local = {}
        for pc in self._pieces:
            st = self._inner.state.get(pc.master, {}) if self._inner is not None else {}
            spec = {k: (t.dim() == 1, str(t.dtype).removeprefix("torch.")) for k, t in st.items() if torch.is_tensor(t)}
            if pc.grad32 is not None:
                spec["master"] = (True, "float32")
            local[pc.name] = spec
        specs: dict[str, dict] = {}
        for other in collectives.all_gather_object(local):
            for name, spec in other.items():
                specs.setdefault(name, {}).update(spec)
        params = {n: p for n, p in self.sync.model.named_parameters()}
        pieces = {pc.name: pc for pc in self._pieces}
        out: dict[int, dict[str, torch.Tensor]] = {}
        for name in sorted(specs):
            p, pc = params[name], pieces.get(name)
            st = self._inner.state.get(pc.master, {}) if pc is not None and self._inner is not None else {}
            entry = {}
            for key, (vec, dtype) in sorted(specs[name].items()):
                dt = getattr(torch, dtype)
                if vec:
                    t = torch.zeros(p.numel(), dtype=dt, device=p.device)
                    if pc is not None:
                        t[pc.lo : pc.hi] = pc.master if key == "master" else st[key]
                    if self.sync.world_size > 1:
                        dist.all_reduce(t)
                else:
                    src = st.get(key) if pc is not None else None
                    t = src.clone() if src is not None else torch.zeros((), dtype=dt, device=p.device)
                    if self.sync.world_size > 1:
                        dev = t.device
                        t = t.to(p.device)
                        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the same on every rank that has it
                        t = t.to(dev)
                entry[key] = t
            out[id(p)] = entry
        return out

    # ---- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 (torch.optim.Optimizer.step)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.finish_param_gather()
        check_grads(self.sync, "ShardedOptimizer.step()")
        self.sync._grad_versions = None  # this step's gradients are used up
        if self._version != self.sync.layout_version:  # requires_grad changed: GradSync laid out new buckets
            self._build(self._full_state())  # the old pieces still hold the masters and states
        self._inner_step()
        self._gather_params()
        return loss

    def _inner_step(self) -> None:
        if self._inner is None:
            return
        for g, inner in zip(self.param_groups, self._inner.param_groups):
            for k, v in g.items():
                if k != "params":
                    inner[k] = v  # LR schedulers change the outer groups
        dsts, srcs = [], []
        local = self.sync.world_size == 1  # the gradients are in .grad, not in the buckets
        for pc in self._pieces:
            if pc.param.grad is None:  # no rank used it: skipped, as torch's optimizers skip it
                pc.master.grad = None
                continue
            grad = _memory_order(pc.param.grad, pc.param)[pc.lo : pc.hi] if local else pc.gslice
            if pc.grad32 is None:
                pc.master.grad = grad
            else:
                dsts.append(pc.grad32)
                srcs.append(grad)
                pc.master.grad = pc.grad32
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        self._inner.step()
        low = [pc for pc in self._pieces if pc.grad32 is not None]
        if low:
            torch._foreach_copy_([pc.pslice for pc in low], [pc.master for pc in low])
        if local:  # views of the parameters' .grad: zero_grad(set_to_none=True) must free that memory
            for pc in self._pieces:
                pc.master.grad = None

    def _waiter(self, buckets: list[int]):
        def hook(module, args) -> None:
            for i in buckets:
                work = self._pending.pop(i, None)
                if work is not None:
                    work.wait()

        return hook

    def finish_param_gather(self) -> None:
        """Wait for the parameters' all_gathers still in flight (``overlap_param_gather=True``): call it
        before reading the parameters outside a forward (EMA, evaluation without forward, saving)."""
        pending, self._pending = self._pending, {}
        for work in pending.values():
            work.wait()

    @torch.no_grad()
    def _gather_params(self) -> None:
        """Every rank's updated slice to every rank: one async all_gather per bucket, the first layers'
        buckets first (the next forward needs them first), round-robin over the communicators."""
        sync = self.sync
        if sync.world_size == 1:
            return
        r, w = dist.get_rank(), sync.world_size
        works = {}
        for b in reversed(sync.buckets):
            start, n = b.flat.storage_offset(), b.flat.numel()
            flat = self._pstores[b.flat.dtype][start : start + n]
            c = n // w
            group = None
            if sync.comm_groups > 1:
                group = collectives.comm_groups(sync.comm_groups)[b.index % sync.comm_groups]
            works[b.index] = _all_gather(flat, flat[r * c : (r + 1) * c], group=group, async_op=True)
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if self.overlap_param_gather and not capturing:  # a captured step ends with its parameters gathered
            self._pending = works
            return
        for work in works.values():
            work.wait()

    # ---- checkpoints -------------------------------------------------------------------------
    @torch.no_grad()
    def _init_state(self) -> None:
        """Give every piece its state (a step with zero gradients and lr 0, then the counters
        reset), so that a checkpoint can be loaded into it: as torch's get_optimizer_state_dict does.
        A state made so steps as a fresh one (zero moments, step 0)."""
        if self._inner is None:
            return
        fresh = [pc for pc in self._pieces if not self._inner.state.get(pc.master)]
        if not fresh:
            return
        kept = [pc.master.grad for pc in self._pieces]
        for pc in self._pieces:
            pc.master.grad = torch.zeros_like(pc.master) if pc in fresh else None
        lrs = [g["lr"] for g in self._inner.param_groups]
        for g in self._inner.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
        self._inner.step()
        for g, lr in zip(self._inner.param_groups, lrs):
            g["lr"] = lr
        for pc, grad in zip(self._pieces, kept):
            pc.master.grad = grad
        for pc in fresh:
            state = self._inner.state[pc.master]
            if torch.is_tensor(state.get("step")):
                state["step"].zero_()
            if torch.is_tensor(state.get("mu_product")):  # NAdam's running product starts at 1
                state["mu_product"].fill_(1.0)

    def _sharded(self, pc: _Piece, t: torch.Tensor, ranges: list[dict]) -> ShardedTensor | torch.Tensor:
        """``t`` (this rank's elements [lo, hi) of the parameter) as a ShardedTensor of the parameter's
        flat size: the metadata lists every rank's range, computed here (no communication)."""
        if len(ranges) == 1:  # world size 1 (maybe without a process group): the whole tensor, as DCP saves it
            return t
        # imported here: only checkpoints need them (ShardedTensor: DTensor cannot express uneven ranges)
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
        from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

        me = collectives.rank()
        metas, local = [], None
        for q, rq in enumerate(ranges):
            if id(pc.param) not in rq:
                continue
            _, lo, hi = rq[id(pc.param)]
            dev = t.device if q == me or t.device.type == "cpu" else torch.device(t.device.type, 0)
            metas.append(ShardMetadata([lo], [hi - lo], f"rank:{q}/{dev}"))
            if q == me:
                local = metas[-1]
        props = TensorProperties(dtype=t.dtype, layout=t.layout, requires_grad=False)
        meta = ShardedTensorMetadata(metas, torch.Size([pc.param.numel()]), props)
        return ShardedTensor._init_from_local_shards_and_global_metadata([Shard(t, local)], meta)

    def state_dict(self) -> dict:
        """The optimizer state in a form torch.distributed.checkpoint saves from every rank and loads
        at another world size: ``{"state": {name: {key: ...}}, "param_groups": [...]}`` keyed by
        parameter name; each per-element state (and the fp32 master of a non-fp32 parameter, under
        "master") is a ShardedTensor of the parameter's flat size whose local shard is this rank's
        range, the very tensor the optimizer steps (``dcp.load`` fills it in place). Scalars (step)
        are plain tensors, the same on every rank that holds a piece."""
        self.finish_param_gather()
        self._init_state()
        ranges = [self._ranges(q) for q in range(self.sync.world_size)]
        state = {}
        for pc in self._pieces:
            items = list(self._inner.state[pc.master].items())
            if pc.grad32 is not None:
                items.append(("master", pc.master))
            entry = {}
            for k, t in items:
                vec = torch.is_tensor(t) and t.dim() == 1 and t.numel() == pc.hi - pc.lo
                entry[k] = self._sharded(pc, t, ranges) if vec else t
            state[pc.name] = entry
        names = self.sync._names
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
            for g in self.param_groups
        ]
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load what ``state_dict()`` gave, after ``dcp.load`` filled it (at any world size), or a
        state_dict of this same layout. The groups' settings (lr, ...) are taken by position."""
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ShardingError(
                f"the checkpoint has {len(groups)} parameter groups, this optimizer {len(self.param_groups)}; "
                "build the optimizer with the same groups as the run that saved it"
            )
        self.finish_param_gather()
        self._init_state()
        for g, saved in zip(self.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        for pc in self._pieces:
            saved = state_dict["state"].get(pc.name)
            if saved is None:
                continue
            state = self._inner.state[pc.master]
            for k, v in saved.items():
                target = pc.master if k == "master" else state.get(k)
                if isinstance(v, ShardedTensor):
                    shards = v.local_shards()
                    meta = shards[0].metadata if len(shards) == 1 else None
                    if meta is None or list(meta.shard_offsets) != [pc.lo] or list(meta.shard_sizes) != [pc.hi - pc.lo]:
                        raise ShardingError(
                            f"the state of {pc.name!r} is sharded for another layout; load it with "
                            "torch.distributed.checkpoint into this optimizer's state_dict() first"
                        )
                    v = shards[0].tensor
                if target is None:
                    state[k] = v.clone() if torch.is_tensor(v) else v
                elif v is not target:
                    target.copy_(v)
            if "master" in saved:
                pc.pslice.copy_(pc.master)
            elif pc.grad32 is not None:  # a plain optimizer's checkpoint: the master from the loaded parameter
                pc.master.copy_(pc.pslice)
        if any(st.dtype != torch.float32 for st in self._pstores.values()):
            self._gather_params()  # the parameters from the loaded fp32 masters

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model state on this rank: ``params`` (every parameter in its dtype, the flat
        buffers' padding included), ``grads`` (GradSync's buckets; at world size 1 the parameters' own
        ``.grad``, as many bytes), ``master`` (fp32 copies of this rank's slice of non-fp32 parameters,
        and their fp32 gradients; fp32 parameters are stepped in place), ``optimizer`` (this rank's
        optimizer state) and ``total``."""
        trainable = {id(s.param) for s in self.sync._slots}
        frozen = sum(p.numel() * p.element_size() for p in self.sync.model.parameters() if id(p) not in trainable)
        out = {
            "params": frozen + sum(t.numel() * t.element_size() for t in self._pstores.values()),
            "grads": sum(t.numel() * t.element_size() for t in self.sync._storages),
            "master": sum(t.numel() * t.element_size() for t in self._extra),
            "optimizer": 0,
        }
        if self._inner is not None:
            for st in self._inner.state.values():
                out["optimizer"] += sum(t.numel() * t.element_size() for t in st.values() if torch.is_tensor(t))
        out["total"] = sum(out.values())
        return out
