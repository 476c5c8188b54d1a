"""Checksums of checkpoint files, and their verification before a checkpoint is trusted.

Both checkpointers write tensors and other values with torch.save, whose zip writer computes the
CRC-32 of every record as it writes (torch.load does not check them: ``zip_intact`` does). What
is not a torch.save zip is checksummed as a whole: DCP's ``.metadata`` (a plain pickle) and a
sharded checkpoint's own ``commit.json`` (``seal``/``unseal``: a CRC-32 of its other contents).
Format version 1 of either checkpointer hashed with sha256 instead (``payload_sha256``,
``file_sha256``): still read and checked. docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
import zlib
from collections.abc import Mapping
from typing import Any, BinaryIO

import torch

_SEAL = "crc32"  # the key of ``seal``'s checksum in a JSON marker


def crc32_on() -> bool:
    """Whether torch.save writes each record's CRC-32 (``torch.serialization.set_crc32_options``; on by default)."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    return bool(get()) if get is not None else True


def zip_intact(source: str | bytes | BinaryIO) -> bool:
    """Every record of a torch.save zip (a path, its bytes, or an open file) matches its CRC-32."""
    if isinstance(source, (bytes, bytearray)):
        source = io.BytesIO(source)
    try:
        with zipfile.ZipFile(source) as z:
            return z.testzip() is None
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error, ValueError):
        return False


def records_intact(path: str, items: list[tuple[int, int]]) -> bool:
    """Every torch.save record of a file that holds several end to end (a DCP shard file; ``items``:
    the offset and length of each) matches its CRC-32s."""
    with open(path, "rb") as f:
        for offset, length in items:
            f.seek(offset)
            if not zip_intact(f.read(length)):
                return False
    return True


def file_crc32(path: str) -> int:
    """The CRC-32 of a whole file (one read; for small files, such as DCP's ``.metadata``)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_sha256(path: str) -> str:
    """The sha256 of a whole file (a version 1 sharded checkpoint's record of each file)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):  # hashlib.file_digest is Python 3.11+
            h.update(chunk)
    return h.hexdigest()


def _canonical(marker: Mapping[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in marker.items() if k != _SEAL}, sort_keys=True).encode()


def seal(marker: Mapping[str, Any]) -> dict[str, Any]:
    """``marker`` (JSON-able) with the CRC-32 of its other contents: a changed byte of the file it is
    written to is then found by ``unseal`` even where the JSON still parses (a digit of a size)."""
    return {**marker, _SEAL: zlib.crc32(_canonical(marker))}


def unseal(marker: Mapping[str, Any]) -> bool:
    """Whether ``marker`` matches the CRC-32 ``seal`` gave it (True for a marker written without one)."""
    if _SEAL not in marker:
        return True
    return marker[_SEAL] == zlib.crc32(_canonical(marker))


def _digest(obj: Any, h: Any) -> None:
    """Feed a canonical encoding of ``obj`` (tensors, containers, scalars) into ``h``."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{list(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, Mapping):
        h.update(b"{")
        for k, v in obj.items():
            _digest(k, h)
            _digest(v, h)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _digest(v, h)
        h.update(b"]")
    else:
        h.update(f"{type(obj).__name__}:{obj!r};".encode())


def payload_sha256(payload: Mapping[str, Any]) -> str:
    """The sha256 of a version 1 one-file checkpoint's payload (all but its ``checksum`` key)."""
    h = hashlib.sha256()
    _digest({k: v for k, v in payload.items() if k != "checksum"}, h)
    return h.hexdigest()
