"""Reading a file's bytes at an offset straight into memory the caller owns (``os.preadv``: no
bytes object in between, the file position untouched, so threads can share one descriptor)."""

from __future__ import annotations

import os


def read_exactly(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` with the bytes of ``fd`` from ``offset`` on. Raises EOFError (saying where) when
    the file ends first. Where there is no ``preadv`` (macOS before 11), through a bytes object."""
    done = 0
    while done < len(view):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [view[done:]], offset + done)
        else:
            data = os.pread(fd, min(len(view) - done, 1 << 30), offset + done)
            view[done : done + len(data)] = data
            n = len(data)
        if n == 0:
            raise EOFError(f"ends at byte {offset + done}, before byte {offset + len(view)}")
        done += n
