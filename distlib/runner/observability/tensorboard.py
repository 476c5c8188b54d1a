"""TensorBoard event files of a run (``run.tensorboard``), written by rank 0 only.

Each metrics.jsonl row becomes scalars at the global step it ends on: the training loss, the
learning rate, the throughput and the evaluation metrics, under ``train/``, ``eval/`` and
``throughput/``. ``tensorboard`` is an optional extra (``pip install 'distlib[tensorboard]'``);
the config refuses the key without it, so nothing fails here once training has started.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distlib.checkpoint import disk
from distlib.runner.observability.sink import MetricSink, scalars


class TensorBoardLog(MetricSink):
    """A ``MetricSink``: each row's numbers as scalars (``metrics.TAGS``). Does nothing unless ``enabled``."""

    def __init__(self, log_dir: str, enabled: bool, purge_step: int | None = None):
        """``purge_step``: the first step this run writes; TensorBoard drops the events an earlier run
        wrote from there on (a resume from a checkpoint older than the last metrics row)."""
        self.writer = None
        self.log_dir = log_dir
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)

    def log(self, row: Mapping[str, Any], step: int) -> None:
        if self.writer is None:
            return
        # the event writer's thread keeps a failed write's error for the next call here: DiskFull then
        with disk.writing(self.log_dir, "TensorBoard's event file"):
            for tag, value in scalars(row).items():
                self.writer.add_scalar(tag, value, global_step=step)
            self.writer.flush()

    def log_text(self, tag: str, text: str, step: int) -> None:
        if self.writer is not None:
            with disk.writing(self.log_dir, "TensorBoard's event file"):
                self.writer.add_text(tag, text, global_step=step)
                self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            with disk.writing(self.log_dir, "TensorBoard's event file"):
                writer.close()
