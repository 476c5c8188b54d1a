"""Exact test accuracy over the ranks: each test image is counted once, whatever the world size."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

import distlib
from distlib.distributed.process_group import Context
from distlib.runner.data.device_loader import DeviceLoader, eval_shards, shift


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    loader: DeviceLoader,
    ctx: Context,
    autocast: contextlib.AbstractContextManager,
    tta: bool,
    translate: int = 0,
) -> float:
    """The accuracy of ``model`` on the uint8 test set, normalized as ``loader`` does.

    ``tta``: average the logits of each image and its mirror image; ``translate`` > 0 adds
    the views shifted by that many pixels up-left and down-right (and their mirrors).
    A collective (an all_reduce of the counts): every rank must call it.
    """
    model.eval()
    correct = torch.zeros((), device=ctx.device, dtype=torch.float64)
    for xb, yb in eval_shards(x_test, y_test, ctx.rank, ctx.world_size, batch_size=1000):
        x = loader.prepare(xb)
        views = [x]
        if tta and translate:
            views += [shift(x, translate), shift(x, -translate)]
        with autocast:
            logits = sum(model(v).float() for v in views)
            if tta:
                logits += sum(model(v.flip(3)).float() for v in views)
        correct += (logits.argmax(1) == yb).sum()
    distlib.all_reduce(correct)
    model.train()
    return correct.item() / y_test.numel()
