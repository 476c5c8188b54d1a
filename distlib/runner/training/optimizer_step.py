"""The optimizer's half of every training step: fp16 loss scaling (``torch.amp.GradScaler``),
gradient-norm clipping, the optimizer step.

Call it only once the gradients are averaged over every rank (after ``GradSync.wait()``, or
once Replicas has reduced them into the root): every rank then holds the same gradients, so
the GradScaler's inf/nan check skips the same steps everywhere and the clipping norm is the
norm of the global gradient, not of one rank's share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from distlib.runner.config import TrainConfig
from distlib.runner.models.parameters import param_groups

# fp8: bf16 autocast around the float8 matrix products (train.precision=fp8, runner/training/float8.py)
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None, "fp8": torch.bfloat16}


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``train.precision`` on ``device``; None: no autocast.
    bf16 (and fp8's, around its float8 products) runs in fp32 on a CPU (slow there); fp16 autocasts on every
    device torch supports."""
    dtype = PRECISIONS[precision]
    if dtype is torch.bfloat16 and device.type != "cuda":
        return None
    return dtype


@dataclass
class OptimizerSpec:
    """An optimizer not built yet: ``cls(groups, **kwargs)``. The step builds it, on the parameters it
    trains: the model's own, or (``dist.shard=optimizer``) this rank's slice of them."""

    cls: type[torch.optim.Optimizer]
    groups: list[dict[str, Any]]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> OptimizerSpec:
        """The spec of an optimizer already built: its class and its groups with every setting."""
        return cls(type(optimizer), [dict(g) for g in optimizer.param_groups])

    def build(self) -> torch.optim.Optimizer:
        return self.cls(self.groups, **self.kwargs)


def optimizer_spec(t: TrainConfig, model: nn.Module, device: torch.device, offload: bool = False) -> OptimizerSpec:
    """``t.optimizer`` over the model's parameters, weight decay on the matrices only; the step builds
    it (over this rank's slice with dist.shard=optimizer). ``offload``: dist.offload, the shards (and
    so the optimizer's state) on the host."""
    cuda = device.type == "cuda" and not offload
    groups = param_groups(model, t.weight_decay)
    if t.optimizer == "adamw":
        # fused: one kernel for every parameter; capturable: its step counter stays on the GPU, which a
        # captured CUDA graph needs
        return OptimizerSpec(torch.optim.AdamW, groups, dict(lr=t.lr, betas=(t.beta1, t.beta2),
                             fused=True if cuda else None, capturable=t.cuda_graph and cuda))  # fmt: skip
    return OptimizerSpec(torch.optim.SGD, groups, dict(lr=t.lr, momentum=t.momentum, nesterov=t.nesterov,
                         fused=True if t.cuda_graph and cuda else None))  # graphs need fused  # fmt: skip


class OptimizerStep:
    """``scale(loss)`` before the backward; ``step()`` once the gradients are averaged:
    unscale (fp16), clip the global norm, step (skipped by the scaler on inf/nan), zero the
    gradients. ``clip()`` alone is what a captured CUDA graph runs between sync and step.
    ``clip_fn(max_norm)``: what clips the global norm (the gradient sync's ``clip_grad_norm_``,
    which also knows sharded gradients); by default torch's over the optimizer's parameters."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        scaler: torch.amp.GradScaler | None,
        clip_grad_norm: float,
        clip_fn: Callable[[float], Any] | None = None,
    ):
        self.optimizer, self.scaler, self.clip_grad_norm = optimizer, scaler, clip_grad_norm
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.clip_fn = clip_fn

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def clip(self) -> None:
        # error_if_nonfinite=False: no host sync, so this can run inside a captured graph;
        # a non-finite norm only happens on a step the scaler skips anyway
        if self.clip_grad_norm <= 0:
            return
        if self.clip_fn is not None:
            self.clip_fn(self.clip_grad_norm)
        else:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad_norm, error_if_nonfinite=False)

    def step(self) -> None:
        if self.scaler is None:
            self.clip()
            self.optimizer.step()
        else:
            self.scaler.unscale_(self.optimizer)  # the averaged gradients: the same inf/nan check on every rank
            self.clip()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
