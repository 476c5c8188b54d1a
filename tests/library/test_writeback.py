"""Files handed to the disk as they are written (distlib/checkpoint/writeback.py): every byte lands
where a plain file puts it, every range is started once and in order, and a sharded checkpoint whose
files pass the writeback size, saved by three ranks, loads the state it saved."""

from __future__ import annotations

import os
import random

import torch
from torch import nn

from distlib.checkpoint import writeback
from distlib.checkpoint.sharded import ShardedCheckpointer
from tests.conftest import run_ranks


def _spy(monkeypatch) -> list[tuple[int, int, int]]:
    """Every (inode, offset, length) the writeback hands to the disk, the advice still given."""
    calls, advise = [], os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_DONTNEED
        calls.append((os.fstat(fd).st_ino, offset, length))
        advise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    return calls


def test_a_file_written_back_as_it_grows_holds_every_byte_and_starts_each_range_once_in_order(tmp_path, monkeypatch):
    calls = _spy(monkeypatch)
    rng = random.Random(11)
    # 40 writes from 1 byte to three times the writeback size: several ranges in one write, many in none
    chunks = [rng.randbytes(rng.choice([1, 13, 999, 1000, 1001, 3071])) for _ in range(40)]
    path = tmp_path / "f.bin"
    with writeback.WritingBack(path, every=1000) as f:
        for i, chunk in enumerate(chunks):
            assert f.write(chunk) == len(chunk)
            assert f.tell() == sum(map(len, chunks[: i + 1]))  # DCP records each item's offset with tell()
    data = b"".join(chunks)
    assert path.read_bytes() == data
    assert calls, "no range was handed to the disk"
    starts = [offset for _, offset, _ in calls]
    ends = [offset + length for _, offset, length in calls]
    assert starts == [0, *ends[:-1]]  # contiguous, each once, in order
    assert all(length >= 1000 for _, _, length in calls)
    assert len(data) - ends[-1] < 1000 + max(map(len, chunks))  # only the tail is left to the fsync


def _save_and_load(ctx, directory: str) -> list[float]:
    writeback.EVERY = 4096  # each rank's files pass it many times (the default is 64 MiB)
    calls = []
    advise = os.posix_fadvise
    os.posix_fadvise = lambda fd, offset, length, advice: (calls.append(length), advise(fd, offset, length, advice))
    torch.manual_seed(5)  # replicated: every rank the same weights and optimizer state
    model = nn.Sequential(nn.Linear(300, 200), nn.ReLU(), nn.Linear(200, 7))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 300)).sum().backward()
    opt.step()
    ck = ShardedCheckpointer(directory)
    ck.save(12, {"model": model, "optimizer": opt}, async_=True)
    ck.close()
    os.posix_fadvise = advise
    fresh = nn.Sequential(nn.Linear(300, 200), nn.ReLU(), nn.Linear(200, 7))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    assert ShardedCheckpointer(directory).resume({"model": fresh, "optimizer": fresh_opt}) == 12
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"],
                               rtol=0, atol=0)  # fmt: skip
    return calls


def test_a_sharded_checkpoint_written_back_as_it_grows_loads_what_three_ranks_saved(tmp_path):
    calls = run_ranks(_save_and_load, 3, str(tmp_path / "ck"))
    # DCP writes a replicated tensor once, on one rank or another: over the ranks, the weights at least
    assert sum(map(sum, calls)) >= 200 * 300 * 4
    assert all(length >= 4096 for c in calls for length in c)


def test_a_file_system_that_refuses_the_advice_is_written_all_the_same(tmp_path, monkeypatch):
    def refuse(fd: int, offset: int, length: int, advice: int) -> None:
        raise OSError(29, "Illegal seek")  # ESPIPE, as for a pipe

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    data = random.Random(3).randbytes(5000)
    with writeback.WritingBack(tmp_path / "f.bin", every=1000) as f:
        for i in range(0, len(data), 700):
            f.write(data[i : i + 700])
    assert (tmp_path / "f.bin").read_bytes() == data
