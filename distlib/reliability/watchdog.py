"""A watchdog process that ends this rank when the rank stops running (SIGSTOP, a frozen host).

A heartbeat thread writes to a tiny child process through a pipe; when the heartbeats stop for
the deadline the child says which rank stalled and SIGKILLs it. docs/reliability.md.

This file also runs as the child: ``python -I -S watchdog.py FD PID DEADLINE RANK``,
with only the standard library.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time


def _process_state(pid: int) -> str:
    """The state letter and meaning from /proc (Linux), or '' elsewhere."""
    names = {"R": "running", "S": "sleeping", "D": "uninterruptible sleep", "T": "stopped", "t": "stopped by a tracer"}
    try:
        with open(f"/proc/{pid}/stat") as f:
            letter = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return f"{letter} ({names.get(letter, 'other')})"


def grace_s(timeout_s: float) -> float:
    """How long after ``timeout_s`` the watchdog acts: the peers' collectives time out
    first and report it, then the stalled rank is killed."""
    return min(5.0, max(1.0, 0.1 * timeout_s))


class Watchdog:
    """Kill this process if it stops running for ``timeout_s`` plus a short grace.

    ``timeout_s`` is the collective timeout (dist.timeout_s). Not a collective;
    start it once per rank, after ``distlib.init``. ``close()`` (or the process
    exiting) ends the child.
    """

    def __init__(self, timeout_s: float, rank: int, interval_s: float | None = None):
        deadline_s = timeout_s + grace_s(timeout_s)
        self.deadline_s = deadline_s
        self.interval_s = interval_s or max(0.05, min(1.0, deadline_s / 10))
        from distlib.reliability import children  # here: the child runs this file alone (python -I -S)

        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # a full pipe must never block the heartbeat
        cmd = [sys.executable, "-I", "-S", os.path.abspath(__file__)]
        cmd += [str(read_fd), str(os.getpid()), repr(float(deadline_s)), str(rank)]
        try:
            # the stop signals held back until the child ignores them (reliability/children.py)
            self._child = children.spawn(cmd, pass_fds=(read_fd,), stdin=subprocess.DEVNULL)
        finally:
            os.close(read_fd)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="distlib-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                os.write(self._write_fd, b".")
            except (BlockingIOError, InterruptedError):
                pass  # the child is behind; it only needs some bytes
            except OSError:
                return  # the child is gone
            self._stop.wait(self.interval_s)

    def close(self) -> None:
        """Stop the heartbeat and end the child (safe to call twice)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            os.close(self._write_fd)  # EOF: the child exits
        except OSError:
            pass
        try:
            self._child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()


def _child_main(argv: list[str]) -> int:
    read_fd, parent, deadline, rank = int(argv[0]), int(argv[1]), float(argv[2]), argv[3]
    # Ctrl-C and torchrun's SIGTERM are for the rank; this process leaves when the rank is gone. They
    # were blocked from its start (children.spawn): one sent meanwhile is dropped here, once ignored
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))
    last = time.monotonic()
    while True:
        ready, _, _ = select.select([read_fd], [], [], max(0.0, last + deadline - time.monotonic()))
        if os.getppid() != parent:
            return 0  # the rank is gone (we were re-parented)
        if ready:
            try:
                data = os.read(read_fd, 4096)
            except OSError:
                return 0
            if not data:
                return 0  # EOF: the rank exited or closed us
            last = time.monotonic()
            continue
        if time.monotonic() - last < deadline:
            continue
        state = _process_state(parent)
        # the line and its newline in one write, as distlib.log.write_line (this script imports no distlib)
        sys.stderr.write(
            f"[distlib watchdog] rank {rank} (pid {parent} on {socket.gethostname()}) has not run for "
            f"{deadline:.3g} s{'; process state ' + state if state else ''}: it stalled. "
            "Killing it with SIGKILL so that the job ends instead of hanging.\n"
        )
        sys.stderr.flush()
        try:
            os.kill(parent, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
