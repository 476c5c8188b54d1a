"""The watchdog kills a rank that stops running, and never outlives its rank."""

from __future__ import annotations

import subprocess
import sys
import time

import distlib.reliability.watchdog

# A rank stand-in that loads only the watchdog module (standard library, no torch: fast).
RANK = """
import importlib.util, os, signal, sys, time
spec = importlib.util.spec_from_file_location("wd", {path!r})
wd = importlib.util.module_from_spec(spec); spec.loader.exec_module(wd)
dog = wd.Watchdog({timeout}, rank=3)
print(dog._child.pid, flush=True)
{action}
"""


def start(action: str, timeout: float = 1.0) -> tuple[subprocess.Popen, int]:
    code = RANK.format(path=distlib.reliability.watchdog.__file__, timeout=timeout, action=action)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int, within: float) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_stopped_rank_is_killed_and_named_soon_after_the_timeout():
    proc, dog = start("os.kill(os.getpid(), signal.SIGSTOP)")
    t0 = time.monotonic()
    proc.wait(timeout=30)
    took = time.monotonic() - t0
    err = proc.stderr.read()
    assert proc.returncode == -9
    assert took < 1.0 + distlib.reliability.watchdog.grace_s(1.0) + 3.0, took
    assert f"[distlib watchdog] rank 3 (pid {proc.pid} on " in err and "state T (stopped)" in err, err
    assert wait_gone(dog, 5)


def test_the_grace_is_a_tenth_of_the_timeout_within_1_to_5_s():
    grace = distlib.reliability.watchdog.grace_s
    assert (grace(1.0), grace(20.0), grace(300.0)) == (1.0, 2.0, 5.0)
    # the heartbeat comes several times per deadline, so that a healthy rank is never late
    for timeout in (1.0, 300.0):
        dog = distlib.reliability.watchdog.Watchdog(timeout, rank=0)
        try:
            assert dog.deadline_s == timeout + grace(timeout) and dog.interval_s <= dog.deadline_s / 5
        finally:
            dog.close()


def test_a_busy_or_waiting_rank_is_left_alone():
    proc, dog = start("t = time.time()\nwhile time.time() - t < 1.5: pass\ntime.sleep(1.5)\nprint('done')")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out.strip() == "done" and "watchdog" not in err


def test_the_watchdog_never_outlives_its_rank():
    proc, dog = start("os._exit(0)")  # no cleanup at all
    proc.wait(timeout=30)
    assert wait_gone(dog, 5)
    proc, dog = start("dog.close(); print(dog._child.poll(), flush=True); time.sleep(0.2)")
    out, _ = proc.communicate(timeout=30)
    assert out.strip() == "0" and wait_gone(dog, 5)


def test_stop_signals_sent_to_the_watchdog_as_it_starts_are_ignored_without_a_word():
    """A stop sent to every process of a job reaches the watchdog too, possibly while its interpreter is
    still importing: the signals wait (blocked from its start) until it ignores them; it lives on, and
    ends without a traceback when its rank closes it."""
    proc, dog = start(
        "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGINT): os.kill(dog._child.pid, s)\n"
        "time.sleep(0.5); print(dog._child.poll(), flush=True); dog.close(); print(dog._child.returncode)"
    )
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out.split() == ["None", "0"], (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
