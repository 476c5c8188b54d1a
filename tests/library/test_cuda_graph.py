"""Whole-step CUDA graphs: where capture cannot work, a clear reason and the eager path.
(Capture itself is tested on GPUs in test_grad_sync.py.)"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import distlib
from distlib.distributed import process_group
from distlib.step import cuda_graph
from distlib.step.cuda_graph import CapturedStep, CaptureUnsupported, build_train_step, capture_problem

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


def _sgd(fused):
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1, fused=fused)


def test_capture_problem_names_the_reason():
    assert "need a GPU" in capture_problem(CPU, _sgd(None))
    assert "grad_accum=2" in capture_problem(CUDA, _sgd(True), grad_accum=2)
    assert "fused=True" in capture_problem(CUDA, _sgd(None))
    adam = torch.optim.Adam(nn.Linear(2, 2).parameters())
    assert "capturable=True" in capture_problem(CUDA, adam)
    assert capture_problem(CUDA, _sgd(True)) is None
    # Adam and AdamW need capturable=True, fused or not: torch's capture check asks for it
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        assert capture_problem(CUDA, cls(nn.Linear(2, 2).parameters(), capturable=True)) is None, cls
        assert "capturable=True" in capture_problem(CUDA, cls(nn.Linear(2, 2).parameters(), fused=True)), cls


def test_cpu_falls_back_to_eager_with_a_warning(caplog):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logger = distlib.get_logger()
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="distlib"):
            assert build_train_step(True, model, opt, lambda x: model(x).sum(), None) is None
    finally:
        logger.removeHandler(caplog.handler)
    assert "train.cuda_graph: CUDA graphs need a GPU" in caplog.text and "training eagerly" in caplog.text
    assert build_train_step(False, model, opt, lambda x: model(x).sum(), None) is None
    with pytest.raises(CaptureUnsupported, match="need a GPU"):
        CapturedStep(model, opt, lambda x: model(x).sum())


class _FakeGraph:
    """Stands in for a live CapturedStep: records whether the process group still existed when
    it was released (a graph holding NCCL work must go before the group)."""

    def __init__(self):
        self.group_alive_at_close: bool | None = None
        process_group.on_shutdown(self._at_shutdown)  # what CapturedStep registers

    _at_shutdown = cuda_graph.CapturedStep._at_shutdown

    def close(self):
        import torch.distributed as dist

        self.group_alive_at_close = dist.is_initialized()


def _release_order(ctx):
    import torch.distributed as dist

    fake = _FakeGraph()
    distlib.shutdown()
    return fake.group_alive_at_close, dist.is_initialized()


def test_shutdown_releases_live_graphs_before_destroying_the_group():
    from tests.conftest import run_ranks

    for alive_at_close, alive_after in run_ranks(_release_order, 2):
        assert alive_at_close is True, "the graph must be released while the group still exists"
        assert alive_after is False
    fake = _FakeGraph()  # no process group: still released
    distlib.shutdown()
    assert fake.group_alive_at_close is False


def _bn_captured_vs_ddp(ctx) -> dict:
    """A BatchNorm model stepped by DDP (broadcast_buffers=True, eager) and by a CapturedStep over
    GradSync's default broadcast_buffers (the pre-forward broadcast is captured and replayed)."""
    from torch.nn import functional as F

    from distlib.parallel.grad_sync import GradSync

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = {}
    for mode in ("ddp", "graph"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 5)).to(ctx.device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
        if mode == "ddp":
            net = nn.parallel.DistributedDataParallel(model, device_ids=[ctx.device.index])
        else:
            sync = GradSync(model)
            step = CapturedStep(model, opt, lambda x, y, m=model: F.cross_entropy(m(x), y), sync, warmup_steps=2)
        for i in range(6):
            g = torch.Generator().manual_seed(100 * i + ctx.rank)  # each rank its own data
            x, y = torch.randn(8, 16, generator=g).to(ctx.device), torch.randint(0, 5, (8,), generator=g).to(ctx.device)
            if mode == "ddp":
                F.cross_entropy(net(x), y).backward()
                opt.step()
                opt.zero_grad()
            else:
                step(x, y)
        torch.cuda.synchronize()
        out[mode] = [t.detach().cpu().clone() for t in list(model.parameters()) + list(model.buffers())]
        if mode == "graph":
            out["captured"] = step.captured
            step.close()
            sync.close()
        else:
            del net
    return out


@pytest.mark.gpus(2)
def test_captured_step_broadcasts_buffers_as_ddp_on_two_gpus():
    from tests.conftest import run_ranks

    results = run_ranks(_bn_captured_vs_ddp, 2, backend="nccl", timeout=600)
    for r in results:
        assert r["captured"]
        for a, b in zip(r["ddp"], r["graph"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)  # the buffers too: broadcast at each replay
