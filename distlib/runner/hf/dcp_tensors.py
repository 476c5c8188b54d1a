"""The tensors of a torch.distributed.checkpoint (DCP) checkpoint, read in one process on the CPU
straight into memory the caller owns, a range of rows (the first dimension) at a time.

DCP's own reader (``dcp.load``) ``torch.load``\\ s each record into a tensor of its own and copies
that into the target: every byte lands twice, both times in freshly allocated memory, whose page
faults cost more than the copies. DCP's ``FileSystemWriter`` writes each tensor (each rank's chunk
of a sharded one) as a ``torch.save`` zip whose storage record is stored uncompressed. ``rows``
finds that record's bytes (from the zip's directory, and its pickle, which says the storage's dtype
and the tensor's shape and strides) and reads them with ``os.preadv`` into the caller's buffer,
which the caller reuses; threads can read at once (the reads release the GIL). A tensor stored any
other way (a storage transform, chunks that are not row ranges, a strided tensor, another writer's
record format) is read whole by ``dcp.load`` instead, with the same result.
"""

from __future__ import annotations

import collections
import ctypes
import io
import math
import os
import pickle
import struct
import sys
import threading
import warnings
import zipfile
from dataclasses import dataclass

import torch

from distlib import DistlibError
from distlib.runner.hf.dtypes import TORCH_STORAGES
from distlib.runner.hf.positional_reads import read_exactly

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip entry's local header: signature, ..., name and extra lengths


class CheckpointReadError(DistlibError, ValueError):
    """A checkpoint whose files do not hold what its metadata says (a truncated file)."""


@dataclass(frozen=True)
class _Chunk:
    row: int  # its first row in the tensor
    rows: int
    file: str
    offset: int  # of its record in the file
    length: int


def _described(storage, offset, size, stride, *_):  # torch._utils._rebuild_tensor_v2, without the data
    return storage, offset, tuple(size), tuple(stride)


class _TensorPickle(pickle.Unpickler):
    """The data.pkl of a torch.save'd tensor, read for its description only: anything else is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _described
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in TORCH_STORAGES:
            return TORCH_STORAGES[name]
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):  # ("storage", dtype, key, location, numel)
        return pid


class _Window:
    """The bytes ``[start, start + length)`` of a file descriptor as a seekable file (for zipfile),
    read with ``os.pread``: threads share the descriptor."""

    def __init__(self, fd: int, start: int, length: int):
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = max(0, min(self.length, offset + (0, self.pos, self.length)[whence]))
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, self.length - self.pos)
        data = os.pread(self.fd, n, self.start + self.pos)
        self.pos += len(data)
        return data


def _contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, s in zip(reversed(size), reversed(stride)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return len(size) == len(stride)


def _record_data(fd: int, offset: int, length: int, dtype: torch.dtype, size: tuple[int, ...]) -> int | None:
    """The file offset of the tensor bytes in the torch.save record at ``offset``, when the record is
    one contiguous tensor of ``dtype`` and ``size`` stored uncompressed in this machine's byte order;
    None otherwise."""
    try:
        with zipfile.ZipFile(_Window(fd, offset, length)) as z:  # type: ignore[arg-type]
            names = set(z.namelist())
            pkl = next(n for n in names if n == "data.pkl" or n.endswith("/data.pkl"))
            root = pkl[: -len("data.pkl")]
            if root + "byteorder" not in names or z.read(root + "byteorder") != sys.byteorder.encode():
                return None
            storage, storage_offset, shape, stride = _TensorPickle(io.BytesIO(z.read(pkl))).load()
            kind, storage_dtype, key, _, _ = storage
            if (kind, storage_dtype, storage_offset, shape) != ("storage", dtype, 0, size):
                return None
            if not _contiguous(shape, stride):
                return None
            info = z.getinfo(f"{root}data/{key}")
            nbytes = math.prod(size) * dtype.itemsize
            if info.compress_type != zipfile.ZIP_STORED or info.file_size < nbytes:
                return None
            head = os.pread(fd, _LOCAL_HEADER.size, offset + info.header_offset)
            signature, name_len, extra_len = _LOCAL_HEADER.unpack(head)
            start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            if signature != b"PK\x03\x04" or start + nbytes > length:
                return None
            return offset + start
    except (zipfile.BadZipFile, pickle.UnpicklingError, StopIteration, KeyError, ValueError, TypeError, EOFError,
            IndexError, AttributeError, struct.error):  # fmt: skip
        return None


def bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable (what os.preadv reads into)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("bytes_of: a contiguous CPU tensor")
    return memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")


class CheckpointTensors:
    """The tensors whose names start with ``prefix`` in the DCP checkpoint directory ``path``.

    ``shapes``: name -> (shape, dtype) of each whole tensor. ``rows(name, start, stop, out)``
    reads rows ``[start, stop)`` into the front of ``out`` (a flat uint8 tensor of at least their
    bytes) and returns them as a tensor viewing it; ``splittable(name)`` says whether a part of the
    rows reads only their bytes (otherwise the whole tensor is read each time). Threads may call
    ``rows`` at once. ``close()`` (or the ``with`` block) closes the files.
    """

    def __init__(self, path: str, prefix: str = ""):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        metadata = dcp.FileSystemReader(path).read_metadata()
        tensors = {k: m for k, m in metadata.state_dict_metadata.items()
                   if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}  # fmt: skip
        self.shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            k: (tuple(m.size), m.properties.dtype) for k, m in tensors.items()
        }
        records: dict[tuple[str, tuple[int, ...]], object] = {}
        for index, info in (metadata.storage_data or {}).items():
            if index.fqn in tensors and index.offset is not None:
                records[(index.fqn, tuple(index.offset))] = info
        self._chunks = {k: self._row_chunks(k, m.chunks, records) for k, m in tensors.items()}
        self._data: dict[_Chunk, int | None] = {}  # each chunk's tensor bytes in its file, once found
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()

    def _row_chunks(self, name: str, chunks, records) -> list[_Chunk] | None:
        """The chunks of ``name`` as row ranges, in row order, covering every row once; None when its
        layout is another (read by dcp.load)."""
        shape = self.shapes[name][0]
        out = []
        for c in chunks:
            offsets, sizes = tuple(c.offsets), tuple(c.sizes)
            info = records.get((name, offsets))
            if info is None or getattr(info, "transform_descriptors", None):
                return None
            if offsets[1:] != (0,) * (len(shape) - 1) or sizes[1:] != shape[1:]:
                return None
            row, rows = (offsets[0], sizes[0]) if shape else (0, 1)
            out.append(_Chunk(row, rows, os.path.join(self.path, info.relative_path), info.offset, info.length))
        out.sort(key=lambda c: c.row)
        row = 0
        for c in out:
            if c.row != row:
                return None
            row += c.rows
        return out if row == (shape[0] if shape else 1) else None

    def __enter__(self) -> CheckpointTensors:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def splittable(self, name: str) -> bool:
        return self._chunks[name] is not None and len(self.shapes[name][0]) > 0

    def _fd(self, file: str) -> int:
        with self._lock:
            if file not in self._fds:
                self._fds[file] = os.open(file, os.O_RDONLY)
            return self._fds[file]

    def _data_offset(self, name: str, chunk: _Chunk) -> int | None:
        with self._lock:
            if chunk in self._data:
                return self._data[chunk]
        shape, dtype = self.shapes[name]
        size = (chunk.rows, *shape[1:]) if shape else ()
        found = _record_data(self._fd(chunk.file), chunk.offset, chunk.length, dtype, size)
        with self._lock:
            self._data[chunk] = found
        return found

    def rows(self, name: str, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        shape, dtype = self.shapes[name]
        whole = shape[0] if shape else 1
        if not 0 <= start <= stop <= whole:
            raise ValueError(f"{name}: rows [{start}, {stop}) of {whole}")
        part = (stop - start, *shape[1:]) if shape else ()
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        nbytes = math.prod(part) * dtype.itemsize
        if out.dtype != torch.uint8 or out.numel() < nbytes:
            raise ValueError(f"{name}: out holds {out.numel()} bytes, {nbytes} needed (a flat uint8 tensor)")
        result = out[:nbytes].view(dtype).view(part)
        if nbytes == 0:
            return result
        chunks = self._chunks[name]
        pieces = []
        for c in chunks or ():
            lo, hi = max(start, c.row), min(stop, c.row + c.rows)
            if lo < hi:
                data = self._data_offset(name, c)
                if data is None:
                    chunks = None
                    break
                pieces.append(
                    (c.file, data + (lo - c.row) * row_bytes, (lo - start) * row_bytes, (hi - lo) * row_bytes)
                )
        if chunks is None:  # read whole by DCP, into out when these are all the rows
            if (start, stop) == (0, whole):
                self._load(name, result)
            else:
                full = torch.empty(shape, dtype=dtype, device="cpu")
                self._load(name, full)
                result.copy_(full[start:stop])
            return result
        view = bytes_of(out)
        for file, at, into, n in pieces:
            self._read(file, at, view[into : into + n])
        return result

    def _read(self, file: str, offset: int, view: memoryview) -> None:
        try:
            read_exactly(self._fd(file), view, offset)
        except EOFError as e:
            raise CheckpointReadError(f"{file} {e}: its metadata says it holds more (a truncated or overwritten "
                                      "checkpoint)") from e  # fmt: skip

    def _load(self, name: str, into: torch.Tensor) -> None:
        import torch.distributed.checkpoint as dcp

        # one at a time: catch_warnings changes the process's filters (that DCP reads in one
        # process is what is meant)
        with self._load_lock, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({name: into}, storage_reader=dcp.FileSystemReader(self.path), no_dist=True)

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``, in memory of its own."""
        shape, dtype = self.shapes[name]
        out = torch.empty(math.prod(shape) * dtype.itemsize, dtype=torch.uint8, device="cpu")
        return self.rows(name, 0, shape[0] if shape else 1, out)
