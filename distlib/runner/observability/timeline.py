"""Where a run's wall time goes, from the start of the process (imports included) to exit.

The trainer calls ``mark(stage)`` at each boundary of its start-up and teardown stages,
``training_started()`` just before the first step, ``add("train" | "eval", seconds)`` from the
loop and ``training_finished()`` after the final evaluation; ``finish()`` stamps the end and
returns the figures that rank 0 writes to ``summary.json``. Every call is a clock read.

The process start comes from the OS (``/proc/self/stat``), so the interpreter start and the
imports before this module count too; where /proc is missing, the timeline starts when it is
created and says so (``start_source``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from distlib.checkpoint import disk


def _start_time_of(pid: int | str) -> float | None:
    """time.time() at which process ``pid`` started, to the kernel's clock tick (10 ms); None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        # field 22 (starttime, ticks after boot); the fields after the ")" of the command name start at field 3
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc (macOS), or no CLOCK_BOOTTIME
        return None
    return time.time() - age


def process_start_time() -> float | None:
    """time.time() at which this process started, from /proc; None where the OS does not say."""
    return _start_time_of("self")


class Timeline:
    """Stage durations and headline figures of one process's run (see the module docstring).

    ``start``: the time (``time.time()``) the run counts from; default the process start.
    """

    def __init__(self, start: float | None = None, *, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.start_source = "given"
        if start is None:
            start = process_start_time()
            self.start_source = "process"
        if start is None:
            start, self.start_source = clock(), "timeline"
        self.start = start
        self.stages: dict[str, float] = {}  # stage -> seconds, in the order first marked
        self.totals: dict[str, float] = {"train": 0.0, "eval": 0.0}
        self.notes: dict[str, Any] = {}
        if os.environ.get("TORCHELASTIC_RUN_ID") and self.start_source == "process":
            launcher = _start_time_of(os.getppid())  # torchrun's agent: its own start-up precedes ours
            if launcher is not None:
                self.notes["launcher_lead_s"] = round(start - launcher, 3)
        self._last = start
        self._first_step: float | None = None
        self._trained: float | None = None
        self._end: float | None = None

    def mark(self, stage: str) -> float:
        """End ``stage``: it lasted from the previous mark (or the start) until now. Returns its seconds.

        Marking the same stage again adds to it (a stage interrupted by another).
        """
        now = self.clock()
        seconds = now - self._last
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds
        self._last = now
        return seconds

    def add(self, what: str, seconds: float) -> None:
        """Count ``seconds`` of "train" (optimizer steps) or "eval" (evaluation) time."""
        if what not in self.totals:
            raise ValueError(f"Timeline.add: unknown total {what!r}; known: {', '.join(self.totals)}")
        self.totals[what] += seconds

    def note(self, **values: Any) -> None:
        """Record facts that explain the figures (e.g. ``data_source="cache"``)."""
        self.notes.update(values)

    def training_started(self) -> None:
        """The first training step is about to run: what came before is start-up."""
        self._last = self._first_step = self.clock()

    def training_finished(self) -> None:
        """The final evaluation is done: what follows is teardown."""
        self._last = self._trained = self.clock()

    def elapsed(self) -> float:
        """Seconds since the start."""
        return self.clock() - self.start

    def finish(self) -> dict[str, Any]:
        """Stamp the end (call it last, just before exiting) and return ``summary()``."""
        self._end = self.clock()
        return self.summary()

    def summary(self) -> dict[str, Any]:
        """The figures so far; an end not yet reached is None (``total_s`` before ``finish()``)."""

        def since(t: float | None, origin: float | None) -> float | None:
            return None if t is None or origin is None else round(t - origin, 3)

        return {
            "to_first_step_s": since(self._first_step, self.start),
            "train_s": round(self.totals["train"], 3),
            "eval_s": round(self.totals["eval"], 3),
            "teardown_s": since(self._end, self._trained),
            "total_s": since(self._end, self.start),
            "stages": {k: round(v, 3) for k, v in self.stages.items()},
            "start_source": self.start_source,
            **self.notes,
        }

    def write(self, path: str) -> dict[str, Any]:
        """Write ``summary()`` as JSON to ``path`` (atomically) and return it."""
        summary = self.summary()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        disk.write_file(path, json.dumps(summary, indent=2) + "\n")  # DiskFull on a full disk
        return summary


def timeline_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) pairs for the run summary on screen, from ``Timeline.summary()``."""
    out = []
    for key, label in (
        ("to_first_step_s", "start to first step"),
        ("train_s", "steps (no evaluation)"),
        ("eval_s", "evaluation"),
        ("teardown_s", "teardown"),
        ("total_s", "process start to exit"),
    ):
        if summary.get(key) is not None:
            out.append((label, f"{summary[key]:.2f}s"))
    stages = summary.get("stages") or {}
    if stages:
        out.append(("stages", "  ".join(f"{k} {v:.2f}" for k, v in stages.items())))
    return out
