"""The files a run leaves in ``run.out_dir``: the resolved config and metrics.jsonl."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from distlib.checkpoint import disk
from distlib.runner.observability.sink import MetricSink


class RunDir(MetricSink):
    """Only the main rank writes; other ranks' calls do nothing. As a ``MetricSink``: metrics.jsonl,
    one row a line, flushed to disk before ``log`` returns (a checkpoint that follows never gets
    ahead of its row)."""

    def __init__(self, path: str, is_main: bool):
        self.path = path
        self.is_main = is_main
        self.metrics_path = os.path.join(path, "metrics.jsonl")
        if is_main:
            os.makedirs(path, exist_ok=True)

    def write_text(self, name: str, text: str) -> None:
        """``name`` in the run directory, whole (a temporary file renamed); ``DiskFull`` on a full disk."""
        if self.is_main:
            disk.write_file(os.path.join(self.path, name), text)

    def read_metrics(self) -> list[dict[str, Any]]:
        if not os.path.exists(self.metrics_path):
            return []
        rows = []
        with open(self.metrics_path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:  # a line cut short by a crash
                        break
        return rows

    def start_metrics(self, completed_epochs: int, step: int | None = None) -> None:
        """Keep the rows up to where the run resumes and drop the rest, so a resumed run never
        writes a row twice: those of global steps up to ``step`` (rows carry their ``step``), and
        of a row without one, those of the first ``completed_epochs`` epochs (numbered from 1)."""
        if not self.is_main:
            return

        def kept(r: dict[str, Any]) -> bool:
            return r["step"] <= step if step is not None and "step" in r else r.get("epoch", 0) <= completed_epochs

        keep = [r for r in self.read_metrics() if kept(r)]
        self.write_text("metrics.jsonl", "".join(json.dumps(r) + "\n" for r in keep))

    def log(self, row: Mapping[str, Any], step: int) -> None:
        self.log_metrics(row)

    def log_metrics(self, row: Mapping[str, Any]) -> None:
        """One row, one line, whole or not at all (a full disk raises ``DiskFull`` and leaves no torn line)."""
        if self.is_main:
            disk.append_line(self.metrics_path, json.dumps(row))
