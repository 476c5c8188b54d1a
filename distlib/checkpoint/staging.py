"""Host memory that asynchronous checkpoint saves stage into: page-locked in place.

A copy from the GPU runs asynchronously, at the link's full speed (about 55 GB/s on an H200), only
into page-locked (pinned) host memory. torch's ``Tensor.pin_memory()`` copies into a new block of
its caching host allocator, rounded up to a power of two (a 41 MB tensor takes 64 MB), after a
pageable copy first. ``pin_in_place`` instead registers each tensor's own memory, at its exact size
(``cudaHostRegister``), several tensors at a time: the driver's page-locking of fresh pages is what
costs (about 3 GB/s per thread), and it is paid once, by the first save, since the checkpointers
keep their staging between saves.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

_THREADS = 8  # page-locking 17.7 GiB took 6.5 s with 8 threads on an H200's host


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def pin_in_place(tensors: Iterable[torch.Tensor]) -> None:
    """Page-lock the memory of each CPU tensor (each must own its storage whole), until it is freed.
    A no-op without CUDA. Raises RuntimeError naming the CUDA error when the driver refuses."""
    if not torch.cuda.is_available():
        return
    unique = {t.untyped_storage().data_ptr(): t for t in tensors if t.untyped_storage().nbytes()}
    cudart = torch.cuda.cudart()

    def pin(item: tuple[int, torch.Tensor]) -> None:
        ptr, t = item
        error = cudart.cudaHostRegister(ptr, t.untyped_storage().nbytes(), 0)
        if int(error) != 0:
            raise RuntimeError(f"cudaHostRegister of {t.untyped_storage().nbytes()} bytes failed: {error}")
        weakref.finalize(t, _unregister, ptr)  # before its memory goes back to the allocator

    with ThreadPoolExecutor(min(_THREADS, max(1, len(unique)))) as pool:
        list(pool.map(pin, unique.items()))


def pinned_empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``shape`` and ``dtype`` in page-locked memory of its exact size (plain memory without CUDA)."""
    t = torch.empty(shape, dtype=dtype)
    pin_in_place([t])
    return t
