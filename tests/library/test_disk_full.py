"""A full disk (distlib/checkpoint/disk.py): how it is recognised, the writes that leave nothing torn
behind, and a sharded save that finds it: ``DiskFull`` on every rank, the partial directory removed,
the committed checkpoints intact and resumable.

The ranks' disk is filled by a file system that takes a given number of bytes from one rank and then
fails as a full disk does (ENOSPC), put in place of DCP's in the rank processes; the runner's
end-to-end tests (tests/runner/test_disk_full.py) use a real small file system."""

from __future__ import annotations

import contextlib
import errno
import json
import os

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from distlib.checkpoint import disk
from distlib.checkpoint.disk import DiskFull, append_line, is_disk_full, write_file
from tests.conftest import run_ranks

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_or_quota_is_recognised_however_it_arrives():
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    try:
        try:
            raise ENOSPC
        except OSError as e:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from e
    except RuntimeError as e:
        chained = e  # torch.save's zip writer: its own error, the OSError as its cause
    dcp = CheckpointException("ranks:dict_keys([2])", {2: (quota, None)})  # DCP: rank -> (error, traceback)
    text_only = RuntimeError(f"PytorchStreamWriter failed writing file data/0: [Errno 28] {os.strerror(28)}")
    for e in (ENOSPC, quota, chained, dcp, text_only):
        assert is_disk_full(e), e
    for e in (OSError(errno.EACCES, "Permission denied"), RuntimeError("unexpected pos 704 vs 598"), None):
        assert not is_disk_full(e), e


class _FillsAfter:
    """``os.write`` that writes ``room`` bytes in all, then fails as a full disk (the last write short)."""

    def __init__(self, room: int):
        self.room = room

    def __call__(self, fd: int, data: bytes) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = os.write(fd, bytes(data)[: self.room])
        self.room -= n
        return n


@pytest.mark.parametrize("room", [0, 7, 30])
def test_a_line_goes_in_whole_or_not_at_all(tmp_path, monkeypatch, room):
    path = str(tmp_path / "metrics.jsonl")
    rows = [{"step": s, "train_loss": 1.0 / s} for s in (3, 6, 9)]
    for row in rows:
        append_line(path, json.dumps(row))
    before = open(path, "rb").read()
    fake_os = type("os", (), {**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")}})
    fake_os.write = staticmethod(_FillsAfter(room))
    monkeypatch.setattr(disk, "os", fake_os)
    with pytest.raises(DiskFull, match=rf"the disk is full: writing metrics.jsonl into {tmp_path} needs about "):
        append_line(path, json.dumps({"step": 12, "train_loss": 0.5, "val_loss": 0.75}))
    assert open(path, "rb").read() == before  # what went in was taken back: no torn line
    assert [json.loads(line) for line in open(path)] == rows


def test_a_file_rewritten_on_a_full_disk_stays_as_it_was_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = str(tmp_path / "summary.json")
    write_file(path, '{"total_s": 1.0}\n')

    class _Half:
        def __init__(self, f):
            self.f = f

        def write(self, data: bytes) -> int:
            self.f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(disk, "open", lambda p, mode="r": _Half(open(p, mode)), raising=False)
    with pytest.raises(DiskFull, match="writing summary.json into .* needs about 2.0 KiB"):
        write_file(path, "x" * 2048)
    assert open(path).read() == '{"total_s": 1.0}\n' and os.listdir(tmp_path) == ["summary.json"]


# ---- a sharded save on a full disk, at 3 ranks ---------------------------------------------------


class _Fills:
    """A stream that takes ``room[0]`` more bytes in all (shared by the rank's files), then fails as a full disk."""

    def __init__(self, stream, room: list[int]):
        self.stream, self.room = stream, room

    def write(self, data) -> int:
        data = bytes(memoryview(data).cast("B"))
        if len(data) > self.room[0]:
            self.stream.write(data[: max(self.room[0], 0)])
            self.room[0] = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room[0] -= len(data)
        return self.stream.write(data)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _fill_disk_of_rank(full_rank: int, room: int) -> None:
    """In this rank's process: DCP's file system of the sharded saves takes ``room`` bytes of ``full_rank``'s
    files, then finds the disk full."""
    from distlib.checkpoint import sharded
    from distlib.distributed import collectives

    left = [room]

    class Filling(sharded._WriteErrors):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as stream:
                yield _Fills(stream, left) if collectives.rank() == full_rank else stream

    sharded._WriteErrors = Filling


def _save_on_a_full_disk(ctx, directory: str, how: str, full_rank: int) -> dict:
    """Two committed saves; then one whose writes find the disk full on ``full_rank``; then a resume."""
    from distlib.checkpoint.sharded import ShardedCheckpointer, verify

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()  # the optimizer's state exists
    objects = {"model": model, "optimizer": opt, "train": {"step": 0}}
    ck = ShardedCheckpointer(directory, keep=3)
    for step in (10, 20):
        objects["train"]["step"] = step
        ck.save(step, objects, async_=how != "sync")
    ck.wait()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _fill_disk_of_rank(full_rank, room=4096)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # what the failed save holds: not what a resume must find
    objects["train"]["step"] = 30
    error = None
    try:
        ck.save(30, objects, async_=how != "sync", in_place=how == "in place")
        ck.wait()
    except DiskFull as e:
        error = str(e)
    names = sorted(os.listdir(directory))
    for name in names:
        verify(os.path.join(directory, name))  # every committed checkpoint whole
    fresh = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    fresh(torch.randn(4, 64)).sum().backward()
    fresh_opt.step()
    state = {"model": fresh, "optimizer": fresh_opt, "train": {"step": -1}}
    step = ShardedCheckpointer(directory).resume(state)
    same = all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
    return {"error": error, "names": names, "step": step, "train": state["train"]["step"], "same": same}


@pytest.mark.parametrize("how", ["sync", "background", "in place"])
def test_a_save_that_finds_the_disk_full_ends_on_every_rank_in_one_line_and_keeps_the_committed_ones(tmp_path, how):
    """Rank 2 of 3 fills the disk (not rank 0, which removes the partial directory): every rank raises the
    same DiskFull (the directory, the checkpoint, what it needs and what is free), the partial directory is
    gone, the two committed checkpoints verify and the newest resumes."""
    directory = str(tmp_path / "ckpt")
    results = run_ranks(_save_on_a_full_disk, 3, directory, how, 2, timeout=240)
    first = results[0]["error"]
    assert first is not None and all(r["error"] == first for r in results), results
    assert first.startswith(f"the disk is full: writing checkpoint step000000030 into {directory} needs about ")
    assert "free there; the partial save is removed, the committed checkpoints (the newest step000000020) are " \
        "intact" in first, first  # fmt: skip
    assert all(r["names"] == ["step000000010", "step000000020"] for r in results), results  # no .partial-
    assert all(r["step"] == 20 and r["train"] == 20 and r["same"] for r in results), results


def test_the_message_counts_what_a_checkpoint_needs(tmp_path):
    """The need is the state's bytes (or the last checkpoint's files, when larger): 5,200 fp32 parameters
    and AdamW's two moments of each, 60.9 KiB; the message's figure is at least that."""
    directory = str(tmp_path / "ckpt")
    results = run_ranks(_save_on_a_full_disk, 2, directory, "sync", 1, timeout=240)
    need = float(results[0]["error"].split("needs about ")[1].split(" KiB")[0])
    assert 3 * 5200 * 4 / 1024 <= need < 2 * 3 * 5200 * 4 / 1024, results[0]["error"]
