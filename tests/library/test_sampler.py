"""distributed_loader (DistributedSampler underneath) and the exact evaluation sampler."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

import distlib


def dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def indices(loader) -> list[int]:
    """One pass over a loader of ``dataset(n)``: the sample indices in order."""
    return [int(i) for (batch,) in loader for i in batch]


def rank_loaders(n: int, world: int, **kwargs) -> list:
    return [
        distlib.distributed_loader(dataset(n), batch_size=3, num_replicas=world, rank=r, **kwargs) for r in range(world)
    ]


# ---- distributed_loader ---------------------------------------------------------------------


def test_each_pass_advances_the_epoch():
    (loader,) = rank_loaders(40, 1, shuffle=True)
    passes = [indices(loader) for _ in range(3)]
    assert all(sorted(p) == list(range(40)) for p in passes)
    assert passes[0] != passes[1] != passes[2] != passes[0]  # the classic forgotten set_epoch would repeat
    assert loader.epoch == 3
    # the same seed gives the same sequence of orders
    (again,) = rank_loaders(40, 1, shuffle=True)
    assert [indices(again) for _ in range(3)] == passes
    (default,) = rank_loaders(40, 1)  # a map-style dataset is shuffled by default
    assert [indices(default) for _ in range(3)] == passes


def test_set_epoch_chooses_the_next_pass():
    (loader,) = rank_loaders(40, 1, shuffle=True)
    passes = [indices(loader) for _ in range(3)]
    loader.set_epoch(1)  # as a resumed run does
    assert indices(loader) == passes[1]


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_share_one_permutation_per_epoch(world):
    n = 12 * world  # divides evenly: no padding, so the shards must be disjoint
    loaders = rank_loaders(n, world, shuffle=True)
    for _epoch in range(3):
        shards = [indices(loader) for loader in loaders]
        assert sorted(itertools.chain(*shards)) == list(range(n))
        # rank r takes every world-th element of the same permutation (DistributedSampler's layout)
        perm = [None] * n
        for r, shard in enumerate(shards):
            perm[r::world] = shard
        g = torch.Generator().manual_seed(0 + _epoch)
        assert perm == torch.randperm(n, generator=g).tolist()


@pytest.mark.parametrize("world, n", [(2, 10), (3, 10), (3, 11), (3, 2), (4, 9)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_exact_covers_every_sample_exactly_once(world, n, shuffle):
    loaders = rank_loaders(n, world, shuffle=shuffle, exact=True)
    for _epoch in range(2):
        shards = [indices(loader) for loader in loaders]
        assert sorted(itertools.chain(*shards)) == list(range(n))  # no padding, no loss
        assert [len(s) for s in shards] == [len(range(r, n, world)) for r in range(world)]
        assert [len(loader.sampler) for loader in loaders] == [len(s) for s in shards]


def test_exact_shuffled_order_changes_per_epoch():
    (a, b, c) = rank_loaders(30, 3, shuffle=True, exact=True)
    first = [indices(x) for x in (a, b, c)]
    second = [indices(x) for x in (a, b, c)]
    assert first != second
    assert sorted(itertools.chain(*second)) == list(range(30))


@pytest.mark.parametrize("world, n", [(3, 10), (2, 11), (4, 9)])
def test_non_exact_pads_like_distributed_sampler(world, n):
    shards = [indices(loader) for loader in rank_loaders(n, world, shuffle=True, seed=5)]
    for r, shard in enumerate(shards):
        sampler = DistributedSampler(dataset(n), num_replicas=world, rank=r, shuffle=True, seed=5)
        sampler.set_epoch(0)
        assert shard == list(sampler)
    counts = Counter(itertools.chain(*shards))
    assert len({len(s) for s in shards}) == 1  # equal shards: every rank takes the same steps
    assert sum(counts.values()) == -(-n // world) * world
    assert set(counts) == set(range(n))  # padding repeats samples, drops none


def test_drop_last_drops_the_tail_everywhere():
    shards = [indices(loader) for loader in rank_loaders(10, 3, shuffle=False, drop_last=True)]
    assert [len(s) for s in shards] == [3, 3, 3]
    # the sampler drops the tail as well, instead of padding it with repeated samples that the
    # loader then keeps (visible with batches of one)
    for shuffle in (False, True):
        shards = [
            indices(distlib.distributed_loader(dataset(10), 1, shuffle=shuffle, drop_last=True, num_replicas=3, rank=r))
            for r in range(3)
        ]
        assert [len(s) for s in shards] == [3, 3, 3] and len(set(itertools.chain(*shards))) == 9, shards


def test_dataloader_kwargs_pass_through_and_sampler_is_refused():
    loader = distlib.distributed_loader(dataset(10), batch_size=4, num_replicas=1, rank=0, shuffle=False)
    assert [len(b) for (b,) in loader] == [4, 4, 2] and len(loader) == 3
    with pytest.raises(ValueError, match="do not pass sampler or batch_sampler"):
        distlib.distributed_loader(dataset(10), batch_size=4, sampler=None)
    with pytest.raises(ValueError, match=r"rank 3 is not in \[0, 3\)"):
        distlib.distributed_loader(dataset(10), batch_size=4, num_replicas=3, rank=3, exact=True)


def test_without_a_process_group_the_loader_sees_everything():
    loader = distlib.distributed_loader(dataset(10), batch_size=4, shuffle=False)
    assert indices(loader) == list(range(10))


# ---- IterableDataset --------------------------------------------------------------------------


class Stream(torch.utils.data.IterableDataset):
    """0..n-1 in order, or shuffled per epoch when ``shuffle`` (its set_epoch is called before each pass)."""

    def __init__(self, n: int, shuffle: bool = False):
        self.n, self.shuffle, self.epoch = n, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.n))
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist())


class SizedStream(Stream):
    def __len__(self) -> int:
        return self.n


def stream_loaders(ds, world: int, **kwargs) -> list:
    return [distlib.distributed_loader(ds, batch_size=3, num_replicas=world, rank=r, **kwargs) for r in range(world)]


def samples(loader) -> list[int]:
    return [int(i) for batch in loader for i in batch]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("n", [23, 4])
def test_iterable_every_sample_once_over_ranks_and_workers(workers, n):
    loaders = stream_loaders(Stream(n), 2, num_workers=workers)
    shards = [samples(loader) for loader in loaders]
    assert sorted(itertools.chain(*shards)) == list(range(n))  # no duplicates, none lost
    assert len(shards[0]) + len(shards[1]) == n


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_epochs_reach_the_dataset_in_the_workers(workers):
    n = 30
    loaders = stream_loaders(Stream(n, shuffle=True), 2, num_workers=workers)
    epochs = []
    for _epoch in range(3):
        shards = [samples(loader) for loader in loaders]
        assert sorted(itertools.chain(*shards)) == list(range(n))
        epochs.append(shards)
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]  # the order changes with the epoch
    assert [loader.epoch for loader in loaders] == [3, 3]
    loaders[0].set_epoch(1)  # a resumed run
    assert samples(loaders[0]) == epochs[1][0]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_len_is_the_batches_of_this_rank(workers, drop_last):
    # 22 and 26 samples: each worker's short last batch (or the dropped one) counts separately
    for n in (22, 26):
        for loader in stream_loaders(SizedStream(n), 2, num_workers=workers, drop_last=drop_last):
            assert len(loader) == sum(1 for _ in loader)
    (unsized,) = stream_loaders(Stream(23), 1)
    with pytest.raises(TypeError, match=r"a loader over an IterableDataset \(Stream\) without __len__ has no length"):
        len(unsized)
    assert isinstance(unsized.dataset, Stream)


def test_iterable_refuses_what_cannot_work():
    with pytest.raises(ValueError, match=r"shuffle=True cannot reorder an IterableDataset \(Stream\)"):
        distlib.distributed_loader(Stream(4), batch_size=2, shuffle=True)
    with pytest.raises(ValueError, match=r"persistent_workers=True .* set_epoch would never reach the workers"):
        distlib.distributed_loader(Stream(4), batch_size=2, num_workers=1, persistent_workers=True)


def test_exact_shuffle_follows_the_seed():
    def orders(seed: int) -> list[list[int]]:
        return [indices(loader) for loader in rank_loaders(30, 3, shuffle=True, exact=True, seed=seed)]

    assert orders(0) != orders(1), "another seed must give another order"
    assert orders(1) == orders(1), "the same seed must give the same order"
    # the exact sampler deals the same permutation as DistributedSampler with that seed
    perm = [None] * 30
    for r, shard in enumerate(orders(7)):
        perm[r::3] = shard
    assert perm == torch.randperm(30, generator=torch.Generator().manual_seed(7)).tolist()
