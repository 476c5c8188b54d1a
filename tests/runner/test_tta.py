"""Test-time augmentation views."""

from __future__ import annotations

import torch

from distlib.runner.device_loader import shift


def test_shift_moves_the_image_and_fills_the_edge_by_reflection():
    x = torch.arange(2 * 3 * 6 * 6, dtype=torch.float32).view(2, 3, 6, 6)
    down = shift(x, 2)
    up = shift(x, -2)
    assert down.shape == up.shape == x.shape
    assert torch.equal(down[..., 2:, 2:], x[..., :-2, :-2])
    assert torch.equal(up[..., :-2, :-2], x[..., 2:, 2:])
    assert torch.equal(down[..., 0, 2:], x[..., 2, :-2])  # reflected row, not zeros
    assert torch.equal(shift(x, 0), x)
