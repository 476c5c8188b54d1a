"""The one interface of a run's metrics: ``MetricSink``, which every sink implements (metrics.jsonl, the
display, the curves, TensorBoard, W&B, MLflow), ``Metrics``, which hands a row to several, and the
tracker names of a row's numbers (``scalars``). The sinks import this module and nothing of each other;
``metrics.build_metrics`` chooses them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# metrics.jsonl key -> the name the trackers show (grouped by prefix)
TAGS = {
    "train_loss": "train/loss",
    "aux_loss": "train/aux_loss",
    "lr": "train/lr",
    "test_acc": "eval/accuracy",
    "val_loss": "eval/loss",
    "val_ppl": "eval/perplexity",
    "samples_per_s": "throughput/samples_per_s",
    "tokens_per_s": "throughput/tokens_per_s",
    "mfu": "throughput/mfu",
}


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row under their tracker names: those of ``TAGS`` and each rank's peak
    memory (``peak_mem_gib``, a list) as ``memory/peak_gib_rank<r>``; values a row leaves empty skipped."""
    out: dict[str, float] = {}
    for key, tag in TAGS.items():
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[tag] = value
    for rank, gib in enumerate(row.get("peak_mem_gib") or []):
        out[f"memory/peak_gib_rank{rank}"] = gib
    return out


class MetricSink:
    """Where metrics rows go. ``log`` gets each row with the global step it ends on, ``log_text`` a
    text (a language model's sample), ``training_done`` is called once training reached the end of
    its budget, ``close`` at teardown whatever happened (twice is fine). The defaults do nothing."""

    def log(self, row: Mapping[str, Any], step: int) -> None:
        pass

    def log_text(self, tag: str, text: str, step: int) -> None:
        pass

    def training_done(self) -> None:
        pass

    def close(self) -> None:
        pass


class Metrics(MetricSink):
    """Every sink of a run, called in order."""

    def __init__(self, sinks: Iterable[MetricSink] = ()):
        self.sinks = list(sinks)

    def log(self, row: Mapping[str, Any], step: int) -> None:
        for sink in self.sinks:
            sink.log(row, step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        for sink in self.sinks:
            sink.log_text(tag, text, step)

    def training_done(self) -> None:
        for sink in self.sinks:
            sink.training_done()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


__all__ = ["TAGS", "MetricSink", "Metrics", "scalars"]
