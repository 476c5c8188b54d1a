"""DistributedSampler-backed loaders that advance the epoch by themselves, and an
exact sampler for evaluation that gives every sample to exactly one rank."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from distlib import collectives


class ExactDistributedSampler(Sampler[int]):
    """Rank r gets indices r, r+W, r+2W, ...: every sample exactly once over the
    ranks, no padding, so ranks may get one sample more or less than others."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, shuffle: bool = False, seed: int = 0):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.n = len(dataset)  # type: ignore[arg-type]
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        return iter(order[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.num_replicas))


class EpochLoader:
    """A DataLoader whose every new pass calls ``sampler.set_epoch`` with the next epoch.

    Forgetting ``set_epoch`` is the classic DistributedSampler bug (every epoch
    sees the same order); here the loader counts its own passes. ``set_epoch``
    sets the epoch of the next pass (used when resuming).
    """

    def __init__(self, loader: DataLoader, sampler: DistributedSampler | ExactDistributedSampler):
        self.loader = loader
        self.sampler = sampler
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def dataset(self) -> Dataset:
        return self.loader.dataset


def distributed_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool = True,
    exact: bool = False,
    seed: int = 0,
    drop_last: bool = False,
    num_replicas: int | None = None,
    rank: int | None = None,
    **dataloader_kwargs: Any,
) -> EpochLoader:
    """A DataLoader over this rank's shard of ``dataset``; ``batch_size`` is per rank.

    ``exact=True`` (for evaluation) gives every sample to exactly one rank
    without the padding that DistributedSampler adds, so a metric summed over
    ranks counts each sample once. Each new pass over the returned loader
    advances the sampler's epoch.
    """
    num_replicas = collectives.world_size() if num_replicas is None else num_replicas
    rank = collectives.rank() if rank is None else rank
    if "sampler" in dataloader_kwargs or "batch_sampler" in dataloader_kwargs:
        raise ValueError("distributed_loader makes its own sampler; do not pass sampler or batch_sampler")
    if exact:
        sampler: DistributedSampler | ExactDistributedSampler = ExactDistributedSampler(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed
        )
    else:
        sampler = DistributedSampler(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **dataloader_kwargs)
    return EpochLoader(loader, sampler)


def shard_size(n: int, num_replicas: int, rank: int, exact: bool) -> int:
    """How many of ``n`` samples rank ``rank`` sees (exact: no padding)."""
    if exact:
        return len(range(rank, n, num_replicas))
    return math.ceil(n / num_replicas)
