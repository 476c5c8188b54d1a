"""One training step, whichever way gradients are synced: ``loss = step(x, y)``.

The trainer sees only ``TrainStep``; ``build_step`` alone picks the implementation from
``dist.mode`` and ``dist.shard``:

- ``process_per_gpu``: ``GradSyncStep``, one process per GPU with distlib.GradSync (with
  ``dist.shard=optimizer`` its reduce-scatter and the ShardedOptimizer; with ``full`` FSDPSync
  over the model from ``shard_model``, FSDP2's mixed precision in place of autocast), run
  eagerly (``grad_accum`` micro-steps, communication on the last only) or replayed as one
  CUDA graph (``train.cuda_graph``, distlib/step/cuda_graph.py); the model's blocks checkpointed and
  compiled first, or (``train.compile=model``) the whole model compiled by ``distlib.compile_for_sync``
  (the kernels then inside the graph): stages 6 to 10 of runner/training/build_order.py;
- ``fallback``: ``ReplicasStep``, one process drives every GPU of its node (distlib.Replicas,
  distlib/parallel/comm_fallback.py).

Every step runs forward, backward, the gradient sync, the optimizer step and ``post_step`` (the
weight EMA's update; inside the graph when there is one), and returns this rank's share of the
step's loss (not synced: its mean over the ranks is the step's loss). The loss optimised is the
step's mean over its trained targets (runner/tasks/losses.py, docs/loss.md): before the forward one
all-reduce counts them (N) over every rank and micro-batch, and each micro-batch's summed loss is
scaled by world size / N, so that the gradient syncs' average over the ranks gives
sum(loss) / N whatever the world size and ``grad_accum``. Loss scaling (fp16) and gradient clipping
are the shared ``OptimizerStep``'s (runner/training/optimizer_step.py), run only on the averaged
gradients; the clipping norm is the sync's ``clip_grad_norm_``, the global norm whether the
gradients are replicated or sharded. Calling a step is a collective: every rank must call it alike.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import nn

import distlib
from distlib.distributed.process_group import Context, EnvError
from distlib.parallel.comm_fallback import Replicas, node_devices
from distlib.runner.config import Config, ConfigError
from distlib.runner.tasks.batch import Inputs, call_model, flatten, micro_batch, unflatten
from distlib.runner.tasks.losses import LossFn, StepLoss, cross_entropy, trained
from distlib.runner.training.build_order import prepare_for_step
from distlib.runner.training.optimizer_step import OptimizerSpec, OptimizerStep, autocast_dtype
from distlib.runner.training.warmup import warm_up
from distlib.step.cuda_graph import build_train_step


class TrainStep:
    """``loss = step(x, y)``: one optimizer step on this rank's batch."""

    optimizer: torch.optim.Optimizer
    modules: list[nn.Module]  # every module the step changes (the model and any replicas of it)
    update: OptimizerStep  # unscale, clip and step, on the averaged gradients
    trained: torch.Tensor  # the last step's trained targets, over every rank (on the device)
    ranks: int = 1  # over which the gradient sync averages a loss

    def __call__(self, x: Inputs, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def count(self, y: torch.Tensor) -> torch.Tensor:
        """The step's trained targets N over every rank (one all-reduce; a collective), kept in
        ``trained``; returns the scale of a summed loss: world size / N (N at least 1: a step with
        nothing trained has a zero loss and zero gradients)."""
        self.trained = n = distlib.all_reduce(trained(y))
        return self.ranks / n.clamp(min=1).to(torch.float32)

    def warm_up(self, x: Inputs, y: torch.Tensor, steps: int) -> None:
        """Run ``steps`` real steps on ``(x, y)`` (cuDNN autotuning, lazy set-up, graph capture),
        then put the weights, buffers and optimizer state back as they were. A collective."""
        scaler = self.update.scaler
        saved = scaler.state_dict() if scaler is not None else None
        warm_up(lambda: self(x, y), self.modules, self.optimizer, steps)
        if scaler is not None:
            scaler.load_state_dict(saved)  # in place: the scale tensor keeps its storage
        self.weights_changed()

    def weights_changed(self) -> None:
        """The weights were changed in place outside a step (put back after the warm-up, loaded from
        a checkpoint): recompute what the step derives from them (float8 all-gathers' scales). A
        collective."""

    def sync_buffers(self) -> None:
        """Bring the buffers of every device this process drives into the model, before it is
        evaluated or saved. A collective."""

    def close(self) -> None:
        """Release what the step holds (hooks, graphs); before the process group goes."""


class GradSyncStep(TrainStep):
    """One process per GPU: the gradient sync (GradSync: all_reduce, or reduce_scatter for the
    sharded optimizer; FSDPSync: FSDP2's reduce-scatters) runs in buckets during the backward."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sync: distlib.GradSync | distlib.FSDPSync,
        loss_of: Callable[..., tuple[torch.Tensor, torch.Tensor]],  # (inputs, targets) -> StepLoss.parts
        *,
        update: OptimizerStep,
        ranks: int = 1,
        grad_accum: int = 1,
        cuda_graph: bool = False,
        post_step: Callable[[], None] | None = None,
        refresh: Callable[[], None] | None = None,  # after each optimizer step and weights_changed()
    ):
        self.model, self.optimizer, self.sync, self.loss_of = model, optimizer, sync, loss_of
        self.refresh = refresh
        if refresh is not None:
            post_step = _then(refresh, post_step)
        self.post_step = post_step
        self.modules = [model]
        self.update = update
        self.grad_accum = grad_accum
        self.ranks = ranks
        self._keys: list[str] | None = None  # a mapping's keys, in the order the graph takes its tensors
        if cuda_graph and update.scaler is not None:  # load_config refuses this; a GradScaler's step syncs the host
            raise ValueError("a captured CUDA-graph step cannot run a GradScaler")
        # the whole step as one CUDA graph, or None: eager (with a warning saying why, if it was asked for)
        self.graph = build_train_step(cuda_graph, model, optimizer, self._graph_loss, sync, grad_accum=grad_accum,
                                      before_step=update.clip if update.clip_grad_norm > 0 else None,
                                      post_step=post_step)  # fmt: skip

    def _graph_loss(self, *inputs: torch.Tensor) -> torch.Tensor:
        *x, y, scale = inputs  # the scale a static input too: each replay reads this step's
        total, mean = self.loss_of(unflatten(x, self._keys), y)
        return total * scale + mean

    def __call__(self, x: Inputs, y: torch.Tensor) -> torch.Tensor:
        scale = self.count(y)  # before the forward: the count's all-reduce overlaps nothing it waits for
        if self.graph is not None:  # forward, backward, all_reduce and SGD: one graph replay
            tensors, self._keys = flatten(x)
            return self.graph(*tensors, y, scale)
        n = self.grad_accum
        loss = torch.zeros((), device=y.device)
        for k in range(n):
            with contextlib.nullcontext() if k == n - 1 else self.sync.no_sync():
                total, mean = self.loss_of(micro_batch(x, k, n), micro_batch(y, k, n))
                micro_loss = total * scale + mean / n
                self.update.scale(micro_loss).backward()
                self.sync.wait()
            loss += micro_loss.detach()
        self.update.step()  # after wait(): the averaged gradients, the same on every rank
        if self.post_step is not None:
            self.post_step()
        return loss

    def weights_changed(self) -> None:
        if self.refresh is not None:
            self.refresh()

    def close(self) -> None:
        if self.graph is not None:
            self.graph.close()
        self.sync.close()


def _then(first: Callable[[], None], then: Callable[[], None] | None) -> Callable[[], None]:
    def both() -> None:
        first()
        if then is not None:
            then()

    return both


class ReplicasStep(TrainStep):
    """One process per node: the batch is split over the node's GPUs and the root replica
    gets the gradients averaged over every GPU of every node."""

    def __init__(
        self,
        replicas: Replicas,
        optimizer: torch.optim.Optimizer,
        loss_fn: StepLoss,
        *,
        update: OptimizerStep,
        autocast_dtype: torch.dtype | None,
        grad_accum: int = 1,
        post_step: Callable[[], None] | None = None,
    ):
        self.replicas, self.optimizer, self.update = replicas, optimizer, update
        # Replicas averages a loss over the micro-batches and over every GPU of every node: a summed
        # loss is scaled by (GPUs x grad_accum) / N, a mean one taken as it is
        self.ranks = replicas.total_devices * grad_accum
        self._scales = {d: torch.ones((), device=d) for d in replicas.devices}  # written in place: graphs read them

        def scaled(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            total, mean = loss_fn.parts(out, y)
            return update.scale(total * self._scales[y.device] + mean)  # scaled on each replica's device

        self.loss_fn = scaled
        self.post_step = post_step
        self.modules = list(replicas.models)
        self.autocast_dtype = autocast_dtype
        self.grad_accum = grad_accum

    def __call__(self, x: Inputs, y: torch.Tensor) -> torch.Tensor:
        scale = self.count(y)
        for s in self._scales.values():
            s.copy_(scale)
        scaled = self.replicas.train_step(
            x, y, self.loss_fn, autocast_dtype=self.autocast_dtype, grad_accum=self.grad_accum
        )
        loss = scaled / self.update.scale(torch.ones_like(scaled))  # the scale this step's backward used
        self.update.step()  # the root holds the gradients averaged over every GPU of every node
        if self.post_step is not None:
            self.post_step()
        return loss

    def sync_buffers(self) -> None:
        self.replicas.sync_buffers()  # BatchNorm statistics averaged over every GPU into the root


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype == torch.bfloat16 else t


def build_step(
    cfg: Config,
    ctx: Context,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | OptimizerSpec,
    per_rank: int,
    post_step: Callable[[], None] | None = None,
    loss_fn: LossFn | StepLoss | None = None,
) -> TrainStep:
    """The step for ``cfg.dist.mode`` and ``cfg.dist.shard``, with its optimizer (``step.optimizer``),
    built from ``optimizer`` (a spec, or an optimizer already built over ``model``'s parameters;
    ``dist.shard=optimizer`` builds the sharded one from its class and groups). ``model``: with
    ``dist.shard=full`` the model from ``shard_model`` (Trainer.build_model). ``per_rank``: this
    process's batch. ``post_step``: run after each optimizer step (captured with it).
    ``loss_fn(outputs, targets)``: the task's loss (``StepLoss``, or a loss function: summed where it
    takes ``reduction``; default: cross-entropy with train.label_smoothing). A collective (GradSync
    and Replicas start from rank 0's weights): every rank must call it."""
    t, shard = cfg.train, cfg.dist.shard
    spec = optimizer if isinstance(optimizer, OptimizerSpec) else None
    dtype = autocast_dtype(t.precision, ctx.device)
    scaler = torch.amp.GradScaler(ctx.device.type) if dtype is torch.float16 else None
    if loss_fn is None:
        loss_fn = functools.partial(cross_entropy, label_smoothing=t.label_smoothing)
    loss_fn = StepLoss.of(loss_fn)
    if cfg.dist.mode == "fallback":
        try:
            devices = node_devices(ctx.device, ctx.local_world_size)
        except ValueError as e:  # several processes on one node would each drive every GPU
            raise EnvError(f"dist.mode=fallback: {e}") from e
        replicas = Replicas(model, devices, bucket_mb=cfg.dist.bucket_mb, cuda_graph=t.cuda_graph)
        try:
            replicas.check_batch(per_rank, t.grad_accum)
        except ValueError as e:
            raise ConfigError([f"train.batch_size={t.batch_size} with dist.mode=fallback: {e}"]) from e
        opt = spec.build() if spec is not None else optimizer
        update = OptimizerStep(opt, scaler=scaler, clip_grad_norm=t.clip_grad_norm)
        return ReplicasStep(replicas, opt, loss_fn, update=update, autocast_dtype=dtype, grad_accum=t.grad_accum,
                            post_step=post_step)  # fmt: skip

    # checkpointing and per-block compile in place, the loss compiled, float8's refresh (build_order.py)
    prepared = prepare_for_step(cfg, model, loss_fn)
    parts = prepared.loss_parts
    if shard == "full":
        sync = distlib.FSDPSync(model, accumulate=cfg.dist.accumulate)
        # FSDP2's mixed precision (shard_model's param_dtype) replaces autocast: the weights are
        # gathered in bf16 and every layer computes in it; the loss is taken in fp32
        autocast = contextlib.nullcontext()
        net = model
    else:
        # broadcast_buffers=False: the runner averages the BatchNorm statistics over the ranks with
        # sync_buffers() before each evaluation instead (every rank's data counts), so the per-forward
        # broadcast of rank 0's buffers would only cost a collective per step
        sync = distlib.GradSync(model, bucket_mb=cfg.dist.bucket_mb, compress=cfg.dist.compress,
                                comm_groups=cfg.dist.comm_groups, shard=shard, broadcast_buffers=False)  # fmt: skip
        autocast = torch.autocast(ctx.device.type, dtype=dtype, enabled=dtype is not None)
        # train.compile=model: compiled at the first step (the warm-up, on a GPU), one graph per bucket so
        # the all_reduces overlap
        whole = prepared.compile_whole
        net = distlib.compile_for_sync(model, sync, backend=t.compile_backend) if whole else model
    if shard == "optimizer":
        spec = spec or OptimizerSpec.of(optimizer)
        opt = sync.sharded_optimizer(spec.cls, spec.groups, **spec.kwargs)
    else:
        opt = spec.build() if spec is not None else optimizer
    update = OptimizerStep(opt, scaler=scaler, clip_grad_norm=t.clip_grad_norm, clip_fn=sync.clip_grad_norm_)

    head = loss_fn.head  # the loss applies the output layer, inside the model's forward (loss.chunks)

    def loss_of(x: Inputs, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast:
            if head is not None:  # the model returns the summed loss, in fp32
                return parts(call_model(net, x, head=head(y)), y)
            out = call_model(net, x)
            if shard == "full":  # as autocast would: the loss's softmax and log in fp32
                out = (_fp32(out[0]), *out[1:]) if isinstance(out, tuple) else _fp32(out)
            return parts(out, y)

    return GradSyncStep(model, opt, sync, loss_of, update=update, ranks=ctx.world_size, grad_accum=t.grad_accum,
                        cuda_graph=t.cuda_graph, post_step=post_step, refresh=prepared.refresh)  # fmt: skip
