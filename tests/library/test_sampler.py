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


def ddp_epoch(n: int, world: int, rank: int, epoch: int, batch_size: int = 3, drop_last: bool = False) -> list[int]:
    """What a DDP script's rank reads in ``epoch``: DataLoader + DistributedSampler with set_epoch."""
    sampler = DistributedSampler(dataset(n), num_replicas=world, rank=rank, shuffle=True, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return indices(torch.utils.data.DataLoader(dataset(n), batch_size=batch_size, sampler=sampler, drop_last=drop_last))


@pytest.mark.parametrize("world", [1, 3])
def test_epochs_follow_the_loop_not_iter(world):
    # the DDP order of epochs 0, 1, 2, whatever the loop does besides its one full pass per epoch
    for rank in range(world):
        (loader,) = [distlib.distributed_loader(dataset(41), 3, num_replicas=world, rank=rank)]
        for epoch in range(3):
            first = next(iter(loader))  # a peek: not a pass
            assert [int(i) for i in first[0]] == ddp_epoch(41, world, rank, epoch)[:3]
            half = iter(loader)
            next(half)  # a pass begun and abandoned replays the same epoch next time
            assert indices(loader) == ddp_epoch(41, world, rank, epoch), (rank, epoch)
        assert loader.epoch == 3


def test_ddp_set_epoch_on_the_sampler_is_honoured():
    loader = distlib.distributed_loader(dataset(41), 3, num_replicas=2, rank=1)
    for epoch in (0, 1, 1, 5, 2):  # DDP's idiom, including a repeated and a jumping epoch
        loader.sampler.set_epoch(epoch)
        next(iter(loader))
        assert indices(loader) == ddp_epoch(41, 2, 1, epoch)
    loader.set_epoch(0)  # the loader's own, same meaning
    assert indices(loader) == ddp_epoch(41, 2, 1, 0)
    assert indices(loader) == ddp_epoch(41, 2, 1, 1)  # then it counts on


def test_state_dict_resumes_the_order():
    loader = distlib.distributed_loader(dataset(41), 3, num_replicas=2, rank=0)
    for _ in range(2):
        indices(loader)
    saved = loader.state_dict()
    assert saved == {"epoch": 2}
    resumed = distlib.distributed_loader(dataset(41), 3, num_replicas=2, rank=0)
    resumed.load_state_dict(saved)
    assert [indices(resumed) for _ in range(2)] == [ddp_epoch(41, 2, 0, e) for e in (2, 3)]
    resumed.set_epoch(7)  # a pending set_epoch is what a checkpoint taken now must hold
    assert resumed.state_dict() == {"epoch": 7}


def test_loader_reads_like_a_dataloader():
    ds = dataset(41)
    loader = distlib.distributed_loader(ds, 4, num_replicas=3, rank=2, drop_last=True, num_workers=0)
    assert loader.batch_size == 4 and loader.drop_last is True and loader.num_workers == 0
    assert loader.dataset is ds and isinstance(loader.sampler, DistributedSampler)
    assert loader.sampler.num_replicas == 3 and loader.sampler.rank == 2
    assert len(loader) == 41 // 3 // 4 == len(list(loader))
    # drop_last applies to both the sampler (no padded repeats) and the last short batch: the
    # DDP script with DistributedSampler(drop_last=True) and DataLoader(drop_last=True)
    assert indices(loader) == ddp_epoch(41, 3, 2, 1, batch_size=4, drop_last=True)
    with pytest.raises(AttributeError):
        loader.no_such_attribute  # noqa: B018


def _loader_on_ranks(ctx, n: int):
    """On a real rank: the loader's passes (with a peek and a re-made iterator), then a resume."""
    loader = distlib.distributed_loader(dataset(n), 3)
    out = []
    for _epoch in range(2):
        next(iter(loader))
        out.append(indices(loader))
    again = distlib.distributed_loader(dataset(n), 3)
    again.load_state_dict(loader.state_dict())
    out.append(indices(again))
    return ctx.rank, out


@pytest.mark.parametrize("world", [2, 3])
def test_loader_on_gloo_ranks_matches_ddp(world):
    from tests.conftest import run_ranks

    for rank, passes in run_ranks(_loader_on_ranks, world, 41):
        assert passes == [ddp_epoch(41, world, rank, e) for e in range(3)], rank


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
    with pytest.raises(distlib.LoaderError, match="do not pass sampler or batch_sampler"):
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


def test_checkpointer_saves_the_loader(tmp_path):
    from distlib.checkpoint.checkpointer import Checkpointer

    loader = distlib.distributed_loader(dataset(41), 3, num_replicas=2, rank=1)
    indices(loader)
    Checkpointer(str(tmp_path)).save({"loader": loader}, epoch=1, step=0, global_step=14, fingerprint={})
    resumed = distlib.distributed_loader(dataset(41), 3, num_replicas=2, rank=1)
    Checkpointer(str(tmp_path)).load({"loader": resumed}, fingerprint={})
    assert indices(resumed) == ddp_epoch(41, 2, 1, 1)
