"""The loss and accuracy curves of a run, as a PNG in its directory.

Drawn with matplotlib's object API on the Agg canvas: no pyplot global state,
no display needed, nothing that depends on the user's matplotlib backend.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from distlib.runner.observability.sink import MetricSink


def plot_curves(rows: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """Write train loss and test accuracy (or validation loss) of metrics.jsonl rows to ``path`` (PNG),
    over the global step when the rows carry it (rows inside an epoch too), else over the epoch."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_acc = fig.subplots(1, 2)
    at = "step" if rows and all("step" in r for r in rows) else "epoch"
    trained = [r for r in rows if r.get("train_loss") is not None]
    ax_loss.plot([r[at] for r in trained], [r["train_loss"] for r in trained], marker="o", ms=3)
    ax_loss.set(xlabel=at, ylabel="train loss", title="training loss")
    validated = [r for r in rows if r.get("val_loss") is not None]
    if validated:  # a language model: its validation loss
        ax_acc.plot([r[at] for r in validated], [r["val_loss"] for r in validated], marker="o", ms=3, c="C1")
        best = min(validated, key=lambda r: r["val_loss"])
        ax_acc.set(xlabel=at, ylabel="validation loss",
                   title=f"validation loss (best {best['val_loss']:.4f} at {at} {best[at]})")  # fmt: skip
    evaluated = [r for r in rows if r.get("test_acc") is not None]
    if evaluated or not validated:
        ax_acc.plot([r[at] for r in evaluated], [100 * r["test_acc"] for r in evaluated], marker="o", ms=3, c="C1")
        acc_title = "test accuracy"
        if evaluated:
            best = max(evaluated, key=lambda r: r["test_acc"])
            acc_title += f" (best {100 * best['test_acc']:.2f}% at {at} {best[at]})"
        ax_acc.set(xlabel=at, ylabel="test accuracy (%)", title=acc_title)
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    if title:
        fig.suptitle(title)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")  # two drawers may overlap
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)  # a reader never sees half a PNG
    except BaseException:  # a full disk: the last curves stay, and no half-written file holds space
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def plot_detached(metrics_path: str, path: str, title: str = "") -> subprocess.Popen:
    """Draw the curves of ``metrics_path`` (metrics.jsonl) to ``path`` in a new process that
    outlives this one, so that importing matplotlib and drawing do not delay the end of the run.

    The child runs this file alone (no distlib, no torch import) in its own session, so that
    torchrun's clean-up of the worker's process group does not stop it; its output goes
    nowhere, so a pipe reading this process's output does not wait for it. A failure leaves
    its traceback in ``path + ".error"``. The PNG appears atomically, up to a few seconds
    after this process has exited.
    """
    code = (
        "import importlib.util, sys; spec = importlib.util.spec_from_file_location('_curves', sys.argv[1]); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m._main(sys.argv[2:])"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, os.path.abspath(__file__), metrics_path, path, title],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


def _main(argv: list[str]) -> None:
    """``plot_detached``'s child: METRICS_JSONL PNG TITLE."""
    metrics_path, path, title = argv
    try:
        with open(metrics_path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        plot_curves(rows, path, title)
    except Exception:
        with contextlib.suppress(OSError), open(path + ".error", "w") as f:  # not on a full disk
            f.write(traceback.format_exc())


class CurvePlot(MetricSink):
    """The curves file of a running job, redrawn at the end and now and then.

    Drawing takes a sizeable fraction of a second, the first import of matplotlib
    a second or more (on a fresh machine many: it builds its font cache), and the
    other ranks wait for the main one meanwhile. So during training it is redrawn
    after a metrics row only when ``every_s`` seconds have passed since the last
    drawing, and, given ``metrics_path`` (metrics.jsonl, which holds every row),
    by a detached process (``plot_detached``; one at a time): the training
    process never imports matplotlib. ``write()`` draws here and now. Disabled
    (non-main ranks) it does nothing.
    """

    def __init__(
        self, path: str, rows: Sequence[dict[str, Any]] = (), *, title: str = "", enabled: bool = True,
        every_s: float = 60.0, metrics_path: str | None = None,
    ):  # fmt: skip
        self.path = path
        self.rows = list(rows)  # epochs done before this process started (a resumed run)
        self.title = title
        self.enabled = enabled
        self.every_s = every_s
        self.metrics_path = metrics_path
        self._last = time.monotonic()
        self._drawing: subprocess.Popen | None = None  # the detached redraw in flight

    def log(self, row: Mapping[str, Any], step: int) -> None:
        """Record a metrics row; redraw if the last drawing is old enough."""
        if not self.enabled:
            return
        self.rows.append(dict(row))
        if time.monotonic() - self._last < self.every_s:
            return
        if self.metrics_path is None:
            self.write()
        elif self._drawing is None or self._drawing.poll() is not None:  # else the last one is still drawing
            self._drawing = plot_detached(self.metrics_path, self.path, self.title)
            self._last = time.monotonic()

    def write(self) -> None:
        if self.enabled and self.rows:
            plot_curves(self.rows, self.path, self.title)
            self._last = time.monotonic()

    def write_detached(self, metrics_path: str) -> subprocess.Popen | None:
        """Draw the final curves from ``metrics_path`` (which holds every row) in a process that
        does not hold up this one's exit (``plot_detached``); None when disabled or empty."""
        if self.enabled and self.rows:
            return plot_detached(metrics_path, self.path, self.title)
        return None

    def training_done(self) -> None:
        """The final curves, drawn from metrics.jsonl after this process exits (``write_detached``)."""
        if self.metrics_path is not None:
            self.write_detached(self.metrics_path)
        else:
            self.write()
