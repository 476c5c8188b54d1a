"""Fixtures of the runner's tests, and what they read from a run's checkpoints."""

from __future__ import annotations

import io
import os
import re
import tempfile
from typing import Any

import pytest
import torch

# what torchrun sets: a test of a one-process run removes them
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def world_size_1(monkeypatch):
    """This process as a world of one: no torchrun variables, one thread (as a torchrun rank has here)."""
    for key in TORCHRUN_VARS:
        monkeypatch.delenv(key, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def checkpoints(out_dir) -> list[str]:
    """The names of a run's committed checkpoints, ``step<global step, 9 digits>``, oldest first."""
    directory = os.path.join(out_dir, "checkpoints")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(n for n in names if re.fullmatch(r"step\d{9}", n))


def step_name(step: int) -> str:
    """The directory name of the checkpoint of global step ``step``."""
    return f"step{step:09d}"


def saved(out_dir, step: int | None = None) -> dict[str, Any]:
    """A run's checkpoint of global ``step`` (the newest when None) as one dict: every object's state
    dict with whole tensors (``export_checkpoint``), and under ``ranks`` each saved rank's own values
    (RNG states, buffers, ``rank_state_dict()``s), in rank order."""
    from distlib.checkpoint.sharded import export_checkpoint

    directory = os.path.join(out_dir, "checkpoints")
    source = os.path.join(directory, step_name(step)) if step is not None else directory
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "state.pt")
        export_checkpoint(source, path)
        state = torch.load(path, weights_only=True)
    state["ranks"] = torch.load(io.BytesIO(state.pop("rank_states")["ranks"]), weights_only=True)
    return state
