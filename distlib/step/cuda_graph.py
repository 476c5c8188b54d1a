"""The whole training step — forward, backward, gradient all_reduce, optimizer step — captured
once as a CUDA graph and replayed, with the inputs copied into static buffers.

Why an NCCL all_reduce inside a captured step can hang, and how this module avoids each cause
(release before destroy, barriers around capture, one collective order, warm-up of the very
collectives captured, thread-local capture mode): docs/cuda_graphs.md.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from distlib.distributed import collectives, process_group
from distlib.errors import DistlibError
from distlib.log import get_logger
from distlib.parallel.grad_sync import GradSync


class CaptureUnsupported(DistlibError, RuntimeError):
    """The step cannot be captured as a CUDA graph here (the reason is in the message)."""


def capture_problem(device: torch.device, optimizer: torch.optim.Optimizer, grad_accum: int = 1) -> str | None:
    """Why a whole-step graph cannot be used with these settings, or None when it can."""
    if device.type != "cuda":
        return f"CUDA graphs need a GPU; the step runs on {device}"
    if grad_accum != 1:
        return f"grad_accum={grad_accum}: only a single micro-step per optimizer step is captured"
    cls = getattr(optimizer, "optimizer_class", type(optimizer))  # a ShardedOptimizer steps this class
    if issubclass(cls, torch.optim.SGD) and not all(g.get("fused") for g in optimizer.param_groups):
        return "SGD must be built with fused=True (its foreach path reads a tensor lr with .item())"
    # torch's own capture check asks every group for capturable=True, fused or not
    if issubclass(cls, (torch.optim.Adam, torch.optim.AdamW)) and not all(
        g.get("capturable") for g in optimizer.param_groups
    ):
        return f"{cls.__name__} must be built with capturable=True (fused=True as well, for speed)"
    return None


def sharding_problem(model: nn.Module) -> str | None:
    """Why a fully sharded model's step cannot be a CUDA graph, or None for any other model."""
    if "torch.distributed.fsdp" not in sys.modules:
        return None  # nothing has sharded it: FSDP2 is not even imported (and costs seconds to import)
    from distlib.parallel.fsdp import is_fully_sharded

    if is_fully_sharded(model):
        return (
            "the model is fully sharded (FSDP2's fully_shard), which does not support CUDA graph capture "
            "(pytorch/pytorch#164264); train it eagerly (train.cuda_graph=false)"
        )
    return None


class CapturedStep:
    """One training step replayed as a CUDA graph: ``loss = step(x, y)``.

    ``loss_fn(*inputs)`` returns the loss (forward under autocast if wanted). Each call copies
    the inputs into static buffers; the first ``warmup_steps`` calls run eagerly on a side
    stream (real training steps: they also build the optimizer state and GradSync's final
    bucket layout), the next one captures and replays, every later one replays. The returned
    loss is a static buffer, overwritten by the next call: accumulate it on the device
    (``total += loss``) or read it before the next step. A call with other input shapes or dtypes
    runs eagerly (every rank must see the same shapes). ``before_step()``, if given, runs between
    the gradient sync and the optimizer step (e.g. gradient clipping), ``post_step()`` after the
    optimizer step (e.g. ``distlib.EMA.update``); both run on both paths and are captured with the
    step: they must not sync with the host, and must read what changes between steps from device
    tensors.

    With a GradSync, building and calling this are collectives: every rank must do the same.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., torch.Tensor],
        sync: GradSync | None = None,
        *,
        warmup_steps: int = 3,
        before_step: Callable[[], None] | None = None,
        post_step: Callable[[], None] | None = None,
    ):
        device = next(model.parameters()).device
        problem = sharding_problem(model) or capture_problem(device, optimizer)
        if problem:
            raise CaptureUnsupported(problem)
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1 (optimizer state and bucket layout), got {warmup_steps}")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.sync = sync
        self.warmup_steps = warmup_steps
        self.before_step = before_step  # runs (and is captured) between the gradient sync and the step
        self.post_step = post_step  # runs (and is captured) after the optimizer step
        self.device = device
        self.steps = 0
        self.eager_steps = 0  # steps that could not replay (warm-up excluded)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static_inputs: list[torch.Tensor] | None = None
        self._static_loss: torch.Tensor | None = None
        self._lr: list[torch.Tensor] = []
        self._lr_values: list[float] = []
        self._side = torch.cuda.Stream(device)
        self._warned = False
        # a live graph holding NCCL work makes ncclCommDestroy wait forever: released before the group goes
        process_group.on_shutdown(self._at_shutdown)

    # ---- the eager step --------------------------------------------------------------
    def _eager(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)  # after replays the .grad views hold the last replay's values
        loss = self.loss_fn(*inputs)
        loss.backward()
        if self.sync is not None:
            self.sync.wait()
        if self.before_step is not None:
            self.before_step()
        self.optimizer.step()
        if self.post_step is not None:
            self.post_step()
        return loss.detach()

    def _matches(self, inputs: tuple[torch.Tensor, ...]) -> bool:
        return len(inputs) == len(self._static_inputs) and all(
            a.shape == b.shape and a.dtype == b.dtype for a, b in zip(inputs, self._static_inputs)
        )

    # ---- capture and replay ----------------------------------------------------------
    def _capture(self) -> None:
        if self.sync is not None and self.sync.world_size > 1 and not self.sync._rebuilt:
            raise RuntimeError("GradSync has not completed a synced step; capture needs its final bucket layout")
        finish = getattr(self.optimizer, "finish_param_gather", None)
        if finish is not None:
            finish()  # a ShardedOptimizer's all_gathers left in flight by the last eager step
        torch.cuda.synchronize(self.device)
        if collectives.world_size() > 1:
            # No NCCL work pending (capture_begin would wait for the watchdog to retire it), and
            # every rank enters capture together.
            dist.barrier()
            torch.cuda.synchronize(self.device)
        groups = self.optimizer.param_groups
        floats = [g["lr"] for g in groups]
        self._lr = [torch.tensor(float(v), dtype=torch.float32, device=self.device) for v in floats]
        self._lr_values = [float(v) for v in floats]
        for g, t in zip(groups, self._lr):
            g["lr"] = t
        # Fresh gradients from the captured backward (grads set to None): autograd writes them into
        # the graph's pool and GradSync gathers each bucket with one copy, instead of one add per
        # parameter into stale views.
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        gc_was_enabled = gc.isenabled()
        gc.disable()  # a collection inside capture could destroy another graph, which invalidates this one
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                loss = self.loss_fn(*self._static_inputs)
                loss.backward()
                if self.sync is not None:
                    self.sync.wait()
                if self.before_step is not None:
                    self.before_step()  # e.g. gradient clipping: device work only, no host sync
                self.optimizer.step()
                if self.post_step is not None:
                    self.post_step()
        except Exception as e:
            raise CaptureUnsupported(
                f"capturing the training step as a CUDA graph failed ({type(e).__name__}: {e}); "
                "run without it (train.cuda_graph=false)"
            ) from e
        finally:
            if gc_was_enabled:
                gc.enable()
            for g, v in zip(groups, floats):
                g["lr"] = v  # schedulers and logging keep seeing plain numbers
        self._static_loss = loss.detach()
        self._graph = graph
        if collectives.world_size() > 1:
            torch.cuda.synchronize(self.device)
            dist.barrier()  # every rank has finished capturing before any replays (as Megatron-LM does)

    def _refresh_lr(self) -> None:
        for i, g in enumerate(self.optimizer.param_groups):
            v = g["lr"]
            if isinstance(v, torch.Tensor):
                self._lr[i].copy_(v)
            elif v != self._lr_values[i]:
                self._lr[i].fill_(v)
                self._lr_values[i] = v

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        """One training step on ``inputs``; returns the loss (a static buffer when replayed)."""
        if self._static_inputs is None:
            self._static_inputs = [torch.empty_like(t, device=self.device) for t in inputs]
        if not self._matches(inputs):
            if not self._warned:
                get_logger().warning(
                    "CapturedStep: inputs %s differ from the captured %s; such steps run eagerly",
                    [tuple(t.shape) for t in inputs],
                    [tuple(t.shape) for t in self._static_inputs],
                )
                self._warned = True
            self.steps += 1
            self.eager_steps += 1
            return self._eager([t.to(self.device, non_blocking=True) for t in inputs])
        for static, t in zip(self._static_inputs, inputs):
            static.copy_(t, non_blocking=True)
        self.steps += 1
        if self.steps <= self.warmup_steps:
            current = torch.cuda.current_stream(self.device)
            self._side.wait_stream(current)
            with torch.cuda.stream(self._side):
                loss = self._eager(self._static_inputs)
            current.wait_stream(self._side)
            return loss
        if self._graph is None:
            self._capture()
        self._refresh_lr()
        self._graph.replay()
        return self._static_loss

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def close(self) -> None:
        """Release the graph (before the process group is destroyed: see the module docstring)."""
        if self._graph is not None:
            torch.cuda.synchronize(self.device)
            self._graph.reset()
            self._graph = None
            self._static_loss = None

    def _at_shutdown(self, together: bool) -> None:
        """``distlib.shutdown()`` closes a step still live, before it destroys the group."""
        self.close()


def build_train_step(
    enabled: bool,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor],
    sync: GradSync | None,
    *,
    grad_accum: int = 1,
    warmup_steps: int = 3,
    before_step: Callable[[], None] | None = None,
    post_step: Callable[[], None] | None = None,
) -> CapturedStep | None:
    """A CapturedStep when ``enabled`` and possible here; otherwise None, with a warning naming
    why (the caller then runs its eager step)."""
    if not enabled:
        return None
    device = next(model.parameters()).device
    problem = sharding_problem(model) or capture_problem(device, optimizer, grad_accum)
    if problem:
        get_logger().warning("train.cuda_graph: %s; training eagerly", problem)
        return None
    return CapturedStep(
        model, optimizer, loss_fn, sync, warmup_steps=warmup_steps, before_step=before_step, post_step=post_step
    )
