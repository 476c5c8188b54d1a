"""The output layer and the cross-entropy in chunks (runner/tasks/chunked_loss.py, ``loss.chunks``):
the plain loss's value and gradients, never the whole logits.

In fp32 with ignored (-100) targets and label smoothing: the loss and the gradients of the hidden
states and the output matrix; then whole models (the built-in GPT, its embedding tied to its output
layer, and a tiny transformers Llama, tied too) at 2 and 3 gloo ranks with the step's trained-token
mean, replicated and fully sharded (FSDP2: the output layer gathered inside the model's forward):
every parameter's gradient and each step's loss equal the plain loss's within 1e-5.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distlib
from distlib.runner.config import Config
from distlib.runner.tasks.chunked_loss import chunked_cross_entropy, linear_cross_entropy
from distlib.runner.tasks.losses import cross_entropy
from distlib.runner.training.step import build_step
from tests.conftest import run_ranks

SMOOTHING = 0.1
VOCAB, T, ROWS = 61, 10, 6  # 6 rows divide over 2 and 3 ranks


def _targets(g: torch.Generator, rows: int, t: int, vocab: int) -> torch.Tensor:
    y = torch.randint(0, vocab, (rows, t), generator=g)
    y[:, : t // 3] = -100  # a prompt
    y[0] = -100  # a row with nothing trained
    y[-1, -4:] = -100  # pads
    return y


@pytest.mark.parametrize(("chunks", "backend"), [(1, None), (3, None), (7, None), (64, None), (3, "aot_eager")])
@pytest.mark.parametrize("smoothing", [0.0, SMOOTHING])
def test_the_chunked_loss_has_the_plain_losss_value_and_gradients(chunks, backend, smoothing):
    g = torch.Generator().manual_seed(chunks)
    hidden = torch.randn(ROWS, T, 12, generator=g, requires_grad=True)
    head = nn.Linear(12, VOCAB, bias=False)
    y = _targets(g, ROWS, T, VOCAB)
    got = linear_cross_entropy(hidden, head, y, chunks=chunks, label_smoothing=smoothing, compile_backend=backend)
    want = F.cross_entropy(head(hidden).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum",
                           label_smoothing=smoothing)  # fmt: skip
    n = int((y != -100).sum())
    assert abs(got.item() - want.item()) / n < 1e-6
    got_grads = torch.autograd.grad(got / n * 3.0, [hidden, head.weight])  # a scaled loss (world size / N, fp16)
    want_grads = torch.autograd.grad(want / n * 3.0, [hidden, head.weight])
    for a, b in zip(got_grads, want_grads):
        assert (a - b).abs().max() < 1e-6
    with torch.no_grad():  # evaluation: the loss alone, nothing to backward
        assert (
            abs(
                linear_cross_entropy(hidden, head, y, chunks=chunks).item()
                - F.cross_entropy(head(hidden).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum").item()
            )
            / n
            < 1e-6
        )


@pytest.mark.parametrize("vocab", [VOCAB, 128])
def test_the_output_layers_products_run_on_a_vocabulary_padded_to_an_aligned_length(vocab):
    """An odd vocabulary (61 here, GPT-2's 50257) is padded to a multiple of 64 for the three matrix
    products, whose rows of logits cuBLAS otherwise reads one element at a time; one already aligned
    is used as it is."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm_.default):
                a, b = args[-2], args[-1]
                self.shapes.append((tuple(a.shape), tuple(b.shape)))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(ROWS * T, 12, generator=g, requires_grad=True)
    head = nn.Linear(12, vocab, bias=False)
    y = _targets(g, ROWS, T, vocab).flatten()
    with Products() as seen:
        loss = linear_cross_entropy(hidden, head, y, chunks=3, label_smoothing=SMOOTHING)
    padded = -(-vocab // 64) * 64
    assert len(seen.shapes) == 9  # three chunks: the logits, the hidden states' and the matrix's gradients
    for a, b in seen.shapes:  # each product has the padded vocabulary as a dimension, never the odd one
        assert padded in a + b, (a, b)
        assert vocab == padded or vocab not in a + b, (a, b)
    loss.backward()
    assert head.weight.grad.shape == (vocab, 12)
    want = F.cross_entropy(head(hidden), y, ignore_index=-100, reduction="sum", label_smoothing=SMOOTHING)
    (want_w,) = torch.autograd.grad(want, [head.weight])
    assert (head.weight.grad - want_w).abs().max() < 1e-5


def test_an_output_layer_with_a_bias_or_of_another_kind_is_applied_whole():
    g = torch.Generator().manual_seed(5)
    hidden, y = torch.randn(2, T, 12, generator=g), _targets(g, 2, T, VOCAB)
    head = nn.Linear(12, VOCAB)  # a bias: the plain loss
    want = F.cross_entropy(head(hidden).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
    torch.testing.assert_close(linear_cross_entropy(hidden, head, y, chunks=4), want)


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        from distlib.runner.models.gpt import gpt

        return gpt(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=2, n_embd=16)
    from distlib.runner.models.hf_causal_lm import hf_causal_lm

    return hf_causal_lm(config=dict(model_type="llama", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                    max_position_embeddings=T, tie_word_embeddings=True))  # fmt: skip


def _batches(world_size: int, steps: int = 2) -> list:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (ROWS, T), generator=g)
        y = _targets(g, ROWS, T, VOCAB)
        y[ROWS // world_size :] = torch.where(torch.rand(y[ROWS // world_size :].shape, generator=g) < 0.2, -100,
                                              y[ROWS // world_size :])  # fmt: skip
        out.append((x, y))
    return out


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
            for n, p in model.named_parameters()}  # fmt: skip


def _rank(ctx, kind: str) -> dict:
    out = {}
    for shard in ("none", "full"):
        for chunked in (False, True):
            cfg = Config()
            cfg.dist.shard = shard
            cfg.train.batch_size, cfg.train.label_smoothing = ROWS, SMOOTHING
            model = _model(kind)
            if shard == "full":
                model = distlib.shard_model(model, device=ctx.device)
            loss = chunked_cross_entropy(3, SMOOTHING) if chunked else functools.partial(
                cross_entropy, label_smoothing=SMOOTHING)  # fmt: skip
            opt = torch.optim.SGD(model.parameters(), lr=1.0)  # each step's change: minus the gradient
            step = build_step(cfg, ctx, model, opt, ROWS // ctx.world_size, loss_fn=loss)
            per = ROWS // ctx.world_size
            rows = slice(ctx.rank * per, (ctx.rank + 1) * per)
            if chunked:  # the model applies the head: it returns the summed loss, not logits
                x, y = _batches(ctx.world_size)[0]
                with torch.no_grad():
                    assert model(x[rows], head=loss.head(y[rows])).dim() == 0
            history = [_full(model)]
            losses = []
            for x, y in _batches(ctx.world_size):
                losses.append(distlib.all_reduce(step(x[rows], y[rows]).detach().clone(), op="mean").item())
                history.append(_full(model))
            step.close()
            out[(shard, chunked)] = (losses, history)
    return out


@pytest.mark.parametrize(("kind", "world_size"), [("gpt", 3), ("llama", 2)])
def test_a_model_trains_with_the_chunked_loss_as_with_the_plain_one(kind, world_size):
    """Tied embeddings: the output layer's gradient and the embedding's are one, both paths'."""
    results = run_ranks(_rank, world_size, kind, timeout=300)[0]
    for shard in ("none", "full"):
        plain_losses, plain = results[(shard, False)]
        losses, chunked = results[(shard, True)]
        assert max(abs(a - b) for a, b in zip(losses, plain_losses)) < 1e-5, (shard, losses, plain_losses)
        for k in range(1, len(plain)):
            names = plain[k].keys()
            assert names == chunked[k].keys()
            for name in names:
                want = plain[k][name] - plain[k - 1][name]  # minus the gradient
                got = chunked[k][name] - chunked[k - 1][name]
                assert want.abs().max() > 0 or "wpe" in name or "bias" in name, name
                assert (got - want).abs().max() < 1e-5, (shard, k, name)
    assert results[("none", True)][0] == pytest.approx(results[("full", True)][0], abs=1e-5)


def _whole_model_rank(ctx) -> dict:
    import torch._dynamo

    out = {}
    for compiled in (False, True):
        cfg = Config()
        cfg.train.batch_size, cfg.train.label_smoothing = ROWS, SMOOTHING
        if compiled:
            cfg.train.compile, cfg.train.compile_backend = "model", "aot_eager"
        model = _model("gpt")
        loss = chunked_cross_entropy(3, SMOOTHING, cfg.train.compile_backend if compiled else None)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        torch._dynamo.utils.counters.clear()
        step = build_step(cfg, ctx, model, opt, ROWS // ctx.world_size, loss_fn=loss)
        per = ROWS // ctx.world_size
        rows = slice(ctx.rank * per, (ctx.rank + 1) * per)
        history, losses = [_full(model)], []
        for x, y in _batches(ctx.world_size, steps=3):
            losses.append(distlib.all_reduce(step(x[rows], y[rows]).detach().clone(), op="mean").item())
            history.append(_full(model))
        step.close()
        out[compiled] = (losses, history, torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return out


def test_a_whole_model_compiled_around_the_chunked_loss_trains_as_eager():
    """train.compile=model with the loss in chunks (the model compiled whole by the step, one graph a
    GradSync bucket, at 3 gloo ranks): the model's graphs end at the hidden states and the loss's
    Function runs between forward and backward; each step's loss and every parameter's change equal
    the eager run's. (Traced into the model's graph, the Function's gradients could not leave it.)"""
    results = run_ranks(_whole_model_rank, 3, timeout=300)[0]
    (eager_losses, eager, _), (losses, compiled, graphs) = results[False], results[True]
    assert graphs > 0  # the model was compiled
    assert max(abs(a - b) for a, b in zip(losses, eager_losses)) < 1e-5, (losses, eager_losses)
    for k in range(1, len(eager)):
        for name in eager[k]:
            want, got = eager[k][name] - eager[k - 1][name], compiled[k][name] - compiled[k - 1][name]
            assert want.abs().max() > 0 or "wpe" in name or "bias" in name, name  # a gradient reached it
            assert (got - want).abs().max() < 1e-5, (k, name)


def test_the_output_matrixs_gradient_is_summed_in_fp32_by_the_product_where_the_op_exists(monkeypatch):
    """The 16-bit operands' product summed into the fp32 gradient: on the CPU (no such kernel) a
    product in their dtype, then added; on fake tensors (the memory plan's, which plans a GPU's step)
    no operation at all, as CUDA's fp32-output product allocates nothing, so that the plan holds no
    temporary the GPU never makes; a torch without that op falls back to the CPU's way, the same sum."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from distlib.runner.tasks import chunked_loss

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(37, 12, generator=g).bfloat16(), torch.randn(12, 5, generator=g).bfloat16()
    start = torch.randn(37, 5, generator=g)
    want = start + a.float() @ b.float()
    acc = start.clone()
    with Ops() as ops:
        chunked_loss._accumulate(acc, a, b)
    assert "aten.mm.default" in ops.seen and not any("addmm" in op for op in ops.seen), ops.seen
    assert (acc - want).abs().max() < 0.05  # the product rounded to bf16, as the plain loss's
    with FakeTensorMode() as mode:
        fake_acc, fake_a, fake_b = (mode.from_tensor(t) for t in (start, a, b))
        with Ops() as ops:
            chunked_loss._accumulate(fake_acc, fake_a, fake_b)
    assert ops.seen == [], ops.seen
    monkeypatch.setitem(chunked_loss._fp32_addmm, "cpu", True)  # a device whose torch lacks the op
    acc = start.clone()
    chunked_loss._accumulate(acc, a, b)
    assert chunked_loss._fp32_addmm["cpu"] is False and (acc - want).abs().max() < 0.05


@pytest.mark.gpus(1)
@pytest.mark.parametrize("backend", [None, "inductor"])
def test_on_a_gpu_the_chunked_loss_in_bf16_is_as_close_to_the_fp32_loss_as_the_plain_one(backend):
    """On CUDA under bf16 autocast, each chunk eager or compiled by inductor, a vocabulary that is not
    a multiple of 64 (padded), -100 targets and label smoothing: against the fp32 loss and gradients,
    the chunked loss's error is within twice the plain bf16 loss's (both round the products to bf16;
    on the CPU the chunked one's is 1.2-1.3 times)."""

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs().max() / b.abs().max()).item()

    g = torch.Generator().manual_seed(7)
    rows, t, width, vocab = 8, 96, 256, 1000
    hidden = torch.randn(rows, t, width, generator=g).cuda().requires_grad_()
    head = nn.Linear(width, vocab, bias=False).cuda()
    y = _targets(g, rows, t, vocab).cuda()
    n = int((y != -100).sum())

    def plain() -> torch.Tensor:
        return F.cross_entropy(head(hidden).flatten(0, 1).float(), y.flatten(), ignore_index=-100, reduction="sum",
                               label_smoothing=SMOOTHING)  # fmt: skip

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference in fp32 proper (another test may have set it)
    try:
        exact = plain()
        exact_grads = torch.autograd.grad(exact / n, [hidden, head.weight])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    with torch.autocast("cuda", torch.bfloat16):
        got = linear_cross_entropy(hidden, head, y, chunks=5, label_smoothing=SMOOTHING, compile_backend=backend)
        want = plain()
    assert abs(got.item() - exact.item()) <= 2 * abs(want.item() - exact.item()) + 1e-5 * n
    got_grads = torch.autograd.grad(got / n, [hidden, head.weight])
    want_grads = torch.autograd.grad(want / n, [hidden, head.weight])
    for a, b, e in zip(got_grads, want_grads, exact_grads):
        assert a.dtype == e.dtype
        assert rel(a, e) <= 2 * rel(b, e) + 1e-3, (rel(a, e), rel(b, e))


@pytest.mark.gpus(1)
def test_on_a_gpu_a_whole_model_compiled_by_inductor_around_the_chunked_loss_trains_as_eager():
    """The composition that once trained nothing on a GPU: the GPT compiled whole by inductor, bf16
    autocast, the loss in chunks (each chunk compiled too), three SGD steps against eager: the same
    losses within bf16's rounding, and every weight moved as far."""
    from distlib.runner.models.gpt import gpt

    g = torch.Generator().manual_seed(13)
    batches = [(torch.randint(0, 256, (4, 64), generator=g).cuda(), _targets(g, 4, 64, 256).cuda()) for _ in range(3)]
    runs = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = gpt(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64).cuda()
        net = torch.compile(model, backend="inductor") if compiled else model
        loss = chunked_cross_entropy(4, SMOOTHING, "inductor" if compiled else None)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        losses = []
        for x, y in batches:
            with torch.autocast("cuda", torch.bfloat16):
                total = net(x, head=loss.head(y))
            (total / (y != -100).sum()).backward()
            opt.step()
            opt.zero_grad()
            losses.append(total.item())
        runs[compiled] = losses, {n: (p.detach() - start[n]).norm().item() for n, p in model.named_parameters()}
    (eager_losses, eager_moved), (losses, moved) = runs[False], runs[True]
    assert losses == pytest.approx(eager_losses, rel=2e-2), (losses, eager_losses)
    for name, distance in eager_moved.items():
        assert moved[name] == pytest.approx(distance, rel=0.1, abs=1e-6), (name, moved[name], distance)
