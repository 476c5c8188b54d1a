"""distlib.runner.hf.dcp_tensors: rows of a DCP checkpoint's tensors read straight from their torch.save
records equal what dcp.load gives, for every dtype and shape (a 0-dim one, an empty one), in any
row range; a tensor whose record is not a contiguous one (a transposed tensor) is read by dcp.load
instead; a truncated file is an error naming it. Fully sharded chunks (one record per rank) are
covered by the export round trip at two ranks (test_hf_causal_lm)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from distlib.runner.hf.dcp_tensors import CheckpointReadError, CheckpointTensors


def _saved(path: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {
        "model.w": torch.randn(9, 4, generator=g),
        "model.b": torch.randn(4, generator=g).to(torch.bfloat16),
        "model.steps": torch.arange(7),
        "model.flags": torch.rand(5, generator=g) > 0.5,
        "model.scale": torch.tensor(3.0, dtype=torch.float64),
        "model.empty": torch.zeros(0, 3),
        "model.t": torch.randn(4, 6, generator=g).t(),  # strided: its record holds the transpose's storage
        "other.x": torch.ones(2),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # that it saves in one process
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=2), no_dist=True)
    return state


def test_rows_read_from_the_records_equal_the_saved_tensors(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    state = _saved(path)
    loaded = []
    original = CheckpointTensors._load
    monkeypatch.setattr(CheckpointTensors, "_load", lambda self, name, into: loaded.append(name) or original(
        self, name, into))  # fmt: skip
    with CheckpointTensors(path, "model.") as tensors:
        assert set(tensors.shapes) == {k for k in state if k.startswith("model.")}
        assert tensors.shapes["model.w"] == ((9, 4), torch.float32) and tensors.shapes["model.scale"] == (
            (),
            torch.float64,
        )
        buf = torch.empty(1024, dtype=torch.uint8)
        for name in tensors.shapes:
            t = tensors.tensor(name)
            assert t.dtype == state[name].dtype and torch.equal(t, state[name]), name
        for start, stop in [(0, 9), (2, 5), (8, 9), (4, 4)]:
            assert torch.equal(tensors.rows("model.w", start, stop, buf[64:]), state["model.w"][start:stop])
        assert torch.equal(tensors.rows("model.t", 1, 3, buf), state["model.t"][1:3])
        assert tensors.splittable("model.w") and not tensors.splittable("model.scale")
        with pytest.raises(ValueError, match="rows"):
            tensors.rows("model.w", 3, 10, buf)
        with pytest.raises(ValueError, match="144 needed"):
            tensors.rows("model.w", 0, 9, buf[:100])
    # only the strided tensor went through dcp.load (twice: whole, then for its rows)
    assert loaded == ["model.t", "model.t"]


def test_a_truncated_file_is_an_error_naming_it(tmp_path):
    path = str(tmp_path / "ck")
    _saved(path)
    with CheckpointTensors(path, "model.") as tensors:
        buf = torch.empty(1024, dtype=torch.uint8)
        tensors.rows("model.w", 0, 1, buf)  # its record found while the file is whole
        chunk = next(c for c in tensors._chunks["model.w"])
        with open(chunk.file, "r+b") as f:
            f.truncate(tensors._data[chunk] + 10)
        with pytest.raises(CheckpointReadError, match=rf"{os.path.basename(chunk.file)} ends at"):
            tensors.rows("model.w", 0, 9, buf)
