"""Text for the language-model task: byte-level text (a ``.txt`` or ``.txt.gz`` file read as
bytes, vocabulary 256, split by position: the last ``val_frac`` for validation), and the loader of
it and of token files (runner/data/token_files.py): the byte stream kept on the device and cut into
windows there, a token file's windows read from its memory map (no CPU DataLoader either way).
"""

from __future__ import annotations

import gzip
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from distlib.runner.data.errors import DataError
from distlib.runner.data.token_files import TokenStream


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
    rank's shard of the windows of a token stream: a tensor held on ``device`` (cut there), or a
    memory-mapped ``TokenStream`` of token files (each step's windows read on the CPU, pinned for
    the copy to a GPU).

    Each pass is one epoch: the windows start at ``offset + i * block_size`` (the offset drawn
    per epoch, so a window's edges move), in an order drawn from ``seed + epoch``, the same on
    every rank, cut into global batches of which each rank takes its slice (as DeviceLoader).
    The global batch of a step (``batch_size * world_size`` windows) is therefore the same at any
    world size: a resume at another one continues at the same global sample. ``iter_from(step)``
    starts a pass at a step without reading the steps before it. ``vocab_size``: a token of a
    ``TokenStream`` that is not below it is a DataError naming its file.
    """

    def __init__(self, tokens: torch.Tensor | TokenStream, *, block_size: int, batch_size: int, rank: int = 0,
                 world_size: int = 1, device: torch.device | str = "cpu", seed: int = 0, max_windows: int = 0,
                 vocab_size: int | None = None):  # fmt: skip
        self.device = torch.device(device)
        self.tokens = tokens.to(self.device) if isinstance(tokens, torch.Tensor) else tokens
        self.block_size, self.batch_size, self.rank, self.world_size = block_size, batch_size, rank, world_size
        self.seed, self.epoch, self.vocab_size = seed, 0, vocab_size
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
        return self.iter_from(0)

    def starts(self, epoch: int) -> torch.Tensor:
        """(steps, world_size, batch_size): where every window of ``epoch`` starts, by step and rank."""
        g = torch.Generator().manual_seed(self.seed + epoch)
        offset = int(torch.randint(0, self.block_size, (), generator=g))
        perm = torch.randperm(self.windows, generator=g)
        steps, b, w = self.steps_per_epoch, self.batch_size, self.world_size
        return offset + perm[: steps * b * w].view(steps, w, b) * self.block_size

    def iter_from(self, step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This epoch's batches from ``step`` on (the pass counts as the epoch's)."""
        starts = self.starts(self.epoch)[:, self.rank]  # at the first batch, as any generator's work
        self.epoch += 1
        yield from self._batches(starts, step)

    def _batches(self, starts: torch.Tensor, step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        t = self.block_size
        if isinstance(self.tokens, torch.Tensor):
            starts = starts.to(self.device).unsqueeze(-1)
            span = torch.arange(t + 1, device=self.device)
            for s in range(step, len(starts)):  # one gather a step: an epoch need not fit in memory at once
                w = self.tokens[starts[s] + span].long()
                yield w[:, :-1], w[:, 1:]
            return
        pin = self.device.type == "cuda"
        for s in range(step, len(starts)):
            at = starts[s].numpy()
            windows = self.tokens.gather(at, t + 1)
            self.tokens.check_vocab(windows, at, self.vocab_size)
            w = torch.from_numpy(windows)
            if pin:  # the trainer's copy to the GPU is then asynchronous
                w = w.pin_memory()
            yield w[:, :-1], w[:, 1:]


def decode_bytes(ids: list[int]) -> str:
    """Byte ids as UTF-8 text (invalid sequences as U+FFFD). An id past 255 is no byte (a byte model's
    vocabulary padded beyond the 256 bytes can still sample one): U+FFFD too, the bytes around it kept."""
    parts, run = [], bytearray()
    for i in ids:
        if 0 <= i < 256:
            run.append(i)
        else:
            parts.append(run.decode("utf-8", errors="replace") + "\ufffd")
            run = bytearray()
    parts.append(run.decode("utf-8", errors="replace"))
    return "".join(parts)


IGNORED = -100  # cross_entropy's ignore_index: the targets of a window that counts for nothing


def eval_windows(tokens: torch.Tensor | TokenStream, block_size: int, rank: int, world_size: int, batch_size: int,
                 device: torch.device, vocab_size: int | None = None,
                 ends_only: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """This rank's share (windows rank, rank + W, ...) of the non-overlapping windows of ``tokens``:
    over all ranks every window exactly once. Every rank yields as many batches as the largest share
    needs (a fully sharded model's forward is a collective): a rank whose share ends a batch early
    yields one more, of one window whose targets are all ``IGNORED``. ``ends_only``: the first batch
    and the last, the shapes an evaluation runs (a warm-up), on every rank alike."""
    n = (len(tokens) - 1) // block_size
    largest = math.ceil(math.ceil(n / world_size) / batch_size)  # the batches of the largest share
    idx = np.arange(rank, n, world_size)
    batches: list[slice | None] = [slice(i, i + batch_size) for i in range(0, len(idx), batch_size)]
    batches += [None] * (largest - len(batches))  # None: a window that counts for nothing
    if ends_only:
        batches = batches[:1] + batches[1:][-1:]
    on_device = isinstance(tokens, torch.Tensor)
    if on_device:  # the windows' starts on the device once: no copy to it per batch
        tokens = tokens.to(device)
        starts = torch.from_numpy(idx * block_size).to(device)
        span = torch.arange(block_size + 1, device=device)
    for b in batches:
        if on_device:
            at = starts[b] if b is not None else starts.new_zeros(1)
            w = tokens[at.view(-1, 1) + span].long()
        else:
            at = idx[b] * block_size if b is not None else np.zeros(1, dtype=np.int64)
            windows = tokens.gather(at, block_size + 1)
            tokens.check_vocab(windows, at, vocab_size)
            w = torch.from_numpy(windows).to(device)
        yield w[:, :-1], torch.full_like(w[:, 1:], IGNORED, dtype=torch.long) if b is None else w[:, 1:]
