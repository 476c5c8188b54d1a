"""Weights in a Hugging Face folder: ``model.safetensors``, or shards named by
``model.safetensors.index.json`` (``weight_map``: tensor name -> file).

``read_into`` copies them into a module whose parameters are whole or sharded (FSDP2's DTensors),
each rank reading only the rows its shards hold, so no rank ever holds the whole state dict. Tensor
names are the module's own state-dict names or, for a transformers model, the names its family's
checkpoints carry, which transformers converts as ``from_pretrained`` does (hf/weight_names.py): a
renamed tensor is read like any other; tensors that transformers converts into one (a mixture of
experts' per-expert matrices, stacked) are read whole and converted by transformers' operations,
each rank keeping its part. A parameter shared by several names (tied embeddings) is read once,
under whichever name the files have.

How a folder is read: each file's JSON header gives every tensor's dtype, shape
and byte range, checked against the model (and the file's size) before anything is read. A whole
tensor, or a run of whole rows of dimension 0 (FSDP2's shard of it), is one range of bytes; the
ranges of a file are read in file order with large ``preadv`` calls (``PIECE`` bytes, adjacent
ranges in one call, a larger range in several split on element boundaries) into a ring of
``BUFFERS`` reusable host buffers (page-locked when the parameters are on a GPU). A background
thread does the reads (they release the GIL), asking the kernel for the next piece while it reads
one; the calling thread views each filled buffer as the file's dtype and copies it into the
flattened parameter (asynchronously to a GPU, cast to the parameter's dtype on the way). A buffer is
refilled only once its copies are done (a CUDA event per buffer). Any other part of a tensor (a
shard on another dimension) is read through ``safetensors.safe_open``'s ``get_slice``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from distlib import DistlibError
from distlib.runner.hf import weight_names
from distlib.runner.hf.dtypes import SAFETENSORS
from distlib.runner.hf.positional_reads import read_exactly

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PIECE = 64 << 20  # bytes of one read (a longer tensor is read in several)
BUFFERS = 3  # host buffers in the ring: one being read into while the others are copied out


class SafetensorsError(DistlibError, ValueError):
    """A folder whose weights cannot be read into the model: missing, unreadable, other names or shapes."""


def weight_files(directory: str) -> dict[str, str]:
    """Tensor name -> the file (path) that holds it."""
    index = os.path.join(directory, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SafetensorsError(f"{index}: unreadable ({type(e).__name__}: {e})") from e
        files = {name: os.path.join(directory, file) for name, file in weight_map.items()}
        absent = sorted({f for f in files.values() if not os.path.isfile(f)})
        if absent:
            raise SafetensorsError(f"{index} names files that are not there: {', '.join(absent[:4])}")
        return files
    single = os.path.join(directory, SINGLE)
    if os.path.isfile(single):
        import safetensors

        try:
            with safetensors.safe_open(single, framework="pt") as f:
                return dict.fromkeys(f.keys(), single)
        except Exception as e:  # a truncated or foreign file
            raise SafetensorsError(f"{single}: unreadable ({type(e).__name__}: {e})") from e
    raise SafetensorsError(f"{directory!r} has neither {SINGLE} nor {INDEX} (only safetensors weights are read)")


def _local_part(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The tensor this rank writes into and the part of the whole tensor it holds (whole for a
    plain tensor; for a DTensor sharded on a 1-D mesh, torch.chunk's rows of this rank)."""
    if not isinstance(t, DTensor):
        return t, tuple(slice(0, n) for n in t.shape)
    local = t.to_local()
    index = [slice(0, n) for n in t.shape]
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard) or index[placement.dim] != slice(0, t.shape[placement.dim]):
            raise SafetensorsError(f"cannot read into a DTensor placed as {t.placements} (one Shard per dimension "
                                   "or Replicate are read)")  # fmt: skip
        d, n = placement.dim, t.shape[placement.dim]
        chunk = math.ceil(n / t.device_mesh.size(mesh_dim))  # torch.chunk's, as FSDP2 shards
        start = min(n, t.device_mesh.get_local_rank(mesh_dim) * chunk)
        index[d] = slice(start, start + local.shape[d])
    return local, tuple(index)


def _targets(module: nn.Module) -> Iterator[tuple[list[str], torch.Tensor]]:
    """Each parameter and persistent buffer once, with every state-dict name it goes by."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    persistent = set(module.state_dict(keep_vars=True))
    for name, b in module.named_buffers(remove_duplicate=False):
        if name in persistent:
            names.setdefault(id(b), []).append(name)
            tensors[id(b)] = b
    for key, t in tensors.items():
        yield names[key], t


class _Stored(NamedTuple):
    """A tensor of a safetensors file as its header gives it: ``start`` and ``end`` in bytes from
    the start of the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def _data_offsets(path: str) -> dict[str, _Stored]:
    """Each tensor's dtype, shape and byte range in a safetensors file (after its 8-byte length and
    JSON header), the ranges checked against the file's size."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= size - 8:
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
        base = 8 + n
        stored = {}
        for name, v in header.items():
            if name == "__metadata__":
                continue
            begin, end = (int(b) for b in v["data_offsets"])
            if not 0 <= begin <= end <= size - base:
                raise ValueError(f"{name}: bytes {begin} to {end} of data that has {size - base}")
            stored[name] = _Stored(str(v["dtype"]), tuple(int(d) for d in v["shape"]), base + begin, base + end)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SafetensorsError(f"{path}: unreadable ({type(e).__name__}: {e})") from e
    return stored


class _Piece:
    """One read: ``nbytes`` from ``offset`` of the file into a buffer, and the parts of the buffer
    each going to a run of elements of a flattened target, as (offset in the buffer, bytes, the
    file's dtype, the target, its first element)."""

    def __init__(self, offset: int):
        self.offset, self.nbytes = offset, 0
        self.parts: list[tuple[int, int, torch.dtype, torch.Tensor, int]] = []


def _pieces(ranges: list[tuple[int, int, torch.dtype, torch.Tensor]], piece: int) -> list[_Piece]:
    """``ranges`` of a file (start, bytes, the file's dtype, the flattened target), in file order,
    as reads of at most ``piece`` bytes: adjacent ranges share a read, a longer one is split on its
    elements' boundaries; a part starts at a multiple of its element size in the buffer (to view
    it as its dtype)."""
    pieces: list[_Piece] = []
    for start, nbytes, dtype, target in ranges:
        size, done = dtype.itemsize, 0
        while done < nbytes:
            at = start + done
            last = pieces[-1] if pieces else None
            joined = last is not None and last.offset + last.nbytes == at and (at - last.offset) % size == 0
            if last is None or not joined or piece - last.nbytes < size:
                last = _Piece(at)
                pieces.append(last)
            take = min(nbytes - done, (piece - last.nbytes) // size * size)
            last.parts.append((at - last.offset, take, dtype, target, done // size))
            last.nbytes += take
            done += take
    return pieces


class _Buffer:
    """A reusable host buffer, with the CUDA events recorded after the copies out of it (it is
    refilled once they have passed)."""

    def __init__(self, nbytes: int, pinned: bool):
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.view = memoryview(self.tensor.numpy())
        self.events: list[torch.cuda.Event] = []

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()
        self.events = []


def _advise(f, advice: str, offset: int = 0, nbytes: int = 0) -> None:
    """A hint to the kernel's read-ahead, where there is posix_fadvise."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fileno(), offset, nbytes, getattr(os, advice))


def _reader(work: list[tuple[str, list[_Piece]]], free: queue.Queue, filled: queue.Queue,
            stop: threading.Event, device: torch.device | None) -> None:  # fmt: skip
    """The reading thread: each file's pieces in order, each into the next free buffer (once its
    copies are done), handed on through ``filled``; ``_DONE`` at the end, or the error."""
    path = ""
    try:
        with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
            for path, pieces in work:
                if not pieces:
                    continue  # nothing of this file on this rank
                with open(path, "rb", buffering=0) as f:
                    _advise(f, "POSIX_FADV_SEQUENTIAL")
                    _advise(f, "POSIX_FADV_WILLNEED", pieces[0].offset, pieces[0].nbytes)
                    for i, piece in enumerate(pieces):
                        if i + 1 < len(pieces):  # the disk busy with the next piece while this one is copied out
                            _advise(f, "POSIX_FADV_WILLNEED", pieces[i + 1].offset, pieces[i + 1].nbytes)
                        buffer = free.get()
                        if buffer is None or stop.is_set():
                            return
                        buffer.wait()
                        read_exactly(f.fileno(), buffer.view[: piece.nbytes], piece.offset)
                        filled.put((piece, buffer))
        filled.put(_DONE)
    except BaseException as e:  # the calling thread raises it
        error = SafetensorsError(f"{path}: unreadable ({type(e).__name__}: {e})")
        error.__cause__ = e
        filled.put(error)


_DONE = object()


def _read_pieces(work: list[tuple[str, list[_Piece]]]) -> None:
    """Read every piece of ``work`` (file, its pieces in file order) and copy it into its targets:
    the reads in a background thread, into ``BUFFERS`` buffers of the largest piece's size."""
    targets = [part[3] for _, pieces in work for p in pieces for part in p.parts]
    if not targets:
        return
    cuda = sorted({t.device for t in targets if t.device.type == "cuda"}, key=str)
    sizes = [p.nbytes for _, pieces in work for p in pieces]
    free: queue.Queue = queue.Queue()
    buffers = [_Buffer(max(sizes), pinned=bool(cuda)) for _ in range(min(BUFFERS, len(sizes)))]
    for b in buffers:
        free.put(b)
    filled: queue.Queue = queue.Queue()
    stop = threading.Event()
    thread = threading.Thread(target=_reader, args=(work, free, filled, stop, cuda[0] if cuda else None),
                              name="safetensors-reader", daemon=True)  # fmt: skip
    thread.start()
    try:
        while (item := filled.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            p, buffer = item
            devices = set()
            for offset, n, dtype, target, first in p.parts:
                src = buffer.tensor[offset : offset + n].view(dtype)
                dst = target[first : first + src.numel()]
                if dst.device.type == "cuda":
                    dst.copy_(src, non_blocking=True)  # from page-locked memory: queued, the buffer read later
                    devices.add(dst.device)
                else:
                    dst.copy_(src)
            for d in devices:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(d))
                buffer.events.append(event)
            free.put(buffer)
    finally:
        stop.set()
        free.put(None)
        thread.join()
        for b in buffers:  # every copy out of them done before they go
            b.wait()


def _row_range(stored: _Stored, local: torch.Tensor, index: tuple[slice, ...]) -> tuple[int, int] | None:
    """The bytes of the file that hold ``index`` of the tensor, when they are one run that the
    (contiguous) local tensor takes flat: the whole tensor, or whole rows of dimension 0; else None."""
    if not local.is_contiguous() or any(s != slice(0, n) for s, n in zip(index[1:], stored.shape[1:])):
        return None
    if not index:  # a 0-d tensor
        return stored.start, stored.end
    row = (stored.end - stored.start) // stored.shape[0]
    return stored.start + index[0].start * row, stored.start + index[0].stop * row


@torch.no_grad()
def read_into(module: nn.Module, directory: str) -> int:
    """Copy the folder's tensors into ``module``'s parameters and persistent buffers (cast to their
    dtype), each rank reading only the rows of its shards. Raises SafetensorsError naming the
    tensors that are missing, left over or of another shape. Returns the bytes this rank read."""
    files = weight_files(directory)
    names = weight_names.plan(module, files)
    targets = list(_targets(module))
    by_name = {n: t for aliases, t in targets for n in aliases}
    # what the conversions make: their first target and the others their patterns name
    converted = {c.target.replace(c.converter.target_patterns[0], p): c for c in names.conversions
                 for p in c.converter.target_patterns}  # fmt: skip
    plan: dict[str, list[tuple[str, torch.Tensor]]] = {}  # file -> (name in it, the tensor to fill)
    missing, used = [], {name for c in names.conversions for name, _ in c.sources}
    for aliases, t in targets:
        stored = [names.renamed[a] for a in aliases if a in names.renamed]
        if not stored:
            if not any(a in converted for a in aliases):
                missing.append(aliases[0])
            continue
        used.update(stored)
        plan.setdefault(files[stored[0]], []).append((stored[0], t))
    unexpected = sorted(set(files) - used)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:4])}{', ...' * (len(missing) > 4)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unknown to the model: {', '.join(unexpected[:4])}"
                         f"{', ...' * (len(unexpected) > 4)}")  # fmt: skip
        raise SafetensorsError(f"{directory}: the weights do not match the model built from its config.json "
                               f"({'; '.join(parts)})")  # fmt: skip
    read = 0
    work: list[tuple[str, list[_Piece]]] = []  # file -> its reads
    sliced: list[tuple[str, str, torch.Tensor, tuple[slice, ...]]] = []  # read through get_slice
    for path in sorted(plan):  # sharded files in their order, each from its start
        stored = _data_offsets(path)
        ranges = []
        for name, t in plan[path]:
            if name not in stored:
                raise SafetensorsError(f"{path}: has no tensor {name} (the index names this file for it)")
            s = stored[name]
            if s.shape != tuple(t.shape):
                raise SafetensorsError(f"{path}: {name} has shape {list(s.shape)}, the model's is {list(t.shape)}")
            dtype = SAFETENSORS.get(s.dtype)
            if dtype is None:
                raise SafetensorsError(f"{path}: {name} is stored as {s.dtype!r}, a dtype not read here (those "
                                       f"read: {', '.join(SAFETENSORS)})")  # fmt: skip
            if s.end - s.start != (nbytes := math.prod(s.shape) * dtype.itemsize):
                raise SafetensorsError(f"{path}: {name} takes {s.end - s.start} bytes, not the {nbytes} of "
                                       f"{list(s.shape)} {s.dtype}")  # fmt: skip
            local, index = _local_part(t)
            if local.numel() == 0:
                continue  # a rank past the last row of a short tensor
            span = _row_range(s, local, index)
            if span is None:
                sliced.append((path, name, local, index))
                continue
            ranges.append((span[0], span[1] - span[0], dtype, local.view(-1)))
            read += span[1] - span[0]
        ranges.sort(key=lambda r: r[0])  # in file order: one sequential read
        work.append((path, _pieces(ranges, PIECE)))
    _read_pieces(work)
    if sliced:
        import safetensors

        for path in dict.fromkeys(p for p, *_ in sliced):
            with safetensors.safe_open(path, framework="pt", device="cpu") as f:
                for _, name, local, index in (e for e in sliced if e[0] == path):
                    rows = f.get_slice(name)[index]
                    read += rows.numel() * rows.element_size()
                    local.copy_(rows.view(local.shape))
    if names.conversions:
        read += _read_converted(module, files, names.conversions, by_name)
    return read


def _read_converted(module: nn.Module, files: dict[str, str], conversions: list[weight_names.Conversion],
                    tensors: dict[str, torch.Tensor]) -> int:  # fmt: skip
    """The tensors transformers makes of several of the folder's (a mixture of experts' per-expert
    matrices stacked into one): each source read whole, converted by transformers' operations, and
    this rank's part of the result copied into its tensor. Returns the bytes read."""
    import safetensors

    read = 0
    with contextlib.ExitStack() as stack:
        opened: dict[str, Any] = {}

        def tensor(name: str) -> torch.Tensor:
            nonlocal read
            path = files[name]
            if path not in opened:
                opened[path] = stack.enter_context(safetensors.safe_open(path, framework="pt", device="cpu"))
            t = opened[path].get_tensor(name)
            read += t.numel() * t.element_size()
            return t

        for conversion in conversions:
            for name, whole in conversion.convert(module, tensor).items():
                t = tensors.get(name)
                if t is None:
                    raise SafetensorsError(f"transformers converts {conversion.sources[0][0]} and others into "
                                           f"{name}, which the model does not have")  # fmt: skip
                if tuple(whole.shape) != tuple(t.shape):
                    raise SafetensorsError(f"{name}: converted from {conversion.sources[0][0]} and others to shape "
                                           f"{list(whole.shape)}, the model's is {list(t.shape)}")  # fmt: skip
                local, index = _local_part(t)
                if local.numel():
                    local.copy_(whole[index])
    return read


__all__ = ["INDEX", "SINGLE", "SafetensorsError", "read_into", "weight_files"]
