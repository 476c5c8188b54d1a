"""A user's own model and data set, trained by the recipe runner without touching it.

Nothing here knows about distlib: a ``torch.utils.data.Dataset`` factory and an ``nn.Module``,
named in ``recipe.yaml`` by import path (``examples.own_model.spirals:spirals``) with their
keyword arguments. Run from the repository root:

    torchrun --standalone --nproc-per-node=2 launch.py examples/own_model/recipe.yaml
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset


def spirals(n: int = 1200, arms: int = 3, noise: float = 0.05, seed: int = 0) -> tuple[Dataset, Dataset]:
    """Points of ``arms`` interleaved spirals in the plane, labelled by their arm; (train,
    validation), about 5 of every 6 points for training. The runner calls it with the recipe's
    ``data.args`` and gives both parts to distlib's ``distributed_loader``."""
    g = torch.Generator().manual_seed(seed)
    label = torch.arange(n) % arms
    r = torch.rand(n, generator=g)
    angle = 3 * math.pi * r + 2 * math.pi * label / arms
    x = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], dim=1) + noise * torch.randn(n, 2, generator=g)
    train = torch.rand(n, generator=g) >= 1 / 6
    return TensorDataset(x[train], label[train]), TensorDataset(x[~train], label[~train])


class MLP(nn.Module):
    """A multi-layer perceptron; ``num_classes`` comes from the recipe's model.num_classes (the
    runner passes it to a model that takes it), the rest from model.args."""

    def __init__(self, num_classes: int, hidden: int = 64, depth: int = 3, in_features: int = 2):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        self.net = nn.Sequential(*layers, nn.Linear(width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
