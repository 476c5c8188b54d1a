"""Learning-rate schedule (linear warm-up, then linear decay to zero) and the weight EMA's decay ramp."""

from __future__ import annotations

import torch


class WarmupLinear:
    """Multiplier of the peak rate at optimizer step ``step`` (for LambdaLR)."""

    def __init__(self, total_steps: int, warmup_frac: float):
        self.total = max(1, total_steps)
        self.warmup = int(warmup_frac * self.total)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        return max(0.0, (self.total - step) / max(1, self.total - self.warmup))


def warmup_linear(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_frac: float
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupLinear(total_steps, warmup_frac))


def ema_decay(decay: float, step: int) -> float:
    """Decay of the weight EMA's update after optimizer step ``step`` (0-based): ``decay``, ramped
    up as ``(1 + step) / (10 + step)`` early on (TensorFlow's ExponentialMovingAverage with
    num_updates), so the average soon forgets the initial weights whatever the decay."""
    return min(decay, (1 + step) / (10 + step))
