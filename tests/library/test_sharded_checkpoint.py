"""Sharded checkpoints: resharding (2 -> 1, 2 -> 4; replicated and FSDP2) against the uninterrupted run,
kill -9 mid-save, asynchronous save, retention, export, and the errors."""

from __future__ import annotations

import copy
import logging
import os
import random
import shutil
import signal

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from distlib.checkpoint.checkpointer import CheckpointError
from distlib.checkpoint.sharded import ShardedCheckpointer, export_checkpoint, main
from distlib.distributed import collectives
from tests.conftest import _rank_context, _Stdio, _worker, flip_a_tensor_byte, free_port, run_ranks

GLOBAL_BATCH = 8


class Net(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


def build(kind: str, seed: int, device: str = "cpu", width: int = 16):
    """Model (replicated, or FSDP2 per layer then the root), AdamW with a no-decay group, a schedule."""
    torch.manual_seed(seed)
    model = Net(width).to(device)
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if not dist.is_initialized():  # world size 1 runs without a process group; FSDP2 needs one
            dist.init_process_group("gloo" if device == "cpu" else "nccl", store=dist.HashStore(), rank=0, world_size=1)
        mesh = init_device_mesh(device if device == "cpu" else "cuda", (dist.get_world_size(),))
        for layer in (model.inp, model.out):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=0.01, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)
    return model, opt, sched


def batch(step: int, device: str = "cpu", size: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step``: the same global batch at every world size."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(size, 8, generator=g), torch.randn(size, 4, generator=g)
    rank, world = collectives.rank(), collectives.world_size()
    per = size // world
    return x[rank * per : (rank + 1) * per].to(device), y[rank * per : (rank + 1) * per].to(device)


def train_step(kind: str, model, opt, sched, step: int, device: str = "cpu") -> float:
    """One step on the global batch; returns its loss (the mean over every rank's samples)."""
    x, y = batch(step, device)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    if kind == "replicated":
        for p in model.parameters():
            collectives.all_reduce(p.grad, "mean")
    opt.step()
    opt.zero_grad()
    sched.step()
    return float(collectives.all_reduce(loss.detach().clone(), "mean"))


def full_state(model, opt) -> tuple[dict, dict]:
    """The whole model and optimizer state, on the CPU (a collective; what rank 0 gets)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, opt, options=options)


def objects(model, opt, sched, train):
    return {"model": model, "optimizer": opt, "scheduler": sched, "train": train}


def _save_then_continue(ctx, kind: str, directory: str, async_: bool):
    """Train 2 steps, save at step 2, then step 3 uninterrupted: its loss and the state after it."""
    model, opt, sched = build(kind, seed=0)
    train = {"step": 0}
    ck = ShardedCheckpointer(directory, keep=2)
    for step in (1, 2):
        train_step(kind, model, opt, sched, step)
        train["step"] = step
        ck.save(step, objects(model, opt, sched, train), async_=async_)
    loss = train_step(kind, model, opt, sched, 3)  # with async_, runs while step 2's checkpoint is written
    ck.close()
    return loss, *full_state(model, opt)


def _resume_then_step(ctx, kind: str, directory: str):
    model, opt, sched = build(kind, seed=1)  # other weights: all must come from the checkpoint
    train = {"step": -1}
    step = ShardedCheckpointer(directory).resume(objects(model, opt, sched, train))
    assert step == 2 and train["step"] == 2, (step, train)
    lr = opt.param_groups[0]["lr"]
    loss = train_step(kind, model, opt, sched, 3)
    return loss, *full_state(model, opt), lr


def assert_states_equal(a: dict, b: dict, path: str = "") -> None:
    assert a.keys() == b.keys(), (path, sorted(a), sorted(b))
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            assert_states_equal(x, y, f"{path}.{k}")
        elif isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7, msg=f"{path}.{k}")
        else:
            assert x == y, (f"{path}.{k}", x, y)


@pytest.mark.parametrize(
    "kind,saved_at,resumed_at", [("replicated", 2, 1), ("replicated", 2, 4), ("fsdp", 2, 1), ("fsdp", 2, 4)]
)
def test_resumes_at_another_world_size_like_the_uninterrupted_run(tmp_path, kind, saved_at, resumed_at):
    ref_loss, ref_model, ref_opt = run_ranks(_save_then_continue, saved_at, kind, str(tmp_path), False)[0]
    loss, model, opt, lr = run_ranks(_resume_then_step, resumed_at, kind, str(tmp_path))[0]
    assert lr == pytest.approx(0.01 * 0.9**2)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert_states_equal(model, ref_model)
    assert_states_equal(opt, ref_opt)
    assert set(os.listdir(tmp_path)) == {"step000000001", "step000000002"}
    if kind == "replicated":  # both ranks hold every tensor; DCP writes each once, not once per rank
        one = tmp_path.parent / f"{tmp_path.name}-one"
        model, opt, sched = build(kind, seed=0)
        ShardedCheckpointer(str(one)).save(2, objects(model, opt, sched, {"step": 2}))
        assert shard_bytes(tmp_path / "step000000002") < 1.2 * shard_bytes(one / "step000000002")


def _zero1_run(ctx, directory: str, resume: bool) -> tuple[float, list[torch.Tensor]]:
    """Net under GradSync(shard="optimizer") with AdamW: 2 steps then a save, or a resume; then step 3.
    With 1 kB buckets each rank's slice holds some parameters whole and none of others:
    its optimizer's state_dict() has keys the other's lacks."""
    import distlib

    torch.manual_seed(1 if resume else 0)  # other weights on resume: all must come from the checkpoint
    model = Net()
    sync = distlib.GradSync(model, shard="optimizer", bucket_mb=1e-3)
    opt = sync.sharded_optimizer(torch.optim.AdamW, model.parameters(), lr=0.01)
    ck = ShardedCheckpointer(directory)

    def step(k: int) -> float:
        x, y = batch(k)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        sync.wait()
        opt.step()
        opt.zero_grad()
        return float(collectives.all_reduce(loss.detach().clone(), "mean"))

    if resume:
        assert ck.resume({"model": model, "optimizer": opt}) == 2
    else:
        step(1), step(2)
        ck.save(2, {"model": model, "optimizer": opt})
    loss = step(3)
    return loss, [p.detach().clone() for p in model.parameters()]


def test_a_sharded_optimizer_whose_ranks_hold_different_parameters_resumes(tmp_path):
    """resume() accepts saved keys that only another rank's state_dict() has (a ShardedOptimizer's
    ranks hold the state of the parameters in their slice only) and continues as the uninterrupted run."""
    ref = run_ranks(_zero1_run, 2, str(tmp_path), False)
    got = run_ranks(_zero1_run, 2, str(tmp_path), True)
    for (ref_loss, ref_w), (loss, w) in zip(ref, got):
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        for a, b in zip(w, ref_w):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _saves_and_resume_recording_warnings(ctx, directory: str) -> dict[str, list[str]]:
    """A ShardedOptimizer saved plainly, in the background (staged and in place), then resumed, every
    warning recorded (each time, not once per place); then torch's ShardedTensor warning raised here."""
    import warnings

    import distlib
    from distlib.checkpoint.sharded import SHARDED_TENSOR_DEPRECATED

    torch.manual_seed(0)
    model = Net()
    sync = distlib.GradSync(model, shard="optimizer", bucket_mb=1e-3)
    opt = sync.sharded_optimizer(torch.optim.AdamW, model.parameters(), lr=0.01)
    objects = {"model": model, "optimizer": opt}

    def step(k: int) -> None:
        x, y = batch(k)
        nn.functional.mse_loss(model(x), y).backward()
        sync.wait()
        opt.step()
        opt.zero_grad()

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step(1)
        ShardedCheckpointer(directory).save(1, objects)
        ck = ShardedCheckpointer(directory)
        ck.save(2, objects, async_=True)
        step(2)
        ck.save(3, objects, async_=True, in_place=True)
        ck.close()
        ShardedCheckpointer(directory).resume(objects)
        ours = [str(w.message) for w in seen]
        seen.clear()
        warnings.warn(SHARDED_TENSOR_DEPRECATED, FutureWarning, stacklevel=1)  # as torch would, outside save and resume
        after = [str(w.message) for w in seen]
    return {"during": ours, "after": after}


def test_an_optimizer_sharded_save_and_resume_hold_back_torchs_sharded_tensor_warning_alone(tmp_path):
    """A ShardedOptimizer's state is ShardedTensors, whose every use as a tensor makes torch warn that
    ShardedTensor is deprecated (twice, once a rank, in every optimizer-sharded run): held back during
    save and resume at 2 ranks, and only there (the same warning raised outside still shows)."""
    from distlib.checkpoint.sharded import SHARDED_TENSOR_DEPRECATED

    for r in run_ranks(_saves_and_resume_recording_warnings, 2, str(tmp_path)):
        assert not [w for w in r["during"] if SHARDED_TENSOR_DEPRECATED in w], r["during"]
        assert r["after"] == [SHARDED_TENSOR_DEPRECATED]


def shard_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.glob("__*.distcp"))


@pytest.mark.parametrize("kind", ["replicated", "fsdp"])
def test_async_save_commits_the_state_of_its_step_while_training_continues(tmp_path, kind):
    """The training's collectives (gloo all_reduces, FSDP2's) run while the background save's do."""
    ref_loss, ref_model, ref_opt = run_ranks(_save_then_continue, 2, kind, str(tmp_path / "sync"), False)[0]
    assert run_ranks(_save_then_continue, 2, kind, str(tmp_path / "async"), True)[0][0] == ref_loss
    loss, model, opt, _ = run_ranks(_resume_then_step, 2, kind, str(tmp_path / "async"))[0]
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert_states_equal(model, ref_model)
    assert_states_equal(opt, ref_opt)


def test_async_save_is_committed_only_by_the_next_save_or_close(tmp_path):
    model, opt, sched = build("replicated", seed=0)
    ck = ShardedCheckpointer(str(tmp_path))
    ck.save(1, objects(model, opt, sched, {}), async_=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # after staging: not in the checkpoint
    assert ck.paths() == []  # written, perhaps, but not committed before wait/close
    ck.close()
    assert [os.path.basename(p) for p in ck.paths()] == ["step000000001"]
    fresh, fopt, fsched = build("replicated", seed=0)
    assert ShardedCheckpointer(str(tmp_path)).resume(objects(fresh, fopt, fsched, {})) == 1
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(q + 1.0, p, rtol=0, atol=1e-6, msg=name)


def _bn_net(device: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)


def _bn_step(model, opt, sched, step: int, device: str) -> None:
    x, y = batch(step, device)
    nn.functional.mse_loss(model(x), y).backward()  # the forward changes BatchNorm's statistics in place
    opt.step()
    opt.zero_grad()
    sched.step()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpus(1))])
def test_an_in_place_save_holds_its_step_while_the_next_optimizer_step_waits_for_the_write(
    tmp_path, monkeypatch, device
):
    """No copy is made of the weights and the optimizer state: the next step's forward runs (its
    BatchNorm statistics do not reach the checkpoint: the buffers are copied at the call), and its
    optimizer step waits until the write has read the tensors (on the CPU, the whole write; from a GPU,
    the copy to the host), so the checkpoint holds the state of its own step."""
    import threading
    import time

    import torch.distributed.checkpoint as dcp

    release, write_data = threading.Event(), dcp.FileSystemWriter.write_data

    def held(self, plan, planner):
        release.wait(30)
        return write_data(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", held)
    model, opt, sched = _bn_net(device)
    _bn_step(model, opt, sched, 1, device)
    ck = ShardedCheckpointer(str(tmp_path))
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    ck.save(1, objects(model, opt, sched, {"step": 1}), async_=True, in_place=True)
    if device == "cuda":  # nothing staged on the device but the buffers' copies
        buffers = sum(b.nbytes for b in model.buffers())
        assert torch.cuda.memory_allocated() - before <= buffers + 4096, (before, torch.cuda.memory_allocated())
    expected = copy.deepcopy(full_state(model, opt))
    timer = threading.Timer(0.5, release.set)
    timer.start()
    t0 = time.perf_counter()
    _bn_step(model, opt, sched, 2, device)
    waited = time.perf_counter() - t0
    if device == "cpu":  # the write reads the tensors to its end: the step waited for the release
        assert waited >= 0.4, waited
    ck.close()
    timer.join()
    fresh, fopt, fsched = _bn_net(device)
    _bn_step(fresh, fopt, fsched, 7, device)  # other weights and statistics: all must come from the checkpoint
    assert ShardedCheckpointer(str(tmp_path)).resume(objects(fresh, fopt, fsched, {})) == 1
    assert_states_equal(full_state(fresh, fopt)[0], expected[0])
    assert_states_equal(full_state(fresh, fopt)[1], expected[1])


def test_keeps_the_newest_committed_checkpoints(tmp_path):
    model, opt, sched = build("replicated", seed=0)
    ck = ShardedCheckpointer(str(tmp_path), keep=2)
    for step in range(1, 5):
        ck.save(step, objects(model, opt, sched, {"step": step}))
    assert sorted(os.listdir(tmp_path)) == ["step000000003", "step000000004"]


# ---- kill -9 mid-save -------------------------------------------------------------------------


def _killed_mid_save(ctx, directory: str, where: str, device: str, async_: bool = False):
    """Save step 1, train, then save step 2 with one rank SIGKILLed inside it (``where``: rank 1 while it
    writes its shards, or rank 0 after every rank wrote, just before its rename commits). ``async_``:
    step 2's save is asynchronous (rank 1 dies in the background write), training goes on, close()
    commits."""
    device = device if device == "cpu" else str(ctx.device)
    model, opt, sched = build("fsdp", seed=0, device=device)
    ck = ShardedCheckpointer(directory, keep=1)  # keep=1: step 1 may go only once step 2 is committed
    train_step("fsdp", model, opt, sched, 1, device)
    ck.save(1, objects(model, opt, sched, {"step": 1}))
    expected = full_state(model, opt)
    if ctx.rank == 0:
        torch.save(expected, os.path.join(directory, "..", "expected.pt"))
    train_step("fsdp", model, opt, sched, 2, device)
    if where == "write" and ctx.rank == 1:
        import torch.distributed.checkpoint as dcp

        def die(self, plan, planner):
            open(os.path.join(self.path, f"__{ctx.rank}_0.distcp"), "wb").write(b"half a shard")
            os.kill(os.getpid(), signal.SIGKILL)

        dcp.FileSystemWriter.write_data = die
    if where == "commit" and ctx.rank == 0:
        replace = os.replace

        def die_before_rename(src, dst):
            if os.path.basename(dst) == "step000000002":
                os.kill(os.getpid(), signal.SIGKILL)
            replace(src, dst)

        os.replace = die_before_rename
    ck.save(2, objects(model, opt, sched, {"step": 2}), async_=async_)
    if async_:
        train_step("fsdp", model, opt, sched, 3, device)
        ck.close()
    raise AssertionError("the save should have failed: a rank was killed")


def _resume_state(ctx, directory: str, device: str = "cpu"):
    device = device if device == "cpu" else str(ctx.device)
    model, opt, sched = build("fsdp", seed=1, device=device)
    train = {}  # a plain dict is loaded in place, and gets the keys it lacks
    step = ShardedCheckpointer(directory).resume(objects(model, opt, sched, train))
    return step, train, full_state(model, opt)


def kill_mid_save_then_resume(tmp_path, where: str, backend: str, async_: bool = False) -> None:
    directory = str(tmp_path / "ck")
    os.makedirs(directory)
    device = "cpu" if backend == "gloo" else "cuda"
    ctx = _rank_context("forkserver" if backend == "gloo" else "spawn")
    queue, port = ctx.Queue(), free_port()
    args = ((directory, where, device, async_), queue, backend, 20, dict(os.environ), True, _Stdio())
    procs = [ctx.Process(target=_worker, args=(_killed_mid_save, r, 2, port, *args)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    killed = 1 if where == "write" else 0
    survivor = procs[1 - killed].exitcode
    for p in procs:
        if p.is_alive():
            p.kill()
    assert procs[killed].exitcode == -signal.SIGKILL
    assert survivor is not None  # the survivor's collective failed: it did not hang
    assert ".partial-step000000002" in os.listdir(directory)
    assert [os.path.basename(p) for p in ShardedCheckpointer(directory).paths()] == ["step000000001"]
    expected_model, expected_opt = torch.load(tmp_path / "expected.pt", weights_only=False)
    for world in (2, 1):
        step, train, (model, opt) = run_ranks(_resume_state, world, directory, device, backend=backend)[0]
        assert (step, train) == (1, {"step": 1})
        assert_states_equal(model, expected_model)
        assert_states_equal(opt, expected_opt)
    assert os.listdir(directory) == ["step000000001"]  # resume deleted the partial directory


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["write", "commit"])
def test_kill_9_mid_save_leaves_the_previous_checkpoint_to_resume(tmp_path, where, async_):
    kill_mid_save_then_resume(tmp_path, where, "gloo", async_)


# ---- export -----------------------------------------------------------------------------------


def _save_fsdp(ctx, directory: str):
    model, opt, sched = build("fsdp", seed=0)
    train_step("fsdp", model, opt, sched, 1)
    ShardedCheckpointer(directory).save(1, objects(model, opt, sched, {"step": 1}))
    return full_state(model, opt)[0]


def test_export_writes_one_file_a_plain_model_loads(tmp_path):
    expected = run_ranks(_save_fsdp, 2, str(tmp_path / "ck"))[0]
    out = str(tmp_path / "model.pt")
    assert export_checkpoint(str(tmp_path / "ck"), out).endswith("step000000001")
    saved = torch.load(out, weights_only=True)
    assert saved["train"] == {"step": 1} and "optimizer" in saved and "scheduler" in saved
    plain = Net()
    plain.load_state_dict(saved["model"])
    assert_states_equal(plain.state_dict(), expected)
    with pytest.raises(CheckpointError, match="no committed sharded checkpoint"):
        export_checkpoint(str(tmp_path), out)
    os.unlink(out)
    assert main([str(tmp_path / "ck" / "step000000001"), out]) == 0  # python -m distlib.checkpoint.sharded
    assert torch.load(out, weights_only=True).keys() == saved.keys()
    assert main([str(tmp_path / "nothing"), out]) == 2


# ---- errors -----------------------------------------------------------------------------------


def saved_once(tmp_path) -> str:
    model, opt, sched = build("replicated", seed=0)
    train_step("replicated", model, opt, sched, 1)
    ShardedCheckpointer(str(tmp_path)).save(1, objects(model, opt, sched, {"step": 1}))
    torch.save(model.inp.weight.detach().clone(), tmp_path / "weight.pt")
    return str(tmp_path / "step000000001")


def test_a_checkpoint_of_another_model_is_refused_naming_the_difference(tmp_path):
    saved_once(tmp_path)
    model, opt, sched = build("replicated", seed=0, width=32)
    with pytest.raises(CheckpointError, match=r"(?s)another model.*model\.inp\.weight \(\[16, 8\] float32 in the"):
        ShardedCheckpointer(str(tmp_path)).resume(objects(model, opt, sched, {}))
    with pytest.raises(CheckpointError, match=r"(?s)settings.*lr: checkpoint has None, this run has 0.1"):
        ShardedCheckpointer(str(tmp_path), settings={"lr": 0.1}).resume(objects(*build("replicated", 0), {}))


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped", "value"])
def test_a_missing_or_corrupt_shard_is_named(tmp_path, damage):
    """``value``: one bit of a weight flipped, every zip and pickle structure intact: only the records'
    CRC-32s (computed by torch.save as DCP writes, checked on resume) can tell."""
    path = saved_once(tmp_path)
    shard = os.path.join(path, "__0_0.distcp")
    if damage == "missing":
        os.unlink(shard)
    elif damage == "truncated":
        os.truncate(shard, os.path.getsize(shard) // 2)
    elif damage == "flipped":
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) - 100)
            f.write(b"\xff" * 8)
    else:
        weight = torch.load(os.path.join(path, "..", "weight.pt"), weights_only=True)
        data = bytearray(open(shard, "rb").read())
        at = bytes(data).find(weight.numpy().tobytes())
        assert at > 0
        data[at + 5] ^= 0x01
        open(shard, "wb").write(bytes(data))
    words = {"missing": "is missing", "truncated": "bytes, .* were written", "flipped": "checksum mismatch",
             "value": "checksum mismatch"}[damage]  # fmt: skip
    with pytest.raises(CheckpointError, match=f"(?s){shard}.*{words}.*delete {path}"):
        ShardedCheckpointer(str(tmp_path)).resume(objects(*build("replicated", 0), {}))


def _checked_by(rank: int, step_dir: str) -> str:
    """A shard file of the checkpoint that ``rank`` alone checks: every rank checks every world_size-th
    file, in name order (.metadata first), of 2 here."""
    names = sorted(n for n in os.listdir(step_dir) if n == ".metadata" or n.endswith(".distcp"))
    return next(n for i, n in enumerate(names) if i % 2 == rank and n != ".metadata")


def _resume_with_fallback(ctx, directory: str) -> dict:
    """Steps 1 and 2 saved at 2 ranks; a file of step 2 damaged where only rank 1 checks it; resumed
    without and with ``fallback``; then a file of step 1 damaged, one rank 0 checks."""
    model, opt, sched = build("replicated", seed=0)
    ck = ShardedCheckpointer(directory)
    train = {"step": 0}
    for step in (1, 2):
        train_step("replicated", model, opt, sched, step)
        train["step"] = step
        ck.save(step, objects(model, opt, sched, train))
        if step == 1:
            at_1 = {k: v.clone() for k, v in model.state_dict().items()}
    newest = os.path.join(directory, "step000000002")
    damaged = _checked_by(1, newest)
    if ctx.rank == 0:
        flip_a_tensor_byte(newest, damaged)
    collectives.barrier()
    out: dict = {"damaged": damaged}
    fresh, fopt, fsched = build("replicated", seed=1)
    train = {"step": -1}
    with pytest.raises(CheckpointError) as e:
        ShardedCheckpointer(directory).resume(objects(fresh, fopt, fsched, train))
    out["without"] = str(e.value)
    out["step"] = ShardedCheckpointer(directory).resume(objects(fresh, fopt, fsched, train), fallback=True)
    out["train"] = train["step"]
    out["model"] = all(torch.equal(v, at_1[k]) for k, v in fresh.state_dict().items())
    with pytest.raises(CheckpointError) as e:  # another model's: refused, not skipped
        ShardedCheckpointer(directory).resume(objects(*build("replicated", 0, width=32), {}), fallback=True)
    out["other"] = str(e.value)
    older = os.path.join(directory, "step000000001")
    if ctx.rank == 0:
        flip_a_tensor_byte(older, _checked_by(0, older))
    collectives.barrier()
    with pytest.raises(CheckpointError) as e:
        ShardedCheckpointer(directory).resume(objects(fresh, fopt, fsched, train), fallback=True)
    out["none"] = str(e.value)
    return out


def test_with_fallback_a_damaged_checkpoint_is_skipped_for_the_previous_one_on_every_rank(tmp_path):
    """Only rank 1 finds the damage: every rank still skips that checkpoint (or, without ``fallback``,
    stops) together and loads the same older one; another model's checkpoint is refused, not skipped."""
    res = run_ranks(_resume_with_fallback, 2, str(tmp_path))
    newest = os.path.join(str(tmp_path), "step000000002")
    for r in res:
        assert f"checkpoint {newest} is damaged: {newest}/{r['damaged']}: checksum mismatch" in r["without"], r
        assert r["step"] == 1 and r["train"] == 1 and r["model"], r
        assert "is from another model or settings" in r["other"] and newest in r["other"], r
        assert r["none"].startswith(f"none of the 2 committed checkpoint(s) in {tmp_path} is usable"), r


@pytest.fixture
def warnings_logged():
    """What the distlib logger warns (it does not propagate to pytest's caplog)."""
    records: list[str] = []

    class ListHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = ListHandler(level=logging.WARNING)
    logging.getLogger("distlib").addHandler(handler)
    yield records
    logging.getLogger("distlib").removeHandler(handler)


FLIPS = int(os.environ.get("DISTLIB_FLIP_TRIALS", "40"))  # per file; any number for a longer search


@pytest.mark.parametrize("name", [".metadata", "commit.json"])
def test_a_changed_byte_of_the_metadata_or_commit_json_is_found_and_the_older_checkpoint_resumed(
    tmp_path, name, warnings_logged
):
    """One byte of step 2's ``.metadata`` (a plain pickle) or ``commit.json`` changed, at seeded random
    places, one at a time: every one is found before anything unpickles or trusts it, named in the
    warning, and step 1 is resumed with its state (not a traceback, not another model's error)."""
    model, opt, sched = build("replicated", seed=0)
    ck = ShardedCheckpointer(str(tmp_path))
    for step in (1, 2):
        train_step("replicated", model, opt, sched, step)
        ck.save(step, objects(model, opt, sched, {"step": step}))
        if step == 1:
            at_1 = {k: v.clone() for k, v in model.state_dict().items()}
    path = os.path.join(str(tmp_path), "step000000002", name)
    original = open(path, "rb").read()
    rng = random.Random(f"{name}-flips")
    places = rng.sample(range(len(original)), min(FLIPS, len(original)))
    for at in places:
        damaged = bytearray(original)
        damaged[at] ^= 1 << rng.randrange(8)
        open(path, "wb").write(bytes(damaged))
        warnings_logged.clear()
        fresh, fopt, fsched = build("replicated", seed=1)
        train = {"step": -1}
        step = ShardedCheckpointer(str(tmp_path)).resume(objects(fresh, fopt, fsched, train), fallback=True)
        assert step == 1 and train["step"] == 1, (at, warnings_logged)
        assert all(torch.equal(v, at_1[k]) for k, v in fresh.state_dict().items()), at
        skipped = [m for m in warnings_logged if m.startswith("skipping checkpoint: ")]
        assert len(skipped) == 1 and path in skipped[0], (at, warnings_logged)
        assert f"resuming from the older checkpoint {os.path.join(str(tmp_path), 'step000000001')}" in warnings_logged
    open(path, "wb").write(original)
    assert ShardedCheckpointer(str(tmp_path)).resume(objects(*build("replicated", 1), {})) == 2


@pytest.mark.parametrize("name", [".metadata", "commit.json", "__0_0.distcp"])
def test_export_verifies_every_file_before_it_reads_one(tmp_path, name):
    path = saved_once(tmp_path)
    if name == "__0_0.distcp":
        flip_a_tensor_byte(path, name)
    else:
        data = bytearray(open(os.path.join(path, name), "rb").read())
        data[len(data) // 2] ^= 0x10
        open(os.path.join(path, name), "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=f"{os.path.join(path, name)}: (checksum mismatch|unreadable)"):
        export_checkpoint(path, str(tmp_path / "model.pt"))
    assert not os.path.exists(tmp_path / "model.pt")


class Killed(BaseException):
    """A kill -9 in the middle of a deletion: nothing after it runs."""


def test_a_deletion_killed_midway_leaves_no_half_checkpoint_under_a_committed_name(tmp_path, monkeypatch):
    """keep=1: saving step 2 deletes step 1; the deletion is killed after its first file. Every directory
    left under a committed name is complete (resumes, verified), and the next resume clears the rest."""
    model, opt, sched = build("replicated", seed=0)
    ck = ShardedCheckpointer(str(tmp_path), keep=1)
    ck.save(1, objects(model, opt, sched, {"step": 1}))
    real_rmtree = shutil.rmtree

    def killed_rmtree(path, *args, **kwargs):
        os.unlink(os.path.join(path, sorted(os.listdir(path))[0]))
        raise Killed

    monkeypatch.setattr(shutil, "rmtree", killed_rmtree)
    with pytest.raises(Killed):
        ck.save(2, objects(model, opt, sched, {"step": 2}))
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    for found in ShardedCheckpointer(str(tmp_path)).paths():
        step = int(os.path.basename(found).removeprefix("step"))
        only = ShardedCheckpointer(str(tmp_path / "alone"))
        shutil.copytree(found, str(tmp_path / "alone" / os.path.basename(found)))
        assert only.resume(objects(*build("replicated", 1), {})) == step  # complete: verified and loaded
        real_rmtree(str(tmp_path / "alone"))
    assert ShardedCheckpointer(str(tmp_path)).paths() == [os.path.join(str(tmp_path), "step000000002")]
    assert ShardedCheckpointer(str(tmp_path)).resume(objects(*build("replicated", 1), {})) == 2
    assert sorted(os.listdir(tmp_path)) == ["step000000002"]  # the interrupted deletion's rest removed


def test_written_says_whether_this_ranks_part_of_the_save_in_flight_is_on_disk(tmp_path, monkeypatch):
    import threading

    import torch.distributed.checkpoint as dcp

    release, write_data = threading.Event(), dcp.FileSystemWriter.write_data

    def held(self, plan, planner):
        release.wait(30)
        return write_data(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", held)
    model, opt, sched = build("replicated", seed=0)
    ck = ShardedCheckpointer(str(tmp_path))
    assert ck.written()  # nothing in flight
    ck.save(1, objects(model, opt, sched, {}), async_=True)
    assert not ck.written()
    release.set()
    for _ in range(3000):
        if ck.written():
            break
        threading.Event().wait(0.01)
    assert ck.written() and ck.paths() == []  # written, not committed: that is wait()'s
    ck.wait()
    assert [os.path.basename(p) for p in ck.paths()] == ["step000000001"] and ck.written()


@pytest.mark.parametrize("async_", [False, True])
def test_every_file_is_synced_before_the_commit_and_the_phases_are_timed(tmp_path, monkeypatch, async_):
    """DCP writes the files unsynced; the save syncs each of this rank's (the shards and .metadata)
    before the commit's commit.json, and says where its time went (``phases``)."""
    synced, fsync = [], os.fsync

    def recording(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    model, opt, sched = build("replicated", seed=0)
    ck = ShardedCheckpointer(str(tmp_path), write_threads=3)
    ck.save(1, objects(model, opt, sched, {}), async_=async_, in_place=async_)
    ck.wait()
    (step,) = ck.paths()
    data = sorted(n for n in os.listdir(step) if n.endswith(".distcp") or n == ".metadata")
    assert len(data) >= 2
    partial = os.path.join(str(tmp_path), ".partial-step000000001")
    marker = synced.index(os.path.join(partial, "commit.json.tmp"))
    assert sorted(os.path.basename(p) for p in synced[:marker] if os.path.dirname(p) == partial) == data
    assert set(ck.phases) >= {"call_s", "to_host_s", "write_s", "fsync_s", "commit_s"} - ({"to_host_s"} if not async_
                                                                                            else set())  # fmt: skip
    assert all(v >= 0 for v in ck.phases.values()) and ck.phases["write_s"] > 0


def test_a_non_empty_partial_directory_is_refused_and_resume_clears_it(tmp_path):
    partial = tmp_path / ".partial-step000000005"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"left by an interrupted save")
    model, opt, sched = build("replicated", seed=0)
    ck = ShardedCheckpointer(str(tmp_path))
    with pytest.raises(CheckpointError, match=f"(?s){partial} is not empty.*delete that directory"):
        ck.save(5, objects(model, opt, sched, {}))
    assert ck.resume(objects(model, opt, sched, {})) is None
    ck.save(5, objects(model, opt, sched, {}))
    assert os.listdir(tmp_path) == ["step000000005"]


class Lazy:
    """State that exists only after a first step, like a hand-written optimizer's."""

    def __init__(self):
        self.t: torch.Tensor | None = None

    def state_dict(self) -> dict:
        return {} if self.t is None else {"t": self.t}

    def load_state_dict(self, state: dict) -> None:
        self.t = state.get("t")


def test_an_object_without_a_place_for_saved_state_is_refused(tmp_path):
    lazy = Lazy()
    lazy.t = torch.ones(3)
    ShardedCheckpointer(str(tmp_path)).save(1, {"lazy": lazy, "train": {"step": 1, "epoch": 0}})
    train: dict = {}
    with pytest.raises(CheckpointError, match=r"'lazy' \(Lazy\) has no place for 1 value.*lazy\.t.*before resume"):
        ShardedCheckpointer(str(tmp_path)).resume({"lazy": Lazy(), "train": train})
    lazy = Lazy()
    lazy.t = torch.zeros(3)
    assert ShardedCheckpointer(str(tmp_path)).resume({"lazy": lazy, "train": train}) == 1
    assert torch.equal(lazy.t, torch.ones(3)) and train == {"step": 1, "epoch": 0}


def test_an_object_without_state_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="'loader'.*state_dict"):
        ShardedCheckpointer(str(tmp_path)).save(1, {"loader": object()})


def test_staging_must_be_one_of_auto_device_host(tmp_path):
    with pytest.raises(ValueError, match="staging must be one of auto, device, host, got 'gpu'"):
        ShardedCheckpointer(str(tmp_path), staging="gpu")


def _host_copy_of_fsdp(ctx):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    from distlib.checkpoint.sharded import _host_copy, _layout

    model, opt, sched = build("fsdp", seed=0)
    train_step("fsdp", model, opt, sched, 1)
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    ops = []

    class DTensorOps(TorchDispatchMode):  # every op run, DTensors' among them, passes here first
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(isinstance(a, DTensor) for a in (*args, *(kwargs or {}).values())):
                ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with DTensorOps():
        host = _host_copy(state)
    pairs = []

    def walk(a, b):
        if isinstance(a, dict):
            assert a.keys() == b.keys()
            for k in a:
                walk(a[k], b[k])
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                walk(x, y)
        elif isinstance(a, torch.Tensor):
            pairs.append((a, b))
        else:
            assert a == b

    walk(state, host)
    dtensors = [(a, b) for a, b in pairs if isinstance(a, DTensor)]
    for a, b in dtensors:
        assert isinstance(b, DTensor) and b.placements == a.placements and b.device_mesh == a.device_mesh
        assert b.shape == a.shape and b.to_local().shape == a.to_local().shape and b.to_local().device.type == "cpu"
        assert b.to_local().untyped_storage().data_ptr() != a.to_local().untyped_storage().data_ptr()
    return len(dtensors), len(pairs), ops, _layout(host) == [(k, s, d, torch.device("cpu")) for k, s, d, _ in
                                                            _layout(state)]  # fmt: skip


@pytest.mark.parametrize("world", [1, 2])
def test_the_host_copy_of_a_sharded_state_keeps_each_dtensors_spec_made_without_a_dtensor_op(tmp_path, world):
    """What an asynchronous save stages into: an empty host tensor per tensor, DTensors with their
    mesh, placements and global shape around this rank's host shard. Made without any DTensor op:
    one per tensor (``t.to("meta")``) cost the first save of a 1.5B GPT 2.2 s on an H200."""
    for n_dtensors, n_tensors, ops, same_layout in run_ranks(_host_copy_of_fsdp, world):
        assert n_dtensors >= 3 * 6 and n_tensors > n_dtensors  # weights, exp_avg, exp_avg_sq; the steps
        assert ops == [] and same_layout


# ---- GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpus(1)
@pytest.mark.parametrize("staging", ["device", "host", "auto"])
def test_gpu_world_size_1_save_and_reload(tmp_path, staging, monkeypatch):
    """An asynchronous save holds the state of its step, wherever it is staged: the steps after it
    (which change the weights and the optimizer state in place) do not reach the checkpoint. On the
    device, tensors larger than the bounce buffers to the host go through them in several pieces."""
    from distlib.checkpoint import sharded

    monkeypatch.setattr(sharded, "_BOUNCE", 256)  # every weight matrix in several pieces, the buffers reused
    model, opt, sched = build("replicated", seed=0, device="cuda")
    train_step("replicated", model, opt, sched, 1, "cuda")
    ck = ShardedCheckpointer(str(tmp_path), staging=staging)
    ck.save(1, objects(model, opt, sched, {"step": 1}), async_=True)
    # a copy: cpu_offload hands back the CPU tensors themselves (AdamW's step), which the next step changes
    expected = copy.deepcopy(full_state(model, opt))
    loss = train_step("replicated", model, opt, sched, 2, "cuda")
    train_step("replicated", model, opt, sched, 3, "cuda")  # while the write may still run
    ck.close()
    assert ck._staging[2] is (staging != "host")  # a small state: auto finds room on the device
    fresh, fopt, fsched = build("replicated", seed=1, device="cuda")
    assert ShardedCheckpointer(str(tmp_path)).resume(objects(fresh, fopt, fsched, {})) == 1
    assert_states_equal(full_state(fresh, fopt)[0], expected[0])
    assert_states_equal(full_state(fresh, fopt)[1], expected[1])
    assert train_step("replicated", fresh, fopt, fsched, 2, "cuda") == pytest.approx(loss, rel=1e-6)


@pytest.mark.gpus(1)
def test_gpu_device_staging_gives_its_memory_back_once_written(tmp_path):
    model, opt, sched = build("replicated", seed=0, device="cuda")
    train_step("replicated", model, opt, sched, 1, "cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    ck = ShardedCheckpointer(str(tmp_path), staging="device")
    ck.save(1, objects(model, opt, sched, {"step": 1}), async_=True)
    state_bytes = sum(p.nbytes for p in model.parameters()) * 3  # weights, exp_avg, exp_avg_sq
    during = torch.cuda.memory_allocated()
    assert during - before >= state_bytes, (before, during, state_bytes)  # the copy, on the device
    ck.wait()
    after = torch.cuda.memory_allocated()
    # the copy is given back (a state dict may keep a small tensor of its own, as AdamW's step)
    assert during - after >= state_bytes and after - before < state_bytes / 10, (before, during, after, state_bytes)
    assert ck.paths()


def _save_then_continue_cuda(ctx, kind: str, directory: str):
    model, opt, sched = build(kind, seed=0, device=f"cuda:{ctx.local_rank}")
    ck = ShardedCheckpointer(directory)
    for step in (1, 2):
        train_step(kind, model, opt, sched, step, ctx.device)
        ck.save(step, objects(model, opt, sched, {"step": step}), async_=True)
    loss = train_step(kind, model, opt, sched, 3, ctx.device)
    ck.close()
    return loss, *full_state(model, opt)


def _resume_then_step_cuda(ctx, kind: str, directory: str):
    model, opt, sched = build(kind, seed=1, device=f"cuda:{ctx.local_rank}")
    train = {"step": 0}
    assert ShardedCheckpointer(directory).resume(objects(model, opt, sched, train)) == 2
    loss = train_step(kind, model, opt, sched, 3, ctx.device)
    return loss, *full_state(model, opt)


@pytest.mark.gpus(2)
@pytest.mark.parametrize("where", ["write", "commit"])
def test_gpu_nccl_kill_9_mid_save_leaves_the_previous_checkpoint(tmp_path, where):
    kill_mid_save_then_resume(tmp_path, where, "nccl")


@pytest.mark.gpus(2)
@pytest.mark.parametrize("kind", ["replicated", "fsdp"])
def test_gpu_nccl_2_to_1(tmp_path, kind):
    ref_loss, ref_model, ref_opt = run_ranks(_save_then_continue_cuda, 2, kind, str(tmp_path), backend="nccl")[0]
    loss, model, opt = run_ranks(_resume_then_step_cuda, 1, kind, str(tmp_path), backend="nccl")[0]
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_states_equal(model, ref_model)
    assert_states_equal(opt, ref_opt)


# ---- across the sharding boundary: ShardedOptimizer <-> a plain optimizer --------------------------
def _optimizer_state(model, opt) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's optimizer state, whole and flat, by parameter name (a collective): the same
    form for a ShardedOptimizer and a plain optimizer."""
    names = {id(p): n for n, p in model.named_parameters()}
    if hasattr(opt, "_full_state"):
        full = opt._full_state()
    else:
        full = {id(p): s for p, s in opt.state.items()}
    return {names[i]: {k: v.detach().reshape(-1).clone() for k, v in s.items()} for i, s in full.items()}


def _cross_run(ctx, directory: str, kind: str, resume: bool):
    """Net under GradSync with AdamW, its optimizer a ShardedOptimizer (``kind="zero1"``) or plain:
    2 steps and a save, or a resume; then step 3. Returns step 3's loss and the optimizer state before it."""
    import distlib

    torch.manual_seed(1 if resume else 0)  # other weights on resume: all must come from the checkpoint
    model = Net()
    if kind == "zero1":
        sync = distlib.GradSync(model, shard="optimizer", bucket_mb=1e-3)
        opt = sync.sharded_optimizer(torch.optim.AdamW, model.parameters(), lr=0.01)
    else:
        sync = distlib.GradSync(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)

    def step(k: int) -> float:
        x, y = batch(k, size=12)  # the same samples at 1, 2 and 3 ranks
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        sync.wait()
        opt.step()
        opt.zero_grad()
        return float(collectives.all_reduce(loss.detach().clone(), "mean"))

    ck = ShardedCheckpointer(directory)
    if resume:
        if kind == "plain":  # a plain optimizer has its state after its first step only: make it now
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            lr = opt.param_groups[0]["lr"]
            opt.param_groups[0]["lr"] = 0.0
            opt.step()
            opt.param_groups[0]["lr"] = lr
            opt.zero_grad()
        assert ck.resume({"model": model, "optimizer": opt}) == 2
    else:
        step(1), step(2)
        ck.save(2, {"model": model, "optimizer": opt})
    state = _optimizer_state(model, opt)
    return step(3), state


@pytest.mark.parametrize(
    "saved,resumed,world_size",
    [("zero1", "plain", 1), ("zero1", "plain", 2), ("zero1", "plain", 3), ("plain", "zero1", 1),
     ("plain", "zero1", 2), ("plain", "zero1", 3)],
)  # fmt: skip
def test_a_checkpoint_crosses_the_optimizer_sharding_boundary_at_any_world_size(tmp_path, saved, resumed, world_size):
    """Saved at 2 ranks with a ShardedOptimizer (each parameter's state a flat ShardedTensor) and
    resumed with a plain optimizer (the state in each parameter's shape), or the other way, at 1, 2 and
    3 ranks: the resumed optimizer state is the saved one and the next step's loss the uninterrupted run's."""
    ref_loss, ref_state = run_ranks(_cross_run, 2, str(tmp_path), saved, False)[0]
    loss, state = run_ranks(_cross_run, world_size, str(tmp_path), resumed, True)[0]
    assert state.keys() == ref_state.keys()
    for name in ref_state:
        assert state[name].keys() == ref_state[name].keys(), name
        for key in ref_state[name]:
            torch.testing.assert_close(state[name][key], ref_state[name][key], rtol=0, atol=0, msg=f"{name}.{key}")
    assert loss == pytest.approx(ref_loss, rel=1e-6)


def _save_replicated(ctx, directory: str) -> None:
    model, opt, sched = build("replicated", seed=0, width=4096)  # tensors large next to the small values
    train_step("replicated", model, opt, sched, 1)
    ShardedCheckpointer(directory).save(1, objects(model, opt, sched, {"step": 1}))


def test_a_replicated_model_is_written_in_parts_by_every_rank(tmp_path):
    """Every rank holds every tensor: DCP's planner spreads them over the ranks, so each writes a part
    (a save gets faster with ranks), and together they write the checkpoint once."""
    run_ranks(_save_replicated, 2, str(tmp_path))
    step = tmp_path / "step000000001"
    parts = [sum(f.stat().st_size for f in step.glob(f"__{r}_*.distcp")) for r in range(2)]
    assert min(parts) > 0.3 * sum(parts), parts
