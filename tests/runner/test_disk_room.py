"""The checkpoint size the runner checks the disk for, against checkpoints actually written."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from distlib.checkpoint.sharded import ShardedCheckpointer
from distlib.runner.training.disk_room import checkpoint_bytes


def _files_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


def _model(frozen_base: bool) -> nn.Module:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(384, 512), nn.BatchNorm1d(512), nn.Linear(512, 320, dtype=torch.bfloat16))
    model.append(nn.Linear(320, 11))
    if frozen_base:  # a base that does not train, under layers that do (a LoRA model's shape)
        model[0].requires_grad_(False)
        model[2].requires_grad_(False)
    return model


@pytest.mark.parametrize(("frozen_base", "optimizer"), [(False, "adamw"), (True, "adamw"), (True, "sgd")])
def test_the_estimate_is_the_size_of_a_written_checkpoint(tmp_path, world_size_1, frozen_base, optimizer):
    """The model's tensors (the frozen base left out, as the checkpoints leave it) and the optimizer's
    state, within DCP's metadata, for AdamW and momentum SGD, with a frozen base and without."""
    model = _model(frozen_base)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained) if optimizer == "adamw" else torch.optim.SGD(trained, lr=0.1, momentum=0.9)
    model[3](model[2](model[1](model[0](torch.randn(8, 384))).bfloat16()).float()).sum().backward()
    opt.step()  # the state exists from the first step on
    ShardedCheckpointer(str(tmp_path), keep=1, frozen=False).save(1, {"model": model, "optimizer": opt})
    written = _files_bytes(str(tmp_path))
    need = checkpoint_bytes(model, optimizer, momentum=0.9)
    assert need <= written <= need * 1.05 + 64_000, (need, written)  # DCP's metadata and pickles on top
    if frozen_base:  # far less than the whole model's tensors would be
        whole = sum(t.numel() * t.dtype.itemsize for t in model.state_dict().values())
        assert need < whole
