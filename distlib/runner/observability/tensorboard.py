"""TensorBoard event files of a run (``run.tensorboard``), written by rank 0 only.

Each metrics.jsonl row becomes scalars at the global step it ends on: the training loss, the
learning rate, the throughput and the evaluation metrics, under ``train/``, ``eval/`` and
``throughput/``. ``tensorboard`` is an optional extra (``pip install 'distlib[tensorboard]'``);
the config refuses the key without it, so nothing fails here once training has started.
"""

from __future__ import annotations

from typing import Any

# metrics.jsonl key -> TensorBoard tag
TAGS = {
    "train_loss": "train/loss",
    "lr": "train/lr",
    "test_acc": "eval/accuracy",
    "val_loss": "eval/loss",
    "val_ppl": "eval/perplexity",
    "samples_per_s": "throughput/samples_per_s",
    "tokens_per_s": "throughput/tokens_per_s",
    "mfu": "throughput/mfu",
}


class TensorBoardLog:
    """``add(row, step)`` after each epoch; ``close()`` flushes. Does nothing unless ``enabled``."""

    def __init__(self, log_dir: str, enabled: bool, purge_step: int | None = None):
        """``purge_step``: the first step this run writes; TensorBoard drops the events an earlier run
        wrote from there on (a resume from a checkpoint older than the last metrics row)."""
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)

    def add(self, row: dict[str, Any], step: int) -> None:
        if self.writer is None:
            return
        for key, tag in TAGS.items():
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag, value, global_step=step)
        for rank, gib in enumerate(row.get("peak_mem_gib") or []):
            self.writer.add_scalar(f"memory/peak_gib_rank{rank}", gib, global_step=step)
        self.writer.flush()

    def add_text(self, tag: str, text: str, step: int) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, global_step=step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
