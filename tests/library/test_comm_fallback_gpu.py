"""The fallback mode on two GPUs (skipped without them): the same parameters as one process
per GPU, eager and with per-replica CUDA graphs, and the same loss trajectory from one node
with two GPUs as from two torchrun 'nodes' with one GPU each.

On the 2-GPU machine: python -m pytest -m gpu tests/library/test_comm_fallback_gpu.py -v
"""

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

from distlib.parallel.comm_fallback import Replicas
from tests.conftest import ROOT, free_port

pytestmark = pytest.mark.gpus(2)


@pytest.fixture
def deterministic():
    """Same kernels on both sides of a comparison: no autotuning, no TF32."""
    saved = (
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
    )
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    (
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
    ) = saved


def bn_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def plain_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)
    )


def data(steps: int, n: int, device="cuda:0"):
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        x = torch.randn(n, 3, 16, 16, generator=g).to(device).contiguous(memory_format=torch.channels_last)
        out.append((x, torch.randint(0, 10, (n,), generator=g).to(device)))
    return out


def make_opt(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)


def reference(net, batches, n_gpus, amp):
    """One process per GPU, emulated on cuda:0: a model copy per GPU (own BatchNorm
    statistics), loss = mean over its shard, gradients averaged over the copies."""
    torch.manual_seed(0)
    copies = [net().cuda().to(memory_format=torch.channels_last)]
    copies += [copy.deepcopy(copies[0]) for _ in range(n_gpus - 1)]
    opt = make_opt(copies[0])
    losses = []
    for x, y in batches:
        for c in copies[1:]:
            for pc, p0 in zip(c.parameters(), copies[0].parameters()):
                pc.data.copy_(p0.data)
        total = 0.0
        for c, xs, ys in zip(copies, x.chunk(n_gpus), y.chunk(n_gpus)):
            c.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                loss = F.cross_entropy(c(xs), ys)
            loss.backward()
            total += loss.item() / n_gpus
        for j, p0 in enumerate(copies[0].parameters()):
            p0.grad = sum(list(c.parameters())[j].grad for c in copies) / n_gpus
        opt.step()
        losses.append(total)
    buffers = [
        (sum(list(c.buffers())[j] for c in copies) / n_gpus) if b.is_floating_point() else b
        for j, b in enumerate(copies[0].buffers())
    ]
    return list(copies[0].parameters()), buffers, losses


def fallback(net, batches, amp, cuda_graph):
    torch.manual_seed(0)
    model = net().cuda().to(memory_format=torch.channels_last)
    replicas = Replicas(model, [0, 1], cuda_graph=cuda_graph)
    opt = make_opt(model)
    losses = []
    for x, y in batches:
        loss = replicas.train_step(x, y, F.cross_entropy, autocast_dtype=torch.bfloat16 if amp else None)
        opt.step()
        opt.zero_grad(set_to_none=True)  # as users write it: must not detach the flat gradient views
        losses.append(loss.item())
    replicas.sync_buffers()
    return replicas, list(model.parameters()), list(model.buffers()), losses


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_two_gpus_match_one_process_per_gpu(deterministic, amp, cuda_graph):
    batches = data(4, 64)
    ref_params, ref_buffers, ref_losses = reference(bn_net, batches, 2, amp)
    replicas, params, buffers, losses = fallback(bn_net, batches, amp, cuda_graph)
    tol = 2e-2 if amp else 1e-4
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    for a, b in zip(buffers, ref_buffers):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    assert losses == pytest.approx(ref_losses, rel=tol)
    assert replicas.models[1][0].weight.device == torch.device("cuda", 1)
    assert (replicas._graphs is not None) == cuda_graph


def test_two_gpus_match_concatenated_batch(deterministic):
    """Without BatchNorm the reference is one process stepping the whole batch."""
    batches = data(4, 64)
    torch.manual_seed(0)
    model = plain_net().cuda().to(memory_format=torch.channels_last)
    opt = make_opt(model)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    _, params, _, _ = fallback(plain_net, batches, amp=False, cuda_graph=False)
    for a, b in zip(params, model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_graph_mode_runs_a_new_shape_eagerly(deterministic):
    """After capture, a smaller last batch runs eagerly and gives what the eager mode gives."""
    batches = data(2, 64) + data(1, 32)
    _, graph_params, _, _ = fallback(bn_net, batches, amp=False, cuda_graph=True)
    _, eager_params, _, _ = fallback(bn_net, batches, amp=False, cuda_graph=False)
    for a, b in zip(graph_params, eager_params):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ---- one node with two GPUs vs two torchrun 'nodes' with one GPU each ----------------------

# The demo recipe without random augmentation: every GPU sees the same images in every run.
DEMO = ["recipes/demo.yaml", "train.epochs=3", "data.augment.crop_pad=0", "data.augment.flip=none", "train.tta=false"]


# launch.py with TF32 off and cuDNN's deterministic, heuristically chosen algorithms (no autotuning)
PINNED = os.path.join("tests", "library", "pinned_kernels_launch.py")


def _torchrun(args, out_dir, gpus: str, extra=()):
    # CUBLAS_WORKSPACE_CONFIG: cuBLAS picks the same kernels whatever the streams (its determinism switch)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, PINNED, *DEMO, f"run.out_dir={out_dir}", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(procs, timeout=300):
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, out[-4000:]


def _metrics(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_nodes_match_one_node_with_two_gpus(tmp_path):
    """Intra-node path (cuda.comm between two GPUs of one process) against the inter-node path
    (NCCL between two node processes of one GPU each), and against one process per GPU."""
    from distlib.runner.data.images import load_image_set

    # Decode the demo data once up front: the decoding run draws from torch's global RNG (a
    # DataLoader inside), which would give that one run another initialization.
    load_image_set(os.path.join(ROOT, "data", "cifar10-demo"))
    one = _torchrun(["--standalone", "--nproc-per-node=1"], tmp_path / "one_node", "0,1", ["dist.mode=fallback"])
    _wait([one])
    port = free_port()
    nodes = [
        _torchrun(
            [
                "--nnodes=2",
                f"--node-rank={k}",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
            ],
            tmp_path / "two_nodes",
            str(k),
            ["dist.mode=fallback"],
        )  # fmt: skip
        for k in range(2)
    ]
    _wait(nodes)
    per_gpu = _torchrun(["--standalone", "--nproc-per-node=2"], tmp_path / "per_gpu", "0,1")
    _wait([per_gpu])
    one_node, two_nodes, per_gpu = (_metrics(tmp_path / d) for d in ("one_node", "two_nodes", "per_gpu"))
    print("train_loss one node, 2 GPUs:     ", [r["train_loss"] for r in one_node])
    print("train_loss two nodes, 1 GPU each:", [r["train_loss"] for r in two_nodes])
    print("train_loss one process per GPU:  ", [r["train_loss"] for r in per_gpu])
    assert len(one_node) == len(two_nodes) == len(per_gpu) == 3
    # With the kernels pinned (PINNED), every GPU runs the same operations on the same values in
    # the three layouts: the same shard of each batch, the same cuDNN algorithms, no TF32. The
    # gradients of the two GPUs meet in one fp32 addition (cuda.comm.reduce_add on one node, an
    # NCCL all_reduce between nodes or ranks), exact whatever the order (a + b == b + a), and the
    # division by 2 is exact. What may still differ is the order in which the epoch's ~30 step
    # losses are summed (per GPU, then averaged; or averaged, then summed): a few units of fp32
    # rounding (2**-24 each, ~2e-6 in all) plus the rounding of train_loss to 5 decimals (2.5e-6
    # of a loss of 2). rel=1e-4 leaves a margin of 20 over that; a wrong gradient scale or a
    # missing all_reduce moves the loss by more than 1e-3 in the first epoch. (Without pinning,
    # TF32 and autotuned algorithms chosen per process made the layouts drift apart by 3e-3 in
    # the first epoch.)
    for a, b, c in zip(one_node, two_nodes, per_gpu):
        assert a["world_size"] == 1 and b["world_size"] == 2
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
        assert c["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
        # test images are sharded differently (one process or two): other batch shapes, so
        # possibly other algorithms and a different argmax for a near-tie
        assert b["test_acc"] == pytest.approx(a["test_acc"], abs=0.01)
