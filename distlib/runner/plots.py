"""The loss and accuracy curves of a run, as a PNG in its directory.

Drawn with matplotlib's object API on the Agg canvas: no pyplot global state,
no display needed, nothing that depends on the user's matplotlib backend.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any


def plot_curves(rows: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """Write train loss and test accuracy per epoch (metrics.jsonl rows) to ``path`` (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_acc = fig.subplots(1, 2)
    epochs = [r["epoch"] for r in rows if r.get("train_loss") is not None]
    ax_loss.plot(epochs, [r["train_loss"] for r in rows if r.get("train_loss") is not None], marker="o", ms=3)
    ax_loss.set(xlabel="epoch", ylabel="train loss", title="training loss")
    evaluated = [r for r in rows if r.get("test_acc") is not None]
    ax_acc.plot([r["epoch"] for r in evaluated], [100 * r["test_acc"] for r in evaluated], marker="o", ms=3, c="C1")
    acc_title = "test accuracy"
    if evaluated:
        best = max(evaluated, key=lambda r: r["test_acc"])
        acc_title += f" (best {100 * best['test_acc']:.2f}% at epoch {best['epoch']})"
    ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)", title=acc_title)
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    if title:
        fig.suptitle(title)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)  # a reader never sees half a PNG


class CurvePlot:
    """The curves file of a running job, redrawn at the end and now and then.

    Drawing takes a sizeable fraction of a second (more for the first import of
    matplotlib), and the other ranks wait for the main one meanwhile, so during
    training it is redrawn after an epoch only when ``every_s`` seconds have
    passed since the last drawing; ``write()`` draws at the end. Disabled
    (non-main ranks) it does nothing.
    """

    def __init__(
        self, path: str, rows: Sequence[dict[str, Any]] = (), *, title: str = "", enabled: bool = True,
        every_s: float = 60.0,
    ):  # fmt: skip
        self.path = path
        self.rows = list(rows)  # epochs done before this process started (a resumed run)
        self.title = title
        self.enabled = enabled
        self.every_s = every_s
        self._last = time.monotonic()

    def add(self, row: dict[str, Any]) -> None:
        """Record an epoch's metrics row; redraw if the last drawing is old enough."""
        if not self.enabled:
            return
        self.rows.append(row)
        if time.monotonic() - self._last >= self.every_s:
            self.write()

    def write(self) -> None:
        if self.enabled and self.rows:
            plot_curves(self.rows, self.path, self.title)
            self._last = time.monotonic()
