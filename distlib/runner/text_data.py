"""Byte-level text for the language-model task: a ``.txt`` or ``.txt.gz`` file read as bytes
(vocabulary 256), split by position (the last ``val_frac`` for validation), and a loader that
keeps the token stream on the device and cuts it into windows there (no CPU DataLoader).
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from distlib.runner.data import DataError


@dataclass
class TextSet:
    """uint8 token streams of both splits and the window length."""

    train: torch.Tensor
    val: torch.Tensor
    block_size: int
    vocab_size: int = 256
    source: str = ""


def load_byte_text(root: str, block_size: int = 256, val_frac: float = 0.05) -> TextSet:
    """The bytes of ``root`` (``.txt``, or ``.txt.gz`` unpacked), the last ``val_frac`` of them for
    validation. ``block_size``: the tokens a sample holds (its targets are the next ones)."""
    if block_size <= 0 or not 0.0 < val_frac < 1.0:
        raise DataError(f"byte_text: block_size must be > 0 and val_frac in (0, 1), got {block_size}, {val_frac}")
    try:
        opener = gzip.open if root.endswith(".gz") else open
        with opener(root, "rb") as f:
            data = f.read()
    except FileNotFoundError as e:
        raise DataError(f"no text file at data.root={root!r}: point data.root at a .txt or .txt.gz file") from e
    except (OSError, EOFError) as e:
        raise DataError(f"data.root={root!r}: could not read the text: {e}") from e
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    n_val = int(len(tokens) * val_frac)
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
    if min(len(train), len(val)) < 2 * block_size + 1:
        raise DataError(f"data.root={root!r}: {len(tokens)} bytes are too few for windows of block_size={block_size} "
                        f"in both splits (val_frac={val_frac}); use a longer text or a smaller block_size")  # fmt: skip
    return TextSet(train, val, block_size, source=os.path.basename(root))


class TokenLoader:
    """Batches ``(x, y)`` of (batch_size, block_size) tokens, y being x shifted by one, from this
    rank's shard of the windows of a token stream held on ``device``.

    Each pass is one epoch: the windows start at ``offset + i * block_size`` (the offset drawn
    per epoch, so a window's edges move), in an order drawn from ``seed + epoch``, the same on
    every rank, cut into global batches of which each rank takes its slice (as DeviceLoader).
    """

    def __init__(self, tokens: torch.Tensor, *, block_size: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 device: torch.device | str = "cpu", seed: int = 0, max_windows: int = 0):  # fmt: skip
        self.device = torch.device(device)
        self.tokens = tokens.to(self.device)
        self.block_size, self.batch_size, self.rank, self.world_size = block_size, batch_size, rank, world_size
        self.seed, self.epoch = seed, 0
        self.windows = len(tokens) // block_size - 1  # room for any offset and the last target
        if max_windows:
            self.windows = min(self.windows, max_windows)
        self.steps_per_epoch = self.windows // (batch_size * world_size)
        if self.steps_per_epoch == 0:
            raise ValueError(f"{self.windows} windows of {block_size} tokens cannot fill one global batch of "
                             f"{batch_size} x {world_size} ranks")  # fmt: skip

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        offset = int(torch.randint(0, self.block_size, (), generator=g))
        perm = torch.randperm(self.windows, generator=g)
        steps, b, t = self.steps_per_epoch, self.batch_size, self.block_size
        idx = perm[: steps * b * self.world_size].view(steps, self.world_size, b)[:, self.rank].reshape(-1)
        starts = (offset + idx * t).to(self.device).view(steps, b, 1)
        span = torch.arange(t + 1, device=self.device)
        self.epoch += 1
        for step in range(steps):  # one gather a step: an epoch of a large corpus need not fit in memory at once
            w = self.tokens[starts[step] + span].long()
            yield w[:, :-1], w[:, 1:]


def eval_windows(tokens: torch.Tensor, block_size: int, rank: int, world_size: int, batch_size: int,
                 device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """This rank's share (windows rank, rank + W, ...) of the non-overlapping windows of ``tokens``:
    over all ranks every window exactly once."""
    tokens = tokens.to(device)
    n = (len(tokens) - 1) // block_size
    idx = torch.arange(rank, n, world_size, device=device)
    span = torch.arange(block_size + 1, device=device)
    for i in range(0, idx.numel(), batch_size):
        w = tokens[(idx[i : i + batch_size] * block_size).view(-1, 1) + span].long()
        yield w[:, :-1], w[:, 1:]
