"""Fixtures of the runner's tests."""

from __future__ import annotations

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
