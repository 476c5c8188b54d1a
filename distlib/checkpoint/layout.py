"""The names in a sharded checkpoint directory, and how a checkpoint leaves its committed name.

``step000000042/`` is a committed checkpoint, ``.partial-step000000042/`` one being written,
``.deleting-step000000042-<id>/`` one being deleted. A committed checkpoint is deleted by renaming
it out of its committed name first (one atomic rename), then removing the files: a process killed
in the middle leaves a ``.deleting-`` directory, never half a checkpoint under a committed name.
Imported by the runner without torch.distributed.checkpoint. docs/reliability.md.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid

COMMITTED = re.compile(r"^step(\d{9})$")
PARTIAL = re.compile(r"^\.partial-step(\d{9})$")
DELETING = re.compile(r"^\.deleting-step\d{9}-[0-9a-f]{8}$")


def step_name(step: int) -> str:
    return f"step{step:09d}"


def fsync_dir(path: str) -> None:
    """``path``'s data (a file's contents, a directory's entries) on the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def discard(path: str) -> None:
    """Delete the checkpoint directory ``path`` so that no part of it keeps its name: renamed to a
    ``.deleting-`` name (fsynced), then removed. A crash in between leaves that directory, which
    ``leftovers`` lists for the next run to remove."""
    if not os.path.isdir(path):
        return
    parent, name = os.path.split(os.path.abspath(path))
    doomed = os.path.join(parent, f".deleting-{name.removeprefix('.partial-')}-{uuid.uuid4().hex[:8]}")
    os.replace(path, doomed)
    fsync_dir(parent)
    shutil.rmtree(doomed, ignore_errors=True)


def leftovers(directory: str) -> list[str]:
    """Directories of deletions that a crash interrupted (``discard``'s), in name order."""
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    return [os.path.join(directory, n) for n in names if DELETING.match(n)]
