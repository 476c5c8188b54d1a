"""Image classification data decoded once into uint8 tensors and cached.

Reads torchvision's CIFAR-10 format (``root/cifar-10-batches-py``), an
ImageFolder with ``train/`` and ``test/`` (as in the JPEG CIFAR-10), or a
``.tar.gz`` of such an ImageFolder, and keeps the decoded result as one tensor
file so that later runs start in a fraction of a second.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import tempfile
import time
from dataclasses import dataclass, field

import torch

from distlib.runner.data.errors import DataError
from distlib.runner.data.image_decode import ListingError, decode_cpu, list_imagefolder, read_archive


@dataclass
class ImageSet:
    """uint8 images (N, C, H, W) and int64 labels (N) for both splits."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: list[str]
    source: str = "decoded"  # or "cache": read from the decoded cache
    timings: dict[str, float] = field(default_factory=dict)  # seconds: decode_s, cache_write_s or cache_read_s


_CIFAR_DIR = "cifar-10-batches-py"
# part of every cache key: raise it when the decoded tensors change (their dtype, layout, order),
# so that a cache written by an older decoder is never read back
CACHE_FORMAT = 1


def _layout(root: str) -> str:
    if root.endswith((".tar.gz", ".tgz", ".tar")) and os.path.isfile(root):
        return "archive"
    if os.path.isdir(os.path.join(root, _CIFAR_DIR)):
        return "cifar10"
    if os.path.isdir(os.path.join(root, "train")) and os.path.isdir(os.path.join(root, "test")):
        return "imagefolder"
    return "missing"


def _signature(root: str, layout: str) -> str:
    """A cache key that changes when the data on disk, or the cache format, changes."""
    h = hashlib.sha256(f"{CACHE_FORMAT}:{os.path.abspath(root)}".encode())
    if layout == "archive":
        st = os.stat(root)
        h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    else:
        base = os.path.join(root, _CIFAR_DIR) if layout == "cifar10" else root
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames.sort()
            if os.path.basename(dirpath).startswith("."):
                continue
            h.update(f"{dirpath}:{len(filenames)}".encode())
    return h.hexdigest()[:16]


def _stack(decoded: list, names: list[str], where: str) -> torch.Tensor:
    """One (N, C, H, W) uint8 tensor from ``decode_cpu`` results, or a DataError
    that names the first file that is unusable."""
    first_shape = None
    for name, x in zip(names, decoded):
        if isinstance(x, str):
            raise DataError(f"{name}: corrupt or unusable image: {x}; delete or replace the file")
        shape = tuple(x.shape[-1:] + x.shape[:2])
        if first_shape is None:
            first_shape, first = shape, name
        elif shape != first_shape:
            raise DataError(
                f"{name}: corrupt or unusable image: image is {shape} (C, H, W), {first} is {first_shape}; "
                "delete or replace the file"
            )
    if not decoded:
        raise DataError(f"{where}: no images found")
    import numpy as np

    return torch.from_numpy(np.stack(decoded)).permute(0, 3, 1, 2).contiguous()


def _decode_splits(splits: list[tuple[str, str, list[str], list, list[int], list[str]]]) -> dict:
    """Decode every split's items in one pass over the cores (one set of worker processes, not one
    per split); ``splits``: (split, where, names, items, labels, classes). Returns split -> (x, y, classes)."""
    decoded = decode_cpu([item for *_, items, _, _ in splits for item in items])
    out, k = {}, 0
    for split, where, names, items, labels, classes in splits:
        x = _stack(decoded[k : k + len(items)], names, where)
        out[split] = (x, torch.tensor(labels, dtype=torch.long), classes)
        k += len(items)
    return out


def _decode(root: str, layout: str, download: bool) -> ImageSet:
    if layout == "cifar10" or (layout == "missing" and download):
        from torchvision.datasets import CIFAR10

        try:
            tr = CIFAR10(root, train=True, download=download)
            te = CIFAR10(root, train=False, download=download)
        except RuntimeError as e:  # torchvision's md5 check: a missing or altered file
            raise DataError(
                f"{os.path.join(root, _CIFAR_DIR)}: not torchvision's CIFAR-10 ({e}); "
                "replace the folder with a complete copy, or let data.download=true fetch it"
            ) from e

        def chw(a):
            return torch.from_numpy(a).permute(0, 3, 1, 2).contiguous()

        return ImageSet(
            chw(tr.data), torch.tensor(tr.targets), chw(te.data), torch.tensor(te.targets), list(tr.classes)
        )
    splits = []
    try:
        if layout == "archive":
            for name, (images, classes) in read_archive(root).items():
                names = [f"{root}:{n}" for n, _, _ in images]
                items, labels = [data for _, data, _ in images], [y for _, _, y in images]
                splits.append((name, f"{root}:{name}", names, items, labels, classes))
        else:
            if not (os.path.isdir(os.path.join(root, "train")) and os.path.isdir(os.path.join(root, "test"))):
                raise DataError(f"{root}: expected train/ and test/ folders")
            for name in ("train", "test"):
                samples, classes = list_imagefolder(os.path.join(root, name))
                paths = [path for path, _ in samples]
                where = os.path.join(root, name)
                splits.append((name, where, paths, paths, [y for _, y in samples], classes))
    except ListingError as e:
        raise DataError(str(e)) from e
    split = _decode_splits(splits)
    (x_tr, y_tr, classes), (x_te, y_te, classes_te) = split["train"], split["test"]
    if classes != classes_te:
        raise DataError(f"{root}: train/ and test/ have different classes ({classes} vs {classes_te})")
    if x_tr.shape[1:] != x_te.shape[1:]:
        raise DataError(f"{root}: train images are {tuple(x_tr.shape[1:])}, test images {tuple(x_te.shape[1:])}")
    return ImageSet(x_tr, y_tr, x_te, y_te, classes)


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "distlib")


def load_image_set(root: str, *, download: bool = False, cache_dir: str = "") -> ImageSet:
    """Decode the data set at ``root`` (or read it from the cache) into uint8 tensors.

    JPEGs are decoded by PIL on every core the first time. (nvJPEG on the GPU was measured on
    an H200 with 16 cores: 10.8 s against 4.3 s, and its pixels differ from PIL's by 4 levels on
    average, so the decode stays on the CPU.) The cache is memory-mapped, so reading it costs next
    to nothing until the pixels are used.
    Raises DataError with what was expected and how to fix it when ``root`` holds no
    usable data.
    """
    layout = _layout(root)
    if layout == "missing" and not download:
        raise DataError(
            f"no data set at data.root={root!r}: expected {root}/{_CIFAR_DIR} (torchvision's CIFAR-10), "
            f"{root}/train and {root}/test (an ImageFolder), or a .tar.gz of such an ImageFolder. "
            "Offline: point data.root at a local copy; online: add data.download=true to let "
            "torchvision fetch CIFAR-10 into that folder"
        )
    cache_dir = cache_dir or default_cache_dir()
    cache = os.path.join(cache_dir, f"images-{_signature(root, layout)}.pt") if layout != "missing" else ""
    t0 = time.perf_counter()
    if cache and os.path.exists(cache):
        try:
            d = torch.load(cache, weights_only=True, mmap=True)
            images = ImageSet(d["x_train"], d["y_train"], d["x_test"], d["y_test"], list(d["classes"]), "cache")
            images.timings["cache_read_s"] = time.perf_counter() - t0
            return images
        except Exception:  # a truncated or foreign cache file: decode again
            pass
    try:
        images = _decode(root, layout, download)
        images.timings["decode_s"] = time.perf_counter() - t0
    except (OSError, tarfile.TarError) as e:
        raise DataError(f"data.root={root!r}: could not read the data set: {e}") from e
    if not cache:
        cache = os.path.join(cache_dir, f"images-{_signature(root, _layout(root))}.pt")
    os.makedirs(cache_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix="tmp-images-", suffix=".pt")
    os.close(fd)
    torch.save(
        {
            "x_train": images.x_train,
            "y_train": images.y_train,
            "x_test": images.x_test,
            "y_test": images.y_test,
            "classes": images.classes,
        },
        tmp,
    )
    os.replace(tmp, cache)  # atomic: concurrent readers see the old file or the whole new one
    images.timings["cache_write_s"] = time.perf_counter() - t0 - images.timings["decode_s"]
    return images
