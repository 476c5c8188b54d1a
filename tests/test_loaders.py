"""distributed_loader (DistributedSampler underneath), the exact evaluation sampler,
and the device-resident DeviceLoader with its augmentation."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, TensorDataset

import distlib
from distlib.device_loader import DeviceLoader, cutout, eval_shards, random_crop


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


# ---- DeviceLoader -----------------------------------------------------------------------------


def image_set(n: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Random uint8 images; the label of image i is i, so a batch tells which samples it holds."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 3, size, size), generator=g, dtype=torch.uint8), torch.arange(n)


def device_loaders(n: int, world: int, batch: int = 4, **kwargs) -> list[DeviceLoader]:
    x, y = image_set(n)
    return [DeviceLoader(x, y, batch_size=batch, rank=r, world_size=world, **kwargs) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_device_loader_ranks_disjoint_and_in_step(world):
    n, batch = 50, 4
    loaders = device_loaders(n, world, batch)
    steps = n // (batch * world)
    orders = []
    for _epoch in range(2):
        seen = []
        for loader in loaders:
            batches = [y for _, y in loader]
            assert len(batches) == len(loader) == steps  # every rank takes the same number of steps
            assert all(len(y) == batch for y in batches)
            seen.append(torch.cat(batches).tolist())
        flat = list(itertools.chain(*seen))
        assert len(flat) == len(set(flat)) == steps * batch * world  # disjoint within the epoch
        orders.append(seen)
    assert orders[0] != orders[1]  # a new permutation each epoch


def test_device_loader_is_deterministic_for_a_seed():
    aug = dict(crop_pad=2, flip="random", cutout_size=3)
    a, b = (DeviceLoader(*image_set(40), batch_size=8, seed=3, **aug) for _ in range(2))
    c = DeviceLoader(*image_set(40), batch_size=8, seed=4, **aug)
    for _epoch in range(2):
        xa, xb, xc = ([x for x, _ in loader] for loader in (a, b, c))
        assert all(torch.equal(p, q) for p, q in zip(xa, xb))
        assert not all(torch.equal(p, q) for p, q in zip(xa, xc))


def test_device_loader_without_augmentation_normalizes_exactly():
    x, y = image_set(20)
    loader = DeviceLoader(x, y, batch_size=5)
    mean, std = loader.mean, loader.std
    for xb, yb in loader:
        torch.testing.assert_close(xb * std + mean, x[yb].float() / 255)
    assert loader.prepare(x[:3]).shape == (3, 3, 8, 8)


def test_device_loader_shapes_dtype_and_memory_format():
    loader = DeviceLoader(*image_set(32), batch_size=8, crop_pad=4, flip="random", cutout_size=4, channels_last=True)
    xb, yb = next(iter(loader))
    assert xb.shape == (8, 3, 8, 8) and xb.dtype == torch.float32 and yb.dtype == torch.int64
    assert xb.is_contiguous(memory_format=torch.channels_last)


def test_device_loader_refuses_too_few_images_and_wrong_dtype():
    x, y = image_set(10)
    with pytest.raises(ValueError, match=r"10 training images cannot fill one global batch of 4 x 3 ranks"):
        DeviceLoader(x, y, batch_size=4, world_size=3)
    with pytest.raises(ValueError, match=r"images must be uint8 \(N, C, H, W\)"):
        DeviceLoader(x.float(), y, batch_size=2)


def test_random_crop_is_a_window_of_the_reflect_padded_image():
    x = torch.rand(16, 3, 8, 8)
    out = random_crop(x, 2, torch.Generator().manual_seed(0))
    padded = F.pad(x, (2, 2, 2, 2), mode="reflect")
    offsets = set()
    for k in range(16):
        match = [(i, j) for i in range(5) for j in range(5) if torch.equal(out[k], padded[k, :, i : i + 8, j : j + 8])]
        assert match, f"image {k} is not a crop of its padded self"
        offsets.add(match[0])
    assert len(offsets) > 1  # offsets are drawn per image
    assert random_crop(x, 0) is x


def test_cutout_zeroes_one_square_per_image():
    x = torch.ones(32, 3, 16, 16)
    out = cutout(x, 5, torch.Generator().manual_seed(0))
    zeros = (out == 0).all(1)  # all channels
    for k in range(32):
        rows, cols = zeros[k].nonzero(as_tuple=True)
        assert 0 < len(rows) <= 25
        assert len(rows) == (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)  # one rectangle
    assert (out != 0).any(1).equal(~zeros)  # the channels agree


def test_alternating_flip_flips_each_image_every_other_epoch():
    x, y = image_set(24)
    loader = DeviceLoader(x, y, batch_size=8, flip="alternating")
    mean, std = loader.mean, loader.std
    flipped_per_epoch = []
    for _epoch in range(3):
        state = {}
        for xb, yb in loader:
            raw = (xb * std + mean) * 255
            for img, label in zip(raw, yb.tolist()):
                orig = x[label].float()
                if torch.allclose(img, orig, atol=1e-3):
                    state[label] = False
                else:
                    assert torch.allclose(img, orig.flip(2), atol=1e-3)
                    state[label] = True
        flipped_per_epoch.append(state)
    e0, e1, e2 = flipped_per_epoch
    assert 0 < sum(e0.values()) < len(e0)  # about half are flipped
    assert all(e1[k] != e0[k] for k in e0) and e2 == e0


@pytest.mark.parametrize("world", [1, 2, 3])
def test_eval_shards_cover_every_sample_exactly_once(world):
    x, y = image_set(10)
    seen = []
    for r in range(world):
        for xb, yb in eval_shards(x, y, r, world, batch_size=3):
            assert len(yb) <= 3 and torch.equal(xb, x[yb])
            seen += yb.tolist()
    assert sorted(seen) == list(range(10))
