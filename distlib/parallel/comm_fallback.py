"""The cuda.comm fallback mode: one process per node drives all of that node's GPUs.

Inside a node ``torch.cuda.comm`` broadcasts parameters, scatters the batch and reduces the
gradients between persistent replicas; between nodes the node processes all_reduce through
torch.distributed. What a step does and costs, and when to use it: docs/fallback.md.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.cuda.comm  # noqa: F401  (a submodule: torch.cuda does not import it on every version)
import torch.distributed as dist
from torch import nn

from distlib.distributed import collectives
from distlib.distributed.model_check import check_same_model
from distlib.distributed.state_broadcast import broadcast_module
from distlib.log import get_logger
from distlib.parallel.buckets import allreduce_buckets
from distlib.parallel.flat_buffers import FlatBuffers

__all__ = ["Replicas", "allreduce_buckets", "node_devices"]  # allreduce_buckets lives in distlib.parallel.buckets

_ALIGN = 64  # elements: each tensor's view in a flat buffer starts 256-byte aligned (fp32)
_GRAPH_WARMUP = 3  # eager iterations on side streams before capture (cudnn autotuning, lazy init)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _broadcast_into(src: torch.Tensor, dsts: list[torch.Tensor]) -> None:
    """Copy ``src`` into each of ``dsts`` (one per other device)."""
    if not dsts:
        return
    if src.is_cuda:
        torch.cuda.comm.broadcast(src, out=dsts)  # one NCCL broadcast, straight into the replicas' buffers
    else:
        for d in dsts:
            d.copy_(src)


def _reduce_add(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of ``tensors`` (one per device) on the first one's device; the first itself
    when there is only one."""
    if len(tensors) == 1:
        return tensors[0]
    if tensors[0].is_cuda:
        return torch.cuda.comm.reduce_add(tensors, destination=tensors[0].device.index)  # one NCCL reduce
    out = tensors[0].clone()
    for t in tensors[1:]:
        out.add_(t)
    return out


def _rows(x: torch.Tensor | Mapping[str, torch.Tensor]) -> int:
    return next(iter(x.values())).shape[0] if isinstance(x, Mapping) else x.shape[0]


def _slice(x: torch.Tensor | Mapping[str, torch.Tensor], sl: slice) -> torch.Tensor | Mapping[str, torch.Tensor]:
    return {k: v[sl] for k, v in x.items()} if isinstance(x, Mapping) else x[sl]


def _device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    # new tensors a module's forward makes without a device go to the replica's GPU
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _autocast(device: torch.device, dtype: torch.dtype | None, cache_enabled: bool = True):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None, cache_enabled=cache_enabled)


def _resolve_devices(model: nn.Module, devices: Sequence[torch.device | int | str] | None) -> list[torch.device]:
    tensors = list(model.parameters()) + list(model.buffers())
    if not tensors:
        raise ValueError("Replicas needs a model with parameters")
    model_devices = {t.device for t in tensors}
    if len(model_devices) > 1:
        raise ValueError(f"the model must live on one device (its root), found {sorted(map(str, model_devices))}")
    root = model_devices.pop()
    if devices is None:
        if root.type != "cuda":
            devices = [root]
        else:
            devices = [root] + [torch.device("cuda", i) for i in range(torch.cuda.device_count()) if i != root.index]
    resolved = []
    for d in devices:
        d = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
        if d.type == "cuda" and d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
        resolved.append(d)
    if not resolved:
        raise ValueError("Replicas needs at least one device")
    if resolved[0] != root:
        raise ValueError(f"the model lives on {root}, but the first (root) device is {resolved[0]}; move it first")
    kinds = {d.type for d in resolved}
    if kinds not in ({"cuda"}, {"cpu"}):
        raise ValueError(f"devices must be all GPUs (or all 'cpu' for tests), got {[str(d) for d in resolved]}")
    if "cuda" in kinds and len(set(resolved)) != len(resolved):
        raise ValueError(f"each GPU may hold one replica, got {[str(d) for d in resolved]}")
    return resolved


class Replicas:
    """A persistent replica of ``model`` on each of ``devices``, driven by one process.

    ``model`` lives on ``devices[0]`` (the root); the other replicas are built once
    (``copy.deepcopy`` + ``.to(device)``). ``devices=None`` means every visible GPU,
    the model's own first. All-'cpu' devices (several replicas on the CPU) exercise
    the same hierarchy without GPUs, for tests.

    Parameters and gradients of every replica are views into one flat buffer per
    dtype, so the intra-node broadcast and reduction are one ``torch.cuda.comm`` call
    each: the coalescing that ``broadcast_coalesced`` / ``reduce_add_coalesced`` do
    on every call is done once here. Build Replicas after the model is final (device,
    memory format) and build the optimizer on ``root``'s parameters.

    ``group`` is the inter-node group (default: the whole world, one process per
    node). Building Replicas is a collective: every node process must build it, in
    the same order; node 0's parameters and buffers then hold everywhere.

    ``cuda_graph=True`` captures each replica's forward+backward as a CUDA graph on
    the first ``train_step`` (the loss function, autocast dtype and ``grad_accum`` of
    that step are captured); a later step with other shapes runs eagerly, with a
    warning. On the CPU it warns and runs eagerly.
    """

    def __init__(
        self,
        model: nn.Module,
        devices: Sequence[torch.device | int | str] | None = None,
        *,
        bucket_mb: float = 25.0,
        cuda_graph: bool = False,
        group: dist.ProcessGroup | None = None,
    ):
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}")
        self.devices = _resolve_devices(model, devices)
        self.bucket_mb = bucket_mb
        self.group = group
        self.nodes = dist.get_world_size(group) if collectives.active(group) else 1
        self.root = model
        self.models: list[nn.Module] = [model]
        for d in self.devices[1:]:
            replica = copy.deepcopy(model).to(d)
            for p in replica.parameters():
                p.grad = None
            self.models.append(replica)
        self._preflight()
        params = [list(m.parameters()) for m in self.models]
        self._buffers = [list(m.buffers()) for m in self.models]
        self._params: list[FlatBuffers] = []
        self._grads: list[FlatBuffers] = []
        self._grad_params: list[list[tuple[nn.Parameter, torch.Tensor]]] = []
        with torch.no_grad():
            for ps, d in zip(params, self.devices):
                pf, gf = FlatBuffers(ps, d, _ALIGN), FlatBuffers(ps, d, _ALIGN)
                for p, v in zip(ps, pf.views):
                    v.copy_(p)
                    p.data = v  # the parameter now lives in the flat buffer
                self._params.append(pf)
                self._grads.append(gf)
                self._grad_params.append([(p, g) for p, g in zip(ps, gf.views) if p.requires_grad])
        self._attach_grads()
        self._sync_from_node0()
        self.cuda_graph = cuda_graph
        if cuda_graph and self.devices[0].type != "cuda":
            get_logger().warning("Replicas: cuda_graph=True needs GPUs; running the CPU replicas eagerly")
            self.cuda_graph = False
        self._graphs: list[torch.cuda.CUDAGraph] | None = None
        self._graph_key: tuple | None = None
        self._warned_shape = False

    # ---- structure ---------------------------------------------------------------------

    @property
    def num_devices(self) -> int:
        """GPUs (replicas) of this node."""
        return len(self.devices)

    @property
    def total_devices(self) -> int:
        """GPUs of all nodes: the gradients are averaged over this many shards."""
        return self.num_devices * self.nodes

    def _preflight(self) -> None:
        """Every node must hold the same model and drive as many GPUs as the others: compared
        up front, so a mismatch fails at once on every node instead of hanging later."""
        counts = check_same_model(self.root, "Replicas", group=self.group, extra=self.num_devices)
        if len(set(counts)) > 1:
            raise ValueError(
                "every node process must drive the same number of GPUs for the gradient average to be "
                f"that of one process per GPU; GPUs per node process: {counts}"
            )

    def _sync_from_node0(self) -> None:
        """Node 0's root parameters and buffers, on every replica of every node."""
        with torch.no_grad():
            broadcast_module(self.root, group=self.group)
            self.broadcast_parameters()
            for j, b in enumerate(self._buffers[0]):
                _broadcast_into(b, [bufs[j] for bufs in self._buffers[1:]])

    def _attach_grads(self) -> None:
        """Point every ``.grad`` at its view in the flat gradient buffer (again, if an
        ``optimizer.zero_grad(set_to_none=True)`` dropped it)."""
        for pairs in self._grad_params:
            for p, g in pairs:
                if p.grad is not g:
                    p.grad = g

    def _zero_grads(self) -> None:
        for gf in self._grads:
            for flat in gf.flat.values():
                flat.zero_()

    # ---- the pieces of a step ----------------------------------------------------------

    def broadcast_parameters(self) -> None:
        """Copy the root's parameters into every other replica (one comm.broadcast per dtype)."""
        with torch.no_grad():
            for dt, flat in self._params[0].flat.items():
                _broadcast_into(flat, [pf.flat[dt] for pf in self._params[1:]])

    def check_batch(self, batch: int, grad_accum: int = 1) -> None:
        """Raise ValueError unless a node batch of ``batch`` splits into equal shards, one per
        GPU, of ``grad_accum`` equal micro-batches each."""
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
        if batch % (self.num_devices * grad_accum) or batch == 0:
            raise ValueError(
                f"a node batch of {batch} does not split into {self.num_devices} equal GPU shards of "
                f"{grad_accum} equal micro-batch(es); use a multiple of {self.num_devices * grad_accum}"
            )

    def scatter(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Split ``t`` along dim 0 into equal shards, one on each replica's device (comm.scatter)."""
        self.check_batch(t.shape[0])
        if self.devices[0].type == "cuda":
            return list(torch.cuda.comm.scatter(t, [d.index for d in self.devices], dim=0))
        return [c.to(d) for c, d in zip(t.chunk(self.num_devices), self.devices)]

    def gather(self, tensors: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        """Concatenate per-replica tensors (outputs, metrics) along ``dim`` on the root (comm.gather)."""
        if self.devices[0].type == "cuda":
            return torch.cuda.comm.gather(list(tensors), dim=dim, destination=self.devices[0].index)
        return torch.cat([t.to(self.devices[0]) for t in tensors], dim=dim)

    def reduce_gradients(self) -> None:
        """Leave on the root the gradients averaged over every GPU of every node.

        Sums the replicas' flat gradient buffers onto the root (comm.reduce_add), sums
        those over the nodes (``allreduce_buckets``) and divides by ``total_devices``.
        A collective over nodes: every node process must call it, in the same order.
        """
        with torch.no_grad():
            for dt, root_flat in self._grads[0].flat.items():
                summed = _reduce_add([gf.flat[dt] for gf in self._grads])
                allreduce_buckets(summed, self.bucket_mb, self.group)
                torch.div(summed, self.total_devices, out=root_flat)

    def join(self) -> None:
        """Uneven inputs are not supported here: raises NotImplementedError.

        Give every node the same number of batches instead (``distlib.data.sampler.distributed_loader`` with
        ``drop_last=True``), or use ``GradSync.join()`` with one process per GPU.
        """
        raise NotImplementedError(
            "Replicas.join(): uneven inputs are not supported by the single-process fallback; give every "
            "node the same number of batches (distributed_loader(..., drop_last=True)) or use GradSync(model).join() "
            "with one process per GPU"
        )

    def sync_buffers(self) -> None:
        """Average floating-point buffers (BatchNorm running statistics) over every GPU of
        every node and give the result to every replica; other buffers (such as
        ``num_batches_tracked``, equal everywhere) take the root's values. Call before
        evaluating or saving the root. A collective over nodes: every node process must
        call it, in the same order.
        """
        with torch.no_grad():
            if self.num_devices > 1:  # this node's sum of every replica's buffers, on the root
                by_dtype: dict[torch.dtype, list[int]] = {}
                for j, b in enumerate(self._buffers[0]):
                    if b.is_floating_point():
                        by_dtype.setdefault(b.dtype, []).append(j)
                for idx in by_dtype.values():
                    summed = _reduce_add([torch.cat([bufs[j].reshape(-1) for j in idx]) for bufs in self._buffers])
                    for j, part in zip(idx, summed.split([self._buffers[0][j].numel() for j in idx])):
                        self._buffers[0][j].copy_(part.view_as(self._buffers[0][j]))
            collectives.sync_buffers(self.root, group=self.group, replicas=self.num_devices)
            for j, b in enumerate(self._buffers[0]):
                _broadcast_into(b, [bufs[j] for bufs in self._buffers[1:]])

    # ---- forward and backward ----------------------------------------------------------

    def _forward(self, i: int, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, dtype, cache=True) -> torch.Tensor:
        d = self.devices[i]
        with _device_guard(d), _autocast(d, dtype, cache):
            out = self.models[i](**x) if isinstance(x, Mapping) else self.models[i](x)
            loss = loss_fn(out, y)
        if loss.dim() != 0:
            raise ValueError(f"loss_fn must return a scalar (the mean over the shard), got shape {tuple(loss.shape)}")
        return loss

    def _forward_backward_eager(self, xs, ys, loss_fn, dtype, grad_accum) -> list[torch.Tensor]:
        m = _rows(xs[0]) // grad_accum
        totals: list[torch.Tensor] = []
        for k in range(grad_accum):
            sl = slice(k * m, (k + 1) * m)
            # One thread issues every replica's forward; each GPU starts as soon as its launches arrive.
            losses = [self._forward(i, _slice(xs[i], sl), ys[i][sl], loss_fn, dtype) for i in range(self.num_devices)]
            # One backward call: autograd runs each GPU's part on that GPU's own worker thread, concurrently.
            torch.autograd.backward([loss / grad_accum for loss in losses] if grad_accum > 1 else losses)
            if grad_accum == 1:
                return [loss.detach() for loss in losses]
            detached = [loss.detach() / grad_accum for loss in losses]
            totals = detached if k == 0 else [a + b for a, b in zip(totals, detached)]
        return totals

    def _capture(self, xs, ys, loss_fn, dtype, grad_accum) -> None:
        """Capture each replica's forward+backward of one micro-batch as a CUDA graph on its GPU."""
        m = xs[0].shape[0] // grad_accum
        self._static_x = [x[:m].clone() for x in xs]  # clone keeps channels_last
        self._static_y = [y[:m].clone() for y in ys]
        saved = [[b.detach().clone() for b in bufs] for bufs in self._buffers]
        streams = [torch.cuda.Stream(device=d) for d in self.devices]
        for d, s in zip(self.devices, streams):
            s.wait_stream(torch.cuda.current_stream(d))
        for _ in range(_GRAPH_WARMUP):  # on side streams, as capture requires
            losses = []
            for i, s in enumerate(streams):
                with torch.cuda.stream(s):
                    losses.append(self._forward(i, self._static_x[i], self._static_y[i], loss_fn, dtype, False))
            torch.autograd.backward([loss / grad_accum for loss in losses])
        for d, s in zip(self.devices, streams):
            torch.cuda.current_stream(d).wait_stream(s)
        self._graphs, self._static_loss = [], []
        for i, (d, s) in enumerate(zip(self.devices, streams)):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.device(d), torch.cuda.graph(g, stream=s):  # each GPU its own capture stream
                loss = self._forward(i, self._static_x[i], self._static_y[i], loss_fn, dtype, False)
                (loss / grad_accum if grad_accum > 1 else loss).backward()
            self._graphs.append(g)
            self._static_loss.append(loss.detach())
        with torch.no_grad():  # the warm-up stepped BatchNorm's statistics: undo that
            for bufs, old in zip(self._buffers, saved):
                for b, o in zip(bufs, old):
                    b.copy_(o)
        self._zero_grads()

    def _forward_backward_graph(self, xs, ys, loss_fn, dtype, grad_accum) -> list[torch.Tensor]:
        if isinstance(xs[0], Mapping):  # inputs by name (a chat batch): run eagerly
            if not self._warned_shape:
                get_logger().warning("Replicas: a batch of named inputs runs eagerly (no CUDA graph)")
                self._warned_shape = True
            return self._forward_backward_eager(xs, ys, loss_fn, dtype, grad_accum)
        key = (tuple(xs[0].shape), xs[0].stride(), xs[0].dtype, tuple(ys[0].shape), ys[0].dtype, dtype, grad_accum)
        if self._graphs is None:
            self._capture(xs, ys, loss_fn, dtype, grad_accum)
            self._graph_key = key
        elif key != self._graph_key:
            if not self._warned_shape:
                get_logger().warning(
                    "Replicas: a step unlike the captured one (shapes, dtype, grad_accum) runs eagerly"
                )
                self._warned_shape = True
            return self._forward_backward_eager(xs, ys, loss_fn, dtype, grad_accum)
        m = xs[0].shape[0] // grad_accum
        totals: list[torch.Tensor] = []
        for k in range(grad_accum):
            sl = slice(k * m, (k + 1) * m)
            for i, d in enumerate(self.devices):
                self._static_x[i].copy_(xs[i][sl])
                self._static_y[i].copy_(ys[i][sl])
                with torch.cuda.device(d):
                    self._graphs[i].replay()  # a few microseconds of host time per GPU
            detached = [loss / grad_accum for loss in self._static_loss] if grad_accum > 1 else self._static_loss
            totals = [t.clone() for t in detached] if k == 0 else [a + b for a, b in zip(totals, detached)]
        return totals

    def forward_backward(
        self,
        xs: Sequence[torch.Tensor | Mapping[str, torch.Tensor]],
        ys: Sequence[torch.Tensor],
        loss_fn: LossFn,
        *,
        autocast_dtype: torch.dtype | None = None,
        grad_accum: int = 1,
    ) -> list[torch.Tensor]:
        """Forward and backward of each replica on its shard, accumulating into the flat
        gradient buffers; returns each replica's loss (mean over its shard)."""
        if self.cuda_graph:
            return self._forward_backward_graph(xs, ys, loss_fn, autocast_dtype, grad_accum)
        return self._forward_backward_eager(xs, ys, loss_fn, autocast_dtype, grad_accum)

    def train_step(
        self,
        x: torch.Tensor | Mapping[str, torch.Tensor],
        y: torch.Tensor,
        loss_fn: LossFn,
        *,
        autocast_dtype: torch.dtype | None = None,
        grad_accum: int = 1,
    ) -> torch.Tensor:
        """Forward and backward of this node's batch on all its GPUs; afterwards the root's
        ``.grad`` hold the gradients averaged over every GPU of every node, ready for
        ``optimizer.step()`` on the root.

        ``x``, ``y``: the node's batch (any device; split evenly over the GPUs, each shard
        into ``grad_accum`` micro-batches); ``x`` a tensor, or a mapping of tensors (each value
        split alike, the model called as ``model(**x)``; no CUDA graph then).
        ``loss_fn(output, target)`` returns the mean loss of a shard. The root's parameters
        reach the replicas at the start of each step, so the optimizer may change them in
        between. Returns the mean loss over this node's GPUs (0-dim, on the root). A
        collective over nodes: every node process must call it, in the same order.
        """
        rows = _rows(x)
        self.check_batch(rows, grad_accum)
        if y.shape[0] != rows:
            raise ValueError(f"inputs and targets differ in batch size: {rows} vs {y.shape[0]}")
        self._attach_grads()
        for m in self.models[1:]:
            if m.training != self.root.training:
                m.train(self.root.training)
        self.broadcast_parameters()
        if isinstance(x, Mapping):  # inputs by name: each value split, each replica called with model(**x)
            parts = {k: self.scatter(v) for k, v in x.items()}
            xs = [{k: p[i] for k, p in parts.items()} for i in range(self.num_devices)]
        else:
            xs = self.scatter(x)
        ys = self.scatter(y)
        self._zero_grads()
        losses = self.forward_backward(xs, ys, loss_fn, autocast_dtype=autocast_dtype, grad_accum=grad_accum)
        self.reduce_gradients()
        return self.gather([loss.reshape(1) for loss in losses]).mean()


def node_devices(device: torch.device, local_world_size: int) -> list[torch.device]:
    """The devices one fallback-mode process drives: every visible GPU, ``device`` (the
    process's own, where its NCCL communicator lives) first.

    Without GPUs: one CPU "device", with a warning, so that the same recipe and the whole
    hierarchy run on a CPU machine. With GPUs, two processes on one node would each drive
    every GPU: that is refused with a ValueError.
    """
    if device.type != "cuda":
        get_logger().warning("dist.mode=fallback: no GPU visible; each process drives one CPU replica")
        return [torch.device("cpu")]
    if local_world_size > 1:
        raise ValueError(
            f"dist.mode=fallback drives every GPU of a node from one process, but {local_world_size} processes "
            "run on this node; start one per node (torchrun --nproc-per-node=1)"
        )
    n = torch.cuda.device_count()
    return [device] + [torch.device("cuda", i) for i in range(n) if i != device.index]
