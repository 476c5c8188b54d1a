"""The fallback mode's hierarchy on the CPU: several CPU 'devices' per process stand in for a
node's GPUs, gloo ranks for the nodes. Compared with a single-process reference."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distlib.parallel.comm_fallback import Replicas, allreduce_buckets, node_devices
from tests.conftest import ROOT, free_port, run_ranks


def bn_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


def plain_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)
    )


NETS = {"bn": bn_net, "plain": plain_net}


def batches(steps: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(123)
    return [(torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(steps)]


def make_opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)


def reference_per_gpu(net: str, data, n_gpus: int, grad_accum: int = 1):
    """One process per GPU, emulated in one process: each 'GPU' a model copy with its own
    BatchNorm statistics, loss = mean over its shard, gradients averaged over the copies."""
    torch.manual_seed(0)
    copies = [NETS[net]() for _ in range(1)]
    copies += [copy.deepcopy(copies[0]) for _ in range(n_gpus - 1)]
    opt = make_opt(copies[0])
    losses = []
    for x, y in data:
        for c in copies[1:]:
            for pc, p0 in zip(c.parameters(), copies[0].parameters()):
                pc.data.copy_(p0.data)
        for c in copies:
            c.zero_grad(set_to_none=True)
        step_loss = 0.0
        for c, xs, ys in zip(copies, x.chunk(n_gpus), y.chunk(n_gpus)):
            for xm, ym in zip(xs.chunk(grad_accum), ys.chunk(grad_accum)):
                loss = F.cross_entropy(c(xm), ym)
                (loss / grad_accum).backward()
                step_loss += loss.item() / grad_accum / n_gpus
        for j, p0 in enumerate(copies[0].parameters()):
            p0.grad = sum(list(c.parameters())[j].grad for c in copies) / n_gpus
        opt.step()
        losses.append(step_loss)
    params = [p.detach().clone() for p in copies[0].parameters()]
    buffers = [
        (sum(list(c.buffers())[j] for c in copies) / n_gpus) if b.is_floating_point() else b
        for j, b in enumerate(copies[0].buffers())
    ]
    return params, buffers, losses


def run_fallback(ctx, net: str, data, n_devices: int, grad_accum: int = 1, zero_to_none: bool = False):
    """This rank is a node with ``n_devices`` CPU replicas; it takes its slice of each global batch."""
    torch.manual_seed(ctx.rank)  # node 1 starts different: Replicas must take node 0's parameters
    model = NETS[net]()
    replicas = Replicas(model, ["cpu"] * n_devices, bucket_mb=1e-4)  # tiny buckets: several all_reduces
    opt = make_opt(model)
    losses = []
    for x, y in data:
        per_node = x.shape[0] // ctx.world_size
        sl = slice(ctx.rank * per_node, (ctx.rank + 1) * per_node)
        loss = replicas.train_step(x[sl], y[sl], F.cross_entropy, grad_accum=grad_accum)
        if ctx.world_size > 1:
            torch.distributed.all_reduce(loss)
            loss /= ctx.world_size
        losses.append(loss.item())
        opt.step()
        if zero_to_none:
            opt.zero_grad(set_to_none=True)
    replicas.sync_buffers()
    replica_params_equal = all(
        torch.equal(p, q) for m in replicas.models[1:] for p, q in zip(model.parameters(), m.parameters())
    )
    replicas.broadcast_parameters()
    replica_params_equal_after = all(
        torch.equal(p, q) for m in replicas.models[1:] for p, q in zip(model.parameters(), m.parameters())
    )
    buffers_equal = all(torch.equal(a, b) for m in replicas.models[1:] for a, b in zip(model.buffers(), m.buffers()))
    return {
        "params": [p.tolist() for p in model.parameters()],  # lists: tensors do not outlive a rank's process
        "buffers": [b.tolist() for b in model.buffers()],
        "losses": losses,
        "stale_before_broadcast": not replica_params_equal or n_devices == 1,
        "replicas_equal": replica_params_equal_after and buffers_equal,
    }


def assert_close_lists(a, b, tol=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.as_tensor(x).float(), torch.as_tensor(y).float(), rtol=tol, atol=tol)


BUCKET_CASES = [(1e-5, 37), (1e-4, 1000), (25.0, 1000)]  # 2-float buckets, uneven last bucket, one bucket


def test_allreduce_buckets_sums_over_ranks():
    out = run_ranks(_allreduce_rank, 3)
    for case, (_, n) in enumerate(BUCKET_CASES):
        expected = sum(torch.arange(n, dtype=torch.float32) * (r + 1) for r in range(3))
        for rank_results in out:
            torch.testing.assert_close(torch.tensor(rank_results[case]), expected)


def _allreduce_rank(ctx):
    return [
        allreduce_buckets(torch.arange(n, dtype=torch.float32) * (ctx.rank + 1), bucket_mb).tolist()
        for bucket_mb, n in BUCKET_CASES
    ]


def test_allreduce_buckets_rejects_bad_input():
    with pytest.raises(ValueError, match="contiguous 1-D"):
        allreduce_buckets(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="bucket_mb"):
        allreduce_buckets(torch.zeros(3), bucket_mb=0)
    t = torch.ones(5)
    assert allreduce_buckets(t) is t and torch.equal(t, torch.ones(5))  # world size 1: untouched


def test_two_nodes_of_two_devices_match_one_process_per_gpu():
    """2 gloo 'nodes' x 2 CPU replicas = 4 'GPUs', with BatchNorm, against the emulation of
    4 processes; node 1 starts from other weights and must take node 0's."""
    data = batches(3, 16)
    ref_params, ref_buffers, ref_losses = reference_per_gpu("bn", data, 4)
    out = run_ranks(run_fallback, 2, "bn", data, 2)
    for node in out:
        assert_close_lists(node["params"], ref_params)
        assert_close_lists(node["buffers"], ref_buffers)  # running stats averaged over all 4 shards
        assert node["losses"] == pytest.approx(ref_losses, rel=1e-5)
        assert node["stale_before_broadcast"] and node["replicas_equal"]


def test_concatenated_batch_with_grad_accum():
    """Without BatchNorm, one process stepping the concatenated global batch is the reference."""
    data = batches(3, 16)
    torch.manual_seed(0)
    model = plain_net()
    opt = make_opt(model)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    out = run_ranks(run_fallback, 2, "plain", data, 2, 2)
    for node in out:
        assert_close_lists(node["params"], list(model.parameters()))
        assert node["losses"] == pytest.approx(losses, rel=1e-5)  # the mean over micro-batches, GPUs and nodes


def test_one_process_three_replicas_without_process_group():
    """World size 1 is the same code: three CPU replicas, no process group; the optimizer's
    zero_grad(set_to_none=True) between steps must not detach the flat gradient views."""
    from distlib.distributed.process_group import Context

    data = batches(3, 12)
    ref_params, ref_buffers, ref_losses = reference_per_gpu("bn", data, 3)
    ctx = Context(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="none")
    out = run_fallback(ctx, "bn", data, 3, zero_to_none=True)
    assert_close_lists(out["params"], ref_params)
    assert_close_lists(out["buffers"], ref_buffers)
    assert out["losses"] == pytest.approx(ref_losses, rel=1e-5)


def test_replicas_follow_the_roots_train_and_eval_mode():
    """Training with frozen BatchNorm statistics (model.eval() during training): every replica runs
    in eval mode too, so the step equals one process on the whole batch in eval mode."""
    torch.manual_seed(0)
    model = bn_net()
    with torch.no_grad():
        model[1].running_mean.uniform_()  # statistics that differ from a batch's
    replicas = Replicas(model, ["cpu", "cpu"])
    ref = copy.deepcopy(model).eval()
    model.eval()
    (x, y), (x2, y2) = batches(2, 8)
    replicas.train_step(x, y, F.cross_entropy)
    F.cross_entropy(ref(x), y).backward()
    assert not any(m.training for m in replicas.models)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    model.train()  # and back: every replica trains again (batch statistics, running ones updated)
    replicas.train_step(x2, y2, F.cross_entropy)
    assert all(m.training for m in replicas.models)
    assert all(not torch.equal(m[1].running_mean, ref[1].running_mean) for m in replicas.models)


def test_flat_views_keep_layout_and_share_memory():
    model = bn_net().to(memory_format=torch.channels_last)
    replicas = Replicas(model, ["cpu", "cpu"], cuda_graph=True)  # no GPUs: warns and runs eagerly
    assert not replicas.cuda_graph
    conv = model[0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last)
    flat = replicas._params[0].flat[torch.float32]
    assert conv.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert conv.grad is not None and conv.grad.stride() == conv.stride()
    with torch.no_grad():
        conv.add_(1.0)  # an optimizer's in-place update of the root...
    replicas.broadcast_parameters()  # ...reaches the replica
    torch.testing.assert_close(replicas.models[1][0].weight, conv)
    # scatter splits along dim 0, gather concatenates along the dim asked for (metrics per column)
    t = torch.arange(12.0).reshape(4, 3)
    assert torch.equal(replicas.gather(replicas.scatter(t)), t)
    assert torch.equal(replicas.gather([t[:, :1], t[:, 1:]], dim=1), t)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="equal GPU shards"):
        Replicas(bn_net(), ["cpu", "cpu", "cpu"]).train_step(torch.randn(4, 3, 6, 6), torch.zeros(4).long(), F.mse_loss)
    with pytest.raises(ValueError, match="multiple of 4"):
        Replicas(bn_net(), ["cpu", "cpu"]).check_batch(6, grad_accum=2)
    with pytest.raises(ValueError, match="a node batch of 0 does not split"):
        Replicas(bn_net(), ["cpu", "cpu"]).check_batch(0)
    with pytest.raises(ValueError, match="all GPUs"):
        Replicas(bn_net(), ["cpu", "meta"])
    with pytest.raises(ValueError, match="must return a scalar"):
        Replicas(bn_net(), ["cpu"]).train_step(
            torch.randn(2, 3, 6, 6), torch.zeros(2).long(), lambda o, t: F.cross_entropy(o, t, reduction="none")
        )
    with pytest.raises(ValueError, match="inputs and targets"):
        Replicas(bn_net(), ["cpu"]).train_step(torch.randn(2, 3, 6, 6), torch.zeros(4).long(), F.cross_entropy)
    assert node_devices(torch.device("cpu"), 4) == [torch.device("cpu")]  # CPU: one replica per process


def test_two_processes_on_a_gpu_node_are_refused():
    # each would drive every GPU of the node; no GPU is touched before the refusal
    with pytest.raises(
        ValueError, match=r"2 processes run on this node; start one per node \(torchrun --nproc-per-node=1\)"
    ):
        node_devices(torch.device("cuda", 0), 2)
    assert node_devices(torch.device("cpu"), 2) == [torch.device("cpu")]  # CPU nodes: one replica per process


def test_nodes_with_different_gpu_counts_fail_on_every_node():
    out = run_ranks(_mismatch_rank, 2)
    for msg in out:
        assert "same number of GPUs" in msg and "[2, 1]" in msg


def _node0_buffers(ctx):
    torch.manual_seed(ctx.rank)
    model = bn_net()
    bn = model[1]
    with torch.no_grad():  # BatchNorm buffers are equal at init whatever the seed: make node 1's differ
        bn.running_mean.uniform_()
        bn.running_var.uniform_(1, 2)
        bn.num_batches_tracked.fill_(3 + ctx.rank)
    replicas = Replicas(model, ["cpu", "cpu"])
    return [[b.tolist() for b in m.buffers()] for m in replicas.models], [p.tolist() for p in model.parameters()]


def test_construction_takes_node0_buffers_on_every_replica():
    out = run_ranks(_node0_buffers, 2)
    node0 = out[0][0][0]
    assert node0[2] == 3  # num_batches_tracked of node 0
    for node, (buffers, params) in enumerate(out):
        for replica in buffers:
            assert replica == node0, (node, "buffers must be node 0's on every replica of every node")
        assert params == out[0][1], node


def _mismatch_rank(ctx):
    try:
        Replicas(bn_net(), ["cpu"] * (2 - ctx.rank))
    except ValueError as e:
        return str(e)
    return "no error"


DEMO = os.path.join(ROOT, "recipes", "demo.yaml")
SMALL = ["data.train_subset=128", "train.epochs=2", "train.batch_size=32", "train.tta=false", "train.eval_every=2"]


def _metrics(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _launch(tmp_path, name, *overrides):
    sys.path.insert(0, ROOT)
    import launch

    assert launch.main([DEMO, *SMALL, f"run.out_dir={tmp_path / name}", *overrides]) == 0
    return _metrics(tmp_path / name)


def _warm_data_cache():
    # The first, decoding load draws from torch's global RNG (a DataLoader inside), which
    # changes the model's initialization of that run only: decode before comparing runs.
    from distlib.runner.data.images import load_image_set

    load_image_set(os.path.join(ROOT, "data", "cifar10-demo"))


def test_launch_fallback_mode_matches_default_mode(tmp_path):
    """The same recipe in either mode: at world size 1 with one CPU replica the two paths do
    the same arithmetic, so the metrics agree."""
    _warm_data_cache()
    base = _launch(tmp_path, "per_gpu")
    fb = _launch(tmp_path, "fallback", "dist.mode=fallback")
    assert len(base) == len(fb) == 2  # both runs wrote every epoch
    for a, b in zip(base, fb):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
        assert b["test_acc"] == pytest.approx(a["test_acc"], abs=1e-3)


def _torchrun(args: list[str], env_extra: dict | None = None, timeout: float = 240) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(procs: list[subprocess.Popen], timeout: float = 240) -> None:
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, out[-3000:]


@pytest.mark.slow
def test_two_torchrun_nodes_in_fallback_mode_match_two_processes(tmp_path):
    """The real topology on the CPU: two torchrun 'nodes' (c10d rendezvous, one process each)
    in fallback mode give the same losses as one node with two processes in the default mode."""
    _warm_data_cache()
    port = free_port()
    nodes = [
        _torchrun(
            [
                "--nnodes=2",
                f"--node-rank={k}",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "launch.py",
                DEMO,
                *SMALL,
                "dist.mode=fallback",
                f"run.out_dir={tmp_path / 'nodes'}",
            ]
        )  # fmt: skip
        for k in range(2)
    ]
    _finish(nodes)
    per_gpu = _torchrun(
        ["--standalone", "--nproc-per-node=2", "launch.py", DEMO, *SMALL, f"run.out_dir={tmp_path / 'per_gpu'}"]
    )
    _finish([per_gpu])
    a, b = _metrics(tmp_path / "nodes"), _metrics(tmp_path / "per_gpu")
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        assert x["train_loss"] == pytest.approx(y["train_loss"], rel=1e-4)
        assert x["world_size"] == y["world_size"] == 2


def _fallback_in_a_group(ctx, data):
    """Global ranks 1 and 2 are the job's two nodes, in a group without rank 0 (the default group
    would be the wrong one for every count, source and collective); 2 CPU replicas each."""
    group = torch.distributed.new_group([1, 2])  # a collective of every rank
    if ctx.rank == 0:
        return None
    node = ctx.rank - 1
    torch.manual_seed(0 if node == 0 else 7)  # the group's first rank holds the reference's weights
    model = bn_net()
    replicas = Replicas(model, ["cpu"] * 2, bucket_mb=1e-4, group=group)
    opt = make_opt(model)
    losses = []
    for x, y in data:
        mine = slice(node * x.shape[0] // 2, (node + 1) * x.shape[0] // 2)
        loss = replicas.train_step(x[mine], y[mine], F.cross_entropy)
        torch.distributed.all_reduce(loss, group=group)
        losses.append(loss.item() / 2)
        opt.step()
    replicas.sync_buffers()
    return {"params": [p.tolist() for p in model.parameters()], "buffers": [b.tolist() for b in model.buffers()],
            "losses": losses, "nodes": replicas.nodes, "total": replicas.total_devices}  # fmt: skip


def test_a_group_of_some_ranks_is_the_set_of_nodes():
    """``group=``: the nodes are the group's ranks (its first one the source of the weights), not the
    whole world; 2 nodes x 2 replicas equal 4 processes per GPU, with BatchNorm."""
    data = batches(3, 16)
    ref_params, ref_buffers, ref_losses = reference_per_gpu("bn", data, 4)
    out = run_ranks(_fallback_in_a_group, 3, data, timeout=90, init_timeout_s=20)
    assert out[0] is None
    for node in out[1:]:
        assert (node["nodes"], node["total"]) == (2, 4)
        assert_close_lists(node["params"], ref_params)
        assert_close_lists(node["buffers"], ref_buffers)
        assert node["losses"] == pytest.approx(ref_losses, rel=1e-5)
