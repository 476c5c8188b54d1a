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
from dataclasses import dataclass

import torch

from distlib.errors import DistlibError


class DataError(DistlibError, RuntimeError):
    """The data set is missing, unreadable or inconsistent."""


@dataclass
class ImageSet:
    """uint8 images (N, C, H, W) and int64 labels (N) for both splits."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: list[str]


_CIFAR_DIR = "cifar-10-batches-py"


def _layout(root: str) -> str:
    if root.endswith((".tar.gz", ".tgz", ".tar")) and os.path.isfile(root):
        return "archive"
    if os.path.isdir(os.path.join(root, _CIFAR_DIR)):
        return "cifar10"
    if os.path.isdir(os.path.join(root, "train")) and os.path.isdir(os.path.join(root, "test")):
        return "imagefolder"
    return "missing"


def _signature(root: str, layout: str) -> str:
    """A cache key that changes when the data on disk changes."""
    h = hashlib.sha256(os.path.abspath(root).encode())
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


def _read_image(path: str) -> torch.Tensor | str:
    """An RGB uint8 CHW tensor, or the reason the file cannot be decoded (an exception
    raised in a DataLoader worker would reach us wrapped in its traceback text)."""
    from PIL import Image
    from torchvision.transforms.functional import pil_to_tensor

    try:
        with Image.open(path) as im:
            return pil_to_tensor(im.convert("RGB"))
    except Exception as e:  # PIL raises several types for truncated or foreign files
        return f"{type(e).__name__}: {e}"


def _collate(batch: list[tuple[torch.Tensor | str, int]]) -> tuple[torch.Tensor | None, torch.Tensor, list]:
    """Stack a batch; when that is impossible, return the problems (position, text) instead."""
    labels = torch.tensor([y for _, y in batch], dtype=torch.long)
    problems = [(i, x) for i, (x, _) in enumerate(batch) if isinstance(x, str)]
    if not problems:
        first = batch[0][0].shape
        problems = [(i, f"image is {tuple(x.shape)} (C, H, W), others are {tuple(first)}")
                    for i, (x, _) in enumerate(batch) if x.shape != first]  # fmt: skip
    if problems:
        return None, labels, problems
    return torch.stack([x for x, _ in batch]), labels, []


def _decode_imagefolder(path: str) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    from torchvision.datasets import ImageFolder

    ds = ImageFolder(path, loader=_read_image)
    if len(ds) == 0:
        raise DataError(f"{path}: no images found")
    workers = min(16, os.cpu_count() or 1)
    batch_size = 500
    loader = torch.utils.data.DataLoader(
        ds, batch_size=batch_size, num_workers=workers if workers > 1 else 0, collate_fn=_collate
    )  # fmt: skip
    xs, ys = [], []
    for b, (x, y, problems) in enumerate(loader):
        if not problems and xs and x.shape[1:] != xs[0].shape[1:]:
            problems = [(0, f"image is {tuple(x.shape[1:])} (C, H, W), {ds.samples[0][0]} is {tuple(xs[0].shape[1:])}")]
        if problems:
            i, text = problems[0]
            more = f" (and {len(problems) - 1} more in the same batch)" if len(problems) > 1 else ""
            raise DataError(
                f"{ds.samples[b * batch_size + i][0]}: corrupt or unusable image: {text}{more}; "
                "delete or replace the file"
            )
        xs.append(x)
        ys.append(y)
    return torch.cat(xs), torch.cat(ys), list(ds.classes)


def _decode(root: str, layout: str, download: bool, scratch: str) -> ImageSet:
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
    if layout == "archive":
        with tarfile.open(root) as tf:
            tf.extractall(scratch, filter="data")
        inner = scratch
        entries = [e for e in os.listdir(scratch) if not e.startswith(".")]
        if "train" not in entries and len(entries) == 1:
            inner = os.path.join(scratch, entries[0])
        root = inner
    if not (os.path.isdir(os.path.join(root, "train")) and os.path.isdir(os.path.join(root, "test"))):
        raise DataError(f"{root}: expected train/ and test/ folders")
    x_tr, y_tr, classes = _decode_imagefolder(os.path.join(root, "train"))
    x_te, y_te, classes_te = _decode_imagefolder(os.path.join(root, "test"))
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

    Raises DataError with what was expected and how to fix it when ``root``
    holds no usable data.
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
    if cache and os.path.exists(cache):
        try:
            d = torch.load(cache, weights_only=True)
            return ImageSet(d["x_train"], d["y_train"], d["x_test"], d["y_test"], list(d["classes"]))
        except Exception:  # a truncated or foreign cache file: decode again
            pass
    with tempfile.TemporaryDirectory(prefix="distlib-data-") as scratch:
        try:
            images = _decode(root, layout, download, scratch)
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
    return images
