"""Library options (sharding, loaders, sharded checkpoints, capture checks) in the combinations the
other tests leave at their defaults.

Each case sets a value of an option that sends the code down another branch (another optimizer
class, a checkpoint taken before the first step, DDP's ``sampler.set_epoch``), in a set-up where
the right value and the plausible wrong one differ.
"""

from __future__ import annotations

import os
import stat

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import distlib
from distlib.parallel.grad_sync import GradSync
from tests.conftest import run_ranks

TINY = {"bucket_mb": 3e-4, "first_bucket_mb": 1e-4}  # several buckets, parameters cut between them


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.LayerNorm(9), nn.Linear(9, 3))


def _train(opt_cls, kw: dict, *, sharded: bool, state_dict_first: bool) -> list[torch.Tensor]:
    model = _net()
    sync = GradSync(model, shard="optimizer", **TINY) if sharded else None
    if sync is None:
        opt = opt_cls(model.parameters(), **kw)
    else:
        opt = sync.sharded_optimizer(opt_cls, model.parameters(), **kw)
    if state_dict_first:
        opt.state_dict()  # a checkpoint taken before the first step (it makes every piece's state)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        F.cross_entropy(model(x), y).backward()
        if sync is not None:
            sync.wait()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "opt_cls, kw",
    [
        (torch.optim.NAdam, {"lr": 0.05}),  # its running product must start at 1, not at the probe step's
        (torch.optim.RAdam, {"lr": 0.05}),  # its rectification reads the step count
        (torch.optim.Adamax, {"lr": 0.05}),
        (torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1}),
        (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else "",
)
def test_a_state_dict_before_the_first_step_leaves_every_elementwise_optimizer_fresh(opt_cls, kw):
    """state_dict() before any step gives every piece a state (a zero-gradient step at lr 0 with its
    counters reset): the training that follows is the plain optimizer's, for each optimizer class."""
    ref = _train(opt_cls, kw, sharded=False, state_dict_first=False)
    got = _train(opt_cls, kw, sharded=True, state_dict_first=True)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


# ---- distributed_loader: DDP's sampler.set_epoch and the checkpoint -----------------------------


def test_a_checkpoint_after_ddps_sampler_set_epoch_holds_that_epoch():
    """DDP's idiom sets the epoch on the sampler alone: a checkpoint taken then holds that epoch (not
    the loader's own count, which differs here), and the resumed loader reads that epoch's order."""
    ds = TensorDataset(torch.arange(41))
    loader = distlib.distributed_loader(ds, 3, num_replicas=2, rank=1)
    for _ in range(2):
        list(loader)  # two completed passes: the loader's own count is 2
    loader.sampler.set_epoch(5)
    saved = loader.state_dict()
    assert saved == {"epoch": 5}
    resumed = distlib.distributed_loader(ds, 3, num_replicas=2, rank=1)
    resumed.load_state_dict(saved)
    loader.sampler.set_epoch(5)
    assert [int(i) for (b,) in resumed for i in b] == [int(i) for (b,) in loader for i in b]


# ---- full sharding: clipping in other norms, the initialisation's seed --------------------------


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 3))


def _fsdp_clip_and_seed(ctx) -> dict:
    from distlib.parallel.fsdp import FSDPSync, shard_model

    out: dict = {"norms": {}, "grads": {}}
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)  # the same on every rank
    torch.manual_seed(0)
    ref = _mlp()
    for norm_type in (1.0, 3.0, float("inf")):
        model = shard_model(_mlp_copy(ref), block_types=[nn.Linear], device="cpu")
        sync = FSDPSync(model)
        F.cross_entropy(model(x), y).backward()
        sync.wait()
        got = sync.clip_grad_norm_(0.05, norm_type=norm_type)
        ref.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        want = nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type)
        out["norms"][norm_type] = (float(got), float(want))
        out["grads"][norm_type] = max(
            (model.get_parameter(n).grad.full_tensor() - p.grad).abs().max().item() for n, p in ref.named_parameters()
        )
    weights = {}
    for seed in (1, 2, 1):
        m = shard_model(_mlp, block_types=[nn.Linear], device="cpu", seed=seed)
        weights.setdefault(seed, []).append(torch.cat([p.full_tensor().flatten() for p in m.parameters()]))
    out["same_seed_same"] = torch.equal(weights[1][0], weights[1][1])
    out["other_seed_differs"] = not torch.equal(weights[1][0], weights[2][0])
    return out


def _mlp_copy(ref: nn.Module):
    def build() -> nn.Module:
        m = _mlp()
        m.load_state_dict(ref.state_dict())
        return m

    return build()


def test_full_sharding_clips_in_every_norm_and_follows_the_seed():
    """FSDPSync.clip_grad_norm_ with norm_type 1, 3 and inf (a max over the ranks' shards, not a
    sum) gives torch's total norm and clipped gradients of one process; shard_model's ``seed``
    chooses the initial weights (the same seed the same weights, another seed others)."""
    for res in run_ranks(_fsdp_clip_and_seed, 2, timeout=120):
        for norm_type, (got, want) in res["norms"].items():
            assert abs(got - want) <= 1e-5 * max(want, 1.0), (norm_type, got, want)
            assert got > 0.05, "clipping must be active to be observed"
        assert max(res["grads"].values()) <= 1e-6, res["grads"]
        assert res["same_seed_same"] and res["other_seed_differs"], res


# ---- sharded checkpoints: what reaches the disk, and a step saved again -------------------------


def test_a_sharded_checkpoint_reaches_the_disk_before_its_name_and_the_name_before_save_returns(tmp_path, monkeypatch):
    """A power cut must leave the previous checkpoint or the whole new one: the shards and the commit
    marker are synced before the rename that commits them, the directory holding the new name
    before save returns."""
    from distlib.checkpoint.sharded import ShardedCheckpointer

    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        kind = "fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file"
        events.append((kind, os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", os.path.basename(str(dst))))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    model = _net()
    ShardedCheckpointer(str(tmp_path)).save(7, {"model": model})
    commit = events.index(("rename", "step000000007"))
    before, after = events[:commit], events[commit + 1 :]
    assert ("fsync file", "commit.json.tmp") in before and ("rename", "commit.json") in before, events
    assert before.index(("fsync file", "commit.json.tmp")) < before.index(("rename", "commit.json")), events
    assert any(k == "fsync file" and n.endswith(".distcp") for k, n in before), ("shards not synced", events)
    assert ("fsync dir", ".partial-step000000007") in before[before.index(("rename", "commit.json")) :], events
    assert after == [("fsync dir", tmp_path.name)], events


def test_a_step_saved_again_replaces_the_older_checkpoint_of_that_step(tmp_path):
    """A run resumed from an older checkpoint saves steps it saved before: the new state replaces the
    old one of that step (resume reads the new one)."""
    from distlib.checkpoint.sharded import ShardedCheckpointer

    model = _net()
    ck = ShardedCheckpointer(str(tmp_path))
    ck.save(1, {"model": model})
    ck.save(2, {"model": model})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ck.save(2, {"model": model})  # again, after a resume from step 1
    fresh = _net()
    assert ShardedCheckpointer(str(tmp_path)).resume({"model": fresh}) == 2
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


# ---- CUDA-graph capture: every parameter group's settings ---------------------------------------


def test_capture_problem_reads_every_parameter_group():
    """A step is capturable only when every parameter group has the settings (the runner builds two
    groups: with and without weight decay); a second group without them is named, the first alone
    having them is not enough."""
    from distlib.step.cuda_graph import capture_problem

    cuda = torch.device("cuda", 0)  # only its type is read: the check runs on the CPU
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    for cls, ok, missing in (
        (torch.optim.SGD, {"fused": True}, "fused=True"),
        (torch.optim.AdamW, {"capturable": True}, "capturable=True"),
    ):
        both = cls([{"params": a.parameters(), **ok}, {"params": b.parameters(), **ok}], lr=0.1)
        assert capture_problem(cuda, both) is None, cls
        first_only = cls([{"params": a.parameters(), **ok}, {"params": b.parameters()}], lr=0.1)
        assert missing in (capture_problem(cuda, first_only) or ""), cls


# ---- compile_for_sync: fullgraph on the bucket-splitting path -----------------------------------


class _Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h)


def _fullgraph(ctx) -> dict:
    from distlib.step.compile import compile_for_sync

    out = {}
    for fullgraph in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _Broken()
        sync = GradSync(model, bucket_mb=0.004, first_bucket_mb=0.001)
        assert len(sync.buckets) > 1  # the split path, not plain torch.compile
        net = compile_for_sync(model, sync, backend="eager", fullgraph=fullgraph)
        try:
            net(torch.randn(2, 16)).sum().backward()
            sync.wait()
            out[fullgraph] = "ran"
        except Exception as e:  # dynamo's Unsupported: the graph break refused
            out[fullgraph] = type(e).__name__
        sync.close()
    return out


def test_compile_for_sync_passes_fullgraph_when_it_splits_at_the_buckets():
    """``fullgraph=True`` means what it means for torch.compile on the path that splits the graph
    at GradSync's buckets too: a model with a graph break is refused (and runs without it)."""
    for r in run_ranks(_fullgraph, 2, timeout=180):
        assert r[False] == "ran" and r[True] != "ran", r
