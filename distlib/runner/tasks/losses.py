"""The built-in loss: ``loss = fn(outputs, targets)``, a mean over every prediction; ``LossFn``, the
shape of every loss a recipe names."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy of (N, C) logits and (N) classes, or of (B, T, V) next-token logits and
    (B, T) tokens (every position counts once); in fp32 whatever the autocast dtype."""
    return F.cross_entropy(outputs.flatten(0, -2).float(), targets.flatten(), label_smoothing=label_smoothing)


__all__ = ["LossFn", "cross_entropy"]
