"""Per-block work: ``find_blocks`` finds a model's repeated blocks; ``compile_blocks`` compiles
each in place into one graph that every block reuses (no recompilation per block or per step),
with the eager results and GradSync's buckets still launched during backward; ``checkpoint_blocks``
recomputes activations (full or selective) with the gradients of no checkpointing, and holds less
memory between forward and backward, and recomputes what its mode says."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distlib
from distlib.parallel.grad_sync import GradSync
from distlib.runner.models.gpt import GPT, Block, GPTConfig
from distlib.step.activation_checkpointing import checkpointing_of
from distlib.step.compile import compile_for_sync

CFG = dict(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**CFG, **kw}))


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)


def _loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net(x).flatten(0, 1), y.flatten())


class Counting:
    """A dynamo backend that counts the graphs it is given and runs them as traced."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> object:
        self.graphs += 1
        return gm.forward


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(Block(GPTConfig(**CFG)), nn.Sequential(Block(GPTConfig(**CFG))))
        self.head = nn.Linear(32, 2)


def test_find_blocks_by_the_blocks_list_by_class_and_by_class_name():
    gpt = _gpt()
    assert distlib.find_blocks(gpt) == list(gpt.blocks)
    assert distlib.find_blocks(gpt, Block) == list(gpt.blocks)
    assert distlib.find_blocks(gpt, "Block") == list(gpt.blocks)
    assert distlib.find_blocks(gpt, "distlib.runner.models.gpt:Block") == list(gpt.blocks)
    assert distlib.find_blocks(gpt, ["Nothing", "MLP"]) == [b.mlp for b in gpt.blocks]
    assert distlib.find_blocks(nn.Linear(2, 2)) == []  # no blocks: the caller decides
    outer = Outer()
    assert distlib.find_blocks(outer) == []  # no `blocks` list
    assert distlib.find_blocks(outer, "Block") == [outer.layers[0], outer.layers[1][0]]
    assert distlib.find_blocks(outer, "Sequential") == [outer.layers]  # the outermost only
    with pytest.raises(TypeError, match="block_class"):
        distlib.find_blocks(gpt, 3)


def test_each_block_is_compiled_in_place_into_one_graph_that_every_block_and_step_reuses():
    """Four blocks, three training steps and a no-grad forward: the backend gets one graph for the
    blocks' training forward (not one per block, nor per step), the losses are eager's, the names
    and state_dict are unchanged, and the blocks alone are compiled."""
    torch._dynamo.reset()
    ref, model = _gpt(), _gpt()
    names = list(model.state_dict())
    backend = Counting()
    assert distlib.compile_blocks(model.blocks, backend=backend) == 4
    assert [getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()].count(True) == 4
    assert all(b._compiled_call_impl is not None for b in model.blocks)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    for step in range(3):
        x, y = _batch(step)
        losses = []
        for net, opt in zip((ref, model), opts):
            loss = _loss(net, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-6), step
        assert backend.graphs == 1, f"step {step}: {backend.graphs} graphs compiled"
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)
    assert backend.graphs <= 2  # the no-grad forward: at most one graph more, for every block
    assert list(model.state_dict()) == names
    assert distlib.compile_blocks(model.blocks, backend=backend) == 4  # again: nothing recompiled
    assert backend.graphs <= 2


def test_compiled_blocks_launch_gradsyncs_buckets_during_backward():
    """When the gradient of the embedding's output arrives (after every block's backward, before
    the embedding's own gradient), per-block compile has launched the blocks' buckets, as eager
    does: each block's backward is its own autograd node, so its gradients' hooks fire as it ends.
    shard="optimizer" keeps its buckets at world size 1."""

    def launched_before_embedding(compile_how: str) -> tuple[int, int]:
        torch._dynamo.reset()
        model = _gpt()
        sync = GradSync(model, bucket_mb=0.01, first_bucket_mb=0.01, shard="optimizer")
        sync.sharded_optimizer(torch.optim.SGD, model.parameters(), lr=0.1)
        net = model
        if compile_how == "blocks":
            distlib.compile_blocks(model.blocks, backend="aot_eager")
        seen = []

        def on_embedding(module, inputs, out) -> None:
            out.register_hook(lambda g: seen.append(sync._next_bucket))

        model.wte.register_forward_hook(on_embedding)
        _loss(net, *_batch()).backward()
        sync.wait()
        assert compile_how == "eager" or all(blk._compiled_call_impl is not None for blk in model.blocks)
        return seen[0], len(sync.buckets)

    eager, n = launched_before_embedding("eager")
    blocks, _ = launched_before_embedding("blocks")
    assert n > 4 and 0 < eager < n
    assert blocks == eager


def test_compile_for_sync_at_world_size_one_compiles_one_graph_even_with_buckets():
    """shard="optimizer" keeps its buckets at world size 1; cutting the graph there would compile one
    piece per bucket (hundreds for a billion-parameter model) for no communication at all."""
    torch._dynamo.reset()
    model = _gpt()
    sync = GradSync(model, bucket_mb=0.01, first_bucket_mb=0.01, shard="optimizer")
    assert len(sync.buckets) > 4
    backend = Counting()
    net = compile_for_sync(model, sync, backend=backend)
    _loss(net, *_batch()).backward()
    assert backend.graphs == 1


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_checkpointed_blocks_have_the_gradients_of_no_checkpointing(dropout):
    """Full and selective checkpointing, eager and per-block compiled (aot_eager): the loss and every
    gradient as without checkpointing; with dropout the recomputation replays the same masks."""
    x, y = _batch()
    ref = _gpt(dropout=dropout)
    torch.manual_seed(1)
    _loss(ref, x, y).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    for mode in ("full", "selective"):
        for compiled in (False, True):
            torch._dynamo.reset()
            model = _gpt(dropout=dropout)
            assert distlib.checkpoint_blocks(model.blocks, mode) == 4
            assert [checkpointing_of(b) for b in model.blocks] == [mode] * 4
            assert isinstance(model.blocks[0], Block) and list(model.state_dict()) == list(ref.state_dict())
            if compiled:
                if dropout:
                    continue  # compiled random ops draw differently from eager ones
                distlib.compile_blocks(model.blocks, backend="aot_eager")
            torch.manual_seed(1)
            _loss(model, x, y).backward()
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6, msg=f"{mode} {compiled} {n}")
    with pytest.raises(ValueError, match="'full' or 'selective'"):
        distlib.checkpoint_blocks(model.blocks, "some")
    distlib.compile_blocks(model.blocks, backend="aot_eager")
    with pytest.raises(ValueError, match="compiled already"):
        distlib.checkpoint_blocks(model.blocks, "full")


def _held_after_forward(mode: str) -> int:
    """Bytes allocated by the forward and still held when it returns (the activations kept for
    backward, and the output), from the profiler's CPU memory events."""
    from torch.profiler import ProfilerActivity, profile

    model = _gpt(n_layer=4, n_embd=64, block_size=64)
    if mode != "none":
        distlib.checkpoint_blocks(model.blocks, mode)
    x = torch.randint(0, 64, (4, 64))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model(x)
    held = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage and e.cpu_parent is None)
    del out
    return held


def test_checkpointing_holds_less_memory_between_forward_and_backward():
    """Measured on the CPU: full keeps each block's input only, selective also attention and every
    other matmul output; both hold less than no checkpointing, full the least."""
    none, full, selective = (_held_after_forward(m) for m in ("none", "full", "selective"))
    assert full < selective < none, (none, full, selective)
    assert full < none / 3


def _matmuls_in_backward(mode: str) -> int:
    """The matrix products run during backward of a one-block GPT: the gradients' own, plus the
    forward's that checkpointing recomputes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    model = _gpt(n_layer=1)
    if mode != "none":
        distlib.checkpoint_blocks(model.blocks, mode)
    loss = _loss(model, *_batch())
    with Count():
        loss.backward()
    return Count.n


def test_selective_checkpointing_recomputes_every_other_matmul_and_full_recomputes_the_block():
    """Of a block's four matmuls (qkv, attention output, MLP in and out) selective keeps the first
    and third and recomputes the second (the fourth's output is needed by nothing in backward, and
    the recomputation stops before it); full recomputes all that backward needs."""
    none, selective, full = (_matmuls_in_backward(m) for m in ("none", "selective", "full"))
    assert selective == none + 1, (none, selective, full)
    assert full == none + 3, (none, selective, full)


def test_no_checkpointing_without_autograd():
    """Evaluation and generation under no_grad run the block plainly: nothing is recomputed."""
    model = _gpt()
    distlib.checkpoint_blocks(model.blocks, "full")
    calls = []
    model.blocks[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    x, y = _batch()
    with torch.no_grad():
        model(x)
    assert len(calls) == 1
    _loss(model, x, y).backward()
    assert len(calls) == 3  # forward, then the recomputation in backward
