"""Decode many small image files at once, on every CPU core.

The CPU path runs PIL in worker processes started as plain interpreters that load only
this file (stdlib, PIL, numpy): no torch or torchvision import, and no fork of a process
that holds a CUDA context or communicator threads. Images travel to the workers as file
paths or as encoded bytes (members of a .tar.gz, never extracted to disk) and come back as
HWC uint8 arrays, or as the text of the reason one cannot be decoded.

The listing follows torchvision's ImageFolder exactly (same classes, same sample order) so
that labels and sample indices do not depend on how the images were decoded.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import subprocess
import sys
import tarfile

# torchvision.datasets.folder.IMG_EXTENSIONS
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class ListingError(ValueError):
    """A folder or archive does not hold the expected split/class/image layout."""


def list_imagefolder(root: str) -> tuple[list[tuple[str, int]], list[str]]:
    """(path, class index) of every image under ``root``/<class>/, and the classes: the
    order of torchvision's ``ImageFolder(root).samples`` and ``.classes``."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise ListingError(f"{root}: no class folders")
    samples = []
    for index, cls in enumerate(classes):
        found = [
            (os.path.join(dirpath, name), index)
            for dirpath, _, names in sorted(os.walk(os.path.join(root, cls), followlinks=True))
            for name in sorted(names)
            if name.lower().endswith(IMG_EXTENSIONS)
        ]
        if not found:
            raise ListingError(f"{os.path.join(root, cls)}: no images ({', '.join(IMG_EXTENSIONS)})")
        samples += found
    return samples, classes


def _ustar_files(data: bytes) -> list[tuple[str, bytes]] | None:
    """(name, content) of the regular files of an uncompressed tar in memory, reading the
    plain ustar/GNU headers directly (tarfile takes seconds for tens of thousands of small
    members); None when the archive uses anything else (long names, pax headers, ...)."""
    files = []
    pos, end = 0, len(data) - 512
    while pos <= end:
        header = data[pos : pos + 512]
        if header[:1] == b"\0":  # the zero blocks that end the archive
            break
        if header[257:262] != b"ustar":
            return None
        checksum = int(header[148:156].strip(b"\0 ") or b"-1", 8)
        if checksum != sum(header[:148]) + 256 + sum(header[156:]):  # the checksum field counts as spaces
            return None
        size = int(header[124:136].strip(b"\0 ") or b"0", 8)
        kind = header[156:157]
        if kind in (b"0", b"\0"):
            name = header[:100].split(b"\0", 1)[0]
            prefix = header[345:500].split(b"\0", 1)[0] if header[257:263] == b"ustar\0" else b""
            if prefix:
                name = prefix + b"/" + name
            files.append((name.decode("utf-8", "surrogateescape"), data[pos + 512 : pos + 512 + size]))
        elif kind != b"5":  # a directory is fine; links, long names, pax headers: let tarfile do it
            return None
        pos += 512 + (size + 511) // 512 * 512
    return files


def _tar_files(path: str) -> list[tuple[str, bytes]]:
    """(name, content) of the regular files of a tar or tar.gz."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    files = _ustar_files(data)
    if files is None:
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            files = [(m.name, data[m.offset_data : m.offset_data + m.size]) for m in tf if m.isfile()]
    return files


def read_archive(path: str) -> dict[str, tuple[list[tuple[str, bytes, int]], list[str]]]:
    """The images of a tar(.gz) that holds ``train/<class>/...`` and ``test/<class>/...``
    (possibly under one top folder), read into memory: split -> ([(name, bytes, class index)],
    classes), in ImageFolder's order."""
    members = [([p for p in name.split("/") if p not in ("", ".")], content) for name, content in _tar_files(path)]
    tops = {parts[0] for parts, _ in members}
    if len(tops) == 1 and not tops & {"train", "test"}:  # one top folder around train/ and test/
        members = [(parts[1:], data) for parts, data in members]
    out = {}
    for split in ("train", "test"):
        # (class, folder inside the class, file name): how ImageFolder walks and sorts
        entries = sorted(
            (parts[1], "/".join(parts[2:-1]), parts[-1], data)
            for parts, data in members
            if len(parts) >= 3 and parts[0] == split
        )
        classes = sorted({e[0] for e in entries})
        if not classes:
            raise ListingError(f"{path}: no {split}/<class>/<image> files")
        index = {c: i for i, c in enumerate(classes)}
        images = [
            ("/".join([split, cls, *([sub] if sub else []), name]), data, index[cls])
            for cls, sub, name, data in entries
            if name.lower().endswith(IMG_EXTENSIONS)
        ]
        empty = set(classes) - {name.split("/")[1] for name, _, _ in images}
        if empty:
            raise ListingError(f"{path}: no images in {split}/{sorted(empty)[0]}")
        out[split] = (images, classes)
    return out


def _decode_one(item: str | bytes):
    """HWC uint8 RGB array of a path or encoded bytes, or the reason it cannot be decoded."""
    import numpy as np
    from PIL import Image

    source = io.BytesIO(item) if isinstance(item, bytes) else item
    try:
        with Image.open(source) as im:
            return np.asarray(im.convert("RGB"))
    except Exception as e:  # PIL raises several types for truncated or foreign files
        text = str(e).replace(f" {source!r}", "")  # not the address of our in-memory buffer
        return f"{type(e).__name__}: {text}"


def _worker() -> None:
    """A worker process: a pickled list of items on stdin, the pickled list of results on stdout."""
    items = pickle.load(sys.stdin.buffer)
    pickle.dump([_decode_one(item) for item in items], sys.stdout.buffer, protocol=pickle.HIGHEST_PROTOCOL)
    sys.stdout.buffer.flush()


# SIGINT's default action first, then the stop signals unblocked (children.spawn started the worker with
# them blocked): a stop sent to every process of the job ends a worker without a KeyboardInterrupt
# traceback, whenever it comes; its parent, signalled too, says why the run ends
_WORKER_CODE = (
    "import signal; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM)); "
    "import importlib.util, sys; spec = importlib.util.spec_from_file_location('_image_decode', sys.argv[1]); "
    "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m._worker()"
)


def cpu_count() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def decode_cpu(items: list[str | bytes], workers: int = 0) -> list:
    """Decode paths or encoded images with PIL on ``workers`` processes (0: every core).

    Returns, in order, an HWC uint8 RGB numpy array per item, or a string saying why that
    item could not be decoded.
    """
    workers = min(workers or cpu_count(), max(1, len(items)))
    if workers == 1:
        return [_decode_one(item) for item in items]
    bounds = [len(items) * k // workers for k in range(workers + 1)]
    from distlib.reliability import children  # the parent's only: a worker loads this file alone

    procs = [
        children.spawn(
            [sys.executable, "-c", _WORKER_CODE, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )  # fmt: skip
        for _ in range(workers)
    ]
    try:
        # every worker reads its whole input before it writes: feeding them one after another cannot block
        for k, p in enumerate(procs):
            pickle.dump(items[bounds[k] : bounds[k + 1]], p.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            p.stdin.close()
        out = []
        for p in procs:
            out += pickle.load(p.stdout)
            if p.wait() != 0:
                raise RuntimeError(f"an image decoding worker exited with code {p.returncode}")
    except (EOFError, pickle.UnpicklingError) as e:
        raise RuntimeError(f"an image decoding worker died: {e}") from e
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out
