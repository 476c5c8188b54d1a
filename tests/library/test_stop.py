"""StopSignal at world size 1 (the agreement across ranks is in test_reliability_ranks.py)."""

from __future__ import annotations

import os
import signal

import pytest

from distlib.reliability import stop as stop_module
from distlib.reliability.stop import StopSignal


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_at_the_next_check_with_128_plus_its_number(sig, code):
    before = signal.getsignal(sig)
    stop = StopSignal()
    assert not stop.check() and not stop.requested
    os.kill(os.getpid(), sig)
    assert stop.requested and stop.check() and stop.check()
    assert (stop.name, stop.exit_code) == (signal.Signals(sig).name, code)
    # copies of the same stop (torchrun forwards what it gets, Slurm signals every process) are ignored
    for _ in range(3):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
    assert stop.check() and stop.exit_code == code
    stop.close()
    assert signal.getsignal(sig) == before


def test_a_second_ctrl_c_seconds_after_the_first_stops_at_once(monkeypatch):
    monkeypatch.setattr(stop_module, "REPEAT_S", 0.0)
    stop = StopSignal()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.check()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.close()


def test_before_a_stop_signal_exists_the_first_signal_interrupts_once():
    """launch.py's ``catch(interrupt=True)``: a signal before training raises Interrupted; its copies do not
    interrupt the unwinding; the StopSignal built after it takes the handlers over, and release() restores them."""
    before = signal.getsignal(signal.SIGTERM)
    stop_module.catch(interrupt=True)
    try:
        with pytest.raises(stop_module.Interrupted) as e:
            os.kill(os.getpid(), signal.SIGTERM)
        assert e.value.signum == signal.SIGTERM and stop_module.received() == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # ignored
        stop_module.release()
        stop_module.catch(interrupt=True)
        stop = StopSignal()  # no signal yet: the handlers only record from here
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.check() and stop.exit_code == 143
        stop.close()
        assert signal.getsignal(signal.SIGTERM) != before  # catch()'s: its caller releases them
    finally:
        stop_module.release()
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_signal_while_an_error_is_handled_is_recorded_and_not_raised():
    """``catch(interrupt=True)`` raises the first signal where the main thread is, but not inside an
    ``except`` or a ``finally`` run by an error: Interrupted would replace that error and cut its
    handling short. The signal is recorded (``received()``) for the error's exit to say."""
    before = signal.getsignal(signal.SIGINT)
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            stop_module.catch(interrupt=True)
            try:
                raise ConnectionError("the store's host is gone")
            except ConnectionError:
                try:
                    os.kill(os.getpid(), sig)  # the handler runs here, inside the except block
                except KeyboardInterrupt as e:  # caught here: it would end the whole test session
                    pytest.fail(f"the signal was raised into the error's handling: {e!r}")
                handled = True
            assert handled and stop_module.received() == sig
            stop_module.release()
        stop_module.catch(interrupt=True)
        with pytest.raises(ConnectionError, match="host is gone"):
            try:
                raise ConnectionError("the store's host is gone")
            finally:
                os.kill(os.getpid(), signal.SIGTERM)
        assert stop_module.received() == signal.SIGTERM
        stop_module.release()
        stop_module.catch(interrupt=True)  # outside any error handling, the first signal still interrupts
        with pytest.raises(stop_module.Interrupted):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop_module.release()
    assert signal.getsignal(signal.SIGINT) == before


def test_closing_without_a_signal_restores_the_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop = StopSignal()
    assert signal.getsignal(signal.SIGTERM) == stop_module._CAUGHT.handle
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


@pytest.mark.parametrize("signalled", [True, False])
def test_a_group_whose_connect_fails_after_a_signal_interrupts_and_any_other_failure_is_raised(monkeypatch, signalled):
    """Every process of a job signalled as training starts: a peer (or torchrun, with the rendezvous store)
    leaves while this rank connects the stop's group, and the connect fails. With a signal received that is
    the signal's interruption (nothing trained yet), the handlers put back; without one, the failure itself."""
    import torch.distributed as dist

    def connect_fails(**kwargs):
        if signalled:
            os.kill(os.getpid(), signal.SIGTERM)  # the job's stop, received while the peers were leaving
        raise dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")

    monkeypatch.setattr(stop_module.collectives, "world_size", lambda: 3)
    monkeypatch.setattr(stop_module.dist, "new_group", connect_fails)
    before = signal.getsignal(signal.SIGTERM)
    try:
        if signalled:
            with pytest.raises(stop_module.Interrupted) as e:
                StopSignal(timeout_s=5)
            assert e.value.signum == signal.SIGTERM and e.value.__cause__ is None
        else:
            with pytest.raises(dist.DistNetworkError, match="likely closed"):
                StopSignal(timeout_s=5)
        assert signal.getsignal(signal.SIGTERM) == before
    finally:
        stop_module.release()
