"""StopSignal at world size 1 (the agreement across ranks is in test_reliability_ranks.py)."""

from __future__ import annotations

import os
import signal

import pytest

from distlib.stop import StopSignal


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
