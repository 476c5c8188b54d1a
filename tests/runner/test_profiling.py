"""StepProfiler: a valid Chrome trace and a sorted table per rank, the right steps,
partial and empty recordings, and the sort key on CPU and GPU."""

from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from distlib.runner.observability.profiling import StepProfiler, device_sort_key


def train_steps(prof: StepProfiler, n: int, device: str = "cpu") -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof.start()
    for _ in range(n):
        x = torch.randn(16, 3, 8, 8, device=device)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        prof.step()
    prof.close()


def _us(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()
    return float(value) * {"us": 1, "ms": 1e3, "s": 1e6}[unit]


def table_column(table: str, header: str) -> list[float]:
    """The values of one time column of key_averages().table(), top to bottom."""
    lines = table.splitlines()
    head = next(i for i, line in enumerate(lines) if header in line)
    names = re.split(r"\s{2,}", lines[head].strip())
    col = names.index(header)
    values = []
    for line in lines[head + 2 :]:
        if line.startswith("---"):
            break
        values.append(_us(re.split(r"\s{2,}", line.strip())[col]))
    return values


def test_writes_a_chrome_trace_and_a_table_sorted_by_self_cpu_time(tmp_path):
    prof = StepProfiler(str(tmp_path / "profile"), rank=3, device=torch.device("cpu"), wait=1, warmup=1, active=2)
    train_steps(prof, 6)
    with open(tmp_path / "profile" / "trace_rank3.json") as f:
        trace = json.load(f)  # valid JSON, as chrome://tracing and Perfetto read it
    names = {e.get("name") for e in trace["traceEvents"]}
    # steps 2 and 3 (from 0) are the active ones: wait=1, warmup=1
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names
    assert not {"ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#4"} & names
    assert any(str(n).startswith("aten::") for n in names)
    table = (tmp_path / "profile" / "table_rank3.txt").read_text()
    assert "aten::" in table and "Self CPU" in table
    times = table_column(table, "Self CPU")
    assert len(times) > 3 and times == sorted(times, reverse=True)


def test_a_run_that_ends_while_recording_still_writes(tmp_path):
    prof = StepProfiler(str(tmp_path), rank=0, device=torch.device("cpu"), wait=1, warmup=1, active=10)
    train_steps(prof, 4)
    assert prof.written
    names = {e.get("name") for e in json.loads((tmp_path / "trace_rank0.json").read_text())["traceEvents"]}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names


def test_too_short_a_run_warns_and_writes_nothing(tmp_path, capsys):
    prof = StepProfiler(str(tmp_path), rank=0, device=torch.device("cpu"), wait=5, warmup=2, active=2)
    train_steps(prof, 3)
    assert not prof.written and not (tmp_path / "trace_rank0.json").exists()
    assert "fewer than profile.wait + profile.warmup + 1 = 8" in capsys.readouterr().err


def test_disabled_does_nothing(tmp_path):
    prof = StepProfiler(str(tmp_path / "p"), rank=0, device=torch.device("cpu"), enabled=False)
    train_steps(prof, 3)
    assert not (tmp_path / "p").exists() and prof.steps == 0


def test_bad_schedule_is_named():
    with pytest.raises(ValueError, match="active >= 1"):
        StepProfiler("x", 0, torch.device("cpu"), active=0)


def test_sort_key():
    cpu_only = [SimpleNamespace(self_device_time_total=0, self_cpu_time_total=5)]
    assert device_sort_key(cpu_only) == "self_cpu_time_total"
    assert device_sort_key([SimpleNamespace(self_device_time_total=7)]) == "self_device_time_total"
    # an older torch knows only the CUDA name
    assert device_sort_key([SimpleNamespace(self_cuda_time_total=7)]) == "self_cuda_time_total"
    assert device_sort_key([]) == "self_cpu_time_total"


@pytest.mark.gpus(1)
def test_on_gpu_the_table_is_sorted_by_device_time_and_the_trace_has_kernels(tmp_path):
    prof = StepProfiler(str(tmp_path), rank=0, device=torch.device("cuda"), wait=1, warmup=1, active=2)
    train_steps(prof, 5, device="cuda")
    trace = json.loads((tmp_path / "trace_rank0.json").read_text())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])
    table = (tmp_path / "table_rank0.txt").read_text()
    header = "Self CUDA" if "Self CUDA" in table else "Self DEVICE"
    times = table_column(table, header)
    assert times[0] > 0 and times == sorted(times, reverse=True)
    assert os.path.getsize(tmp_path / "trace_rank0.json") > 1000


def test_config_rejects_a_bad_schedule_before_anything_starts():
    from distlib.runner.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, ["profile.active=0", "profile.wait=-1", "profile.warmup=x"])
    assert e.value.problems == [
        "profile.warmup: expected int, got 'x'",
        "profile.active: must be > 0, got 0",
        "profile.wait: must be >= 0, got -1",
    ]
