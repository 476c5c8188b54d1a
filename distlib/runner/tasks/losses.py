"""The losses a step optimises.

``LossFn``, the shape of every loss a recipe names: ``loss = fn(outputs, targets)``, a mean. The
built-in ``cross_entropy`` also takes ``reduction="sum"``: its sum over the trained targets (those
not ``IGNORED``, -100).

``StepLoss``, what the training step calls: ``total, mean = loss.parts(outputs, targets)``. The step
divides ``total`` by the step's trained targets over every micro-batch and every rank (``count``,
all-reduced once per step before the forward: docs/loss.md) and averages ``mean`` over the
micro-batches and ranks, as it always has. A loss that takes ``reduction`` gives its sum to
``total`` (the trained-token mean: the same at every world size and accumulation); any other gives
its mean to ``mean`` (each micro-batch and rank weighs the same, as before).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from distlib.runner import components
from distlib.runner.data.text import IGNORED

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Parts = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def cross_entropy(
    outputs: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy of (N, C) logits and (N) classes, or of (B, T, V) next-token logits and
    (B, T) tokens, over the targets that are not ``IGNORED``: their mean, or (``reduction="sum"``)
    their sum; in fp32 whatever the autocast dtype."""
    return F.cross_entropy(outputs.flatten(0, -2).float(), targets.flatten(), label_smoothing=label_smoothing,
                           ignore_index=IGNORED, reduction=reduction)  # fmt: skip


def trained(targets: torch.Tensor) -> torch.Tensor:
    """How many of ``targets`` are trained (not ``IGNORED``): an int64 0-dim tensor, on their device."""
    return (targets != IGNORED).sum()


class StepLoss:
    """A loss as the step takes it: ``parts(outputs, targets) -> (total, mean)``, ``total`` summed
    over the trained targets, ``mean`` a term already averaged (either may be a zero). Called, it is
    the loss of one batch on its own: ``total / trained(targets) + mean``. ``head``, where the loss
    applies the model's output layer itself (runner/tasks/chunked_loss.py): ``head(targets)`` is what
    the model is called with (``model(x, head=...)``), and its outputs are then what ``parts`` takes."""

    def __init__(self, parts: Parts, head: Callable[[torch.Tensor], Callable[..., Any]] | None = None):
        self.parts, self.head = parts, head

    @classmethod
    def of(cls, fn: LossFn | StepLoss) -> StepLoss:
        """``fn`` as a StepLoss: its sum (``fn(..., reduction="sum")``) where it takes ``reduction``,
        else its mean."""
        if isinstance(fn, StepLoss):
            return fn
        if components.accepted(fn, {"reduction": "sum"}):
            return cls(lambda outputs, targets: (fn(outputs, targets, reduction="sum"), _zero(targets)))
        return cls(lambda outputs, targets: (_zero(targets), fn(outputs, targets)))

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        total, mean = self.parts(outputs, targets)
        return total / trained(targets).clamp(min=1) + mean


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), device=like.device)


__all__ = ["IGNORED", "LossFn", "StepLoss", "cross_entropy", "trained"]
