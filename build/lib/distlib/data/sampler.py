"""DistributedSampler-backed loaders that advance the epoch at the end of each pass, an
exact sampler for evaluation that gives every sample to exactly one rank, and the
sharding of an IterableDataset over ranks and DataLoader workers."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler, get_worker_info

from distlib.distributed import collectives
from distlib.errors import DistlibError


class LoaderError(DistlibError, ValueError):
    """A ``distributed_loader`` or sampler argument that cannot work (the message says why and what to
    pass instead). A ValueError too, as these were before."""


class _Epochs:
    """``set_epoch`` of the samplers an ``EpochLoader`` drives: the user's call (DDP's
    ``loader.sampler.set_epoch(epoch)``) is remembered, so that the loader adopts it at its next pass
    instead of overriding it."""

    requested_epoch: int | None = None

    def set_epoch(self, epoch: int) -> None:
        self.requested_epoch = epoch
        self._apply_epoch(epoch)

    def _apply_epoch(self, epoch: int) -> None:
        raise NotImplementedError


class ExactDistributedSampler(_Epochs, Sampler[int]):
    """Rank r gets indices r, r+W, r+2W, ...: every sample exactly once over the
    ranks, no padding, so ranks may get one sample more or less than others."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, shuffle: bool = False, seed: int = 0):
        if not 0 <= rank < num_replicas:
            raise LoaderError(f"rank {rank} is not in [0, {num_replicas})")
        self.n = len(dataset)  # type: ignore[arg-type]
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def _apply_epoch(self, epoch: int) -> None:
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


class ShardedIterable(_Epochs, IterableDataset):
    """An IterableDataset's samples split over ranks and DataLoader workers, each exactly once per pass.

    The worker ``w`` of ``num_workers`` on rank ``r`` keeps the samples ``i`` of the
    stream with ``i % (num_replicas * num_workers) == r * num_workers + w`` (torch's
    docs for IterableDataset split the work by worker id in the same way; torchdata
    calls it a sharding filter): every worker reads the whole stream and skips the
    others' samples. ``num_workers`` must be the same on every rank. ``set_epoch``
    is passed on to the dataset when it has one (to reshuffle its stream per epoch).
    """

    def __init__(self, dataset: IterableDataset, num_replicas: int, rank: int):
        if not 0 <= rank < num_replicas:
            raise LoaderError(f"rank {rank} is not in [0, {num_replicas})")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0

    def _apply_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()  # None in the main process (num_workers=0)
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        shard = self.rank * workers + worker
        return itertools.islice(iter(self.dataset), shard, None, self.num_replicas * workers)

    def num_batches(self, batch_size: int, drop_last: bool, num_workers: int) -> int:
        """The batches this rank yields in one pass, from ``len(dataset)``: each worker batches its own
        shard, so every worker may end with a short batch. TypeError when the dataset has no length."""
        n = len(self.dataset)  # type: ignore[arg-type]
        workers = max(num_workers, 1)
        total = self.num_replicas * workers
        sizes = [len(range(self.rank * workers + w, n, total)) for w in range(workers)]
        return sum(k // batch_size if drop_last else -(-k // batch_size) for k in sizes)


class _LoaderSampler(_Epochs, DistributedSampler):
    """torch's DistributedSampler (same order, same padding) whose ``set_epoch`` the loader notices."""

    def _apply_epoch(self, epoch: int) -> None:
        DistributedSampler.set_epoch(self, epoch)


class EpochLoader:
    """A DataLoader over this rank's shard that keeps the sampler's epoch for the loop.

    The epoch advances when a pass is completed (its iterator is exhausted), not when ``iter()``
    is called: a peek (``next(iter(loader))``) or an iterator made again before the pass ends
    replays the same epoch's order. ``loader.set_epoch(e)`` and DDP's ``loader.sampler.set_epoch(e)``
    both choose the epoch of the next pass (the latest call wins); without either, pass ``k``
    uses epoch ``k``, which is the order DDP gives with ``sampler.set_epoch(k)`` before each epoch.
    ``state_dict()`` / ``load_state_dict()`` carry the epoch, so a run resumed from a checkpoint
    continues with the next epoch's order (a pass cut short is replayed from its start).

    Reads like a DataLoader: ``batch_size``, ``dataset`` (the one given, not the sharding wrapper of an
    IterableDataset), ``sampler`` (the distributed sampler), ``drop_last``, ``num_workers`` and any other
    attribute of the DataLoader underneath (``loader.loader``).

    ``len()`` is the number of batches this rank yields per pass. Over an
    IterableDataset it is computed from ``len(dataset)`` and raises TypeError
    when the dataset has no length.
    """

    def __init__(self, loader: DataLoader, sampler: DistributedSampler | ExactDistributedSampler | ShardedIterable):
        self.loader = loader
        self.sampler = sampler
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next pass (its order); as ``sampler.set_epoch`` in a DDP script."""
        self.sampler.set_epoch(epoch)
        self.epoch = epoch

    def _take_epoch(self) -> int:
        requested = getattr(self.sampler, "requested_epoch", None)
        if requested is not None:  # set by the user, on the loader or on its sampler
            self.epoch = int(requested)
            self.sampler.requested_epoch = None
        self.sampler._apply_epoch(self.epoch)
        return self.epoch

    def __iter__(self) -> Iterator[Any]:
        epoch = self._take_epoch()
        it = iter(self.loader)  # the sampler's order is drawn here, at iter(), as a DataLoader does
        return self._pass(it, epoch)

    def _pass(self, it: Iterator[Any], epoch: int) -> Iterator[Any]:
        yield from it
        if self.epoch == epoch and getattr(self.sampler, "requested_epoch", None) is None:
            self.epoch = epoch + 1  # a completed pass: the next one is a new epoch

    def state_dict(self) -> dict[str, int]:
        """The epoch of the next pass, for a checkpoint (``load_state_dict`` restores it)."""
        requested = getattr(self.sampler, "requested_epoch", None)
        return {"epoch": self.epoch if requested is None else int(requested)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a ``state_dict()``: the next pass uses its epoch."""
        self.set_epoch(int(state["epoch"]))

    def __len__(self) -> int:
        if isinstance(self.sampler, ShardedIterable):
            if not hasattr(self.sampler.dataset, "__len__"):
                raise TypeError(
                    f"a loader over an IterableDataset ({type(self.sampler.dataset).__name__}) without __len__ "
                    "has no length: iterate it to the end, or give the dataset a __len__"
                )
            return self.sampler.num_batches(self.loader.batch_size, self.loader.drop_last, self.loader.num_workers)
        return len(self.loader)

    @property
    def dataset(self) -> Dataset:
        """The dataset given to ``distributed_loader`` (not the sharding wrapper of an IterableDataset)."""
        if isinstance(self.sampler, ShardedIterable):
            return self.sampler.dataset
        return self.loader.dataset

    def __getattr__(self, name: str) -> Any:
        # batch_size, drop_last, num_workers, pin_memory, collate_fn, ...: the DataLoader's own
        if name.startswith("__") or name in ("loader", "sampler", "epoch"):
            raise AttributeError(name)
        return getattr(self.loader, name)


def distributed_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool | None = None,
    exact: bool = False,
    seed: int = 0,
    drop_last: bool = False,
    num_replicas: int | None = None,
    rank: int | None = None,
    **dataloader_kwargs: Any,
) -> EpochLoader:
    """A DataLoader over this rank's shard of ``dataset``; ``batch_size`` is per rank.

    A map-style dataset is shuffled (``shuffle`` defaults to True, with ``seed + epoch``) by a
    DistributedSampler, which pads so that every rank takes the same number of batches.
    ``drop_last=True`` applies to both the sampler (the tail is dropped instead of padded with
    repeated samples) and the DataLoader (the last short batch is dropped). ``exact=True`` (for
    evaluation) gives every sample to exactly one rank without that padding, so a metric summed
    over ranks counts each sample once. The returned ``EpochLoader`` advances the epoch when a pass
    is completed and honours ``set_epoch`` on itself or its sampler (see ``EpochLoader``).

    An IterableDataset is split by ``ShardedIterable``: every sample exactly once
    per pass over ranks and DataLoader workers, without padding, in the dataset's
    own order (it shuffles itself, if at all, e.g. from the epoch its ``set_epoch``
    receives; ``shuffle=True`` is refused, ``exact`` and ``seed`` do not apply).
    Ranks may then yield different numbers of batches: a training loop must end
    every rank's epoch at the same step (a fixed number of steps per epoch, or a
    collective "done" flag), or the ranks that go on wait in a collective forever.
    ``len()`` of such a loader: see ``EpochLoader``.
    """
    num_replicas = collectives.world_size() if num_replicas is None else num_replicas
    rank = collectives.rank() if rank is None else rank
    if "sampler" in dataloader_kwargs or "batch_sampler" in dataloader_kwargs:
        raise LoaderError(
            "distributed_loader makes its own sampler; do not pass sampler or batch_sampler "
            "(shuffle, seed, drop_last and exact choose what it does)"
        )
    if isinstance(dataset, IterableDataset):
        return _iterable_loader(dataset, batch_size, shuffle, drop_last, num_replicas, rank, dataloader_kwargs)
    shuffle = True if shuffle is None else shuffle
    if exact:
        sampler: DistributedSampler | ExactDistributedSampler = ExactDistributedSampler(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed
        )
    else:
        sampler = _LoaderSampler(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **dataloader_kwargs)
    return EpochLoader(loader, sampler)


def _iterable_loader(
    dataset: IterableDataset,
    batch_size: int,
    shuffle: bool | None,
    drop_last: bool,
    num_replicas: int,
    rank: int,
    dataloader_kwargs: dict[str, Any],
) -> EpochLoader:
    name = type(dataset).__name__
    if shuffle:
        raise LoaderError(
            f"shuffle=True cannot reorder an IterableDataset ({name}): it yields its samples in its own order; "
            "shuffle inside the dataset (its set_epoch(epoch) is called before each pass) and leave shuffle unset"
        )
    if dataloader_kwargs.get("persistent_workers") and hasattr(dataset, "set_epoch"):
        raise LoaderError(
            f"persistent_workers=True keeps each worker's copy of {name} from the first pass, so its set_epoch "
            "would never reach the workers; use persistent_workers=False"
        )
    sharded = ShardedIterable(dataset, num_replicas=num_replicas, rank=rank)
    loader = DataLoader(sharded, batch_size=batch_size, drop_last=drop_last, **dataloader_kwargs)
    return EpochLoader(loader, sharded)
