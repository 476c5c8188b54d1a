"""What RunDir puts on the disk, and when: every metrics row synced as it is written, and the
files it rewrites (config.yaml, metrics.jsonl trimmed on resume) replaced whole or not at all."""

from __future__ import annotations

import builtins
import json
import os

import pytest

from distlib.checkpoint import disk
from distlib.checkpoint.disk import DiskFull
from distlib.runner.observability.run_dir import RunDir


def test_each_metrics_row_is_synced_to_the_disk_as_it_is_written(tmp_path, monkeypatch):
    """A row the run has printed must survive a power cut or a killed node: the resumed run trims
    the file to its checkpoint and must find every earlier epoch's row."""
    synced: list[tuple[str, int]] = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    run = RunDir(str(tmp_path), is_main=True)
    for epoch in (1, 2, 3):
        run.log_metrics({"epoch": epoch, "train_loss": 1.0 / epoch})
        # synced before log_metrics returns, with the whole row in it
        assert synced[-1] == (run.metrics_path, os.path.getsize(run.metrics_path)), synced
    assert len(synced) == 3


class _FullDisk:
    """A file opened for writing that takes half of what is written, then fails as a full disk does."""

    def __init__(self, f):
        self.f = f

    def write(self, text: bytes) -> int:
        self.f.write(text[: len(text) // 2])
        self.f.flush()
        raise OSError(28, "No space left on device")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


@pytest.mark.parametrize("what", ["config", "trimmed metrics"])
def test_a_failed_rewrite_leaves_the_previous_file_whole(tmp_path, monkeypatch, what):
    run = RunDir(str(tmp_path), is_main=True)
    run.write_text("config.yaml", "model:\n  name: small_cnn\n")
    rows = [{"epoch": e, "train_loss": 1.0 / e} for e in (1, 2, 3)]
    for row in rows:
        run.log_metrics(row)
    before = {name: open(tmp_path / name).read() for name in ("config.yaml", "metrics.jsonl")}

    def full_disk_open(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        return _FullDisk(f) if "w" in mode else f

    monkeypatch.setattr(disk, "open", full_disk_open, raising=False)  # the writer's open(), not the builtin
    name = "config.yaml" if what == "config" else "metrics.jsonl"
    with pytest.raises(DiskFull, match=f"the disk is full: writing {name} into {tmp_path}"):
        if what == "config":
            run.write_text("config.yaml", "model:\n  name: resnet18\n" * 50)
        else:
            run.start_metrics(1)  # a resume trims the rows after its checkpoint
    for name, text in before.items():
        assert open(tmp_path / name).read() == text, name
    assert sorted(os.listdir(tmp_path)) == ["config.yaml", "metrics.jsonl"]  # the temporary file removed
    assert [json.loads(line) for line in before["metrics.jsonl"].splitlines()] == rows
