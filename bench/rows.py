"""The rows a benchmark suite reports: each printed as a JSON line under the suite's name (what
``bench/run.sh`` collects) and appended to the suite's JSON-lines file (what ``--report`` tables)."""

from __future__ import annotations

import json
import os


def emit(suite: str, path: str, row: dict, rows: list[dict]) -> None:
    """Add ``row`` to ``rows``, print it as ``{suite: row}`` and append it to ``path`` (none when empty)."""
    rows.append(row)
    print(json.dumps({suite: row}), flush=True)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def sync(device: str) -> None:
    """Wait for the GPU's queued work before a clock is read (nothing to wait for on the CPU)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def failure(stderr: str) -> str:
    """Why a run failed, in one line of its ``stderr``: the runner's own ``error:`` line where it wrote
    one (under torchrun the last lines are torchrun's report, which does not say why), else the last."""
    lines = stderr.strip().splitlines() or ["?"]
    said = [line for line in lines if line.startswith("error:")]
    return said[-1][:400] if said else lines[-1][-300:]
