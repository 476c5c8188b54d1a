"""How a run ends: one line and an exit code for each kind of failure, and a fast exit."""

from __future__ import annotations

import logging
import os
import sys

from distlib.distributed.process_group import context
from distlib.errors import DistlibError
from distlib.parallel.grad_sync import GradSyncTimeout
from distlib.reliability.failures import describe


def exit_code(e: BaseException, timeout_s: float) -> int | None:
    """Say in one line why the run ends and return its exit code; None for a bug (re-raise it).

    2: bad input (the config, environment, data or a checkpoint); 1: a collective timed out or
    lost a peer; 130: Ctrl-C before training started (stops inside it return their own codes).
    """
    if (
        isinstance(e, GradSyncTimeout)
        and (message := describe(e, rank=getattr(context(), "rank", 0), timeout_s=timeout_s)) is not None
    ):
        code = 1  # a collective that timed out: another rank stalled or died (the runner has no uneven inputs)
    elif isinstance(e, DistlibError):
        message, code = str(e), 2
    elif isinstance(e, KeyboardInterrupt):  # a second Ctrl-C, or one before training started
        message, code = "interrupted", 130
    elif (message := describe(e, rank=getattr(context(), "rank", 0), timeout_s=timeout_s)) is not None:
        code = 1
    else:  # a bug: its traceback says more than one line could
        return None
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def fast_exit(code: int) -> None:
    """Exit without the interpreter's finalization, which takes seconds once torch is imported
    (module teardown, not work of ours). Only after a clean return of ``main``: the process
    group is destroyed, every file we wrote is closed, the device idle; output is flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
