"""A safetensors file written as its tensors are read: the header first (it needs only the names,
dtypes and shapes), then each group of tensors' bytes as soon as that group is read and cast, while
the next group is read in the background.

Why not ``safetensors.torch.save_file``: it needs every tensor in memory at once (the whole model,
cast), and writes only after all of them are read (older versions copy each to a bytes object
first): reading and writing follow each other. Here the host holds two groups of the source tensors
(the one cast and written, the one being read) and one group of written bytes; reading overlaps
casting and writing, and the kernel writes the file back to the disk as it goes.

The file is what ``save_file`` writes for the same tensors: an 8-byte little-endian header length,
the JSON header (``__metadata__`` first, then each tensor's dtype, shape and ``data_offsets``),
padded with spaces to a multiple of 8 bytes, then the tensors' bytes back to back, in the order
``save_file`` uses (the widest dtypes first, so each tensor starts aligned to its element size,
then by name).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from distlib.checkpoint import writeback
from distlib.runner.hf.dcp_tensors import bytes_of
from distlib.runner.hf.dtypes import SAFETENSORS_NAMES

ALIGN = 64  # bytes: where each part starts in a group's read buffer (any dtype views it)


@dataclass(frozen=True)
class Entry:
    """One tensor of the file: its name, shape, the dtype it is written in and the dtype it is read
    in (cast while writing). ``splittable``: its rows can be read a range at a time."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source_dtype: torch.dtype
    splittable: bool = False

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1


# reads rows [start, stop) of an entry into the front of a flat uint8 buffer (or from memory it
# already has), returning them as a contiguous tensor of its source dtype; called from threads
Read = Callable[[Entry, int, int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _Part:
    entry: Entry
    start: int  # rows
    stop: int
    at: int  # its bytes' offset in the file's data
    nbytes: int  # written
    source_nbytes: int  # read


def header(entries: Sequence[Entry], metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[int]]:
    """The header's bytes (length and JSON) and each entry's data offset, for ``entries`` in file
    order (see ``ordered``)."""
    fields: dict[str, object] = {}
    if metadata:
        fields["__metadata__"] = dict(metadata)
    offsets, at = [], 0
    for e in entries:
        if e.dtype not in SAFETENSORS_NAMES:
            raise ValueError(f"{e.name}: dtype {e.dtype} has no safetensors name")
        n = math.prod(e.shape) * e.dtype.itemsize
        fields[e.name] = {"dtype": SAFETENSORS_NAMES[e.dtype], "shape": list(e.shape), "data_offsets": [at, at + n]}
        offsets.append(at)
        at += n
    text = json.dumps(fields, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


def ordered(entries: Sequence[Entry]) -> list[Entry]:
    """``entries`` in save_file's order: the widest dtype first, then by name."""
    return sorted(entries, key=lambda e: (-e.dtype.itemsize, e.name))


def _groups(entries: Sequence[Entry], offsets: Sequence[int], group_bytes: int, part_bytes: int) -> list[list[_Part]]:
    """The file's data as groups of about ``group_bytes`` read bytes, each of parts (one read each) of
    at most ``part_bytes`` where an entry is splittable and of whole entries otherwise."""
    groups: list[list[_Part]] = []
    group: list[_Part] = []
    size = 0
    for e, at in zip(entries, offsets):
        row_source, row_out = e.row_numel() * e.source_dtype.itemsize, e.row_numel() * e.dtype.itemsize
        step = max(1, part_bytes // row_source) if e.splittable and row_source else max(e.rows, 1)
        for start in range(0, max(e.rows, 1), step):
            stop = min(start + step, e.rows)
            part = _Part(e, start, stop, at + start * row_out, (stop - start) * row_out, (stop - start) * row_source)
            if group and size + part.source_nbytes > group_bytes:
                groups.append(group)
                group, size = [], 0
            group.append(part)
            size += part.source_nbytes
    if group:
        groups.append(group)
    return groups


def _placed(group: Sequence[_Part]) -> tuple[list[int], int]:
    """Each part's offset in the group's read buffer (aligned), and the bytes the buffer needs."""
    places, at = [], 0
    for p in group:
        places.append(at)
        at += -(-p.source_nbytes // ALIGN) * ALIGN
    return places, at


def _write_all(fd: int, views: list[memoryview], offset: int) -> None:
    views = [v for v in views if len(v)]
    while views:
        batch = views[:512]  # well under IOV_MAX
        n = os.pwritev(fd, batch, offset)
        offset += n
        while n and views:
            if n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0


def write(
    path: str,
    entries: Sequence[Entry],
    read: Read,
    *,
    metadata: Mapping[str, str] | None = None,
    group_bytes: int = 128 << 20,
    part_bytes: int = 8 << 20,
    threads: int = 8,
) -> int:
    """Write ``entries`` into the safetensors file ``path`` (through ``path + ".tmp"``, fsynced, then
    renamed into place), reading each with ``read`` in ``threads`` threads, a group of about
    ``group_bytes`` of source bytes ahead of the one being cast and written. Returns the file's bytes."""
    entries = ordered(entries)
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"tensor names repeat: {sorted(n for n in set(names) if names.count(n) > 1)}")
    head, offsets = header(entries, metadata)
    groups = _groups(entries, offsets, group_bytes, part_bytes)
    buffers = [torch.empty(0, dtype=torch.uint8, device="cpu")] * 2  # reused: no new pages per group
    cast = torch.empty(max((sum(p.nbytes for p in g) for g in groups), default=0), dtype=torch.uint8, device="cpu")
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="safetensors-read")

    def submit(i: int) -> list[Future]:
        places, need = _placed(groups[i])
        if buffers[i % 2].numel() < need:
            buffers[i % 2] = torch.empty(need, dtype=torch.uint8, device="cpu")
        buf = buffers[i % 2]
        return [pool.submit(read, p.entry, p.start, p.stop, buf[at:]) for p, at in zip(groups[i], places)]

    try:
        _write_all(fd, [memoryview(head)], 0)
        pending = submit(0) if groups else []
        for i, group in enumerate(groups):
            tensors = [f.result() for f in pending]
            pending = submit(i + 1) if i + 1 < len(groups) else []  # read while this one is cast and written
            first, views, keep = group[0].at, [], []
            for p, t in zip(group, tensors):
                e = p.entry
                want = (p.stop - p.start, *e.shape[1:]) if e.shape else ()
                if tuple(t.shape) != want or t.dtype != e.source_dtype:
                    raise ValueError(
                        f"{e.name}: read gave {tuple(t.shape)} {t.dtype}, expected {want} {e.source_dtype}"
                    )
                if t.dtype == e.dtype:  # written as read
                    t = t.contiguous()
                else:
                    t = cast[p.at - first : p.at - first + p.nbytes].view(e.dtype).view(want).copy_(t)
                keep.append(t)  # the views below do not hold their tensors
                views.append(bytes_of(t))
            _write_all(fd, views, len(head) + first)
            # these pages to the disk now (writeback.py): it writes while the next groups are read, not all
            # at the fsync, nor once the kernel's dirty threshold (a tenth of the memory) is reached
            writeback.start(fd, len(head) + first, sum(p.nbytes for p in group))
        os.fsync(fd)
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        os.close(fd)
        os.remove(tmp)
        raise
    pool.shutdown(wait=True)
    os.close(fd)
    os.replace(tmp, path)
    return len(head) + sum(math.prod(e.shape) * e.dtype.itemsize for e in entries)
