"""The run timeline (summary.json): stage arithmetic on a fake clock, the process start
read from the OS, and that importing the runner pulls in no heavy module it does not need."""

import json
import os
import subprocess
import sys
import time

import pytest

from distlib.runner.observability.timeline import Timeline, process_start_time, timeline_rows
from tests.conftest import ROOT


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_stages_and_headline_figures(tmp_path):
    clock = FakeClock()
    tl = Timeline(start=990.0, clock=clock)  # the process started 10 s before the first mark
    tl.mark("imports")
    clock.t += 2
    tl.mark("data")
    clock.t += 1
    tl.training_started()
    tl.add("train", 5.0)
    tl.add("eval", 0.5)
    tl.add("train", 4.0)
    tl.add("eval", 0.25)
    clock.t += 10
    tl.training_finished()
    clock.t += 0.75
    tl.mark("shutdown")
    assert tl.summary()["total_s"] is None  # not finished yet
    clock.t += 0.25
    summary = tl.finish()
    assert summary["to_first_step_s"] == 13.0
    assert (summary["train_s"], summary["eval_s"]) == (9.0, 0.75)
    assert summary["teardown_s"] == 1.0 and summary["total_s"] == 24.0
    # the gap before training_started() (1 s) belongs to no stage; shutdown starts at training_finished()
    assert summary["stages"] == {"imports": 10.0, "data": 2.0, "shutdown": 0.75}
    tl.note(data_source="cache")
    written = tl.write(str(tmp_path / "out" / "summary.json"))
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == written
    assert written["data_source"] == "cache" and written["start_source"] == "given"
    labels = [label for label, _ in timeline_rows(written)]
    assert labels[:5] == [
        "start to first step",
        "steps (no evaluation)",
        "evaluation",
        "teardown",
        "process start to exit",
    ]


def test_under_torchrun_the_launchers_lead_is_noted(monkeypatch):
    """launcher_lead_s: how long torchrun's agent (the parent) ran before this worker started."""
    from distlib.runner.observability import timeline

    starts = {"self": 1000.0, os.getppid(): 990.5}
    monkeypatch.setattr(timeline, "_start_time_of", lambda pid: starts[pid])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert Timeline().summary()["launcher_lead_s"] == 9.5
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert "launcher_lead_s" not in Timeline().summary()  # not under torchrun


def test_unknown_total_is_an_error():
    with pytest.raises(ValueError, match="unknown total 'training'"):
        Timeline(start=0.0).add("training", 1.0)


def test_process_start_comes_from_the_os():
    before = time.time()
    out = subprocess.run(
        [sys.executable, "-c", "import time; time.sleep(0.5); "
         "from distlib.runner.observability.timeline import process_start_time; print(process_start_time())"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    after = time.time()
    start = float(out)
    # the child's start lies between our Popen and its answer (clock tick 10 ms), not at its import of the module
    assert before - 0.05 <= start <= after - 0.5
    assert process_start_time() < before  # this process started earlier


def test_launch_imports_no_torchvision_matplotlib_or_rich():
    code = (
        "import sys; import launch; from distlib.runner.observability.environment import _torchvision_version; "
        "v = _torchvision_version(); "
        "print(sorted(m for m in ('torchvision', 'matplotlib', 'rich') if m in sys.modules)); print(v)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded, version = out.stdout.splitlines()
    assert loaded == "[]"
    import torchvision

    assert version == torchvision.__version__  # read without importing it
