"""The progress reporter: plain lines, rich on a (fake) terminal, the summary,
silence on other ranks, and that the loss is read only when the display redraws."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from distlib.runner.observability.progress import TrainingProgress, format_duration, summarize

ROWS = [
    {"epoch": 1, "train_loss": 2.0, "test_acc": 0.30, "images_per_s": 1000.0, "epoch_s": 2.0, "train_s": 2.0,
     "elapsed_s": 2.5, "world_size": 2},
    {"epoch": 2, "train_loss": 1.5, "test_acc": None, "images_per_s": 3000.0, "epoch_s": 1.0, "train_s": 3.0,
     "elapsed_s": 3.0, "world_size": 2},
    {"epoch": 3, "train_loss": 1.2, "test_acc": 0.25, "images_per_s": 2000.0, "epoch_s": 1.0, "train_s": 4.0,
     "elapsed_s": 4.6, "world_size": 2},
]  # fmt: skip


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def plain_console() -> Console:
    return Console(file=io.StringIO(), force_terminal=False)


def run_epochs(p: TrainingProgress, clock: FakeClock, steps: int = 4, dt: float = 0.5, rows=ROWS) -> None:
    p.start(epochs=len(rows), steps_per_epoch=steps, images_per_step=100)
    for row in rows:
        for _ in range(steps):
            clock.t += dt
            p.step(torch.tensor(row["train_loss"]))
        p.epoch_end(row)
    p.finish(rows)


def test_plain_mode_prints_one_line_per_epoch_and_a_summary():
    console, clock = plain_console(), FakeClock()
    p = TrainingProgress("auto", console=console, clock=clock)  # not a terminal -> plain
    assert p.mode == "plain"
    run_epochs(p, clock)
    lines = console.file.getvalue().splitlines()
    assert lines[0] == "epoch 1/3  loss 2.0000  acc 0.3000  1,000 img/s  2.0s elapsed, 4.0s left"
    assert lines[1] == "epoch 2/3  loss 1.5000  acc -  3,000 img/s  4.0s elapsed, 2.0s left"
    assert lines[2].startswith("epoch 3/3  loss 1.2000  acc 0.2500")
    assert lines[3] == "run summary"
    summary = dict(line.strip().split("  ", 1) for line in lines[4:])
    summary = {k: v.strip() for k, v in summary.items()}
    assert summary["final accuracy"] == "0.2500"
    assert summary["best accuracy"] == "0.3000 (epoch 1)"
    assert summary["training time"] == "4.0s"
    assert summary["time with evaluation"] == "4.6s"  # elapsed_s, not train_s
    assert summary["images/s"] == "1,750"  # 7,000 images over 4 s, not the mean of the rates
    assert summary["world size"] == "2"
    assert not any("\x1b[" in line for line in lines)  # no terminal escapes in log files


def test_plain_mode_reports_inside_long_epochs_at_most_every_plain_every_s():
    console, clock = plain_console(), FakeClock()
    p = TrainingProgress("plain", console=console, clock=clock, plain_every_s=30.0)
    p.start(epochs=1, steps_per_epoch=100, images_per_step=10)
    for _ in range(100):
        clock.t += 1.0
        p.step(torch.tensor(0.5))
    lines = console.file.getvalue().splitlines()
    assert len(lines) == 3  # at 30, 60 and 90 s
    assert lines[0] == "epoch 1/1 step 30/100  loss 0.5000  10 img/s  30.0s elapsed, 1m10s left"


def test_rich_mode_on_a_fake_terminal():
    console, clock = Console(file=io.StringIO(), force_terminal=True, width=150), FakeClock()
    p = TrainingProgress("auto", console=console, clock=clock)
    assert p.mode == "rich"
    run_epochs(p, clock)
    out = console.file.getvalue()
    assert "\x1b[" in out  # it did draw a live display
    assert "epoch 3/3" in out and "img/s" in out and "left" in out
    assert "run summary" in out and "best accuracy" in out and "0.3000 (epoch 1)" in out
    assert p._bar is None  # stopped: the cursor is back


def test_the_bar_keeps_the_last_accuracy_through_epochs_without_evaluation():
    clock = FakeClock()
    p = TrainingProgress("rich", console=Console(file=io.StringIO(), force_terminal=True), clock=clock)
    p.start(epochs=3, steps_per_epoch=4, images_per_step=100)
    p.epoch_end(ROWS[0])
    p.epoch_end(ROWS[1])  # not evaluated
    assert p._fields(clock())["acc"] == "0.3000"
    p.close()


def test_rich_mode_close_in_finally_restores_the_terminal_after_an_error():
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    p = TrainingProgress("rich", console=console)
    with pytest.raises(RuntimeError):
        try:
            p.start(epochs=2, steps_per_epoch=10, images_per_step=8)
            p.step(torch.tensor(1.0))
            raise RuntimeError("boom")
        finally:
            p.close()
            p.close()  # twice is fine
    out = console.file.getvalue()
    assert out.rfind("\x1b[?25h") > out.rfind("\x1b[?25l") >= 0  # the cursor, hidden by the bar, is shown again


def test_other_ranks_print_nothing():
    for mode in ("plain", "rich"):
        console, clock = Console(file=io.StringIO(), force_terminal=mode == "rich"), FakeClock()
        p = TrainingProgress(mode, enabled=False, console=console, clock=clock)
        run_epochs(p, clock)
        p.close()
        assert console.file.getvalue() == ""


def test_the_loss_is_read_only_when_the_display_redraws(monkeypatch):
    clock = FakeClock()
    p = TrainingProgress("rich", console=Console(file=io.StringIO(), force_terminal=True), clock=clock, refresh_s=0.25)
    reads = []
    monkeypatch.setattr(p._loss, "update", lambda loss: reads.append(loss) or 0.0)
    p.start(epochs=1, steps_per_epoch=1000, images_per_step=1)
    for _ in range(1000):
        clock.t += 0.001  # 1000 steps in one second
        p.step(torch.tensor(1.0))
    assert 3 <= len(reads) <= 4  # about four redraws a second, not one read per step
    p.close()


def test_loss_reader_on_cpu_tensors_and_floats():
    p = TrainingProgress("plain", console=plain_console())
    assert p._loss.update(torch.tensor(0.25)) == 0.25
    assert p._loss.update(0.5) == 0.5
    assert p._loss.update(None) == 0.5


@pytest.mark.gpus(1)
def test_loss_reader_on_cuda_copies_without_blocking():
    p = TrainingProgress("plain", console=plain_console())
    loss = torch.tensor(1.5, device="cuda")
    first = p._loss.update(loss)  # starts the copy, shows the previous value
    assert first != first  # nan: nothing has landed yet
    torch.cuda.synchronize()
    assert p._loss.update(torch.tensor(2.5, device="cuda")) == 1.5
    torch.cuda.synchronize()
    assert p._loss.update(None) == 2.5


def test_bad_mode_is_named():
    with pytest.raises(ValueError, match="'fancy'"):
        TrainingProgress("fancy")


def test_format_duration_and_empty_summary():
    assert format_duration(12.34) == "12.3s"
    assert format_duration(245) == "4m05s"
    assert format_duration(7620) == "2h07m"
    assert format_duration(float("nan")) == "-"
    assert summarize([]) == []
    assert ("final accuracy", "-") not in summarize(ROWS[:1])


def test_a_resumed_run_counts_from_where_it_resumed():
    clock = FakeClock()
    p = TrainingProgress("plain", console=plain_console(), clock=clock, refresh_s=0.0, plain_every_s=0.0)
    p.start(epochs=4, steps_per_epoch=10, images_per_step=100, start_epoch=3, start_step=5)
    assert p.total_steps == 15  # the 5 left of epoch 3 and the 10 of epoch 4
    clock.t += 1.0
    p.step(1.0)
    line = p.console.file.getvalue().splitlines()[-1]
    assert line.startswith("epoch 3/4 step 6/10"), line
    assert "100 img/s" in line  # the one step of this run, not the 5 before it
    assert p._left(clock.t) == pytest.approx(14.0)  # 1 s a step, 14 steps to go
