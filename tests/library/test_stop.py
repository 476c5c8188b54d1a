"""StopSignal at world size 1 (the agreement across ranks is in test_reliability_ranks.py)."""

from __future__ import annotations

import os
import signal

import pytest

from distlib.reliability.stop import StopSignal


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_at_the_next_check_with_128_plus_its_number(sig, code):
    before = signal.getsignal(sig)
    stop = StopSignal()
    assert not stop.check() and not stop.requested
    os.kill(os.getpid(), sig)
    assert stop.requested and stop.check() and stop.check()
    assert (stop.name, stop.exit_code) == (signal.Signals(sig).name, code)
    # a second signal of the same kind takes the default action, so a stuck run can still be stopped
    assert signal.getsignal(sig) == before
    stop.close()
    assert signal.getsignal(sig) == before


def test_closing_without_a_signal_restores_the_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop = StopSignal()
    assert signal.getsignal(signal.SIGTERM) == stop._handle
    stop.close()
    assert {s: signal.getsignal(s) for s in before} == before


def test_the_signals_given_are_the_ones_caught():
    """``signals=(SIGUSR1,)``: that signal stops the run with 128 + its number, and SIGTERM's and
    SIGINT's handlers are left as they were (the defaults would catch those two instead)."""
    ignored = signal.signal(signal.SIGUSR1, lambda *_: None)  # uncaught, SIGUSR1 would end pytest
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    stop = StopSignal(signals=(signal.SIGUSR1,))
    try:
        assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
        assert signal.getsignal(signal.SIGINT) == before[signal.SIGINT]
        assert not stop.check()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.check() and (stop.name, stop.exit_code) == ("SIGUSR1", 128 + signal.SIGUSR1)
    finally:
        stop.close()
        restored = {s: signal.getsignal(s) for s in before}
        signal.signal(signal.SIGUSR1, ignored)
    assert restored == before
