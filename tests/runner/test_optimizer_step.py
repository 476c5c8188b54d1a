"""fp16 loss scaling and gradient clipping in every TrainStep (runner/training/optimizer_step.py).

Both must act on the gradients averaged over the ranks: the GradScaler then skips the same
steps on every rank, and the clipping norm is the global gradient's. Two gloo ranks run the
step that ``build_step`` builds, and are compared with each other and with one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distlib.runner.config import Config
from distlib.runner.training.optimizer_step import autocast_dtype
from distlib.runner.training.step import build_step
from tests.conftest import run_ranks

PER_RANK, FEATURES, CLASSES = 8, 6, 4
SMOOTHING = 0.1  # train.label_smoothing: the reference's loss smooths its targets alike


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, CLASSES)).to(device)


def _batches(steps: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of each step (rank r gets rows r*PER_RANK ...)."""
    g = torch.Generator().manual_seed(1)
    n = PER_RANK * world_size
    return [(torch.randn(n, FEATURES, generator=g) * 0.5, torch.randint(0, CLASSES, (n,), generator=g))
            for _ in range(steps)]  # fmt: skip


def _config(mode: str, precision: str, clip: float, world_size: int, device: torch.device) -> Config:
    cfg = Config()
    cfg.dist.mode = mode
    cfg.train.precision, cfg.train.clip_grad_norm = precision, clip
    cfg.train.batch_size, cfg.train.label_smoothing = PER_RANK * world_size, SMOOTHING
    cfg.train.cuda_graph = device.type == "cuda"
    return cfg


def _sgd(model: nn.Module, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, fused=True if fused else None)


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for p in model.parameters()]


# ---- fp16: a non-finite gradient on one rank skips the step on every rank --------------------
INF_STEP, STEPS = 2, 4


def _fp16_rank(ctx, mode: str) -> list[tuple[list[torch.Tensor], float]]:
    model = _model(ctx.device)
    cfg = _config(mode, "fp16", 0.0, ctx.world_size, ctx.device)
    cfg.train.cuda_graph = False
    step = build_step(cfg, ctx, model, _sgd(model, False), PER_RANK)
    scaler = step.update.scaler
    assert scaler is not None
    rows = slice(ctx.rank * PER_RANK, (ctx.rank + 1) * PER_RANK)
    start = _weights(model), scaler.state_dict()
    x, y = _batches(1, ctx.world_size)[0]
    step.warm_up(x[rows].to(ctx.device), y[rows].to(ctx.device), 2)  # undone: weights and the scaler's counts
    assert all(torch.equal(a, b) for a, b in zip(start[0], _weights(model))) and scaler.state_dict() == start[1]
    history = [(_weights(model), scaler.get_scale())]
    for k, (x, y) in enumerate(_batches(STEPS, ctx.world_size)):
        x = x[rows].clone()
        if k == INF_STEP and ctx.rank == 1:
            x[0, 0] = float("inf")  # only this rank's gradient is non-finite
        step(x.to(ctx.device), y[rows].to(ctx.device))
        history.append((_weights(model), scaler.get_scale()))
    step.close()
    return history


@pytest.mark.parametrize("mode", ["process_per_gpu", "fallback"])
def test_fp16_skips_a_non_finite_step_on_every_rank(mode):
    _check_skipped_everywhere(run_ranks(_fp16_rank, 2, mode))


@pytest.mark.gpus(2)
def test_fp16_skips_a_non_finite_step_on_every_rank_with_nccl():
    _check_skipped_everywhere(run_ranks(_fp16_rank, 2, "process_per_gpu", backend="nccl"))


def _check_skipped_everywhere(ranks: list) -> None:
    for r, history in enumerate(ranks):
        for k in range(STEPS):
            (before, scale_before), (after, scale_after) = history[k], history[k + 1]
            if k == INF_STEP:  # skipped everywhere: the weights stay, the scale halves
                assert all(torch.equal(a, b) for a, b in zip(before, after)), f"rank {r} stepped on step {k}"
                assert scale_after == scale_before / 2, (r, k, scale_before, scale_after)
            else:  # an ordinary step: taken, the scale kept
                assert not all(torch.equal(a, b) for a, b in zip(before, after)), f"rank {r} skipped step {k}"
                assert scale_after == scale_before, (r, k, scale_before, scale_after)
    for (w0, s0), (w1, s1) in zip(*ranks):  # the ranks stay identical
        assert s0 == s1 and all(torch.equal(a, b) for a, b in zip(w0, w1))


# ---- clipping: the norm of the averaged gradient, as one process would clip it --------------
CLIP = 0.05


def _clip_rank(ctx, mode: str, precision: str = "fp32") -> list[torch.Tensor]:
    model = _model(ctx.device)
    cuda = ctx.device.type == "cuda"
    cfg = _config(mode, precision, CLIP, ctx.world_size, ctx.device)
    cfg.train.cuda_graph = cfg.train.cuda_graph and precision != "fp16"
    step = build_step(cfg, ctx, model, _sgd(model, cuda), PER_RANK)
    rows = slice(ctx.rank * PER_RANK, (ctx.rank + 1) * PER_RANK)
    for x, y in _batches(STEPS + 4 if cuda else STEPS, ctx.world_size):  # on a GPU: past warm-up into replays
        step(x[rows].to(ctx.device), y[rows].to(ctx.device))
    if cuda:
        assert step.graph is not None and step.graph.captured
    step.close()
    return _weights(model)


def _reference(
    world_size: int, steps: int, device: torch.device, precision: str = "fp32"
) -> tuple[list[torch.Tensor], list[float]]:
    """One process, the whole global batch, torch's cross-entropy with label smoothing and clip_grad_norm_
    (fp16: under autocast, unscaled: the clipping sees the true gradient)."""
    model = _model(device)
    opt = _sgd(model, False)
    norms = []
    autocast = torch.autocast(device.type, dtype=torch.float16, enabled=precision == "fp16")
    for x, y in _batches(steps, world_size):
        with autocast:
            out = model(x.to(device)).float()
        F.cross_entropy(out, y.to(device), label_smoothing=SMOOTHING).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return _weights(model), norms


@pytest.mark.parametrize("mode", ["process_per_gpu", "fallback"])
def test_clip_grad_norm_clips_the_global_gradient(mode):
    expected, norms = _reference(2, STEPS, torch.device("cpu"))
    assert min(norms) > CLIP * 2, norms  # clipping acts on every step
    for weights in run_ranks(_clip_rank, 2, mode):
        for a, b in zip(weights, expected):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["process_per_gpu", "fallback"])
def test_fp16_clips_the_unscaled_gradient(mode):
    """fp16: the loss scaler's factor (65,536) is taken off before the norm is clipped."""
    expected, norms = _reference(2, STEPS, torch.device("cpu"), "fp16")
    assert min(norms) > CLIP * 2, norms
    for weights in run_ranks(_clip_rank, 2, mode, "fp16"):
        for a, b in zip(weights, expected):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)  # fp16 products, summed in another order


@pytest.mark.gpus(2)
def test_clip_grad_norm_inside_the_captured_cuda_graph():
    expected, _ = _reference(2, STEPS + 4, torch.device("cuda"))
    for weights in run_ranks(_clip_rank, 2, "process_per_gpu", backend="nccl"):
        for a, b in zip(weights, expected):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_autocast_dtype_follows_the_precision_on_each_device():
    """On the CPU the tests run on, bf16 means no autocast: a rule that dropped bf16 everywhere would
    agree there, and every GPU run would train in fp32. The device is only named here (no GPU needed)."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert autocast_dtype("bf16", cuda) is torch.bfloat16 and autocast_dtype("bf16", cpu) is None
    assert autocast_dtype("fp16", cuda) is autocast_dtype("fp16", cpu) is torch.float16
    assert autocast_dtype("fp32", cuda) is autocast_dtype("fp32", cpu) is None
