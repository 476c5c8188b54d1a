"""Learning-rate schedule (linear warm-up, then a linear or cosine decay to ``min_frac`` of the
peak) and the weight EMA's decay ramp."""

from __future__ import annotations

import math

import torch


class WarmupLinear:
    """Multiplier of the peak rate at optimizer step ``step`` (for LambdaLR)."""

    def __init__(self, total_steps: int, warmup_frac: float, shape: str = "linear", min_frac: float = 0.0):
        self.total = max(1, total_steps)
        self.warmup = int(warmup_frac * self.total)
        self.shape, self.min_frac = shape, min_frac

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        left = max(0.0, (self.total - step) / max(1, self.total - self.warmup))  # 1 after the warm-up, 0 at the end
        if self.shape == "cosine":
            left = 0.5 * (1.0 - math.cos(math.pi * left))
        return self.min_frac + (1.0 - self.min_frac) * left


def warmup_linear(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_frac: float, shape: str = "linear",
    min_frac: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:  # fmt: skip
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupLinear(total_steps, warmup_frac, shape, min_frac))


def retarget(scheduler: torch.optim.lr_scheduler.LambdaLR, schedule: WarmupLinear) -> bool:
    """Put ``schedule`` in place of a resumed scheduler's own (a checkpoint restores the multiplier's
    attributes, its total steps among them) and set the optimizer's rates to what it gives at the step
    reached. True when it differed: the budget changed since the checkpoint."""
    changed = False
    for fn in scheduler.lr_lambdas:
        if vars(fn) != vars(schedule):
            fn.__dict__.update(vars(schedule))
            changed = True
    if changed:
        step = scheduler.last_epoch  # optimizer steps done: the next one runs at this step's rate
        lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, lr in zip(scheduler.optimizer.param_groups, lrs):
            group["lr"] = lr
        scheduler._last_lr = lrs  # what get_last_lr() reports
    return changed


def ema_decay(decay: float, step: int) -> float:
    """Decay of the weight EMA's update after optimizer step ``step`` (0-based): ``decay``, ramped
    up as ``(1 + step) / (10 + step)`` early on (TensorFlow's ExponentialMovingAverage with
    num_updates), so the average soon forgets the initial weights whatever the decay."""
    return min(decay, (1 + step) / (10 + step))
