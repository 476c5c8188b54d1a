"""Checkpoints: round trip, atomic writes, retention, corrupt files, foreign checkpoints, per-rank state."""

from __future__ import annotations

import copy
import logging
import os
import random
import stat
import struct

import numpy as np
import pytest
import torch

from distlib.checkpoint.checkpointer import (
    Checkpointer,
    CheckpointError,
    Resumed,
    fingerprint,
    read_verified,
    write_atomic,
)
from distlib.checkpoint.integrity import payload_sha256
from distlib.runner.models.parameters import param_groups
from distlib.runner.models.vision import small_cnn
from distlib.runner.training.schedule import warmup_linear


def make(width: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    model = small_cnn(10, width)
    opt = torch.optim.SGD(param_groups(model, 5e-4), lr=0.1, momentum=0.9, nesterov=True)
    sched = warmup_linear(opt, 100, 0.1)
    return model, opt, sched


def train_steps(model, opt, sched, n: int = 2) -> None:
    for _ in range(n):
        model(torch.randn(4, 3, 16, 16)).logsumexp(1).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def objects(model, opt, sched) -> dict:
    return {"model": model, "optimizer": opt, "scheduler": sched}


@pytest.fixture
def warnings_of_distlib():
    """Records what the distlib logger says (it does not propagate to pytest's caplog)."""
    records: list[logging.LogRecord] = []

    class ListHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = ListHandler(logging.WARNING)
    logger = logging.getLogger("distlib")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def saved_three(tmp_path, keep: int = 3):
    model, opt, sched = make()
    fp = fingerprint(model, lr=0.1)
    ck = Checkpointer(str(tmp_path), keep=keep)
    for epoch in (1, 2, 3):
        train_steps(model, opt, sched)
        ck.save(objects(model, opt, sched), epoch=epoch, step=0, global_step=epoch * 2, fingerprint=fp)
    return ck, fp


def test_round_trip_restores_model_optimizer_schedule_rng_and_position(tmp_path):
    model, opt, sched = make()
    train_steps(model, opt, sched, 3)
    fp = fingerprint(model, **{"model.name": "small_cnn", "train.lr": 0.1})
    ck = Checkpointer(str(tmp_path / "ck"))
    random.seed(5)
    torch.manual_seed(7)
    np.random.seed(9)
    path = ck.save(objects(model, opt, sched), epoch=2, step=5, global_step=21, fingerprint=fp, extra={"t": 1.5})
    assert os.path.basename(path) == "epoch0002-step000005.pt" and ck.last_saved == (2, 5)
    expected_rand, expected_py, expected_np = torch.rand(3), random.random(), np.random.random(3).tolist()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    ref_opt = copy.deepcopy(opt.state_dict())
    train_steps(model, opt, sched, 2)  # move everything away from the saved state

    m2, o2, s2 = make(seed=1)
    reader = Checkpointer(str(tmp_path / "ck"))
    resumed = reader.load(objects(m2, o2, s2), fingerprint=fingerprint(m2, **fp["settings"]))
    assert reader.last_saved == (2, 5)  # the position the loaded checkpoint was saved at
    assert (resumed.epoch, resumed.step, resumed.global_step, resumed.extra) == (2, 5, 21, {"t": 1.5})
    for k, v in m2.state_dict().items():
        assert torch.equal(v, reference[k]), k
    for i, st in ref_opt["state"].items():
        assert torch.equal(o2.state_dict()["state"][i]["momentum_buffer"], st["momentum_buffer"])
    assert s2.last_epoch == 3 and o2.param_groups[0]["lr"] == ref_opt["param_groups"][0]["lr"]
    assert torch.equal(torch.rand(3), expected_rand) and random.random() == expected_py
    assert np.random.random(3).tolist() == expected_np, "numpy's random state must be restored"


def test_file_holds_only_tensors_and_plain_containers(tmp_path):
    ck, _ = saved_three(tmp_path)
    payload = torch.load(ck.paths()[0], weights_only=True)  # would raise on any pickled object

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            assert isinstance(x, (torch.Tensor, str, int, float, bool, type(None))), type(x)

    walk(payload)


def test_empty_directory_is_a_fresh_start(tmp_path):
    model, opt, sched = make()
    assert (
        Checkpointer(str(tmp_path / "none")).load(objects(model, opt, sched), fingerprint=fingerprint(model))
        == Resumed()
    )


def test_keeps_only_the_newest(tmp_path):
    ck, _ = saved_three(tmp_path, keep=2)
    names = [os.path.basename(p) for p in ck.paths()]
    assert names == ["epoch0003-step000000.pt", "epoch0002-step000000.pt"]
    assert sorted(os.listdir(tmp_path)) == sorted(names)  # no temporary files left behind
    with pytest.raises(ValueError, match="keep must be >= 1, got 0"):
        Checkpointer(str(tmp_path), keep=0)


def test_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = str(tmp_path / "epoch0001-step000000.pt")
    write_atomic({"a": torch.ones(3)}, path)

    def crash(obj, f, *a, **k):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        write_atomic({"a": torch.zeros(3)}, path)
    assert os.listdir(tmp_path) == ["epoch0001-step000000.pt"]
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.ones(3))


@pytest.mark.parametrize("damage", ["truncate", "flip_bytes", "empty"])
def test_corrupt_newest_falls_back_to_the_previous(tmp_path, damage, warnings_of_distlib):
    ck, fp = saved_three(tmp_path)
    newest = ck.paths()[0]
    data = bytearray(open(newest, "rb").read())
    if damage == "truncate":
        data = data[: len(data) * 2 // 3]
    elif damage == "flip_bytes":
        for i in range(len(data) // 2, len(data) // 2 + 64):
            data[i] ^= 0xFF
    else:
        data = bytearray()
    open(newest, "wb").write(bytes(data))
    model, opt, sched = make()
    resumed = ck.load(objects(model, opt, sched), fingerprint=fp)
    assert resumed.epoch == 2 and resumed.path == ck.paths()[1]
    text = " ".join(r.getMessage() for r in warnings_of_distlib)
    assert "epoch0003-step000000.pt" in text and "older checkpoint" in text


def test_a_changed_tensor_value_fails_the_checksum(tmp_path):
    model, opt, sched = make()
    with torch.no_grad():
        model[-1].bias.fill_(1.2345678)  # a value whose bytes are easy to find in the file
    ck = Checkpointer(str(tmp_path))
    path = ck.save(objects(model, opt, sched), epoch=1, step=0, global_step=1, fingerprint=fingerprint(model))
    data = bytearray(open(path, "rb").read())
    at = data.find(struct.pack("<f", 1.2345678) * 4)
    assert at > 0
    data[at] ^= 0x01  # the zip and the pickle stay valid: only the records' CRC-32s can tell
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_verified(path)
    # a one-element tensor counts too (BatchNorm's num_batches_tracked, a 0-dim step counter)
    path = ck.save(objects(model, opt, sched), epoch=2, step=0, global_step=2, fingerprint=fingerprint(model))
    read_verified(path)
    counter = next(v for v in model.state_dict().values() if v.dim() == 0)
    data = bytearray(open(path, "rb").read())
    at = data.find(counter.numpy().tobytes() + b"PK")  # the record's bytes, then the next zip header
    assert at > 0
    data[at] ^= 0x01
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_verified(path)


def test_a_version_1_checkpoint_with_its_sha256_still_loads_and_is_checked(tmp_path):
    """Files of the format before the CRC-32s: a sha256 of the payload, computed before writing."""
    model, opt, sched = make()
    ck = Checkpointer(str(tmp_path))
    path = ck.save(objects(model, opt, sched), epoch=1, step=0, global_step=1, fingerprint=fingerprint(model))
    payload = torch.load(path, weights_only=True)
    payload["version"] = 1
    del payload["record_crc32"]
    payload["checksum"] = payload_sha256(payload)
    write_atomic(payload, path)
    assert read_verified(path)["version"] == 1
    payload["position"]["step"] = 7  # another payload, a stale sha256
    write_atomic(payload, path)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_verified(path)


def test_no_readable_checkpoint_is_a_clear_error(tmp_path):
    ck, fp = saved_three(tmp_path)
    for p in ck.paths():
        open(p, "wb").write(b"not a checkpoint")
    model, opt, sched = make()
    with pytest.raises(CheckpointError, match="none of the 3 checkpoint"):
        ck.load(objects(model, opt, sched), fingerprint=fp)


def test_checkpoint_of_another_model_or_config_names_the_difference(tmp_path):
    ck, _ = saved_three(tmp_path)
    model, opt, sched = make(width=8)
    with pytest.raises(CheckpointError) as err:
        ck.load(objects(model, opt, sched), fingerprint=fingerprint(model, lr=0.2))
    text = str(err.value)
    assert "lr: checkpoint has 0.1, this run has 0.2" in text
    assert "0.0.weight ([4, 3, 3, 3] float32 in the checkpoint, [8, 3, 3, 3] float32 here)" in text
    assert "run.resume=false" in text
    # tensors only this model has, and tensors only the checkpoint has, are named too
    model, opt, sched = make()
    fp = fingerprint(model, lr=0.1)
    fp["tensors"]["head.weight"] = "[3] float32"
    del fp["tensors"]["0.0.weight"]
    with pytest.raises(CheckpointError) as err:
        ck.load(objects(model, opt, sched), fingerprint=fp)
    text = str(err.value)
    assert "model tensors not in the checkpoint: head.weight" in text, text
    assert "checkpoint tensors this model does not have: 0.0.weight" in text, text
    # the same model in another dtype
    model64, opt64, sched64 = make()
    model64.double()
    with pytest.raises(CheckpointError, match=r"\[4, 3, 3, 3\] float32 in the checkpoint, \[4, 3, 3, 3\] float64 here"):
        ck.load(objects(model64, opt64, sched64), fingerprint=fingerprint(model64, lr=0.1))
    # an object this run restores that the checkpoint has no state for
    with pytest.raises(CheckpointError, match=r"epoch0003-step000000\.pt has no state for ema"):
        ck.load({**objects(model, opt, sched), "ema": copy.deepcopy(model)}, fingerprint=fingerprint(model, lr=0.1))


def test_a_checkpoint_of_another_format_version_is_refused(tmp_path):
    ck, _ = saved_three(tmp_path)
    path = ck.paths()[0]
    payload = torch.load(path, weights_only=True)
    payload["version"] = 3
    write_atomic(payload, path)  # a valid file of another version
    with pytest.raises(CheckpointError, match="checkpoint format version 3, expected 1 or 2"):
        read_verified(path)
    # a readable torch file of something else under a checkpoint's name (a bare state_dict)
    write_atomic(make()[0].state_dict(), path)
    with pytest.raises(CheckpointError, match=r"epoch0003-step000000\.pt: not a distlib checkpoint"):
        read_verified(path)


def test_resume_loads_when_enabled_and_deletes_the_old_checkpoints_when_not(tmp_path, warnings_of_distlib):
    ck, fp = saved_three(tmp_path)
    model, opt, sched = make(seed=1)
    resumed = ck.resume(objects(model, opt, sched), fingerprint=fp, enabled=True, epochs=5)
    assert (resumed.epoch, resumed.path) == (3, ck.paths()[0])
    assert ck.resume(objects(model, opt, sched), fingerprint=fp, enabled=False) == Resumed()
    assert ck.paths() == [] and os.listdir(tmp_path) == []
    assert any("deleted the old checkpoints" in r.getMessage() for r in warnings_of_distlib)


def test_temporary_files_are_not_checkpoints(tmp_path):
    ck, _ = saved_three(tmp_path)
    open(tmp_path / ".tmp-1-abcd-epoch0009-step000000.pt", "wb").write(b"partial")
    open(tmp_path / "epoch0009-step000000.pt.bak", "wb").write(b"a copy of the user's")  # not ours either
    assert os.path.basename(ck.paths()[0]) == "epoch0003-step000000.pt"
    assert ck.clear() == 3 and ck.paths() == []
    assert (tmp_path / "epoch0009-step000000.pt.bak").exists()


def test_optimizer_state_is_restored_into_the_tensors_it_had(tmp_path):
    """A captured CUDA graph keeps using the momentum buffers it was captured with."""
    model, opt, sched = make()
    train_steps(model, opt, sched, 2)
    ck = Checkpointer(str(tmp_path))
    ck.save(objects(model, opt, sched), epoch=1, step=0, global_step=2, fingerprint=fingerprint(model))
    saved = [s["momentum_buffer"].clone() for s in opt.state.values()]
    train_steps(model, opt, sched, 2)
    buffers = [s["momentum_buffer"] for s in opt.state.values()]
    ck.load(objects(model, opt, sched), fingerprint=fingerprint(model))
    after = [s["momentum_buffer"] for s in opt.state.values()]
    assert all(a is b for a, b in zip(after, buffers))
    assert all(torch.equal(a, s) for a, s in zip(after, saved))


def test_the_file_reaches_the_disk_before_its_name_and_the_name_before_save_returns(tmp_path, monkeypatch):
    """A power cut must leave the old checkpoint or the whole new one: the data is synced before the
    rename makes it the checkpoint, and the directory (the rename itself) before save returns."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        events.append(("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file", target))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", os.path.basename(str(dst))))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    model, opt, sched = make()
    Checkpointer(str(tmp_path)).save(objects(model, opt, sched), epoch=1, step=0, global_step=1,
                                     fingerprint=fingerprint(model))  # fmt: skip
    kinds = [kind for kind, _ in events]
    assert kinds == ["fsync file", "rename", "fsync dir"], events
    assert os.path.basename(events[0][1]).startswith(".tmp-")  # the temporary file's data, then its new name
    assert events[1][1] == "epoch0001-step000000.pt" and events[2][1] == str(tmp_path)


def test_a_checkpoint_gets_the_mode_of_any_other_file_the_run_writes(tmp_path):
    """0666 less the umask, as open() gives: a group-shared run directory stays readable to the group
    (a private temporary file renamed into place would be 0600)."""
    old = os.umask(0o022)
    try:
        model, opt, sched = make()
        path = Checkpointer(str(tmp_path)).save(objects(model, opt, sched), epoch=1, step=0, global_step=1,
                                                fingerprint=fingerprint(model))  # fmt: skip
        open(tmp_path / "metrics.jsonl", "w").close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == stat.S_IMODE(os.stat(tmp_path / "metrics.jsonl").st_mode) == 0o644


def test_newest_is_the_latest_epoch_then_step_with_mid_epoch_checkpoints(tmp_path):
    """A run stopped mid-epoch saves epochNNNN-stepNNNNNN with step > 0: the order (and what is kept
    and resumed) is by epoch, then step; with every step 0 a key that put the step first would agree."""
    model, opt, sched = make()
    fp = fingerprint(model)
    ck = Checkpointer(str(tmp_path), keep=3)
    for epoch, step in ((1, 0), (1, 5), (2, 0), (2, 3)):
        ck.save(objects(model, opt, sched), epoch=epoch, step=step, global_step=8 * epoch + step, fingerprint=fp)
    names = [os.path.basename(p) for p in ck.paths()]
    assert names == ["epoch0002-step000003.pt", "epoch0002-step000000.pt", "epoch0001-step000005.pt"]
    resumed = Checkpointer(str(tmp_path)).load(objects(*make(seed=1)), fingerprint=fp)
    assert (resumed.epoch, resumed.step, resumed.global_step) == (2, 3, 19)


def test_an_async_save_holds_the_state_of_its_step_and_is_waited_for(tmp_path, monkeypatch):
    """save(async_=True) returns with the state copied: the steps that follow do not change the file;
    wait() (or the next save) finishes it, and a failed background write is raised there."""
    import threading

    from distlib.checkpoint import checkpointer

    trained, write = threading.Event(), checkpointer.write_atomic

    def write_later(payload, path):  # the write starts only once the next steps have run
        trained.wait(30)
        write(payload, path)

    monkeypatch.setattr(checkpointer, "write_atomic", write_later)
    model, opt, sched = make()
    train_steps(model, opt, sched)
    expected = copy.deepcopy(model.state_dict())
    ck = Checkpointer(str(tmp_path))
    ck.save(objects(model, opt, sched), epoch=1, step=0, global_step=2, fingerprint=fingerprint(model), async_=True)
    train_steps(model, opt, sched)  # while it is written
    trained.set()
    ck.wait()
    payload = read_verified(ck.paths()[0])
    for k, v in expected.items():
        assert torch.equal(payload["state"]["model"][k], v), k
    assert not any(torch.equal(payload["state"]["model"][k], v) for k, v in model.state_dict().items()
                   if v.is_floating_point())  # fmt: skip
    (tmp_path / "a-file").write_text("")
    ck.directory = str(tmp_path / "a-file" / "checkpoints")  # the next write cannot create its directory
    ck.save(objects(model, opt, sched), epoch=2, step=0, global_step=4, fingerprint=fingerprint(model), async_=True)
    with pytest.raises(CheckpointError, match="could not write checkpoint"):
        ck.wait()


def test_a_view_into_a_larger_storage_is_saved_at_its_own_size(tmp_path):
    # parameters living in a flat buffer (the fallback mode's, a sharded optimizer's): torch.save
    # writes a tensor's whole storage, so the checkpoint must hold the view's elements only
    flat = torch.zeros(1_000_000)
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.data = flat[:8].view(2, 4)
        model.weight.copy_(torch.arange(8.0).view(2, 4))
    ckpt = Checkpointer(str(tmp_path))
    path = ckpt.save({"model": model}, epoch=1, step=0, global_step=1, fingerprint={})
    assert os.path.getsize(path) < 100_000  # not the 4 MB flat buffer
    state = read_verified(path)["state"]["model"]
    assert torch.equal(state["weight"], torch.arange(8.0).view(2, 4))
