"""What rank 0 shows while it trains: a live rich progress bar on a terminal, plain
log lines otherwise (CI, log files), and a summary table at the end.

The reporter is built to stay out of the training loop's way: ``step()`` costs a
clock read and a comparison; the display is redrawn at most every ``refresh_s``
seconds, and only a redraw looks at the loss. Non-main ranks print nothing.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

import torch

if TYPE_CHECKING:  # rich is imported when first used: it is not needed to start training
    from rich.console import Console
    from rich.progress import Progress

from distlib.runner.observability.sink import MetricSink
from distlib.runner.observability.timeline import timeline_rows

MODES = ("auto", "rich", "plain")


def format_duration(seconds: float) -> str:
    """12.3s, 4m05s, 2h07m."""
    if seconds != seconds or seconds == math.inf:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class _LossReader:
    """The latest loss value without stalling the device.

    ``loss.item()`` on a GPU tensor waits for every queued kernel (a device sync):
    once per step that would drain the launch queue and cost a real fraction of a
    fast step. On CUDA we instead copy the loss into pinned host memory without
    blocking and read it at a later redraw, once its event has completed; the
    shown value lags by at most one redraw. CPU tensors are read directly.
    """

    def __init__(self) -> None:
        self.value = float("nan")
        self._host: torch.Tensor | None = None
        self._event: Any = None  # torch.cuda.Event of the pending copy, or None

    def update(self, loss: torch.Tensor | float | None) -> float:
        if self._event is not None and self._event.query():
            self.value = float(self._host)  # the copy has landed: reading pinned memory does not sync
            self._event = None
        if loss is None:
            return self.value
        if not isinstance(loss, torch.Tensor):
            self.value = float(loss)
        elif not loss.is_cuda:
            self.value = float(loss.detach())  # CPU tensor: no device to wait for
        elif self._event is None:  # one copy in flight at a time
            if self._host is None:
                self._host = torch.empty((), dtype=torch.float32, pin_memory=True)
            self._host.copy_(loss.detach().float().reshape(()), non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        return self.value


def _headline(row: dict[str, Any]) -> tuple[str, str]:
    """The evaluation of a metrics row as the progress line shows it: (label, value)."""
    key, label = ("val_loss", "val_loss") if "val_loss" in row else ("test_acc", "acc")
    return label, "-" if row.get(key) is None else f"{row[key]:.4f}"


def run_rates(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The rates of metrics.jsonl rows over the whole run: what was trained on divided by the time
    spent training (``epoch_s``), for each rate the rows have (``samples_per_s``, ``images_per_s``,
    ``tokens_per_s``). A row inside an epoch counts from the epoch's start, as the epoch's next row
    does: each epoch's last row covers it."""
    ends = list({r["epoch"]: r for r in rows}.values())
    out = {}
    for key in ("samples_per_s", "images_per_s", "tokens_per_s"):
        timed = [r for r in ends if r.get("epoch_s") and r.get(key)]
        if timed:
            out[key] = round(sum(r[key] * r["epoch_s"] for r in timed) / sum(r["epoch_s"] for r in timed), 1)
    return out


def summarize(rows: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(label, value) pairs of the end-of-run summary from metrics.jsonl rows."""
    if not rows:
        return []
    last = rows[-1]
    evaluated = [r for r in rows if r.get("test_acc") is not None]
    out: list[tuple[str, str]] = []
    if evaluated:
        best = max(evaluated, key=lambda r: r["test_acc"])
        final = last.get("test_acc")
        out.append(("final accuracy", "-" if final is None else f"{final:.4f}"))
        out.append(("best accuracy", f"{best['test_acc']:.4f} (epoch {best['epoch']})"))
    validated = [r for r in rows if r.get("val_loss") is not None]
    if validated:
        v = validated[-1]
        out.append(("final validation loss", f"{v['val_loss']:.4f} (perplexity {v['val_ppl']:.2f})"))
    out.append(("final train loss", f"{last['train_loss']:.4f}"))
    partial = f" and {last['epoch_step']} steps" if "epoch_step" in last else ""  # ended inside an epoch
    out.append(("epochs", f"{last['epoch'] - 1}{partial}" if partial else str(last["epoch"])))
    if "step" in last:
        out.append(("steps", f"{last['step']:,}"))
    if "tokens" in last:
        out.append(("tokens", f"{last['tokens']:,}"))
    if "train_s" in last:
        out.append(("training time", format_duration(last["train_s"])))
    if "elapsed_s" in last:
        out.append(("time with evaluation", format_duration(last["elapsed_s"])))
    rates = run_rates(rows)  # over the whole run
    for key, label in (("images_per_s", "images/s"), ("tokens_per_s", "tokens/s")):
        if key in rates:
            out.append((label, f"{rates[key]:,.0f}"))
    if last.get("mfu") is not None:
        out.append(("MFU (last epoch)", f"{100 * last['mfu']:.1f}%"))
    if last.get("peak_mem_gib"):
        out.append(("peak GPU memory (GiB/rank)", " ".join(f"{g:.1f}" for g in last["peak_mem_gib"])))
    if "world_size" in last:
        out.append(("world size", str(last["world_size"])))
    return out


class TrainingProgress(MetricSink):
    """Live progress of a training run on the main rank.

    ``mode``: "rich" (a live bar), "plain" (one line per epoch, and one every
    ``plain_every_s`` seconds inside long epochs), or "auto" (rich when the
    console is a terminal). Usage::

        progress = TrainingProgress(cfg.run.progress, enabled=ctx.is_main)
        try:
            progress.start(epochs=E, steps_per_epoch=S, images_per_step=B)
            for epoch ...:
                for batch ...:
                    ...
                    progress.step(loss)
                progress.epoch_end(row)
            progress.finish(rows)
        finally:
            progress.close()
    """

    def __init__(
        self,
        mode: str = "auto",
        *,
        enabled: bool = True,
        console: Console | None = None,
        refresh_s: float = 0.25,
        plain_every_s: float = 30.0,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if mode not in MODES:
            raise ValueError(f"progress mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.enabled = enabled
        if console is None:
            from rich.console import Console

            console = Console(file=sys.stdout)
        self.console = console
        self.mode = ("rich" if self.console.is_terminal else "plain") if mode == "auto" else mode
        self.refresh_s = refresh_s
        self.plain_every_s = plain_every_s
        self.clock = clock
        self._bar: Progress | None = None
        self._task: Any = None
        self._loss = _LossReader()
        self._started = False

    # -- the loop's calls ------------------------------------------------------------

    def start(
        self,
        *,
        epochs: int,
        steps_per_epoch: int,
        images_per_step: int,
        start_epoch: int = 1,
        start_step: int = 0,
        unit: str = "img",
        total_steps: int | None = None,
    ) -> None:
        """Begin the display; ``images_per_step`` is the global batch (all ranks), counted in
        ``unit`` ("img"; "tok": tokens of the batch's sequences). A resumed run starts at epoch
        ``start_epoch`` (from 1), ``start_step`` steps into it. ``total_steps``: the run's last
        step, counted over every epoch (default: ``epochs`` whole epochs); ``epochs`` 0: no limit."""
        if not self.enabled:
            return
        self.unit = unit
        self.epochs = epochs
        self.steps_per_epoch = steps_per_epoch
        self.images_per_step = images_per_step
        self.epoch = start_epoch
        if total_steps is None:
            total_steps = epochs * steps_per_epoch
        self.total_steps = max(0, total_steps - (start_epoch - 1) * steps_per_epoch - start_step)  # in this run
        self.done = 0  # steps in this run
        self.epoch_step = start_step
        self._epoch_first = start_step  # the epoch's steps before this run: not in its rate
        self.acc: str | None = None  # the last evaluation, as shown
        self.metric = "val_loss" if unit == "tok" else "acc"  # its label
        self.t_start = self.t_epoch = self.clock()
        self._next_draw = self.t_start + self.refresh_s
        self._next_plain = self.t_start + self.plain_every_s
        self._started = True
        if self.mode == "rich":
            from rich.progress import BarColumn, Progress, TextColumn

            self._bar = Progress(
                TextColumn("[bold]epoch {task.fields[epoch]}"),
                BarColumn(),
                TextColumn("step {task.fields[step]}"),
                TextColumn("{task.fields[rate]} " + unit + "/s"),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[metric]} {task.fields[acc]}"),
                TextColumn("{task.fields[elapsed]} elapsed, [bold]{task.fields[left]}[/] left"),
                console=self.console,
                auto_refresh=False,  # we redraw from step(), so no thread competes with the loop
            )
            self._task = self._bar.add_task("train", total=max(self.total_steps, 1), **self._fields(self.clock()))
            self._bar.start()

    def step(self, loss: torch.Tensor | float | None = None) -> None:
        """Count one optimizer step; redraws when ``refresh_s`` has passed.

        ``loss`` is this step's loss on this rank (a tensor is fine: it is only
        read at a redraw, without a device sync).
        """
        if not self._started:
            return
        self.done += 1
        self.epoch_step += 1
        now = self.clock()
        if now < self._next_draw:
            return
        self._next_draw = now + self.refresh_s
        self._loss.update(loss)
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, **self._fields(now))
            self._bar.refresh()
        elif now >= self._next_plain:
            self._next_plain = now + self.plain_every_s
            self._print_plain(self._line(now))

    def log(self, row: dict[str, Any], step: int) -> None:
        """As a ``MetricSink``: a row inside an epoch carries its ``epoch_step``."""
        self.epoch_end(row, ends_epoch="epoch_step" not in row)

    def epoch_end(self, row: dict[str, Any], ends_epoch: bool = True) -> None:
        """Report a metrics row (``epoch``, ``train_loss``, ``test_acc``, ``images_per_s``, ...):
        of a finished epoch, or (``ends_epoch`` False) of an evaluation inside one."""
        if not self._started:
            return
        now = self.clock()
        label, value = _headline(row)
        self.metric = label
        if value != "-":
            self.acc = value
        rate = row.get("tokens_per_s", row.get("images_per_s", row.get("samples_per_s", 0)))
        mfu = f"  MFU {100 * row['mfu']:.1f}%" if row.get("mfu") is not None else ""
        where = self._of(row["epoch"]) + ("" if ends_epoch else f" step {row.get('epoch_step')}/{self.steps_per_epoch}")
        line = (
            f"epoch {where}  loss {row['train_loss']:.4f}  {label} {value}  "
            f"{rate:,.0f} {self.unit}/s{mfu}  {format_duration(now - self.t_start)} elapsed, "
            f"{format_duration(self._left(now))} left"
        )
        if self._bar is not None:
            self._bar.console.print(line)
            fields = self._fields(now)  # the finished epoch stays on the bar until the next step
            fields["rate"] = f"{rate:,.0f}"
            self._bar.update(self._task, completed=self.done, **fields)
            self._bar.refresh()
        else:
            self._print_plain(line)
        self._next_plain = now + self.plain_every_s
        if not ends_epoch:
            return
        self.epoch = row["epoch"] + 1
        self.epoch_step = self._epoch_first = 0
        self.t_epoch = now

    def finish(self, rows: Sequence[dict[str, Any]], timeline: dict[str, Any] | None = None) -> None:
        """Stop the live display and print the summary of ``rows`` (metrics.jsonl), with the
        start-up, training and teardown times of ``timeline`` (``Timeline.summary()``) if given."""
        if not self.enabled:
            return
        self.close()
        summary = summarize(rows) + (timeline_rows(timeline) if timeline else [])
        if not summary:
            return
        if self.mode == "rich":
            from rich.table import Table

            table = Table(title="run summary", show_header=False)
            table.add_column(style="bold")
            table.add_column(justify="right")
            for label, value in summary:
                table.add_row(label, value)
            self.console.print(table)
        else:
            width = max(len(label) for label, _ in summary)
            self._print_plain("run summary\n" + "\n".join(f"  {label:<{width}}  {value}" for label, value in summary))

    def close(self) -> None:
        """Stop the live display (restores the cursor); safe to call twice."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        self._started = False

    # -- formatting ------------------------------------------------------------------

    def _of(self, epoch: int) -> str:
        """``3/10``; ``3`` when the epochs are not what ends the run."""
        return f"{epoch}/{self.epochs}" if self.epochs else str(epoch)

    def _left(self, now: float) -> float:
        if self.done == 0:
            return float("nan")
        return (now - self.t_start) / self.done * (self.total_steps - self.done)

    def _rate(self, now: float) -> float:
        # Over the epoch so far, on the host clock. Without a sync the host may run a
        # few steps ahead of the device; over an epoch that error is small.
        dt = now - self.t_epoch
        steps = self.epoch_step - self._epoch_first
        return steps * self.images_per_step / dt if dt > 0 and steps else float("nan")

    def _fields(self, now: float) -> dict[str, str]:
        rate = self._rate(now)
        loss = self._loss.value
        return {
            "epoch": self._of(self.epoch),
            "step": f"{self.epoch_step}/{self.steps_per_epoch}",
            "rate": "-" if rate != rate else f"{rate:,.0f}",
            "loss": "-" if loss != loss else f"{loss:.4f}",
            "metric": self.metric,
            "acc": "-" if self.acc is None else self.acc,
            "elapsed": format_duration(now - self.t_start),
            "left": format_duration(self._left(now)),
        }

    def _line(self, now: float) -> str:
        f = self._fields(now)
        return (
            f"epoch {f['epoch']} step {f['step']}  loss {f['loss']}  {f['rate']} {self.unit}/s  "
            f"{f['elapsed']} elapsed, {f['left']} left"
        )

    def _print_plain(self, text: str) -> None:
        out: TextIO = self.console.file
        out.write(text + "\n")
        out.flush()
