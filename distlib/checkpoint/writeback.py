"""Files whose pages go to the disk while they are written, not all at the fsync that follows.

A write returns once its bytes are in the page cache; the disk takes them later, when the kernel's
flusher wakes up or its dirty threshold (a tenth of the memory by default) is reached, or at the
fsync that a checkpoint's commit must wait for. A checkpoint of many GiB therefore writes at memory
speed and then waits at the fsync for the whole of it: the disk stays idle during the writes.

``start(fd, offset, length)`` asks Linux to write a range back now: ``posix_fadvise(POSIX_FADV_DONTNEED)``
starts the writeback of the range's dirty pages without waiting for it (Python's ``os`` has no
``sync_file_range``), and drops only pages that are clean already, so what was just written stays
cached for a read that follows. ``WritingBack`` is a buffered file that does this every ``every``
bytes it is given. Where ``posix_fadvise`` does not exist, both only write.
"""

from __future__ import annotations

import io
import os

# how much a file takes before its pages are handed to the disk: enough for one request queue to
# stay busy, small enough that the writeback starts within a fraction of a second
EVERY = 64 << 20
_ADVISE = hasattr(os, "posix_fadvise")


def start(fd: int, offset: int, length: int) -> None:
    """Start writing the bytes ``[offset, offset + length)`` of the open file ``fd`` to the disk,
    without waiting for them."""
    if _ADVISE and length > 0:
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:  # advice only: a file that takes none (a pipe: ESPIPE) is written all the same
            pass


class WritingBack(io.BufferedWriter):
    """A file opened for writing (``open(path, "wb")``'s kind) that starts the writeback of each
    ``every`` bytes as they are written; ``fsync`` then waits only for the last of them."""

    def __init__(self, path: str | os.PathLike, every: int | None = None) -> None:
        super().__init__(io.FileIO(path, "wb"))
        self.every = EVERY if every is None else every
        self._since = 0  # bytes given since the last writeback started
        self._started = 0  # the offset up to which writeback was started

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        n = super().write(data)
        self._since += n
        if self._since >= self.every:
            self.flush()  # the buffered bytes into the page cache first: only those can be written back
            end = self.tell()
            start(self.fileno(), self._started, end - self._started)
            self._started, self._since = end, 0
        return n
