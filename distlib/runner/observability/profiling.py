"""torch.profiler over a few training steps, on every rank: a Chrome trace and
the table of operators sorted by device time (or CPU time without a GPU).

Files, in ``out_dir`` (``<run.out_dir>/profile``)::

    trace_rank{R}.json   open in https://ui.perfetto.dev or chrome://tracing
    table_rank{R}.txt    key_averages().table(), as torch.autograd.profiler prints it
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from distlib.log import get_logger


def device_sort_key(events: Any) -> str:
    """The key_averages() column to sort by: self device time when the trace has
    device kernels, else self CPU time.

    torch >= 2.4 names it ``self_device_time_total`` (``self_cuda_time_total`` is
    the deprecated alias); older versions know only the CUDA name.
    """
    events = list(events)
    if not events:
        return "self_cpu_time_total"
    name = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    if any(getattr(e, name, 0) > 0 for e in events):
        return name
    return "self_cpu_time_total"


class StepProfiler:
    """Profiles steps ``wait + warmup`` .. ``wait + warmup + active - 1`` (counted
    from 0) of the training loop, which calls ``step()`` after each optimizer
    step. Disabled, every call is a no-op.

    The trace and table are written when the active steps are done, or by
    ``close()`` if the run ends while recording. Each rank writes its own files.
    """

    def __init__(
        self,
        out_dir: str,
        rank: int,
        device: torch.device,
        *,
        enabled: bool = True,
        wait: int = 2,
        warmup: int = 2,
        active: int = 4,
        row_limit: int = 40,
    ):
        if wait < 0 or warmup < 0 or active < 1:
            raise ValueError(f"profile: need wait >= 0, warmup >= 0, active >= 1; got {wait}, {warmup}, {active}")
        self.out_dir = out_dir
        self.rank = rank
        self.enabled = enabled
        self.wait, self.warmup, self.active = wait, warmup, active
        self.row_limit = row_limit
        self.steps = 0
        self.trace_path = os.path.join(out_dir, f"trace_rank{rank}.json")
        self.table_path = os.path.join(out_dir, f"table_rank{rank}.txt")
        self.written = False
        self._prof: profile | None = None
        self._running = False
        if enabled:
            activities = [ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(
                activities=activities,
                schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                on_trace_ready=self._write,
            )

    def start(self) -> None:
        if self._prof is not None:
            os.makedirs(self.out_dir, exist_ok=True)
            self._prof.start()
            self._running = True

    def step(self) -> None:
        """Mark the end of one training step."""
        if self._prof is not None:
            self._prof.step()
            self.steps += 1

    def close(self) -> None:
        """Stop profiling; writes what was recorded if the run ended mid-recording. Safe to call twice."""
        if self._prof is None or not self._running:
            return
        prof, self._prof = self._prof, None
        prof.stop()
        if not self.written:
            get_logger().warning(
                "profile: the run took %d step(s), fewer than profile.wait + profile.warmup + 1 = %d; "
                "nothing was recorded",
                self.steps, self.wait + self.warmup + 1,
            )  # fmt: skip

    def _write(self, prof: profile) -> None:
        prof.export_chrome_trace(self.trace_path)
        events = prof.key_averages()
        table = events.table(sort_by=device_sort_key(events), row_limit=self.row_limit)
        with open(self.table_path, "w") as f:
            f.write(table + "\n")
        self.written = True
        get_logger().info(
            "profile: wrote %s and %s (open the trace in https://ui.perfetto.dev or chrome://tracing)",
            self.trace_path, self.table_path,
        )  # fmt: skip
