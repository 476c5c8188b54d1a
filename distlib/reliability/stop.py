"""SIGTERM and SIGINT stop every rank at the same step boundary.

A signal only sets a flag; ``check()`` all_reduces the flags over a separate gloo group, one step
behind, so every rank stops at the same step without a device sync. A run stopped this way exits
with 128 + the signal number.

Schedulers deliver a stop more than once: Slurm signals every process of a job step, Kubernetes
the container's, and torchrun forwards the signal it gets to every worker, so a worker often gets
two copies. A repeat of a signal already received is ignored (the process is stopping already);
only a SIGINT more than ``REPEAT_S`` after the first signal (a person pressing Ctrl-C again) stops
at once, with KeyboardInterrupt. Before a ``StopSignal`` exists, ``catch(interrupt=True)`` makes the
first signal raise ``Interrupted`` instead: a process with nothing to save yet stops at once (unless
an error is being handled: then the signal is only recorded, for the error's exit to say).
docs/reliability.md.
"""

from __future__ import annotations

import datetime
import signal
import sys
import threading
import time
from types import FrameType

import torch
import torch.distributed as dist

from distlib.distributed import collectives
from distlib.reliability.children import STOP_SIGNALS

REPEAT_S = 5.0  # a SIGINT this long after the first signal is a person's second Ctrl-C, not a forwarded copy


class Interrupted(KeyboardInterrupt):
    """The first stop signal, raised where the main thread was while ``catch(interrupt=True)`` held, or by
    ``StopSignal()`` when its group could not be connected after a signal (the peers were stopping)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Caught:
    """The process's handlers of the stop signals and what they received (one per process: handlers are)."""

    def __init__(self) -> None:
        self.first = 0  # the first signal received (0: none)
        self.first_at = 0.0
        self.interrupt = False  # the first signal raises Interrupted
        self.previous: dict[int, object] = {}

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.first:
            self.first, self.first_at = signum, time.monotonic()
            # not while an error is being handled (the handler runs wherever the main thread is, an
            # ``except`` or ``finally`` block too): the way out would be cut short, and the error lost;
            # the signal is recorded, and the code that ends the run says it (``received()``)
            if self.interrupt and sys.exc_info()[1] is None:
                self.interrupt = False  # once: a repeat must not interrupt the unwinding
                raise Interrupted(signum)
            return
        if signum == signal.SIGINT and time.monotonic() - self.first_at > REPEAT_S:
            raise KeyboardInterrupt  # a second Ctrl-C, seconds later: stop now, without a checkpoint
        # else a copy of a stop already received (torchrun forwards what it gets; Slurm signals every process)


_CAUGHT = _Caught()


def catch(signals: tuple[int, ...] = STOP_SIGNALS, *, interrupt: bool) -> None:
    """Install the handlers of ``signals`` (from the main thread; elsewhere nothing happens), or keep those
    installed. ``interrupt``: until a ``StopSignal`` is built, the first one raises ``Interrupted`` in
    the main thread (its repeats are ignored); else the signals are only recorded (``received()``)."""
    if threading.current_thread() is not threading.main_thread():
        return
    _CAUGHT.interrupt = interrupt and not _CAUGHT.first
    for s in signals:
        if s not in _CAUGHT.previous:
            _CAUGHT.previous[s] = signal.signal(s, _CAUGHT.handle)


def received() -> int:
    """The first stop signal this process received since ``catch`` (0: none)."""
    return _CAUGHT.first


def release() -> None:
    """Put back the handlers ``catch`` replaced, and forget what was received."""
    if threading.current_thread() is threading.main_thread():
        for s, previous in _CAUGHT.previous.items():
            signal.signal(s, previous)  # type: ignore[arg-type]
        _CAUGHT.previous.clear()
    _CAUGHT.first, _CAUGHT.interrupt = 0, False


class StopSignal:
    """Catches ``signals`` and makes every rank agree when to stop.

    Building it is a collective when the world size is above 1 (it creates a
    gloo group): every rank must build it, in the same order. Every rank must
    call ``check()`` the same number of times. A signal that came while the
    group was being connected, whose connect then failed, raises ``Interrupted``.
    """

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS, timeout_s: float = 300.0):
        self.signum = 0  # the agreed signal once check() has returned True
        self.signals = tuple(signals)
        self._installed = not _CAUGHT.previous  # the handlers are this object's to restore
        catch(self.signals, interrupt=False)
        self._work = None
        self._group = None
        self._flag = torch.zeros(1, dtype=torch.int32)
        if collectives.world_size() > 1:
            # gloo works on CPU tensors whatever the main backend, and keeps the flag off the GPU streams
            try:
                self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
            except Exception:
                signum = self._local
                self.restore_handlers()  # no object is returned to close
                if not signum:
                    raise
                # the job is stopping while its ranks connect this group: a peer interrupted before it (or
                # torchrun, taking the rendezvous store along) left mid-connect. Nothing is trained yet, so
                # this is the signal's interruption, not a lost peer
                raise Interrupted(signum) from None

    @property
    def _local(self) -> int:
        return received() if received() in self.signals else 0

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

    def agree(self) -> int:
        """The signal any rank has received so far (0: none), the same on every rank, now (a synchronous
        reduction): for the end of a run, after the last ``check()``. A collective; ``exit_code`` follows."""
        if self._work is not None:
            self._work.wait()
            self._work = None
            self.signum = self.signum or int(self._flag.item())
        if self._group is None:
            self.signum = self.signum or self._local
            return self.signum
        self._flag.fill_(max(self.signum, self._local))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
        self.signum = int(self._flag.item())
        return self.signum

    def close(self, wait: bool = True) -> None:
        """Finish the pending reduction (every rank has one) and restore the signal handlers. ``wait=False``
        after a failure: the reduction is dropped (a peer may be gone), not waited for."""
        if self._work is not None and wait:
            self._work.wait()
        self._work = None
        self._group = None  # a group still referenced keeps its gloo threads past shutdown
        self.restore_handlers()

    def restore_handlers(self) -> None:
        """Put back the handlers this object installed (none when ``catch`` installed them before it:
        that caller releases them)."""
        if self._installed:
            release()
            self._installed = False
