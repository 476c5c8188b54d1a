"""How a run ends: one line and an exit code for each kind of failure, and a fast exit."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import torch

from distlib.checkpoint.disk import describe_error as disk_full_line
from distlib.checkpoint.disk import is_disk_full
from distlib.distributed.process_group import context
from distlib.errors import DistlibError
from distlib.log import write_line
from distlib.parallel.grad_sync import GradSyncTimeout
from distlib.reliability import stop
from distlib.reliability.failures import describe, peer_reports, report
from distlib.reliability.stop import Interrupted

# A rank under torchrun that is not its node's local rank 0 waits this long for torchrun to end it
# after a configuration error (local rank 0 reports it and exits first); then it reports it itself.
PEER_REPORT_WAIT_S = 30.0


def exit_code(e: BaseException, timeout_s: float, *, before_start: bool = False) -> int | None:
    """Say in one line why the run ends and return its exit code; None for a bug (re-raise it).

    2: bad input (the config, environment, data or a checkpoint), a full disk, out of GPU memory; 1: a
    collective timed out or lost a peer; 128 + the signal: SIGINT/SIGTERM before training started (stops
    inside it return their own codes). ``before_start``: the error came from the recipe, before any process group
    (every local rank of a torchrun node read the same files and raised the same): reported once
    per node. Every rank leaves word of why it ends for its peers (``failures.report``): a rank whose
    collective fails because a peer left says what that peer said, with its exit code (a data error
    found by one rank ends every rank with it), or names the peer that ended without a word. One that
    received a stop signal and finds torchrun's store gone (torchrun ended, taking it along) was
    stopped: 128 + the signal.
    """
    if before_start and isinstance(e, DistlibError):
        report_config_error(str(e))
        return 2
    rank = getattr(context(), "rank", 0)
    described = describe(e, rank=rank, timeout_s=timeout_s)  # a collective's failure, or None
    if isinstance(e, GradSyncTimeout) and described is not None:
        message, code = described, 1  # another rank stalled or died (the runner has no uneven inputs)
    elif isinstance(e, DistlibError):  # a full disk (DiskFull) and running out of memory (OutOfMemory) among them
        message, code = str(e), 2
    elif is_disk_full(e):  # a write whose writer did not name it
        message, code = disk_full_line(e), 2
    elif isinstance(e, torch.OutOfMemoryError):  # outside the trainer's steps (building the model)
        message, code = f"out of GPU memory: {_first_line(e)}", 2
    elif isinstance(e, Interrupted):  # a stop signal before training started
        message, code = _interrupted(e.signum), 128 + e.signum
    elif isinstance(e, KeyboardInterrupt):  # a second Ctrl-C
        message, code = "interrupted", 130
    elif described is not None and " lost the connection " in described:
        message, code = _after_a_lost_peer(e, described, rank, timeout_s)
    elif described is not None:
        message, code = described, 1
    else:  # a bug: its traceback says more than one line could
        report(1, f"{type(e).__name__}: {str(e).strip()[:200]} (its traceback is in its output)")
        return None
    report(code, message)
    write_line(f"error: {message}")
    return code


def _interrupted(signum: int) -> str:
    return "interrupted" if signum == signal.SIGINT else f"interrupted by {signal.Signals(signum).name}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _after_a_lost_peer(e: BaseException, described: str, rank: int, timeout_s: float) -> tuple[str, int]:
    """What a rank whose collective lost a peer says, and its exit code: what a peer that ended first said
    (its stop or its error, with its code), or the ranks that ended, each with its reason or none."""
    # this rank's own word first: a survivor is then never taken for a lost rank by another survivor
    report(1, described)
    reports = peer_reports()
    for peer, said in sorted(reports.items()):
        if said is not None and said["code"] != 1:  # an error of its own (bad input, a stop): the cause
            message = said["message"]
            return (message if message.startswith("(on rank") else f"(on rank {peer}) {message}"), said["code"]
    signum = stop.received()
    if not reports and signum and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent hosted the store, and it is gone after a stop signal: torchrun, signalled
        # again, ended and took it along; the job is stopping. With the store there, a signal excuses
        # no lost peer (torchrun sends SIGTERM to every worker once one died: a survivor names that
        # one), nor where rank 0 hosted it (srun, mpirun): then its loss is rank 0's
        return _interrupted(signum), 128 + signum
    gone = {peer: (said["message"] if said else None) for peer, said in reports.items()
            if said is None or not said["message"].startswith(f"rank {peer} lost the connection")}  # fmt: skip
    return describe(e, rank=rank, timeout_s=timeout_s, lost=gone) or described, 1


def report_config_error(message: str) -> None:
    """Print a configuration error once per torchrun node, by local rank 0, not once per rank.

    Under torchrun the other local ranks raised the same error from the same files: they print
    nothing and wait (``PEER_REPORT_WAIT_S``) for torchrun, which ends them once local rank 0 has
    exited with status 2, so the message cannot be lost to a rank that was ended before it printed.
    torchrun's failure summary then names local rank 0's exit code 2 as the root cause (torchrun
    itself exits 1, as for any failed worker). Not written: torchrun's error file
    (``TORCHELASTIC_ERROR_FILE``), which would replace the summary's link with a line of ours but
    makes the agent log an error of its own. torchrun ends a waiting rank with SIGTERM, which the
    launcher's stop handler records (``stop.received()``; not raised while an error is handled): that
    rank then ends without a word (local rank 0 said it). Without torchrun: printed at once.
    """
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if under_torchrun and os.environ.get("LOCAL_RANK", "0") != "0":
        end = time.monotonic() + PEER_REPORT_WAIT_S
        while time.monotonic() < end:  # torchrun ends this process here in the usual case
            if stop.received():
                return  # torchrun's SIGTERM after local rank 0 reported the error: nothing more to say
            time.sleep(0.05)
    write_line(f"error: {message}")


def fast_exit(code: int) -> None:
    """Exit without the interpreter's finalization, which takes seconds once torch is imported
    (module teardown, not work of ours). Only after a clean return of ``main``: the process
    group is destroyed, every file we wrote is closed, the device idle; output is flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
