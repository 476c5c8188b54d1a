"""Weights in a Hugging Face folder: ``model.safetensors``, or shards named by
``model.safetensors.index.json`` (``weight_map``: tensor name -> file).

``read_into`` copies them into a module whose parameters are whole or sharded (FSDP2's DTensors):
each rank reads, with ``safe_open`` and ``get_slice``, only the rows its shards hold, so no rank
ever holds the whole state dict. Tensor names are the module's own state-dict names; a parameter
shared by several names (tied embeddings) is read once, under whichever name the files have.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from distlib import DistlibError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


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


def _data_offsets(path: str) -> dict[str, tuple[int, int]]:
    """Each tensor's byte range in a safetensors file (after its 8-byte length and JSON header)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    base = 8 + n
    return {k: (base + v["data_offsets"][0], base + v["data_offsets"][1]) for k, v in header.items()
            if k != "__metadata__"}  # fmt: skip


def _read_ahead(path: str, ranges: list[tuple[int, int]]) -> None:
    """Ask the kernel to read ``ranges`` of ``path`` into the page cache now, in the background: the
    reads from the memory map then find their pages there instead of faulting them in one by one
    (half the disk's speed). Where posix_fadvise is missing, the reads fault them in as before."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        for start, end in ranges:
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


@torch.no_grad()
def read_into(module: nn.Module, directory: str) -> int:
    """Copy the folder's tensors into ``module``'s parameters and persistent buffers (cast to their
    dtype), each rank reading only the rows of its shards. Raises SafetensorsError naming the
    tensors that are missing, left over or of another shape. Returns the bytes this rank read."""
    import safetensors

    files = weight_files(directory)
    plan: dict[str, list[tuple[str, torch.Tensor]]] = {}  # file -> (name in it, the tensor to fill)
    missing, used = [], set()
    for aliases, t in _targets(module):
        found = next((n for n in aliases if n in files), None)
        if found is None:
            missing.append(aliases[0])
            continue
        used.update(a for a in aliases if a in files)
        plan.setdefault(files[found], []).append((found, t))
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
    for path, entries in plan.items():
        offsets = _data_offsets(path)
        entries.sort(key=lambda e: offsets.get(e[0], (0, 0))[0])  # in file order: one sequential read
        _read_ahead(path, [offsets[n] for n, _ in entries if n in offsets])
        with safetensors.safe_open(path, framework="pt", device="cpu") as f:
            for name, t in entries:
                part = f.get_slice(name)
                shape = tuple(part.get_shape())
                if shape != tuple(t.shape):
                    raise SafetensorsError(f"{path}: {name} has shape {list(shape)}, the model's is {list(t.shape)}")
                local, index = _local_part(t)
                if local.numel() == 0:
                    continue  # a rank past the last row of a short tensor
                rows = part[index]
                read += rows.numel() * rows.element_size()
                local.copy_(rows.view(local.shape))
    return read


__all__ = ["INDEX", "SINGLE", "SafetensorsError", "read_into", "weight_files"]
