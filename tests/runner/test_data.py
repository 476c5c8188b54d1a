"""The data.root formats the loader reads (an ImageFolder, a .tar.gz of one, torchvision's
cifar-10-batches-py), images of another size, and the decode cache: reused, and where it lives.

Every data set here is a tiny one built in tmp_path from data/cifar10-demo.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from distlib.runner.data import images as data_module
from distlib.runner.data.errors import DataError
from distlib.runner.data.images import load_image_set
from tests.conftest import ROOT

DEMO = os.path.join(ROOT, "data", "cifar10-demo")
CLASSES = ("cat", "dog")


def imagefolder(root, per_class: int = 3) -> str:
    """train/ and test/ with ``per_class`` demo JPEGs of two classes each."""
    for split in ("train", "test"):
        for cls in CLASSES:
            os.makedirs(os.path.join(root, split, cls))
            src = os.path.join(DEMO, split, cls)
            for name in sorted(os.listdir(src))[:per_class]:
                shutil.copy(os.path.join(src, name), os.path.join(root, split, cls, name))
    return str(root)


def assert_same_set(a, b) -> None:
    for key in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(a, key), getattr(b, key)), key
    assert a.classes == b.classes


def test_imagefolder_is_decoded_to_uint8(tmp_path):
    images = load_image_set(imagefolder(tmp_path / "f"), cache_dir=str(tmp_path / "cache"))
    assert images.x_train.dtype == torch.uint8 and images.x_train.shape == (6, 3, 32, 32)
    assert images.y_train.tolist() == [0, 0, 0, 1, 1, 1] and images.classes == list(CLASSES)
    assert images.x_test.shape == (6, 3, 32, 32)
    assert images.y_train.dtype == images.y_test.dtype == torch.int64  # what cross_entropy takes as targets


def test_train_and_test_of_other_classes_are_named(tmp_path):
    """A test split with other classes would label its images by the wrong class index."""
    root = imagefolder(tmp_path / "f")
    os.rename(os.path.join(root, "test", "dog"), os.path.join(root, "test", "frog"))
    with pytest.raises(
        DataError, match=r"train/ and test/ have different classes \(\['cat', 'dog'\] vs \['cat', 'frog'\]\)"
    ):
        load_image_set(root, cache_dir=str(tmp_path / "cache"))


def test_an_archive_without_a_test_split_is_named(tmp_path):
    folder = imagefolder(tmp_path / "f", per_class=1)
    archive = str(tmp_path / "train-only.tar.gz")
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(os.path.join(folder, "train"), arcname="train")  # train/ alone: not one top folder to strip
    with pytest.raises(DataError, match=r"no test/<class>/<image> files"):
        load_image_set(archive, cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize("top_folder", [True, False])
def test_tar_gz_of_an_imagefolder(tmp_path, top_folder):
    folder = imagefolder(tmp_path / "cifar")
    archive = str(tmp_path / "cifar.tar.gz")
    with tarfile.open(archive, "w:gz") as tf:
        if top_folder:  # cifar/train/..., cifar/test/...
            tf.add(folder, arcname="cifar")
        else:  # train/..., test/...
            for split in ("train", "test"):
                tf.add(os.path.join(folder, split), arcname=split)
    got = load_image_set(archive, cache_dir=str(tmp_path / "cache"))
    assert_same_set(got, load_image_set(folder, cache_dir=str(tmp_path / "cache2")))


def cifar_batches(root, n_train: int = 10, n_test: int = 4, classes: int = 3) -> tuple[np.ndarray, list[int]]:
    """torchvision's cifar-10-batches-py layout: five data batches, a test batch, the meta file."""
    base = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(base)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (5 * n_train + n_test, 3 * 32 * 32), dtype=np.uint8)
    labels = [int(i % classes) for i in range(len(data))]
    parts = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for k, name in enumerate(parts):
        sl = slice(k * n_train, (k + 1) * n_train) if k < 5 else slice(5 * n_train, None)
        with open(os.path.join(base, name), "wb") as f:
            pickle.dump({"data": data[sl], "labels": labels[sl]}, f)
    with open(os.path.join(base, "batches.meta"), "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(classes)]}, f)
    return data, labels


def test_cifar10_batches_folder(tmp_path, monkeypatch):
    import torchvision.datasets.cifar as cifar

    data, labels = cifar_batches(tmp_path / "c")
    monkeypatch.setattr(cifar, "check_integrity", lambda *a, **k: True)  # the files' md5s are the real set's
    images = load_image_set(str(tmp_path / "c"), cache_dir=str(tmp_path / "cache"))
    x = torch.from_numpy(data).view(-1, 3, 32, 32)
    assert torch.equal(images.x_train, x[:50]) and torch.equal(images.x_test, x[50:])  # CHW, as torchvision stores
    assert images.y_train.tolist() == labels[:50] and images.y_test.tolist() == labels[50:]
    assert images.classes == ["class0", "class1", "class2"]


def test_a_corrupt_cifar10_batches_folder_is_a_data_error(tmp_path):
    cifar_batches(tmp_path / "c")  # md5s do not match the real set's: torchvision refuses it
    with pytest.raises(DataError, match=r"cifar-10-batches-py"):
        load_image_set(str(tmp_path / "c"), cache_dir=str(tmp_path / "cache"))


def test_images_of_another_size_are_named(tmp_path):
    root = imagefolder(tmp_path / "f")
    odd = os.path.join(root, "train", "dog", sorted(os.listdir(os.path.join(root, "train", "dog")))[1])
    Image.new("RGB", (16, 16)).save(odd, format="JPEG")
    with pytest.raises(DataError) as err:
        load_image_set(root, cache_dir=str(tmp_path / "cache"))
    assert str(err.value).startswith(f"{odd}: corrupt or unusable image: image is (3, 16, 16)"), err.value
    # every test image of another size than the training images
    root2 = imagefolder(tmp_path / "g")
    for cls in CLASSES:
        folder = os.path.join(root2, "test", cls)
        for name in os.listdir(folder):
            Image.new("RGB", (24, 24)).save(os.path.join(folder, name), format="JPEG")
    with pytest.raises(DataError, match=r"train images are \(3, 32, 32\), test images \(3, 24, 24\)"):
        load_image_set(root2, cache_dir=str(tmp_path / "cache"))


def test_the_decode_cache_is_reused_and_lives_in_the_default_place(tmp_path, monkeypatch):
    root = imagefolder(tmp_path / "f")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    first = load_image_set(root)  # cache_dir "": $XDG_CACHE_HOME/distlib
    assert first.source == "decoded" and set(first.timings) == {"decode_s", "cache_write_s"}, first.timings
    cached = os.listdir(tmp_path / "xdg" / "distlib")
    assert len(cached) == 1 and cached[0].startswith("images-") and cached[0].endswith(".pt"), cached
    # replace an image by garbage of the same name: a second decode would fail, the cache does not
    victim = os.path.join(root, "train", "cat", sorted(os.listdir(os.path.join(root, "train", "cat")))[0])
    with open(victim, "wb") as f:
        f.write(b"not an image any more")
    second = load_image_set(root)
    assert_same_set(second, first)
    assert second.source == "cache" and set(second.timings) == {"cache_read_s"}, second.timings
    assert os.listdir(tmp_path / "xdg" / "distlib") == cached
    # a cache file cut short (a crash of the machine, a full disk) is decoded again, not a crash:
    # here the decode meets the garbage image
    cache_file = tmp_path / "xdg" / "distlib" / cached[0]
    cache_file.write_bytes(cache_file.read_bytes()[:1000])
    with pytest.raises(DataError, match="corrupt or unusable image"):
        load_image_set(root)
    # a folder with one file fewer is another data set: decoded again (the garbage is found), not
    # taken from the cache
    dogs = os.path.join(root, "train", "dog")
    os.remove(os.path.join(dogs, sorted(os.listdir(dogs))[0]))
    with pytest.raises(DataError, match="corrupt or unusable image"):
        load_image_set(root)
    # without XDG_CACHE_HOME: ~/.cache/distlib; an explicit cache_dir is its own cache (here: decodes again)
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(DataError, match="corrupt or unusable image"):
        load_image_set(root)
    with pytest.raises(DataError, match="corrupt or unusable image"):
        load_image_set(root, cache_dir=str(tmp_path / "elsewhere"))
    os.remove(victim)
    again = load_image_set(root)
    assert again.x_train.shape[0] == first.x_train.shape[0] - 2
    assert len(os.listdir(tmp_path / "home" / ".cache" / "distlib")) == 1
    # another cache format (a decoder that writes other tensors) never reads the old file
    monkeypatch.setattr(data_module, "CACHE_FORMAT", data_module.CACHE_FORMAT + 1)
    assert load_image_set(root).source == "decoded"
    assert len(os.listdir(tmp_path / "home" / ".cache" / "distlib")) == 2


def test_a_rewritten_archive_of_the_same_size_is_decoded_again(tmp_path):
    """The cache key of an archive follows its size and modification time: the same images with
    the classes swapped (an archive of the same size) are a new data set."""
    folder = imagefolder(tmp_path / "f")
    archive = str(tmp_path / "cifar.tar")

    def write_tar(swap: bool) -> None:
        with tarfile.open(archive, "w", format=tarfile.USTAR_FORMAT) as tf:
            for split in ("train", "test"):
                for cls, src in zip(CLASSES, CLASSES[::-1] if swap else CLASSES):
                    for k, name in enumerate(sorted(os.listdir(os.path.join(folder, split, src)))):
                        data = open(os.path.join(folder, split, src, name), "rb").read()
                        info = tarfile.TarInfo(f"{split}/{cls}/{k}.jpg")
                        info.size = len(data)
                        tf.addfile(info, io.BytesIO(data))

    write_tar(swap=False)
    first = load_image_set(archive, cache_dir=str(tmp_path / "cache"))
    size, mtime = os.path.getsize(archive), os.stat(archive).st_mtime_ns
    write_tar(swap=True)
    os.utime(archive, ns=(mtime + 10**9, mtime + 10**9))  # rewritten a second later
    assert os.path.getsize(archive) == size
    second = load_image_set(archive, cache_dir=str(tmp_path / "cache"))
    assert second.source == "decoded"
    assert torch.equal(second.x_train, first.x_train.roll(3, 0))  # dog's three images first now
    assert torch.equal(second.y_train, first.y_train)


def test_the_cache_key_tells_data_sets_of_one_shape_apart(tmp_path, monkeypatch):
    """Two data sets with the same folders and file counts share a cache directory (the default one
    does), each named by the same relative data.root from its own checkout: each gets its own
    images; a renamed class folder is a new data set with the new class."""
    cache = str(tmp_path / "cache")
    imagefolder(tmp_path / "a" / "data")
    monkeypatch.chdir(tmp_path / "a")
    first = load_image_set("data", cache_dir=cache)
    other = tmp_path / "b" / "data"
    for split in ("train", "test"):  # the same layout and counts, other images (the next three of each class)
        for cls in CLASSES:
            os.makedirs(other / split / cls)
            for name in sorted(os.listdir(os.path.join(DEMO, split, cls)))[3:6]:
                shutil.copy(os.path.join(DEMO, split, cls, name), other / split / cls / name)
    monkeypatch.chdir(tmp_path / "b")
    second = load_image_set("data", cache_dir=cache)
    assert second.source == "decoded" and not torch.equal(second.x_train, first.x_train)
    # dog/ renamed fox/: the same files in the same order under another class name
    for split in ("train", "test"):
        os.rename(other / split / "dog", other / split / "fox")
    renamed = load_image_set("data", cache_dir=cache)
    assert renamed.source == "decoded" and renamed.classes == ["cat", "fox"]
    assert torch.equal(renamed.x_train, second.x_train)
    assert load_image_set("data", cache_dir=cache).source == "cache"  # and its own cache is reused
