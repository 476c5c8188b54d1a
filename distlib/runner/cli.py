"""The runner's command: ``torchrun --nproc-per-node=N -m distlib.runner RECIPE.yaml [a.b=value ...]``,
``distlib-train RECIPE.yaml ...`` (the installed script) or ``python launch.py ...`` from a checkout.

This module imports nothing heavy (``import distlib`` loads no torch), so the command's stop handlers
are in place before the seconds of torch's import; the run itself is ``distlib.runner.main``.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn


def _stopped_while_importing(signum: int, frame: object) -> None:
    """A stop signal during the imports (seconds of torch's): nothing to save or tear down yet; one line and
    128 + the signal, as later in the start (an import cut by KeyboardInterrupt would print a traceback,
    and SIGTERM's default action would end the process without a word)."""
    name = "" if signum == signal.SIGINT else f" by {signal.Signals(signum).name}"
    sys.stderr.write(f"error: interrupted{name}\n")  # the line and its newline in one write (distlib.log.write_line)
    sys.stderr.flush()
    os._exit(128 + signum)


def run(argv: list[str] | None = None) -> NoReturn:
    """Train the recipe the command line names and exit with the run's code: 0 done, 2 bad input
    (``error: ...``), 1 a collective failed or a bug, 130/143 stopped by SIGINT/SIGTERM.

    Only for a program's entry (it replaces the process's signal handlers and ends the process); a test
    calls ``distlib.runner.main.main`` instead."""
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, _stopped_while_importing)  # main() replaces them (stop.catch)
    from distlib.runner.main import main
    from distlib.runner.training.outcome import fast_exit

    fast_exit(main(sys.argv[1:] if argv is None else argv))
    raise AssertionError("unreachable")  # fast_exit ends the process
