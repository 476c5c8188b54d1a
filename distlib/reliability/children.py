"""Helper processes that handle the stop signals their own way.

A stop reaches every process of a job: Slurm signals each one of a job step, Kubernetes the
container's, a terminal's Ctrl-C the foreground process group, a test or an operator every
descendant of torchrun. A helper (the watchdog, an image decoding worker) must not die mid-import
with a KeyboardInterrupt traceback, which reads as a crash in the job's output. So it starts with
SIGINT and SIGTERM blocked (a thread's signal mask is kept across fork and exec) and unblocks them
once it has set its own handling: the watchdog ignores them, a decoding worker takes the default
action and ends without a word. A signal sent meanwhile waits for that moment.

Standard library only: the image decoding module, which runs in its workers without torch, imports it.
"""

from __future__ import annotations

import signal
import subprocess
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def spawn(cmd: list[str], **popen_kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **popen_kwargs)`` whose process starts with ``STOP_SIGNALS`` blocked. The
    child unblocks them after setting its handlers:
    ``signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGTERM, signal.SIGINT))``. A signal sent to
    this process while it starts the child is delivered once the call returns. Where there are no
    signal masks (not POSIX), a plain ``Popen``."""
    if not hasattr(signal, "pthread_sigmask"):
        return subprocess.Popen(cmd, **popen_kwargs)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # this thread's: the child inherits it
    try:
        return subprocess.Popen(cmd, **popen_kwargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
