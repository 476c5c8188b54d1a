"""The device-resident DeviceLoader with its augmentation, and the evaluation shards."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from distlib.runner.data.device_loader import DeviceLoader, cutout, eval_shards, normalize_stats, random_crop

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


@pytest.mark.parametrize("world", [2, 3])
def test_each_step_of_the_ranks_is_one_global_batch_of_one_process(world):
    """Rank r's batch of step k is the r-th slice of the global batch one process takes at step k
    with the whole global batch: the ranks together train as that process (train.grad_accum)."""
    n, batch = 50, 4
    (whole,) = device_loaders(n, 1, batch * world)
    ranks = device_loaders(n, world, batch)
    for _epoch in range(2):
        per_rank = [[y for _, y in loader] for loader in ranks]
        for k, (_, y) in enumerate(whole):
            assert torch.equal(torch.cat([steps[k] for steps in per_rank]), y), (k, world)


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


def test_normalize_stats_are_the_per_channel_mean_and_std_on_the_0_1_scale():
    x, _ = image_set(20)
    x[:, 1] //= 2  # channels of their own means and spreads
    x[:, 2] = 200 + x[:, 2] // 8
    pixels = x.numpy().astype(np.float64) / 255
    mean, std = normalize_stats(x)
    np.testing.assert_allclose(mean.numpy(), pixels.mean(axis=(0, 2, 3)), rtol=1e-5)
    np.testing.assert_allclose(std.numpy(), pixels.std(axis=(0, 2, 3), ddof=1), rtol=1e-5)


def test_random_flip_is_drawn_for_each_image():
    x, y = image_set(64)
    loader = DeviceLoader(x, y, batch_size=32, flip="random")
    for xb, yb in loader:
        raw = (xb * loader.std + loader.mean) * 255
        flipped = []
        for img, label in zip(raw, yb.tolist()):
            if torch.allclose(img, x[label].float(), atol=1e-3):
                flipped.append(False)
            else:
                assert torch.allclose(img, x[label].float().flip(2), atol=1e-3)
                flipped.append(True)
        assert 0 < sum(flipped) < len(flipped), flipped  # within one batch: some flipped, some not


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
    x = torch.rand(64, 3, 8, 8)
    out = random_crop(x, 2, torch.Generator().manual_seed(0))
    padded = F.pad(x, (2, 2, 2, 2), mode="reflect")
    offsets = set()
    for k in range(64):
        match = [(i, j) for i in range(5) for j in range(5) if torch.equal(out[k], padded[k, :, i : i + 8, j : j + 8])]
        assert match, f"image {k} is not a crop of its padded self"
        offsets.add(match[0])
    # offsets are drawn per image, every one of the 2 * pad + 1 in each direction
    assert {i for i, _ in offsets} == {j for _, j in offsets} == set(range(5)), offsets
    assert random_crop(x, 0) is x


@pytest.mark.parametrize("size", [5, 4])
def test_cutout_zeroes_one_square_per_image(size):
    x = torch.ones(32, 3, 16, 16)
    out = cutout(x, size, torch.Generator().manual_seed(0))
    zeros = (out == 0).all(1)  # all channels
    inside = 0
    for k in range(32):
        rows, cols = zeros[k].nonzero(as_tuple=True)
        height, width = rows.max() - rows.min() + 1, cols.max() - cols.min() + 1
        assert len(rows) == height * width  # one rectangle
        assert 0 < height <= size and 0 < width <= size  # a square of side size, or the part of it in the image
        if 0 < rows.min() and rows.max() < 15 and 0 < cols.min() and cols.max() < 15:  # not cut by an edge
            assert (height, width) == (size, size), (k, height, width)
            inside += 1
    assert inside > 0
    assert (out != 0).any(1).equal(~zeros)  # the channels agree


def test_alternating_flip_flips_each_image_every_other_epoch():
    x, y = image_set(24)
    loader = DeviceLoader(x, y, batch_size=8, flip="alternating")
    loader.augment_chunk = 5  # augmented in several chunks, as a data set of over 16,384 images is
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


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_eval_shards_cover_every_sample_exactly_once_in_as_many_batches(world):
    """Every rank yields the same number of batches (a fully sharded forward is a collective); a rank
    short of a batch gets one sample labelled -1, which no prediction matches."""
    x, y = image_set(10)
    seen, batches = [], []
    for r in range(world):
        mine = list(eval_shards(x, y, r, world, batch_size=3))
        batches.append(len(mine))
        for xb, yb in mine:
            kept = yb >= 0
            assert len(yb) <= 3 and torch.equal(xb[kept], x[yb[kept]])
            seen += yb[kept].tolist()
    assert sorted(seen) == list(range(10))
    assert len(set(batches)) == 1, batches  # 4 ranks: shares of 3, 3, 2, 2 samples, one batch each


# ---- the augmentation's random draws ----------------------------------------------------------
# Every image of the set is one image, so a batch's pixels depend on the draws alone (not on which
# samples the shuffled order put in it).

AUGMENT = {"crop_pad": 2, "flip": "random", "cutout_size": 3}


def epoch_pixels(*, rank: int, world: int = 2, seed: int = 0, epoch: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    one = torch.randint(0, 256, (1, 3, 8, 8), generator=g, dtype=torch.uint8)
    images = one.expand(32, -1, -1, -1).contiguous()
    loader = DeviceLoader(images, torch.zeros(32, dtype=torch.long), batch_size=4, rank=rank, world_size=world,
                          seed=seed, **AUGMENT)  # fmt: skip
    loader.set_epoch(epoch)
    return torch.cat([x for x, _ in loader])


def test_each_rank_epoch_and_seed_draws_its_own_augmentation_and_the_same_again():
    base = epoch_pixels(rank=0)
    assert torch.equal(base, epoch_pixels(rank=0))  # a resumed epoch sees the same crops, flips, squares
    # ranks that drew alike would augment the k-th image of every rank's slice the same way
    assert not torch.equal(base, epoch_pixels(rank=1))
    assert not torch.equal(base, epoch_pixels(rank=0, epoch=1))  # a new epoch, new draws
    assert not torch.equal(base, epoch_pixels(rank=0, seed=1))  # train.seed reaches the augmentation
    # the draws differ image by image, not only somewhere in the epoch
    per_image = (base - epoch_pixels(rank=1)).flatten(1).abs().amax(1) > 0
    assert per_image.float().mean() > 0.5, per_image
