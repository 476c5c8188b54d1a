"""warm_up runs real steps and then leaves model and optimizer exactly as they were."""

from __future__ import annotations

import torch
from torch import nn

import distlib
from distlib.runner.training.warmup import warm_up


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)) for _ in range(4)]
    return model, opt, batches


def _step(model, opt, x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_training_after_warm_up_is_bitwise_the_training_without_it():
    model_a, opt_a, batches = _setup()
    for x, y in batches:
        _step(model_a, opt_a, x, y)

    model_b, opt_b, batches = _setup()
    junk = torch.randn(32, 8), torch.randint(0, 3, (32,))
    warm_up(lambda: _step(model_b, opt_b, *junk), [model_b], opt_b, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(_setup()[0].state_dict().values(), model_b.state_dict().values()))
    for x, y in batches:
        _step(model_b, opt_b, x, y)
    for (name, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        assert torch.equal(a, b), name


def test_zero_steps_does_nothing():
    model, opt, _ = _setup()
    calls = []
    warm_up(lambda: calls.append(1), [model], opt, steps=0)
    assert calls == []


def test_every_module_given_is_put_back_the_weight_average_too():
    """With train.ema the step also moves the average (``EMA.update`` runs inside it, captured in the
    graph on a GPU): the warm-up must put back every module it is given, not only the model."""

    def run(warm: bool):
        model, opt, batches = _setup()
        ema = distlib.EMA(model, decay=0.5)

        def step(x, y):
            _step(model, opt, x, y)
            ema.update()

        if warm:
            junk = torch.randn(32, 8), torch.randint(0, 3, (32,))
            warm_up(lambda: step(*junk), [model, ema.module], opt, steps=3)
        for x, y in batches:
            step(x, y)
        return model.state_dict(), ema.module.state_dict()

    (model_a, ema_a), (model_b, ema_b) = run(warm=False), run(warm=True)
    for name in model_a:
        assert torch.equal(model_a[name], model_b[name]), name
        assert torch.equal(ema_a[name], ema_b[name]), f"the average's {name}"


def test_a_frozen_base_shared_with_the_weight_average_is_not_copied():
    """A model whose first layer is frozen (a LoRA base) and its EMA, which shares that layer: the
    warm-up copies the trained layer, the BatchNorm buffers and the average's own tensors, never the
    frozen layer (no step changes it), and puts everything back."""
    from distlib.runner.training.warmup import _snapshot

    model, opt, _ = _setup()
    model[0].requires_grad_(False)
    ema = distlib.EMA(model, decay=0.5)
    copied = {id(t) for t, _ in _snapshot([model, ema.module])}
    assert not copied & {id(p) for p in model[0].parameters()}
    assert {id(p) for p in (*model[3].parameters(), *ema.module[3].parameters())} <= copied
    assert {id(b) for b in (*model[1].buffers(), *ema.module[1].buffers())} <= copied
    before = {k: v.clone() for k, v in ema.module.state_dict().items()}
    junk = torch.randn(32, 8), torch.randint(0, 3, (32,))
    warm_up(lambda: (_step(model, opt, *junk), ema.update()), [model, ema.module], opt, steps=2)
    for k, v in ema.module.state_dict().items():
        assert torch.equal(v, before[k]), k


def _sharded(ctx):
    """A model, GradSync(shard="optimizer") and its AdamW (the optimizer state lives in the inner optimizer)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    sync = distlib.GradSync(model, shard="optimizer")
    opt = sync.sharded_optimizer(torch.optim.AdamW, model.parameters(), lr=0.01)

    def step(x, y):
        nn.functional.cross_entropy(model(x), y).backward()
        sync.wait()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def test_warm_up_resets_a_sharded_optimizers_state():
    """AdamW's moments and step counter of a ShardedOptimizer are its inner optimizer's: the warm-up
    zeroes them too, so the training after it is the training without it."""
    ctx = distlib.init("gloo")
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)) for _ in range(3)]
    model_a, _, step_a = _sharded(ctx)
    for x, y in batches:
        step_a(x, y)
    model_b, opt_b, step_b = _sharded(ctx)
    junk = torch.randn(32, 8), torch.randint(0, 3, (32,))
    warm_up(lambda: step_b(*junk), [model_b], opt_b, steps=3)
    for x, y in batches:
        step_b(x, y)
    for (name, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        assert torch.equal(a, b), name
    distlib.shutdown()
