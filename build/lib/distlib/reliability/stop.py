"""SIGTERM and SIGINT stop every rank at the same step boundary.

A signal only sets a flag; ``check()`` all_reduces the flags over a separate gloo group, one step
behind, so every rank stops at the same step without a device sync. A run stopped this way exits
with 128 + the signal number. docs/reliability.md.
"""

from __future__ import annotations

import datetime
import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

from distlib.distributed import collectives


class StopSignal:
    """Catches ``signals`` and makes every rank agree when to stop.

    Building it is a collective when the world size is above 1 (it creates a
    gloo group): every rank must build it, in the same order. Every rank must
    call ``check()`` the same number of times.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT), timeout_s: float = 300.0):
        self.signum = 0  # the agreed signal once check() has returned True
        self._local = 0
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for s in signals:
                self._previous[s] = signal.signal(s, self._handle)
        self._work = None
        self._group = None
        self._flag = torch.zeros(1, dtype=torch.int32)
        if collectives.world_size() > 1:
            # gloo works on CPU tensors whatever the main backend, and keeps the flag off the GPU streams
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._local = signum
        # the next identical signal takes the default action: a stuck run can still be stopped at once
        previous = self._previous.pop(signum, signal.SIG_DFL)
        signal.signal(signum, previous)  # type: ignore[arg-type]

    @property
    def requested(self) -> bool:
        """Whether this rank got a signal (not yet agreed with the others)."""
        return self._local != 0

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def check(self) -> bool:
        """True when the ranks agreed to stop here. Every rank must call it at the same steps."""
        if self.signum:
            return True
        if self._group is None:
            self.signum = self._local
            return bool(self.signum)
        if self._work is not None:
            self._work.wait()
            self._work = None
            if int(self._flag.item()):
                self.signum = int(self._flag.item())
                return True
        self._flag.fill_(self._local)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return False

    def close(self) -> None:
        """Finish the pending reduction (every rank has one) and restore the signal handlers."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._group = None  # a group still referenced keeps its gloo threads past shutdown
        self.restore_handlers()

    def restore_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for s, previous in self._previous.items():
                signal.signal(s, previous)  # type: ignore[arg-type]
        self._previous.clear()
