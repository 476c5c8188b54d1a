"""distlib.runner.hf.safetensors_stream: the streamed file holds, tensor for tensor, what save_file
writes for the same (cast) tensors, in one group or in many, its header valid for safe_open; a read
that fails leaves no file behind."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

pytest.importorskip("safetensors")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from distlib.runner.hf import safetensors_stream  # noqa: E402
from distlib.runner.hf.safetensors_stream import Entry  # noqa: E402


def _source() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed.weight": torch.randn(37, 5, generator=g),  # larger than a group below: split into parts
        "model.norm.weight": torch.rand(5, generator=g) + 0.5,
        "model.layers.0.proj.weight": torch.randn(6, 3, generator=g),
        "half.weight": torch.randn(4, 4, generator=g).to(torch.bfloat16),  # already in the written dtype
        "positions": torch.arange(11),  # an int buffer: written as it is
        "mask": torch.rand(3, 3, generator=g) > 0.5,
        "scale": torch.tensor(2.5),  # 0-dim
        "empty": torch.zeros(0, 4),
        "wide": torch.randn(2, 3, generator=g, dtype=torch.float64),
    }


def _entries(source: dict[str, torch.Tensor], dtype: torch.dtype) -> list[Entry]:
    return [Entry(k, tuple(v.shape), dtype if v.is_floating_point() else v.dtype, v.dtype, splittable=True)
            for k, v in source.items()]  # fmt: skip


def _read(source: dict[str, torch.Tensor], calls: list | None = None):
    def read(e: Entry, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        if calls is not None:
            calls.append((e.name, start, stop))
        t = source[e.name]
        part = t[start:stop] if t.dim() else t
        return out[: part.nbytes].view(part.dtype).view(part.shape).copy_(part)  # into the buffer, as a reader does

    return read


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group_bytes", [1 << 20, 200], ids=["one-group", "many-groups"])
def test_the_streamed_file_holds_what_save_file_writes(tmp_path, dtype, group_bytes):
    source = _source()
    streamed, reference = str(tmp_path / "streamed.safetensors"), str(tmp_path / "reference.safetensors")
    calls: list = []
    n = safetensors_stream.write(streamed, _entries(source, dtype), _read(source, calls), metadata={"format": "pt"},
                                 group_bytes=group_bytes, part_bytes=64, threads=3)  # fmt: skip
    save_file({k: v.to(dtype) if v.is_floating_point() else v for k, v in source.items()}, reference,
              metadata={"format": "pt"})  # fmt: skip
    assert n == os.path.getsize(streamed) == os.path.getsize(reference)
    assert sorted(os.listdir(tmp_path)) == ["reference.safetensors", "streamed.safetensors"]  # no .tmp left
    got, want = load_file(streamed), load_file(reference)
    assert got.keys() == want.keys() == source.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k
    # the embedding (740 bytes of fp32) was read in parts of at most 64 bytes: rows of 20 bytes, 3 at a time
    assert sorted(c[1:] for c in calls if c[0] == "model.embed.weight") == [
        (i, min(i + 3, 37)) for i in range(0, 37, 3)
    ]
    with safe_open(streamed, framework="pt") as f:
        assert f.metadata() == {"format": "pt"} and set(f.keys()) == set(source)
        assert torch.equal(f.get_tensor("positions"), torch.arange(11))
    with open(streamed, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        text = f.read(size)
    assert size % 8 == 0 and text.rstrip(b" ").endswith(b"}")  # padded with spaces to a multiple of 8
    header = json.loads(text)
    assert next(iter(header)) == "__metadata__"
    at = 0
    for start, stop in sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__"):  # back to back
        assert start == at
        at = stop
    assert at == n - 8 - size
    itemsize = {"F64": 8, "I64": 8, "F32": 4, "BF16": 2, "BOOL": 1}
    assert all(v["data_offsets"][0] % itemsize[v["dtype"]] == 0 for k, v in header.items() if k != "__metadata__")


def test_a_failed_read_leaves_the_old_file_and_no_partial_one(tmp_path):
    source = _source()
    path = str(tmp_path / "model.safetensors")
    safetensors_stream.write(path, _entries(source, torch.bfloat16), _read(source), group_bytes=200, part_bytes=64)
    before = open(path, "rb").read()
    inner = _read(source)

    def failing(e, start, stop, out):
        if e.name == "model.layers.0.proj.weight":
            raise OSError("the disk went away")
        return inner(e, start, stop, out)

    with pytest.raises(OSError, match="the disk went away"):
        safetensors_stream.write(path, _entries(source, torch.float32), failing, group_bytes=200, part_bytes=64)
    assert os.listdir(tmp_path) == ["model.safetensors"] and open(path, "rb").read() == before


def test_a_read_of_the_wrong_shape_or_dtype_and_repeated_names_are_errors(tmp_path):
    source = {"a": torch.ones(4, 2)}
    entries = _entries(source, torch.bfloat16)
    with pytest.raises(ValueError, match=r"a: read gave \(4, 2\) torch.float64, expected \(4, 2\) torch.float32"):
        safetensors_stream.write(str(tmp_path / "x"), entries, lambda e, s, t, out: torch.ones(4, 2).double())
    with pytest.raises(ValueError, match="names repeat"):
        safetensors_stream.write(str(tmp_path / "x"), entries * 2, _read(source))
    assert os.listdir(tmp_path) == []
