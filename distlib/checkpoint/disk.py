"""A full disk: how a write that found no room is recognised, the one line that says so, and writes
that leave nothing torn behind when it happens.

``ENOSPC`` (no space left on the device) and ``EDQUOT`` (the user's quota spent) end a write the same
way. They reach the caller as an ``OSError``, as the cause or context of another error, inside DCP's
``CheckpointException`` (its ``failures``: rank -> (exception, traceback)), or only as text (an error
torch's C++ writer raised from the Python one's); ``is_disk_full`` finds them in each. ``DiskFull`` is
the ``CheckpointError`` (so a ``DistlibError``: one ``error:`` line, exit 2 under the runner) that names
the directory, what was being written, what it needs and what is free (``shutil.disk_usage``).

``write_file`` (a temporary file, then a rename) and ``append_line`` (one line whole or not at all)
are the writes that a full disk must not leave half done: the temporary file is removed, the line
truncated back. docs/reliability.md ("A full disk").
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator

from distlib.checkpoint.state import CheckpointError

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# the text of each, as an error that carries only its message says it ("No space left on device", ...)
_TEXTS = tuple(os.strerror(n) for n in sorted(DISK_FULL_ERRNOS))


def is_disk_full(e: BaseException | None) -> bool:
    """Whether ``e``, or an error it was raised from or wraps, is a write that found the disk (or the
    quota) full."""
    seen: set[int] = set()
    stack: list[object] = [e]
    while stack:
        x = stack.pop()
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in DISK_FULL_ERRNOS:
            return True
        if any(text in str(x) for text in _TEXTS):
            return True
        stack += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)  # DCP's CheckpointException: rank -> (exception, traceback)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
    return False


def free_bytes(path: str) -> int | None:
    """The bytes free to this user on the file system of ``path`` (its nearest existing parent); None
    when it cannot be asked."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def size(n: int) -> str:
    """``n`` bytes in the unit that reads best (GiB, MiB, KiB)."""
    for unit, div in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def describe(directory: str, what: str, need: int | None = None, note: str = "") -> str:
    """The line of a full disk: where, what, how much it needs against what is free now, ``note``."""
    free = free_bytes(directory)
    needs = f" needs about {size(need)}," if need else ","
    has = f" {size(free)} free there" if free is not None else " no room"
    return (f"the disk is full: writing {what} into {os.path.abspath(directory)}{needs}{has}{note}; "
            "free space on that disk, or write to another")  # fmt: skip


def describe_error(e: BaseException) -> str:
    """The line of a disk-full error ``e`` that no writer named: the file of its ``OSError`` when it has one."""
    stack: list[object] = [e]
    while stack:
        x = stack.pop()
        if isinstance(x, OSError) and x.errno in DISK_FULL_ERRNOS and x.filename:
            path = os.fsdecode(x.filename)
            return describe(os.path.dirname(path) or ".", os.path.basename(path))
        if isinstance(x, BaseException):
            stack += [c for c in (x.__cause__, x.__context__) if c is not None and c is not x]
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    return f"the disk is full ({type(e).__name__}: {first}); free space on that disk, or write to another"


class DiskFull(CheckpointError):
    """A write that found the disk full: the directory, what was written, what it needs and what is free."""

    def __init__(self, directory: str, what: str, need: int | None = None, note: str = "", *,
                 message: str | None = None):  # fmt: skip
        """``message``: the line as another rank worded it (the same on every rank), else ``describe``'s."""
        self.directory, self.what, self.need = directory, what, need
        super().__init__(message or describe(directory, what, need, note))


@contextlib.contextmanager
def writing(directory: str, what: str, need: int | None = None) -> Iterator[None]:
    """Raise ``DiskFull`` in place of a disk-full error of the writes inside (other errors pass)."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as e:
        if is_disk_full(e):
            raise DiskFull(directory, what, need) from e
        raise


def write_file(path: str, data: str | bytes, what: str | None = None) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it and a rename: a reader sees the
    old file or the whole new one. On a full disk the temporary file is removed (it would hold what
    space it took) and ``DiskFull`` names ``what`` (the file's name by default)."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    payload = data.encode() if isinstance(data, str) else data
    with writing(directory, what or os.path.basename(path), len(payload)):
        try:
            with open(tmp, "wb") as f:
                f.write(payload)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def append_line(path: str, line: str, *, fsync: bool = True, what: str | None = None) -> None:
    """Append ``line`` (a newline added) to ``path`` whole or not at all: the bytes go in with
    ``os.write`` on an ``O_APPEND`` descriptor, and a write that stops short (a full disk) is truncated
    back to where the file ended, so a reader never finds a torn line. Raises ``DiskFull``."""
    payload = (line + "\n").encode()
    with writing(os.path.dirname(path) or ".", what or os.path.basename(path), len(payload)):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.fstat(fd).st_size
            try:
                done = 0
                while done < len(payload):  # a short write (the disk filled up) raises at the next one
                    done += os.write(fd, payload[done:])
                if fsync:
                    os.fsync(fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, end)
                raise
        finally:
            os.close(fd)
