"""Test-time augmentation views, and the evaluation that uses them."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from distlib.runner.data.device_loader import DeviceLoader, shift
from distlib.runner.tasks.evaluation import evaluate


def test_shift_moves_the_image_and_fills_the_edge_by_reflection():
    x = torch.arange(2 * 3 * 6 * 6, dtype=torch.float32).view(2, 3, 6, 6)
    down = shift(x, 2)
    up = shift(x, -2)
    assert down.shape == up.shape == x.shape
    assert torch.equal(down[..., 2:, 2:], x[..., :-2, :-2])
    assert torch.equal(up[..., :-2, :-2], x[..., 2:, 2:])
    assert torch.equal(down[..., 0, 2:], x[..., 2, :-2])  # reflected row, not zeros
    assert torch.equal(shift(x, 0), x)


def test_evaluate_counts_the_argmax_of_the_summed_views_of_the_unaugmented_images():
    """One process (the ranks' share is test_e2e's): the accuracy of the normalized test images,
    their mirror images added with ``tta``, and the shifted views with ``translate``; never the
    training augmentation of the loader. float64: no rounding noise in the comparison."""
    torch.manual_seed(0)  # no pooling: the predictions follow where things are in the image
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 16 * 16, 10)).double()  # fmt: skip
    model[1].running_mean.uniform_(-0.5, 0.5)  # statistics unlike a batch's: evaluation mode matters
    model[1].running_var.uniform_(0.5, 2.0)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (150, 3, 16, 16), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 10, (150,), generator=g)
    loader = DeviceLoader(x, y, batch_size=8, crop_pad=4, flip="random", cutout_size=4, dtype=torch.float64)
    pixels = x.float() / 255  # per-channel statistics of the images, as float32
    mean, std = pixels.mean(dim=(0, 2, 3)).view(1, 3, 1, 1), pixels.std(dim=(0, 2, 3)).view(1, 3, 1, 1)
    v = (x.double() / 255 - mean.double()) / std.double()
    with torch.no_grad():
        model.eval()
        views = [v, shift(v, 2), shift(v, -2)]
        logits = [model(u) for u in views]
        mirrored = [model(u.flip(3)) for u in views]
        model.train()

    def accuracy(out: torch.Tensor) -> float:
        return (out.argmax(1) == y).double().sum().item() / len(y)

    plain = accuracy(logits[0])
    tta = accuracy(logits[0] + mirrored[0])
    translated = accuracy(logits[0] + logits[1] + logits[2] + (mirrored[0] + mirrored[1] + mirrored[2]))
    assert len({plain, tta, translated}) == 3, (plain, tta, translated)  # each view changes the count here

    ctx = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    off = torch.autocast("cpu", enabled=False)
    assert evaluate(model, x, y, loader, ctx, off, tta=False) == plain
    assert evaluate(model, x, y, loader, ctx, off, tta=False, translate=2) == plain  # shifted views only with tta
    assert evaluate(model, x, y, loader, ctx, off, tta=True) == tta
    assert evaluate(model, x, y, loader, ctx, off, tta=True, translate=2) == translated
    assert model.training  # put back in training mode
