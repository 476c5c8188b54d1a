"""The built-in loss: ``loss = fn(outputs, targets)``, a mean over every prediction."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy of (N, C) logits and (N) classes, or of (B, T, V) next-token logits and
    (B, T) tokens (every position counts once); in fp32 whatever the autocast dtype."""
    return F.cross_entropy(outputs.flatten(0, -2).float(), targets.flatten(), label_smoothing=label_smoothing)
