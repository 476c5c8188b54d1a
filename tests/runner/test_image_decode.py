"""The first decode of an image set: the listing matches torchvision's ImageFolder, the
parallel PIL decode (from folders and from a .tar.gz read in memory) gives the same pixels
and labels as torchvision's ImageFolder with PIL, bad files are named, the cache is
memory-mapped."""

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch

from distlib.reliability import children
from distlib.runner.data import image_decode
from distlib.runner.data.errors import DataError
from distlib.runner.data.image_decode import decode_cpu, list_imagefolder
from distlib.runner.data.images import load_image_set
from tests.conftest import ROOT

DEMO = os.path.join(ROOT, "data", "cifar10-demo")


def small_copy(root, per_class: int = 3, classes=("bird", "cat", "dog")) -> str:
    for split in ("train", "test"):
        for cls in classes:
            src = os.path.join(DEMO, split, cls)
            os.makedirs(os.path.join(root, split, cls))
            for name in sorted(os.listdir(src))[:per_class]:
                shutil.copy(os.path.join(src, name), os.path.join(root, split, cls, name))
    return str(root)


def reference(split_dir: str):
    """torchvision's ImageFolder with PIL: what the runner decoded before."""
    from torchvision.datasets import ImageFolder
    from torchvision.transforms.functional import pil_to_tensor

    ds = ImageFolder(split_dir)
    x = torch.stack([pil_to_tensor(ds.loader(p)) for p, _ in ds.samples])
    return ds.samples, ds.classes, x, torch.tensor(ds.targets)


def test_listing_matches_imagefolder(tmp_path):
    root = small_copy(tmp_path / "images")
    nested = os.path.join(root, "train", "cat", "more")  # a sub-folder and a non-image file
    os.makedirs(nested)
    shutil.copy(os.path.join(DEMO, "train", "cat", "0000.jpg"), os.path.join(nested, "a.JPG"))
    open(os.path.join(root, "train", "dog", "notes.txt"), "w").write("not an image")
    samples, classes, _, _ = reference(os.path.join(root, "train"))
    assert list_imagefolder(os.path.join(root, "train")) == ([tuple(s) for s in samples], classes)


@pytest.mark.parametrize("layout", ["folder", "archive"])
def test_decode_equals_imagefolder_with_pil(tmp_path, layout):
    root = small_copy(tmp_path / "images", per_class=5)
    data_root = root
    if layout == "archive":  # one top folder around train/ and test/, as a downloaded archive has
        data_root = str(tmp_path / "images.tar.gz")
        with tarfile.open(data_root, "w:gz") as tf:
            tf.add(root, arcname="cifar")
    images = load_image_set(data_root, cache_dir=str(tmp_path / "cache"))
    assert images.source == "decoded"
    for split, x, y in (("train", images.x_train, images.y_train), ("test", images.x_test, images.y_test)):
        _, classes, x_ref, y_ref = reference(os.path.join(root, split))
        assert images.classes == classes
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    again = load_image_set(data_root, cache_dir=str(tmp_path / "cache"))
    assert again.source == "cache" and torch.equal(again.x_train, images.x_train)
    assert torch.equal(again.y_test, images.y_test) and again.classes == images.classes


def test_parallel_decode_keeps_order_and_reports_bad_items():
    paths = [os.path.join(DEMO, "train", "cat", n) for n in sorted(os.listdir(os.path.join(DEMO, "train", "cat")))][:7]
    items = [open(p, "rb").read() if i % 2 else p for i, p in enumerate(paths)]  # paths and bytes mixed
    items.insert(3, b"this is not a JPEG")
    serial = decode_cpu(items, workers=1)
    parallel = decode_cpu(items, workers=3)
    assert isinstance(parallel[3], str) and "cannot identify image file" in parallel[3]
    assert serial[3] == parallel[3]
    for a, b in zip(serial[:3] + serial[4:], parallel[:3] + parallel[4:]):
        assert a.shape == (32, 32, 3) and np.array_equal(a, b)


@pytest.mark.parametrize("moment", ["starting", "decoding"])
def test_a_decoding_worker_stopped_by_sigint_ends_without_a_traceback(tmp_path, moment):
    """A stop sent to every process of the job reaches the decoding workers too, while their interpreter
    starts or mid-decode: they end by the signal, without the KeyboardInterrupt traceback that would
    read as a crash in the job's output."""
    fifo = str(tmp_path / "image.jpg")
    os.mkfifo(fifo)  # the worker blocks reading it: a moment inside its decode, known to the test
    worker = children.spawn(  # as decode_cpu starts them
        [sys.executable, "-c", image_decode._WORKER_CODE, image_decode.__file__],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    if moment == "starting":
        worker.send_signal(signal.SIGINT)  # its interpreter is still importing
    pickle.dump([fifo], worker.stdin)
    worker.stdin.close()
    if moment == "decoding":
        with open(fifo, "wb") as writer:  # returns once the worker has opened the image
            writer.write(b"\xff\xd8")  # the start of a JPEG: the decoder waits for the rest
            writer.flush()
            worker.send_signal(signal.SIGINT)
    worker.wait(timeout=60)  # with the image's end (the writer closed), a worker that caught the signal goes on
    err = worker.stderr.read()
    worker.stdout.close()
    worker.stderr.close()
    assert worker.returncode == -signal.SIGINT, (worker.returncode, err.decode())
    assert err == b""


def test_corrupt_member_of_an_archive_is_named(tmp_path):
    root = small_copy(tmp_path / "images")
    bad = os.path.join(root, "train", "cat", sorted(os.listdir(os.path.join(root, "train", "cat")))[1])
    open(bad, "wb").write(b"this is not a JPEG")
    archive = str(tmp_path / "images.tar.gz")
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(os.path.join(root, "train"), arcname="train")
        tf.add(os.path.join(root, "test"), arcname="test")
    name = "train/cat/" + os.path.basename(bad)
    with pytest.raises(DataError, match=f"^{archive}:{name}: corrupt or unusable image: "):
        load_image_set(archive, cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("long_name", [False, True])
def test_tar_reading_matches_tarfile(tmp_path, fmt, long_name):
    """The direct ustar reader, or tarfile where the archive needs it (long names, pax headers)."""
    from distlib.runner.data.image_decode import _tar_files

    root = small_copy(tmp_path / "images", per_class=2)
    if long_name:  # ustar keeps the 130-character name in its prefix field, gnu and pax in headers of their own
        deep = os.path.join(root, "train", "cat", "x" * 60, "y" * 60)
        os.makedirs(deep)
        shutil.copy(os.path.join(DEMO, "train", "cat", "0000.jpg"), os.path.join(deep, "long.jpg"))
    archive = str(tmp_path / "a.tar")
    with tarfile.open(archive, "w", format=fmt) as tf:
        tf.add(root, arcname="top")
    with tarfile.open(archive) as tf:
        expected = [(m.name, tf.extractfile(m).read()) for m in tf if m.isfile()]
    assert _tar_files(archive) == expected and len(expected) >= 12
