"""A run's life through ``python launch.py``: SIGTERM saves and exits 143, the same command
continues, a finished run has nothing to do, and run.resume=false starts over without the old
checkpoints. One process, the demo's small CNN on a subset, checkpoints every epoch.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.runner.conftest import TORCHRUN_VARS, checkpoints, step_name

RUN = [
    "recipes/demo.yaml", "train.epochs=2", "data.train_subset=2048", "model.width=8",
    "run.checkpoint_every=1", "dist.backend=gloo", "run.progress=plain",
]  # fmt: skip
STEPS = 16  # an epoch's, of 2,048 images in batches of 128

pytestmark = pytest.mark.slow


def env() -> dict:
    out = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    return {**out, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def launch(out_dir, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "launch.py", *RUN, f"run.out_dir={out_dir}", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)


def epochs(out_dir) -> list[int]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["epoch"] for line in f if line.strip()]


def test_sigterm_exits_143_then_the_run_continues_finishes_and_has_nothing_left(tmp_path):
    out = str(tmp_path / "out")
    log = open(tmp_path / "sigterm.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "launch.py", *RUN, f"run.out_dir={out}"],
        cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        first = os.path.join(out, "checkpoints", step_name(STEPS))  # epoch 1's, committed
        end = time.monotonic() + 240
        while not os.path.exists(first) and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    log.seek(0)
    text = log.read()
    assert code == 143, text[-3000:]  # 128 + SIGTERM: an interrupted run is not a success
    m = re.search(r"stopped by SIGTERM at epoch (\d+) step (\d+); checkpoint saved in", text)
    assert m, text[-3000:]
    epoch, step = int(m.group(1)), int(m.group(2))
    assert step_name((epoch - 1) * STEPS + step) in checkpoints(out)  # the stop's own checkpoint
    assert step_name(2 * STEPS) not in checkpoints(out)

    again = launch(out)  # the same command continues
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stderr
    assert epochs(out) == [1, 2]
    assert checkpoints(out)[-1] == step_name(2 * STEPS)

    metrics_before = open(os.path.join(out, "metrics.jsonl")).read()
    ckpts_before = {p: os.path.getmtime(os.path.join(out, "checkpoints", p)) for p in checkpoints(out)}
    done = launch(out)  # finished: it says so and trains nothing
    assert done.returncode == 0, done.stderr[-3000:]
    assert "this run is complete, nothing to do" in done.stderr
    assert "epoch 1/2" not in done.stdout and "epoch 2/2" not in done.stdout
    assert open(os.path.join(out, "metrics.jsonl")).read() == metrics_before
    assert {p: os.path.getmtime(os.path.join(out, "checkpoints", p)) for p in checkpoints(out)} == ckpts_before

    fresh = launch(out, "run.resume=false", "train.epochs=1")  # starts over: the old checkpoints go
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "deleted the old checkpoints" in fresh.stderr
    assert os.listdir(os.path.join(out, "checkpoints")) == [step_name(STEPS)]
    assert epochs(out) == [1]


@pytest.mark.parametrize(
    "command, signum",
    [
        (["launch.py"], signal.SIGTERM),
        (["-m", "distlib.runner"], signal.SIGINT),
        (["-m", "distlib.runner"], signal.SIGTERM),
    ],
)
def test_a_stop_during_the_imports_is_one_line_and_128_plus_the_signal(tmp_path, command, signum):
    """The checkout's launch.py and the installed command alike: their handlers are in place before
    torch's import (``import distlib`` loads no torch), so a stop in the first second is one line."""
    proc = subprocess.Popen([sys.executable, *command, *RUN, f"run.out_dir={tmp_path}"], cwd=ROOT, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(0.8)  # inside the imports: torch alone takes seconds
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err[-2000:]
    said = "error: interrupted" + ("" if signum == signal.SIGINT else " by SIGTERM")
    assert err.strip() == said, err[-2000:]
