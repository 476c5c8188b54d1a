"""GradSync on real ranks against one process stepping on the concatenated batch.

CPU tests run gloo ranks; GPU tests (NCCL, whole-step CUDA graphs) are skipped without GPUs.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import distlib
from distlib.distributed.state_broadcast import broadcast_module
from distlib.parallel.grad_sync import GradSync, ModelMismatchError
from tests.conftest import run_ranks

B = 4  # samples per rank


class Net(nn.Module):
    """A small conv net; optional extra layers for the edge cases."""

    def __init__(self, unused: bool = False, frozen: bool = False, branch: bool = False, classes: int = 5):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc1 = nn.Linear(4 * 8 * 8, 16)
        self.fc2 = nn.Linear(16, classes)
        self.unused = nn.Linear(7, 7) if unused else None  # never called
        self.frozen = nn.Linear(16, 16).requires_grad_(False) if frozen else None
        self.branch = nn.Linear(16, 16) if branch else None  # used only when forward asks for it

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = F.relu(self.fc1(F.relu(self.conv(x)).flatten(1)))
        if self.frozen is not None:
            h = h + self.frozen(h)
        if self.branch is not None and use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.fc2(h)


def _batch(step: int, n: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 3, 8, 8, generator=g).to(device), torch.randint(0, 5, (n,), generator=g).to(device)


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _train(
    ctx, model_kw: dict, sync_kw: dict, zero: str, steps: int = 4, accum: int = 1, device="cpu", cl: bool = False
) -> dict:
    """Train with GradSync on this rank's slice and a reference on the whole batch; compare.
    ``cl``: channels_last model and inputs."""
    torch.manual_seed(100 + ctx.rank)  # different initial weights per rank: the broadcast must fix them
    model = Net(**model_kw).to(device)
    if cl:
        model = model.to(memory_format=torch.channels_last)
    sync = GradSync(model, **sync_kw)
    ref = Net(**model_kw).to(device)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    launches: list[tuple[int, bool]] = []  # (parameters ready, inside backward) at each bucket launch
    in_backward = [False]
    launch = sync._launch

    def spy(bucket):
        launches.append((sum(s.ready_step == sync._step for s in sync._slots), in_backward[0]))
        launch(bucket)

    sync._launch = spy
    world = ctx.world_size
    for step in range(steps):
        x, y = _batch(step, world * B, device)
        # reference: one process, the whole batch (per-rank parts as the ranks see them)
        parts = [ref(x[r * B : (r + 1) * B], use_branch=r == 0) for r in range(world)]
        ref_loss = sum(F.cross_entropy(p, y[r * B : (r + 1) * B]) for r, p in enumerate(parts)) / world
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        # distributed: this rank's slice, in `accum` micro-batches
        xs, ys = x[ctx.rank * B : (ctx.rank + 1) * B], y[ctx.rank * B : (ctx.rank + 1) * B]
        if cl:
            xs = xs.contiguous(memory_format=torch.channels_last)
        m = B // accum
        for k in range(accum):
            loss = F.cross_entropy(model(xs[k * m : (k + 1) * m], use_branch=ctx.rank == 0), ys[k * m : (k + 1) * m])
            if k < accum - 1:
                with sync.no_sync():
                    (loss / accum).backward()
                    sync.wait()  # a no-op inside no_sync
            else:
                in_backward[0] = True
                (loss / accum).backward()
                in_backward[0] = False
                sync.wait()
        # a parameter no rank used keeps grad None (as with DDP); every other one has its bucket view
        views = all(p.grad is s.view for p, s in zip(sync.params, sync._slots) if p.grad is not None)
        strides = all(p.grad.stride() == p.stride() for p in sync.params if p.grad is not None)
        grads = {n: None if p.grad is None else p.grad.abs().sum().item() for n, p in model.named_parameters()}
        opt.step()
        if zero == "none":
            opt.zero_grad(set_to_none=True)
        elif zero == "keep":
            opt.zero_grad(set_to_none=False)
        else:
            sync.zero_grad()
    layout = [sync._names[id(s.param)] for b in sync.buckets for s in b.slots]
    return {
        "diff": _max_diff(model, ref),
        "views": views,
        "strides": strides,  # gradient views keep the parameter's layout (channels_last too)
        "buckets": len(sync.buckets),
        "layout": layout,
        "launched_in_backward": sum(inside for _, inside in launches),
        "first_launch_ready": launches[0][0] if launches else None,
        "trainable": len(sync.params),
        "comp": [str(b.comp.dtype) for b in sync.buckets if b.comp is not None],
        "grads": grads,  # after the last wait()
    }


CONFIGS = [
    ("tiny", {"bucket_mb": 1e-4, "first_bucket_mb": 1e-5}, "none"),  # a bucket per parameter
    ("uneven", {"bucket_mb": 0.004, "first_bucket_mb": 0.001}, "keep"),  # a few buckets of mixed sizes
    ("one", {"bucket_mb": 100, "first_bucket_mb": 100}, "views"),  # everything in one bucket
]


def _equivalence(ctx, configs):
    return {name: _train(ctx, {}, kw, zero) for name, kw, zero in configs}


@pytest.mark.parametrize("world", [2, 3])
def test_equivalence_with_one_process_for_bucket_sizes(world):
    configs = CONFIGS if world == 2 else CONFIGS[:2]
    results = run_ranks(_equivalence, world, configs)
    for rank, res in enumerate(results):
        for name, r in res.items():
            assert r["diff"] < 1e-5, (rank, name, r["diff"])
            assert r["views"], (rank, name, "every .grad must be a view into its bucket after wait()")
            assert r["layout"] == results[0][name]["layout"], "bucket layout must agree across ranks"
    tiny, uneven, one = (results[0].get(n) for n in ("tiny", "uneven", "one"))
    assert tiny["buckets"] == tiny["trainable"] == 6
    assert 1 < uneven["buckets"] < uneven["trainable"]
    # communication overlaps backward: a bucket is launched before every gradient is ready
    assert tiny["launched_in_backward"] >= tiny["buckets"] - 1
    assert tiny["first_launch_ready"] < tiny["trainable"]
    if one is not None:
        assert one["buckets"] == 1


SMALL = {"bucket_mb": 0.002, "first_bucket_mb": 5e-4}  # a few buckets
TINY = {"bucket_mb": 1e-4, "first_bucket_mb": 1e-5}  # a bucket per parameter


def _freeze_with_sync_zero_grad(ctx) -> dict:
    """fc1 frozen after two steps, gradients zeroed with sync.zero_grad() (the buckets, in place): the
    frozen layer must not move again (no stale gradient view left on it), the others still train."""
    torch.manual_seed(0)
    model = Net()
    sync = GradSync(model, **SMALL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        if step == 2:
            model.fc1.requires_grad_(False)
            frozen = model.fc1.weight.detach().clone()
            trained = model.fc2.weight.detach().clone()
        x, y = _batch(step, B)
        F.cross_entropy(model(x[ctx.rank :: 2]), y[ctx.rank :: 2]).backward()
        sync.wait()
        opt.step()
        sync.zero_grad()
    sync.close()
    return {
        "frozen_moved": (model.fc1.weight - frozen).abs().max().item(),
        "frozen_grad": model.fc1.weight.grad,
        "trained_moved": (model.fc2.weight - trained).abs().max().item(),
    }


def _no_sync_is_silent(ctx) -> int:
    """The all_reduces issued by a backward and wait() inside no_sync(): none."""
    model = Net()
    sync = GradSync(model, **TINY)
    calls = []
    original = dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        x, y = _batch(0, B)
        with sync.no_sync():
            F.cross_entropy(model(x), y).backward()
            sync.wait()
        inside = len(calls)
        F.cross_entropy(model(x), y).backward()
        sync.wait()
    finally:
        dist.all_reduce = original
    sync.close()
    return inside, len(calls) - inside


def _edge_cases(ctx):
    return {
        "freeze": _freeze_with_sync_zero_grad(ctx),
        "no_sync_calls": _no_sync_is_silent(ctx),
        "unused_frozen": _train(ctx, {"unused": True, "frozen": True}, SMALL, "none"),
        "branch_on_rank0_only": _train(ctx, {"branch": True}, TINY, "none"),
        "no_sync": _train(ctx, {}, SMALL, "none", accum=2),
        "no_sync_views": _train(ctx, {"branch": True}, {"bucket_mb": 0.002}, "views", accum=2),
        "channels_last": _train(ctx, {}, SMALL, "none", cl=True),
    }


def test_unused_frozen_data_dependent_and_no_sync():
    results = run_ranks(_edge_cases, 2)
    for rank, res in enumerate(results):
        freeze = res.pop("freeze")
        assert freeze["frozen_moved"] == 0.0 and freeze["frozen_grad"] is None, (rank, freeze)
        assert freeze["trained_moved"] > 0, (rank, freeze)
        inside, synced = res.pop("no_sync_calls")
        assert inside == 0 and synced == 6, (rank, "no_sync() communicates nothing", inside, synced)
        for name, r in res.items():
            assert r["diff"] < 1e-5, (rank, name, r["diff"])
            assert r["strides"], (rank, name)
        assert res["channels_last"]["views"]
        grads = res["unused_frozen"]["grads"]
        assert grads["frozen.weight"] is None, "frozen parameters are not synced and get no gradient"
        assert grads["unused.weight"] is None, "a parameter unused on every rank keeps grad None (as DDP)"
        assert res["unused_frozen"]["trainable"] == 8  # conv, fc1, fc2, unused: weight + bias
        assert res["branch_on_rank0_only"]["grads"]["branch.weight"] > 0  # rank 1 received rank 0's gradient


def _compressed_and_buffers(ctx):
    exact = _train(ctx, {}, {"bucket_mb": 0.004, "first_bucket_mb": 0.001}, "none")
    bf16 = _train(ctx, {}, {"bucket_mb": 0.004, "first_bucket_mb": 0.001, "compress": "bf16"}, "none")
    bn = nn.BatchNorm1d(3)
    sync = GradSync(bn)
    bn.running_mean.fill_(float(ctx.rank))
    bn.num_batches_tracked.fill_(10 + ctx.rank)
    sync.sync_buffers()
    # the default bucket sizes (first_bucket_mb=1, bucket_mb=25) on a model of 3 MB
    big = nn.Sequential(*(nn.Linear(512, 512) for _ in range(3)))
    default = GradSync(big)
    layout = default.bucket_sizes(), sum(p.numel() * p.element_size() for p in big.parameters())
    default.close()
    return exact, bf16, bn.running_mean.tolist(), bn.num_batches_tracked.item(), layout


def test_bf16_compression_close_to_exact_and_buffer_sync():
    for exact, bf16, mean, tracked, (sizes, nbytes) in run_ranks(_compressed_and_buffers, 2):
        assert bf16["comp"] and set(bf16["comp"]) == {"torch.bfloat16"}
        assert bf16["diff"] < 5e-3, bf16["diff"]  # bf16 rounding of the averaged gradients
        assert exact["diff"] < 1e-5
        assert mean == [0.5, 0.5, 0.5] and tracked == 10  # running statistics averaged, counters from rank 0
        # defaults: a first bucket of at most 1 MB (the last layer's bias: its 1 MB weight does not fit
        # beside it), then the other 3 MB in one bucket of at most 25 MB; bucket_sizes() counts gradient bytes
        assert sizes == [512 * 4, nbytes - 512 * 4], sizes


# ---- buckets spread over several communicators (comm_groups) -------------------------------
def _group_launches(ctx, n: int) -> list[int]:
    """The group index of each all_reduce GradSync issues in one synced step (a bucket per parameter)."""
    from distlib.distributed import collectives

    model = Net()
    sync = GradSync(model, **TINY, comm_groups=n)
    groups = collectives.comm_groups(n)
    seen: list[int] = []
    original = dist.all_reduce

    def spy(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        seen.append(next(i for i, g in enumerate(groups) if g is group))
        return original(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = spy
    try:
        x, y = _batch(0, B)
        F.cross_entropy(model(x), y).backward()
        sync.wait()
    finally:
        dist.all_reduce = original
    sync.close()
    return seen


def _comm_groups(ctx, full: bool):
    from distlib.distributed import collectives

    kw = {"bucket_mb": 0.004, "first_bucket_mb": 0.001}  # a few buckets of mixed sizes
    out = {
        "tiny_g2": _train(ctx, {}, {**TINY, "comm_groups": 2}, "none"),
        "uneven_g3": _train(ctx, {}, {**kw, "comm_groups": 3}, "keep"),
        "missing_g3": _train(ctx, {"unused": True, "frozen": True, "branch": True}, {**TINY, "comm_groups": 3}, "none"),
        "no_sync_g2": _train(ctx, {"branch": True}, {**SMALL, "comm_groups": 2}, "views", accum=2),
    }
    if full:  # the rest on two ranks only (time)
        out["uneven_g2"] = _train(ctx, {}, {**kw, "comm_groups": 2}, "views")
        out["one_g2"] = _train(ctx, {}, {"bucket_mb": 100, "first_bucket_mb": 100, "comm_groups": 2}, "none")
        out["bf16_g2"] = _train(ctx, {}, {**kw, "compress": "bf16", "comm_groups": 2}, "none")
        out["bf16_g1"] = _train(ctx, {}, {**kw, "compress": "bf16"}, "none")
    launches = _group_launches(ctx, 3)
    cpu = torch.device("cpu")
    timeouts = {g._get_backend(cpu).options._timeout for g in collectives.comm_groups(3)[1:]}
    same_timeout = timeouts == {dist.group.WORLD._get_backend(cpu).options._timeout}  # not torch's 30 min
    # groups are created once per process group and shared: the largest n made n - 1 of them
    created = len(collectives._EXTRA_GROUPS[1])
    shared = collectives.comm_groups(2) == collectives.comm_groups(3)[:2]
    # groups made under another default group (destroyed, then initialized again) are not reused
    stale = object()
    collectives._EXTRA_GROUPS = (lambda: object(), [stale])  # a cache made for another default group
    fresh = collectives.comm_groups(2)
    return out, launches, created, shared and same_timeout, fresh[1] is not stale and fresh[0] is None


@pytest.mark.parametrize("world", [2, 3])
def test_comm_groups_match_one_process(world):
    results = run_ranks(_comm_groups, world, world == 2)
    for rank, (res, launches, created, shared, fresh) in enumerate(results):
        for name, r in res.items():
            limit = 5e-3 if name.startswith("bf16") else 1e-5
            assert r["diff"] < limit, (rank, name, r["diff"])
            assert r["views"] and r["strides"], (rank, name)
            assert r["layout"] == results[0][0][name]["layout"], "bucket layout must agree across ranks"
        # bucket i on group i % n, buckets in order: the same collectives per group on every rank
        assert launches == [i % 3 for i in range(6)], launches
        assert created == 2 and shared and fresh
        grads = res["missing_g3"]["grads"]
        assert grads["unused.weight"] is None and grads["frozen.weight"] is None
        assert grads["branch.weight"] > 0  # used on rank 0 only: every rank gets the average
    if world == 2:
        res = results[0][0]
        # bf16 rounding is the same whichever communicator a bucket travels on
        assert abs(res["bf16_g2"]["diff"] - res["bf16_g1"]["diff"]) < 1e-6
        assert res["one_g2"]["buckets"] == 1
    assert results[0][0]["tiny_g2"]["launched_in_backward"] >= results[0][0]["tiny_g2"]["buckets"] - 1


def test_comm_groups_bad_values_and_world_size_one():
    from distlib.distributed import collectives
    from distlib.runner.config import ConfigError, load_config

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="comm_groups must be an integer >= 1"):
            GradSync(Net(), comm_groups=bad)
    # the constructor's and the collectives' argument errors: DistlibErrors, and ValueErrors as before
    for kwargs in ({"comm_groups": 0}, {"bucket_mb": 0}, {"compress": "fp8"}, {"shard": "full"}):
        with pytest.raises(distlib.ArgumentError) as e:
            GradSync(Net(), **kwargs)
        assert isinstance(e.value, ValueError), kwargs
    with pytest.raises(distlib.ArgumentError, match="comm_groups: n must be an integer >= 1"):
        collectives.comm_groups(0)
    with pytest.raises(distlib.ArgumentError, match="replicas must be an integer >= 1"):
        collectives.sync_buffers(Net(), replicas=0)
    # world size 1: no group is created, and the step is the plain one
    model = Net()
    sync = GradSync(model, comm_groups=4)
    assert sync.comm_groups == 4 and collectives.comm_groups(4) == [None] * 4
    assert collectives._EXTRA_GROUPS is None
    x, y = _batch(0, B)
    F.cross_entropy(model(x), y).backward()
    before = [p.grad.clone() for p in model.parameters()]
    sync.wait()
    assert all(torch.equal(g, p.grad) for g, p in zip(before, model.parameters())), "world size 1: wait() is a no-op"
    assert load_config(None, ["dist.comm_groups=3"]).dist.comm_groups == 3
    with pytest.raises(ConfigError, match=r"dist\.comm_groups: must be > 0, got 0"):
        load_config(None, ["dist.comm_groups=0"])
    with pytest.raises(ConfigError, match=r"dist\.comm_groups: expected int"):
        load_config(None, ["dist.comm_groups=2.5"])


class Chain(nn.Module):
    """Registered l0..l3 but applied l3 first: gradients arrive in registration order, the
    opposite of what the initial layout assumes."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def _rebuild(ctx):
    torch.manual_seed(ctx.rank)
    model = Chain()
    sync = GradSync(model, bucket_mb=1e-4, first_bucket_mb=1e-5)
    ref = Chain()
    ref.load_state_dict(model.state_dict())
    before = [sync._names[id(s.param)] for b in sync.buckets for s in b.slots]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(2 * B, 8, generator=g)
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(x[ctx.rank * B : (ctx.rank + 1) * B]).square().mean().backward()
        sync.wait()
        opt.step()
        opt.zero_grad()
    after = [sync._names[id(s.param)] for b in sync.buckets for s in b.slots]
    return before, after, _max_diff(model, ref)


def test_bucket_order_rebuilt_from_arrival_order():
    results = run_ranks(_rebuild, 2)
    for before, after, diff in results:
        assert before[0].startswith("layers.3") and before[-1].startswith("layers.0")
        assert after[0].startswith("layers.0") and after[-1].startswith("layers.3"), after
        assert after == results[0][1]
        assert diff < 1e-5


def _mismatch(ctx, kind):
    classes = 6 if (kind in ("shape", "both") and ctx.rank == 1) else 5
    model = Net(classes=classes, unused=kind in ("extra", "both") and ctx.rank == 2)
    t0 = time.perf_counter()
    try:
        GradSync(model)
    except ModelMismatchError as e:
        return str(e), time.perf_counter() - t0
    return None, time.perf_counter() - t0


def _mismatches(ctx):
    return [_mismatch(ctx, "shape"), _mismatch(ctx, "extra"), _mismatch(ctx, "both")]


def test_preflight_mismatch_fails_fast_on_every_rank():
    results = run_ranks(_mismatches, 3)
    for (shape_msg, t_shape), (extra_msg, t_extra), (both_msg, _) in results:
        assert shape_msg is not None and extra_msg is not None, "every rank must raise"
        assert "rank 1" in shape_msg and "'fc2.weight' has shape (6, 16), rank 0 has (5, 16)" in shape_msg
        assert "rank 2" in extra_msg and "'unused.weight'" in extra_msg and "does not exist on rank 0" in extra_msg
        assert t_shape < 10 and t_extra < 10
        # two ranks differ from rank 0, each in its own way: both are named
        assert "rank 1: param 'fc2.weight' has shape (6, 16)" in both_msg, both_msg
        assert "rank 2: param 'unused.weight'" in both_msg, both_msg


class BufNet(nn.Module):
    """Parameters and buffers, with a per-rank variant for the preflight cases."""

    def __init__(self, variant: str = ""):
        super().__init__()
        shape = (4,) if variant == "buffer_shape" else (3,)
        dtype = torch.float64 if variant == "buffer_dtype" else torch.float32
        buffers = [("scale", torch.ones(shape, dtype=dtype)), ("shift", torch.zeros(3))]
        for name, t in reversed(buffers) if variant == "buffer_order" else buffers:
            self.register_buffer(name, t)
        layers = [("lin", nn.Linear(3, 3)), ("bn", nn.BatchNorm1d(3))]
        for name, m in reversed(layers) if variant == "param_order" else layers:
            self.add_module(name, m)
        if variant == "requires_grad":
            self.lin.weight.requires_grad_(False)  # frozen on one rank only: the buckets would differ

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x)) * self.scale[:3].float() + self.shift


def _rank0_buffers(ctx):
    torch.manual_seed(ctx.rank)
    model = BufNet()
    with torch.no_grad():  # every buffer differs between the ranks before GradSync
        model.scale.uniform_()
        model.shift.uniform_()
        model.bn.running_mean.uniform_()
        model.bn.running_var.uniform_(1, 2)
        model.bn.num_batches_tracked.fill_(7 + ctx.rank)
    GradSync(model)
    # broadcast_module cuts each dtype into chunks of at most chunk_bytes: 40 bytes here, so that
    # chunks of one, two and three tensors all occur (a model of more than 64 MB per dtype)
    other = BufNet()
    with torch.no_grad():
        other.scale.uniform_()
        other.bn.running_var.uniform_(1, 2)
    before = {k: v.tolist() for k, v in other.state_dict().items()}
    broadcast_module(other, chunk_bytes=40)
    chunked = {k: v.tolist() for k, v in other.state_dict().items()}
    own = BufNet()  # broadcast=False: each rank keeps its own weights (e.g. each loaded them itself)
    kept = own.lin.weight.tolist()
    GradSync(own, broadcast=False).close()
    return {k: v.tolist() for k, v in model.state_dict().items()}, before, chunked, own.lin.weight.tolist() == kept


def test_construction_broadcasts_rank0_parameters_and_buffers():
    (r0, before0, chunked0, kept0), (r1, before1, chunked1, kept1) = run_ranks(_rank0_buffers, 2)
    assert kept0 and kept1, "GradSync(broadcast=False) must leave the weights alone"
    assert r0["bn.num_batches_tracked"] == 7
    assert r1 == r0, "every parameter and buffer must be rank 0's after GradSync()"
    assert all(before0[k] != before1[k] for k in ("lin.weight", "lin.bias", "bn.running_var", "scale"))
    assert chunked0 == before0 and chunked1 == before0, "every chunk of the broadcast must reach rank 1"


def _buffer_mismatch(ctx, variant):
    try:
        GradSync(BufNet(variant if ctx.rank == 1 else ""))
    except ModelMismatchError as e:
        return str(e)
    return None


def _buffer_mismatches(ctx):
    variants = ("buffer_dtype", "buffer_shape", "buffer_order", "param_order", "requires_grad")
    out = {v: _buffer_mismatch(ctx, v) for v in variants}
    model = nn.Linear(2, 2)
    model.bias = nn.Parameter(torch.zeros(2, device="meta"))  # parameters on two devices
    try:
        GradSync(model)
    except ValueError as e:
        out["two_devices"] = str(e)
    return out


def test_preflight_compares_buffers_and_registration_order():
    for rank, res in enumerate(run_ranks(_buffer_mismatches, 2)):
        assert "GradSync needs the model on one device" in res.pop("two_devices", ""), rank
        for variant, msg in res.items():
            assert msg is not None, (rank, variant, "every rank must raise ModelMismatchError")
            assert "rank 1" in msg, (variant, msg)
        assert "buffer 'scale' has dtype torch.float64, rank 0 has torch.float32" in res["buffer_dtype"], res
        assert "buffer 'scale' has shape (4,), rank 0 has (3,)" in res["buffer_shape"], res["buffer_shape"]
        assert "registration order" in res["buffer_order"] and "registration order" in res["param_order"]
        assert "'lin.weight' has requires_grad=False, rank 0 has True" in res["requires_grad"], res["requires_grad"]


def _autograd_grads_after_backward(ctx, shard: str) -> list[int]:
    """After each backward (before wait()): how many of autograd's own gradient tensors are still alive,
    and whether every .grad is already its bucket's view."""
    import weakref

    torch.manual_seed(0)
    model = Net()
    made: list[weakref.ref] = []
    for p in model.parameters():  # registered before GradSync's hooks: they see autograd's tensor
        p.register_post_accumulate_grad_hook(lambda p: made.append(weakref.ref(p.grad)))
    sync = GradSync(model, bucket_mb=1e-3, first_bucket_mb=1e-4, shard=shard)
    if shard == "optimizer":
        opt = sync.sharded_optimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    alive = []
    for step in range(3):  # the first layout, then the one rebuilt from the arrival order
        made.clear()
        x, y = _batch(step, B)
        F.cross_entropy(model(x), y).backward()
        alive.append(sum(r() is not None for r in made))
        flat = {st.data_ptr() for st in sync._storages}  # rebuilt after the first step (arrival order)
        views = all(p.grad.untyped_storage().data_ptr() in flat for p in model.parameters())
        sync.wait()
        opt.step()
        opt.zero_grad(set_to_none=True)  # autograd makes new gradient tensors in the next backward
        alive.append(int(not views))
    return alive


@pytest.mark.parametrize("shard", ["none", "optimizer"])
def test_autograd_gradients_are_freed_when_their_bucket_is_launched(shard):
    """Each bucket's gradients are copied into it when the bucket is complete; autograd's own tensors
    go then, not at wait(): the backward never holds every gradient twice (the memory plan counts
    them once)."""
    for alive in run_ranks(_autograd_grads_after_backward, 2, shard):
        assert alive == [0] * 6, alive


def _twice(ctx):
    model = Net()
    sync = GradSync(model, bucket_mb=1e-4, first_bucket_mb=1e-5)
    x, y = _batch(0, B)
    F.cross_entropy(model(x), y).backward()
    try:
        F.cross_entropy(model(x), y).backward()
    except distlib.DistlibError as e:
        sync.wait()  # keep the ranks' collectives matched before shutdown
        return f"{type(e).__name__}: {e}" if isinstance(e, RuntimeError) else "not a RuntimeError"
    return None


def test_backward_twice_without_wait_is_a_clear_error():
    for msg in run_ranks(_twice, 2):
        assert msg and msg.startswith("GradSyncError") and "produced twice before sync.wait()" in msg, msg
        assert "no_sync" in msg


def _join_misuse(ctx) -> list[str]:
    model = Net()
    sync = GradSync(model)
    out = []
    with sync.join():
        try:
            with sync.join():
                pass
        except distlib.GradSyncError as e:
            out.append(str(e))
    try:
        with sync.join():
            x, y = _batch(0, B)
            F.cross_entropy(model(x), y).backward()  # no wait() before leaving
    except distlib.GradSyncError as e:
        out.append(str(e))
        sync.wait()
    return out


def test_join_misuse_is_a_distlib_error():
    for msgs in run_ranks(_join_misuse, 2):
        assert msgs == [
            "GradSync.join(): already inside join()",
            "GradSync.join(): a synced backward was not followed by sync.wait() before leaving",
        ]


def _uneven_without_join(ctx) -> str:
    model = Net()
    sync = GradSync(model)
    message = ""
    for step in range(2 if ctx.rank == 0 else 1):  # rank 0 has one batch more, and no join()
        x, y = _batch(step, B)
        F.cross_entropy(model(x), y).backward()
        try:
            sync.wait()
        except distlib.GradSyncError as e:
            message = str(e)
    if ctx.rank == 1:
        time.sleep(4)  # gone only after rank 0's timeout (a closed connection would be another error)
    distlib.shutdown(barrier=False)  # a gloo group is unusable after a timeout: no final barrier
    return message


def test_uneven_inputs_without_join_time_out_with_a_hint():
    r0, r1 = run_ranks(_uneven_without_join, 2, init_timeout_s=2.5)
    assert r1 == ""
    assert r0.startswith("GradSync.wait(): a gradient all_reduce timed out") and "`with sync.join():`" in r0, r0


def test_world_size_one_is_a_no_op():
    model = Net()
    sync = GradSync(model)
    x, y = _batch(0, B)
    F.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    sync.wait()
    assert sync.world_size == 1 and not sync.buckets
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    with sync.no_sync():  # accumulation: a second backward adds to the gradients, wait() changes nothing
        F.cross_entropy(model(x), y).backward()
        sync.wait()
    assert all(torch.allclose(2 * g, p.grad) for g, p in zip(grads, model.parameters()))
    F.cross_entropy(model(x), y).backward()  # synced again after no_sync
    sync.wait()
    assert all(torch.allclose(3 * g, p.grad) for g, p in zip(grads, model.parameters()))
    sync.zero_grad()
    assert all(p.grad.abs().sum() == 0 for p in model.parameters())


# ---- GPU: NCCL and whole-step CUDA graphs (skipped on CPU machines) -------------------------
def _exact_cuda():
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = True


def _nccl_equivalence(ctx):
    _exact_cuda()
    out = {name: _train(ctx, {}, kw, zero, device=ctx.device) for name, kw, zero in CONFIGS}
    out["default"] = _train(ctx, {"unused": True}, {}, "none", device=ctx.device)
    out["bf16"] = _train(ctx, {}, {"compress": "bf16"}, "none", device=ctx.device)
    # buckets on 2 and 3 NCCL communicators (their all_reduces run concurrently)
    out["uneven_g2"] = _train(
        ctx, {}, {"bucket_mb": 0.004, "first_bucket_mb": 0.001, "comm_groups": 2}, "none", device=ctx.device
    )
    out["tiny_g3"] = _train(ctx, {"unused": True}, {**TINY, "comm_groups": 3}, "keep", device=ctx.device)
    return out


@pytest.mark.gpus(2)
def test_nccl_equivalence_on_two_gpus():
    for res in run_ranks(_nccl_equivalence, 2, backend="nccl", timeout=240):
        for name, r in res.items():
            # cuDNN may pick other algorithms for the reference's larger batch: a little more slack than on CPU
            assert r["diff"] < (5e-3 if name == "bf16" else 5e-5), (name, r["diff"])


_KEEP: list = []


def _graph_vs_eager(ctx, steps: int = 8, comm_groups: int = 1) -> dict:
    """The same training with the eager step and with CapturedStep; returns the differences."""
    from distlib.step.cuda_graph import CapturedStep

    _exact_cuda()
    device = ctx.device if ctx is not None else torch.device("cuda", 0)
    world = ctx.world_size if ctx is not None else 1
    rank = ctx.rank if ctx is not None else 0
    out = {}
    runs = {}
    for mode in ("eager", "graph"):
        torch.manual_seed(0)
        model = Net().to(device).to(memory_format=torch.channels_last)
        sync = GradSync(model, bucket_mb=0.004, first_bucket_mb=0.001, comm_groups=comm_groups)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # lr changes every step

        def loss_fn(x, y, model=model):
            return F.cross_entropy(model(x), y)

        step = CapturedStep(model, opt, loss_fn, sync, warmup_steps=2) if mode == "graph" else None
        losses = []
        for i in range(steps):
            x, y = _batch(i, world * B, device)
            x = x[rank * B : (rank + 1) * B].contiguous(memory_format=torch.channels_last)
            y = y[rank * B : (rank + 1) * B]
            if step is None:
                loss = loss_fn(x, y)
                loss.backward()
                sync.wait()
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                loss = step(x, y)
            losses.append(loss.item())
            sched.step()
        runs[mode] = (model, losses)
        if step is not None:
            out["captured"] = step.captured
            if ctx is None:
                step.close()
            else:
                _KEEP.append(step)  # left to distlib.shutdown(), which must release it before the group goes
    out["param_diff"] = _max_diff(runs["eager"][0], runs["graph"][0])
    out["loss_diff"] = max(abs(a - b) for a, b in zip(runs["eager"][1], runs["graph"][1]))
    return out


@pytest.mark.gpus(1)
def test_captured_step_equals_eager_on_one_gpu():
    out = _graph_vs_eager(None)
    assert out["captured"]
    assert out["param_diff"] < 1e-5 and out["loss_diff"] < 1e-5, out


def _graph_vs_eager_groups(ctx) -> dict:
    """One communicator, then the buckets round-robin on two (the warm-up uses both before capture)."""
    return {n: _graph_vs_eager(ctx, comm_groups=n) for n in (1, 2)}


@pytest.mark.gpus(2)
def test_captured_step_equals_eager_on_two_gpus():
    for res in run_ranks(_graph_vs_eager_groups, 2, backend="nccl", timeout=240):
        for n, out in res.items():
            assert out["captured"], n
            assert out["param_diff"] < 1e-5 and out["loss_diff"] < 1e-5, (n, out)


def _join_buffers(ctx, broadcast: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(192, 8), nn.BatchNorm1d(8), nn.Linear(8, 5))
    sync = GradSync(model, broadcast_buffers=broadcast)
    with sync.join():
        for step in range(3 if ctx.rank == 1 else 1):  # rank 1 leaves join() last
            x, y = _batch(10 * step + ctx.rank, B)
            F.cross_entropy(model(x), y).backward()
            sync.wait()
    return [b.clone() for b in model.buffers()]


@pytest.mark.parametrize("broadcast", [True, False])
def test_join_ends_with_the_last_joiners_buffers_as_ddp(broadcast):
    r0, r1 = run_ranks(_join_buffers, 2, broadcast)
    assert all(torch.equal(a, b) for a, b in zip(r0, r1)) == broadcast
    assert int(r0[-1]) == (3 if broadcast else 1)  # num_batches_tracked: rank 1's three forwards, or rank 0's own one
