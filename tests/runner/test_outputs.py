"""What a run leaves in run.out_dir: the curves PNG, environment.json, and (end to
end, under torchrun) the progress lines, the summary and the per-rank profile."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import distlib
from distlib.runner.observability.environment import environment_json, git_commit
from distlib.runner.observability.plots import CurvePlot, plot_curves, plot_detached
from tests.conftest import ROOT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ENV_KEYS = {
    "distlib", "python", "platform", "hostname", "torch", "torchvision", "cuda", "cudnn", "cudnn_benchmark", "nccl",
    "gpu_count", "gpus", "world_size", "local_world_size", "nodes", "backend", "git", "argv", "ranks",
}  # fmt: skip


def rows(n: int, eval_every: int = 1) -> list[dict]:
    return [
        {"epoch": e, "train_loss": 2.0 / e, "test_acc": 0.1 * e if e % eval_every == 0 or e == n else None}
        for e in range(1, n + 1)
    ]


def assert_png(path) -> None:
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == PNG_MAGIC and len(data) > 5000


def test_plot_curves_writes_a_png_also_with_skipped_evaluations(tmp_path):
    plot_curves(rows(6, eval_every=2), str(tmp_path / "sub" / "curves.png"), title="demo")
    assert_png(tmp_path / "sub" / "curves.png")
    assert os.listdir(tmp_path / "sub") == ["curves.png"]  # the temporary file is gone
    plot_curves([{"epoch": 1, "train_loss": 1.0, "test_acc": None}], str(tmp_path / "one.png"))
    assert_png(tmp_path / "one.png")


def test_detached_plot_draws_from_metrics_without_torch_and_reports_failures(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows(4, eval_every=2)))
    assert plot_detached(str(metrics), str(tmp_path / "curves.png"), "demo").wait(timeout=120) == 0
    assert_png(tmp_path / "curves.png")
    assert not (tmp_path / "curves.png.error").exists()
    plot_detached(str(tmp_path / "missing.jsonl"), str(tmp_path / "none.png")).wait(timeout=120)
    assert not (tmp_path / "none.png").exists()
    assert "FileNotFoundError" in (tmp_path / "none.png.error").read_text()


def test_curve_plot_redraws_only_when_due_and_only_on_the_main_rank(tmp_path):
    path = tmp_path / "curves.png"
    plot = CurvePlot(str(path), rows(2), every_s=3600)
    plot.log({"epoch": 3, "train_loss": 0.5, "test_acc": 0.4}, step=3)
    assert not path.exists()  # not due yet: training is not held up by drawing
    plot.write()
    assert_png(path)
    assert [r["epoch"] for r in plot.rows] == [1, 2, 3]  # rows of a resumed run come first

    eager = CurvePlot(str(tmp_path / "eager.png"), every_s=0)
    eager.log(rows(1)[0], step=1)
    assert_png(tmp_path / "eager.png")

    other_rank = CurvePlot(str(tmp_path / "no.png"), rows(3), enabled=False, every_s=0)
    other_rank.log(rows(1)[0], step=1)
    other_rank.write()
    assert not (tmp_path / "no.png").exists()


def test_curves_are_redrawn_during_training_at_most_once_a_minute(tmp_path, monkeypatch):
    from distlib.runner.observability import plots

    clock, drawn = [0.0], []
    monkeypatch.setattr(plots, "time", SimpleNamespace(monotonic=lambda: clock[0]))  # plots' clock only
    monkeypatch.setattr(plots, "plot_curves", lambda rows, path, title="": drawn.append((clock[0], len(rows))))
    plot = CurvePlot(str(tmp_path / "curves.png"))
    for t, row in zip((30, 61, 62, 100, 121, 122), rows(6)):  # an epoch ends at each of these seconds
        clock[0] = float(t)
        plot.log(row, step=row["epoch"])
    assert drawn == [(61.0, 2), (121.0, 5)]


def test_during_training_the_curves_are_drawn_by_a_detached_process_one_at_a_time(tmp_path, monkeypatch):
    """Given metrics.jsonl, the redraw never imports matplotlib in the training process: a detached
    drawer is started when due, and none while the last one is still drawing."""
    from distlib.runner.observability import plots

    clock, started, running = [0.0], [], [True]
    monkeypatch.setattr(plots, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(plots, "plot_curves", lambda *a, **k: pytest.fail("drawn in the training process"))

    def detached(metrics_path, path, title=""):
        started.append(clock[0])
        return SimpleNamespace(poll=lambda: None if running[0] else 0)

    monkeypatch.setattr(plots, "plot_detached", detached)
    plot = CurvePlot(str(tmp_path / "curves.png"), metrics_path=str(tmp_path / "metrics.jsonl"))
    for t, row in zip((61, 122, 130), rows(3)):  # the first drawer still runs at 122 s
        clock[0] = float(t)
        plot.log(row, step=row["epoch"])
    running[0] = False
    clock[0] = 131.0
    plot.log(rows(4)[3], step=4)
    assert started == [61.0, 131.0]


def test_metrics_cut_short_by_a_crash_are_read_up_to_the_cut_and_trimmed_on_resume(tmp_path):
    from distlib.runner.observability.run_dir import RunDir

    run = RunDir(str(tmp_path / "run"), is_main=True)
    for row in rows(2):
        run.log_metrics(row)
    with open(run.metrics_path, "a") as f:
        f.write('{"epoch": 3, "train_lo')  # the crash hit inside epoch 3's row
    assert run.read_metrics() == rows(2)
    run.start_metrics(1)  # resumed from epoch 1's checkpoint
    assert open(run.metrics_path).read() == json.dumps(rows(2)[0]) + "\n"
    other = RunDir(str(tmp_path / "other"), is_main=False)  # another rank: writes nothing
    other.log_metrics(rows(1)[0])
    other.start_metrics(0)
    assert not (tmp_path / "other").exists()


def test_nodes_are_the_distinct_hosts_of_the_ranks(monkeypatch):
    from distlib.runner.observability import environment

    ranks = [{"rank": 0, "hostname": "a"}, {"rank": 1, "hostname": "a"}, {"rank": 2, "hostname": "b"}]
    monkeypatch.setattr(environment.collectives, "all_gather_object", lambda info: ranks)
    ctx = distlib.init("gloo")
    try:
        env = environment.collect_environment(ctx)
    finally:
        distlib.shutdown()
    assert env["nodes"] == 2 and env["ranks"] == ranks


def test_environment_at_world_size_1():
    ctx = distlib.init("gloo")
    try:
        env = json.loads(environment_json(ctx))
    finally:
        distlib.shutdown()
    assert ENV_KEYS <= set(env)
    assert env["world_size"] == 1 and env["backend"] == "none" and env["nodes"] == 1
    assert env["torch"] == torch.__version__ and env["distlib"] == distlib.__version__
    assert env["gpu_count"] == torch.cuda.device_count() == len(env["gpus"])
    assert [(r["rank"], r["hostname"], r["device"]) for r in env["ranks"]] == [(0, env["hostname"], "cpu")]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_commit(tmp_path):
    assert git_commit(str(tmp_path)) is None  # not a checkout

    def git(*args):
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
            capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip

    git("init", "-q")
    (tmp_path / "f.txt").write_text("a")
    git("add", "f.txt")
    git("commit", "-qm", "one")
    assert git_commit(str(tmp_path)) == {"commit": git("rev-parse", "HEAD"), "dirty": False}
    (tmp_path / "f.txt").write_text("b")
    assert git_commit(str(tmp_path))["dirty"] is True


@pytest.mark.slow
def test_launch_under_torchrun_leaves_its_outputs(tmp_path):
    """Two ranks, plain progress (stdout is a pipe), profiling on: rank 0 alone prints;
    every rank writes its own trace and table."""
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "launch.py",
        "recipes/demo.yaml", f"run.out_dir={out}", "train.epochs=2", "data.train_subset=512",
        "profile.enabled=true", "profile.wait=1", "profile.warmup=1", "profile.active=2",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]

    lines = p.stdout.splitlines()
    assert [line.split("  ")[0] for line in lines[:3]] == ["epoch 1/2", "epoch 2/2", "run summary"]
    assert sum(line.startswith("epoch") for line in lines) == 2  # not once per rank
    assert any(line.split() == ["world", "size", "2"] for line in lines)

    assert any(line.strip().startswith("start to first step ") for line in lines)  # the timeline
    summary = json.loads((out / "summary.json").read_text())
    assert summary["to_first_step_s"] > 0 and summary["total_s"] >= summary["to_first_step_s"] + summary["train_s"]
    deadline = time.monotonic() + 120  # the curves are drawn by a detached process, after the exit
    while not (out / "curves.png").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert {"config.yaml", "metrics.jsonl", "environment.json", "curves.png", "profile"} <= set(os.listdir(out))
    assert_png(out / "curves.png")
    env_json = json.loads((out / "environment.json").read_text())
    assert ENV_KEYS <= set(env_json) and env_json["world_size"] == 2 and env_json["backend"] == "gloo"
    assert [r["rank"] for r in env_json["ranks"]] == [0, 1]  # gathered from every rank
    for rank in (0, 1):
        trace = json.loads((out / "profile" / f"trace_rank{rank}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"ProfilerStep#2", "ProfilerStep#3"} <= names
        assert not {"ProfilerStep#1", "ProfilerStep#4"} & names  # profile.wait and profile.active, not the defaults
        assert any("all_reduce" in str(n) or "allreduce" in str(n) for n in names)  # the gradient sync is in it
        assert "Self CPU" in (out / "profile" / f"table_rank{rank}.txt").read_text()


def test_a_missing_bytecode_cache_is_named_with_its_fix(tmp_path, monkeypatch):
    import py_compile
    import sys

    from distlib.runner.observability.environment import bytecode_hint

    source = tmp_path / "site" / "pkg" / "__init__.py"
    source.parent.mkdir(parents=True)
    source.write_text("x = 1\n")
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # as PYTHONDONTWRITEBYTECODE=1 does
    hint = bytecode_hint(str(source))
    assert hint and "PYTHONPYCACHEPREFIX" in hint and f"compileall -q {tmp_path / 'site'}" in hint, hint
    py_compile.compile(str(source))  # its bytecode cached: nothing to say
    assert bytecode_hint(str(source)) is None
    source.with_name("__pycache__").rename(tmp_path / "gone")
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # Python writes what it compiles: only a first run pays
    assert bytecode_hint(str(source)) is None
