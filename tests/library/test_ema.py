"""distlib.EMA: the same average as torch's AveragedModel with get_ema_multi_avg_fn, and on a GPU
the same inside a captured CUDA-graph step as eagerly, with the decay changed after capture."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import distlib
from tests.conftest import run_ranks


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


def _batch(i: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 3, 6, 6, generator=g).to(device), torch.randint(0, 3, (8,), generator=g).to(device)


def _float_state(m: nn.Module) -> list[torch.Tensor]:
    return [t for t in [*m.parameters(), *m.buffers()] if t.is_floating_point()]


def test_matches_averaged_model_over_steps():
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    decay = 0.8
    ref = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
    ema = distlib.EMA(model, decay=0.0)  # AveragedModel's first update is a copy: decay 0
    for i in range(6):
        x, y = _batch(i, "cpu")
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        ref.update_parameters(model)
        ema.update()
        ema.set_decay(decay)  # read by the next update
    ours, theirs = _float_state(ema.module), _float_state(ref.module)
    assert len(ours) == len(theirs) == 8  # conv, BatchNorm and linear weights and biases, running mean/var
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert ema.module[1].num_batches_tracked == model[1].num_batches_tracked == 6
    # the average is not the model: the test would pass trivially if update copied
    assert any((a - m).abs().max() > 1e-3 for a, m in zip(ours, _float_state(model)))
    assert set(ema.state_dict()) == {f"module.{k}" for k in model.state_dict()}
    # a checkpoint of torch's AveragedModel loads (runs saved before distlib.EMA resume)
    fresh = distlib.EMA(_net(), decay)
    fresh.load_state_dict(ref.state_dict())
    for a, b in zip(_float_state(fresh.module), theirs):
        assert torch.equal(a, b)
    partial = {k: v for k, v in ref.state_dict().items() if k != "module.0.weight"}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"module\.0\.weight\""):
        fresh.load_state_dict(partial)  # strict, as nn.Module's: a checkpoint of another model is refused
    with pytest.raises(ValueError, match="decay must be in"):
        ema.set_decay(1.5)


def _ema_before_the_sharded_optimizer(ctx, steps: int) -> tuple[float, float]:
    """An EMA made before ``sync.sharded_optimizer`` (which moves every parameter into its flat
    buffer), against the average computed by hand from the weights after each step: the largest
    difference, and how far the weights moved."""
    torch.manual_seed(0)
    model = _net()
    ema = distlib.EMA(model, decay=0.5)
    ref = [t.detach().clone() for t in _float_state(model)]
    start = [t.clone() for t in ref]
    sync = distlib.GradSync(model, shard="optimizer")
    opt = sync.sharded_optimizer(torch.optim.SGD, model.parameters(), lr=0.1, momentum=0.9)
    for i in range(steps):
        x, y = _batch(10 * i + ctx.rank, "cpu")
        F.cross_entropy(model(x), y).backward()
        sync.wait()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema.update()
        ref = [0.5 * r + 0.5 * t.detach() for r, t in zip(ref, _float_state(model))]
    diff = max((a - r).abs().max().item() for a, r in zip(_float_state(ema.module), ref))
    moved = max((t - s).abs().max().item() for t, s in zip(_float_state(model), start))
    return diff, moved


def test_frozen_parameters_are_shared_not_copied_and_the_rest_averaged_as_before():
    """A model whose first layer is frozen (a pretrained base under adapters): the EMA's frozen
    parameters are the model's own tensors (no second copy), the trained ones averaged exactly as
    torch's AveragedModel averages them, BatchNorm's buffers too."""
    torch.manual_seed(3)
    model = _net()
    model[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ref = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.7), use_buffers=True)
    ema = distlib.EMA(model, decay=0.0)
    assert ema.module[0].weight is model[0].weight and ema.module[0].bias is model[0].bias
    assert ema.module[4].weight is not model[4].weight  # trained: its own copy
    frozen = {p.data_ptr() for p in model[0].parameters()}
    assert not frozen & {p.data_ptr() for m in (ema.module[1], ema.module[4]) for p in m.parameters()}
    for i in range(5):
        x, y = _batch(10 + i, "cpu")
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        ref.update_parameters(model)
        ema.update()
        ema.set_decay(0.7)
    for a, b in zip(_float_state(ema.module), _float_state(ref.module)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert (ema.module[4].weight - model[4].weight).abs().max() > 1e-3  # averaged, not the model's
    assert not any(p.requires_grad for p in ema.module.parameters() if p not in set(model[0].parameters()))


@pytest.mark.parametrize("world", [1, 2])
def test_an_average_made_before_the_sharded_optimizer_follows_the_weights_it_moves(world):
    """The sharded optimizer moves every parameter into its flat buffer (``param.data = ...``); the
    average, made before it, reads the weights where they are now (it read detached aliases of the
    old storage and stayed on the first weights)."""
    for diff, moved in run_ranks(_ema_before_the_sharded_optimizer, world, 4):
        assert moved > 1e-2 and diff < 1e-6, (diff, moved)


@pytest.mark.gpus(1)
def test_captured_update_equals_eager_on_one_gpu():
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    device = torch.device("cuda", 0)
    results = {}
    for mode in ("eager", "graph"):
        torch.manual_seed(0)
        model = _net().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, fused=True)
        ema = distlib.EMA(model, decay=0.5)

        def loss_fn(x, y, model=model):
            return F.cross_entropy(model(x), y)

        step = (
            distlib.CapturedStep(model, opt, loss_fn, warmup_steps=2, post_step=ema.update) if mode == "graph" else None
        )
        for i in range(8):
            ema.set_decay(0.5 if i < 4 else 0.9)  # changed after the capture (step 3): read on the device
            x, y = _batch(i, device)
            if step is None:
                loss_fn(x, y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                ema.update()
            else:
                step(x, y)
        torch.cuda.synchronize()
        if step is not None:
            assert step.captured
            step.close()
        results[mode] = _float_state(ema.module)
    # same kernels eagerly and replayed, deterministic cuDNN and no TF32: equal up to rounding
    for a, b in zip(results["eager"], results["graph"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
