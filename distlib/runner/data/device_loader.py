"""A loader that keeps the whole (small) data set on the device, shards it per
rank without a CPU DataLoader, and augments each batch on the device.

The same code runs on the CPU (tests, the demo) and on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F


def normalize_stats(x_uint8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std of uint8 NCHW images, on the 0..1 scale."""
    x = x_uint8.float().div_(255)
    return x.mean(dim=(0, 2, 3)), x.std(dim=(0, 2, 3))


def random_crop(x: torch.Tensor, pad: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random crop of each image after reflect padding by ``pad`` (the classic CIFAR crop)."""
    if pad == 0:
        return x
    n, c, h, w = x.shape
    xp = F.pad(x, (pad, pad, pad, pad), mode="reflect")
    i = torch.randint(0, 2 * pad + 1, (n,), device=x.device, generator=generator)
    j = torch.randint(0, 2 * pad + 1, (n,), device=x.device, generator=generator)
    rows = (i.view(n, 1) + torch.arange(h, device=x.device).view(1, h)).view(n, 1, h, 1)
    cols = (j.view(n, 1) + torch.arange(w, device=x.device).view(1, w)).view(n, 1, 1, w)
    idx_n = torch.arange(n, device=x.device).view(n, 1, 1, 1)
    idx_c = torch.arange(c, device=x.device).view(1, c, 1, 1)
    return xp[idx_n, idx_c, rows, cols]


def shift(x: torch.Tensor, pixels: int) -> torch.Tensor:
    """Each image moved by ``pixels`` down and right (negative: up and left), the edge
    filled by reflection (a test-time augmentation view)."""
    p = abs(pixels)
    if p == 0:
        return x
    h, w = x.shape[-2:]
    xp = F.pad(x, (p, p, p, p), mode="reflect")
    start = 0 if pixels > 0 else 2 * p
    return xp[..., start : start + h, start : start + w]


def cutout(x: torch.Tensor, size: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Zero one random ``size``×``size`` square per image."""
    if size == 0:
        return x
    n, _, h, w = x.shape
    cy = torch.randint(0, h, (n, 1, 1), device=x.device, generator=generator)
    cx = torch.randint(0, w, (n, 1, 1), device=x.device, generator=generator)
    # rows cy - size // 2 ... and columns cx - size // 2 ..., size of each (cut by the edges)
    ys = torch.arange(h, device=x.device).view(1, h, 1) - cy + size // 2
    xs = torch.arange(w, device=x.device).view(1, 1, w) - cx + size // 2
    mask = (ys >= 0) & (ys < size) & (xs >= 0) & (xs < size)
    return x.masked_fill(mask.unsqueeze(1), 0.0)


class DeviceLoader:
    """Batches of this rank's shard of an in-memory uint8 image set.

    Each pass is one epoch: a permutation drawn from ``seed + epoch`` (the same on
    every rank), cut into global batches of ``batch_size * world_size``, of which
    this rank takes its ``batch_size`` slice. Training drops the last partial
    global batch so every rank takes the same number of steps.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        *,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        mean: torch.Tensor | None = None,
        std: torch.Tensor | None = None,
        crop_pad: int = 0,
        flip: str = "none",
        cutout_size: int = 0,
        seed: int = 0,
        channels_last: bool = False,
        dtype: torch.dtype = torch.float32,
    ):
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise ValueError(f"images must be uint8 (N, C, H, W), got {images.dtype} {tuple(images.shape)}")
        self.device = torch.device(device)
        self.images = images.to(self.device)
        self.labels = labels.to(self.device)
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        if mean is None or std is None:
            mean, std = normalize_stats(images)
        self.mean = mean.to(self.device).view(1, -1, 1, 1)
        self.std = std.to(self.device).view(1, -1, 1, 1)
        self.crop_pad = crop_pad
        self.flip = flip
        self.cutout_size = cutout_size
        self.seed = seed
        self.channels_last = channels_last
        self.dtype = dtype
        self.epoch = 0
        self.augment_chunk = 16384
        n = images.shape[0]
        self.steps_per_epoch = n // (batch_size * world_size)
        if self.steps_per_epoch == 0:
            raise ValueError(f"{n} training images cannot fill one global batch of {batch_size} x {world_size} ranks")
        # airbench's alternating flip: a fixed random half flipped on even epochs, the other half on odd ones
        g = torch.Generator().manual_seed(seed + 7919)
        self._flip_bits = torch.randint(0, 2, (n,), generator=g, dtype=torch.bool).to(self.device)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps_per_epoch

    def prepare(self, x_uint8: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW -> normalized float, in the loader's memory format."""
        x = x_uint8.to(self.dtype).div_(255).sub_(self.mean).div_(self.std)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def _augment(self, x: torch.Tensor, idx: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        x = random_crop(x, self.crop_pad, gen)
        if self.flip == "random":
            flip = torch.rand(x.shape[0], device=x.device, generator=gen) < 0.5
            x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
        elif self.flip == "alternating":
            flip = self._flip_bits[idx] ^ bool(self.epoch % 2)
            x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
        return cutout(x, self.cutout_size, gen)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # The whole epoch's shard is augmented up front, in a few large chunks: one
        # set of kernels per epoch instead of one per step keeps a small-batch GPU
        # step from being bound by launches.
        n = self.images.shape[0]
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).to(self.device)
        gen = torch.Generator(device=self.device)
        gen.manual_seed((self.seed + 1) * 1_000_003 + self.epoch * 1009 + self.rank)
        steps, b = self.steps_per_epoch, self.batch_size
        idx = perm[: steps * b * self.world_size].view(steps, self.world_size, b)[:, self.rank].reshape(-1)
        chunks = []
        for start in range(0, idx.numel(), self.augment_chunk):
            part = idx[start : start + self.augment_chunk]
            x = self._augment(self.images[part].to(self.dtype), part, gen)
            chunks.append(x.div_(255).sub_(self.mean).div_(self.std))
        x = torch.cat(chunks)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        y = self.labels[idx]
        self.epoch += 1
        for step in range(steps):
            yield x[step * b : (step + 1) * b], y[step * b : (step + 1) * b]


def eval_shards(
    images: torch.Tensor, labels: torch.Tensor, rank: int, world_size: int, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's exact shard (indices rank, rank+W, ...) in batches: over all
    ranks every sample appears exactly once. Every rank yields as many batches as the largest
    shard needs (a fully sharded model's forward is a collective): a rank whose shard ends a batch
    early yields one more, of one sample labelled -1, which no prediction matches."""
    n = images.shape[0]
    idx = torch.arange(rank, n, world_size, device=images.device)
    for i in range(0, idx.numel(), batch_size):
        j = idx[i : i + batch_size]
        yield images[j], labels[j]
    if math.ceil(math.ceil(n / world_size) / batch_size) > math.ceil(idx.numel() / batch_size):
        yield images[:1], torch.full_like(labels[:1], -1)
