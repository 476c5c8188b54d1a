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
