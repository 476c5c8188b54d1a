"""Float8 training (distlib/step/float8.py): the rule of which Linear layers go float8, the conversion
(emulated on the CPU, the state_dict unchanged), the errors, and FSDP2's float8 all-gathers at two gloo
ranks against one process, with the scales kept current after the weights change in place."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distlib
from distlib.runner.models.gpt import GPT, GPTConfig
from tests.conftest import run_ranks

pytest.importorskip("torchao")  # the fp8 extra (in the test extra: CI has it)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.odd = nn.Linear(width, 40)  # 40: not a multiple of 16, which float8 products need
        self.sub = nn.modules.linear.NonDynamicallyQuantizableLinear(width, width)  # a subclass: its own forward


class Net(nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.embed = nn.Embedding(10, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, 16)  # outside the blocks
        self.blocks[0].tied, self.blocks[1].tied = nn.Linear(width, width), nn.Linear(width, width)
        self.blocks[0].tied.weight = self.blocks[1].tied.weight  # one weight, two layers (as a tied output layer)


def test_the_rule_takes_the_blocks_plain_linear_layers_whose_sides_are_multiples_of_16():
    names = distlib.float8_layers(Net(), layers="all")
    assert names == ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down"]


def test_auto_leaves_out_the_matrices_too_small_to_gain_by_torchaos_thresholds():
    """tensorwise: a (K, N) = (in, out) product gains unless K <= 4096 and N <= 1024; rowwise wants
    larger matrices still. On the meta device: the rule needs no memory (the memory plan asks it)."""
    with torch.device("meta"):
        model = nn.Module()
        model.blocks = nn.ModuleList([nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 2048), nn.Linear(8192, 512),
                                                    nn.Linear(2048, 8192))])  # fmt: skip
    assert distlib.float8_layers(model) == ["blocks.0.1", "blocks.0.2", "blocks.0.3"]
    assert distlib.float8_layers(model, recipe="rowwise") == ["blocks.0.3"]
    assert len(distlib.float8_layers(model, layers="all")) == 4


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(recipe="blockwise"), ["'blockwise'", "tensorwise, rowwise"]),
        (dict(layers="some"), ["'some'", "'auto' or 'all'"]),
        (dict(recipe="rowwise", fsdp_float8_all_gather=True), ["all-gathers", "tensorwise"]),
    ],
)
def test_what_cannot_be_converted_is_a_float8_error_that_says_why(kwargs, words):
    with pytest.raises(distlib.Float8Error) as e:
        distlib.convert_to_float8(Net(), **kwargs)
    for w in words:
        assert w in str(e.value)


def test_a_model_without_blocks_is_refused_naming_the_way_to_name_them():
    with pytest.raises(distlib.Float8Error, match="block_class"):
        distlib.float8_layers(nn.Sequential(nn.Linear(64, 64)))


def test_without_torchao_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # `import torchao.float8` now raises ImportError
    with pytest.raises(distlib.Float8Error, match=r"pip install 'distlib\[fp8\]'"):
        distlib.convert_to_float8(Net(), layers="all")
    assert distlib.float8_layers(Net(), layers="all")  # the rule without sizes needs no torchao


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32))


def test_conversion_emulates_float8_on_the_cpu_and_keeps_the_state_dict():
    """The blocks' layers become torchao's Float8Linear, emulated here; the state_dict's names and values
    are the model's own (a checkpoint of either loads into the other); the outputs are float8's: close
    to the high-precision ones, not equal."""
    ref, model = _gpt(), _gpt()
    names = distlib.convert_to_float8(model, layers="all")
    assert len(names) == 8 and all(n.startswith("blocks.") for n in names)
    modules = dict(model.named_modules())
    assert all(type(modules[n]).__name__ == "Float8Linear" and modules[n].config.emulate for n in names)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.wte.weight  # still tied
    sd, want = model.state_dict(), ref.state_dict()
    assert sd.keys() == want.keys()
    assert all(torch.equal(sd[k], want[k]) for k in want)
    model.load_state_dict(want)
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    a, b = ref(x), model(x)
    assert not torch.equal(a, b)
    torch.testing.assert_close(b, a, rtol=0.1, atol=0.1)  # e4m3: 3 mantissa bits
    b.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def _reshard(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _fsdp_float8(ctx, steps: int) -> tuple[list[float], dict[str, torch.Tensor], bool]:
    """The GPT with float8 all-gathers under FSDP2, converted by ``shard_model(convert=)`` (this rank's
    half of each batch), AdamW, the scales computed after each step; then whether a weight changed in
    place outside a step keeps a stale scale until ``precompute_float8_scales``."""
    from distlib.parallel import fsdp

    whole = []
    build_whole = fsdp._build_whole
    fsdp._build_whole = lambda *a, **k: whole.append(1) or build_whole(*a, **k)
    try:  # converted between the recorded build and fully_shard: each parameter replayed into its shards
        model = distlib.shard_model(
            _gpt, convert=lambda m: distlib.convert_to_float8(m, layers="all", fsdp_float8_all_gather=True)
        )
    finally:
        fsdp._build_whole = build_whole
    assert not whole  # never built whole on a rank
    local = model.blocks[0].attn.qkv.weight.to_local()
    assert type(local).__name__ == "WeightWithDynamicFloat8CastTensor"  # all-gathered in float8
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 256, (4, 32), generator=g)
        half = x.chunk(ctx.world_size)[ctx.rank]
        loss = F.cross_entropy(model(half).flatten(0, 1), half.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        distlib.precompute_float8_scales(model)
        losses.append(distlib.all_reduce(loss.detach(), op="mean").item())
    weights = {k: v.full_tensor() for k, v in model.state_dict().items()}
    x = torch.randint(0, 256, (2, 32), generator=g)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # as loading a checkpoint or undoing warm-up steps does: in place
        stale = model(x)
        _reshard(model)  # a forward without backward leaves the last block and the root gathered
        distlib.precompute_float8_scales(model)
        fresh = model(x)
        _reshard(model)
    stale_differs = not torch.equal(stale, fresh)
    return losses, weights, stale_differs


def test_fsdp2_float8_all_gathers_train_as_one_process_does():
    """At two gloo ranks each weight is cast to float8 on its shard with the scale of the whole weight and
    gathered in float8: the losses and weights of one process that converts the same model (no FSDP2)
    and runs each rank's half of the batch alone (the activations' scales are each half's), within 1e-5
    (the ranks sum the gradients in another order). A weight changed in place keeps its
    old scale until precompute_float8_scales: the runner calls it after the warm-up and a resume too."""
    steps = 3
    got = run_ranks(_fsdp_float8, 2, steps, timeout=120)
    model = _gpt()
    distlib.convert_to_float8(model, layers="all")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(2)
    want = []
    for _ in range(steps):
        x = torch.randint(0, 256, (4, 32), generator=g)
        loss = 0.0
        for half in x.chunk(2):  # each half alone, as each rank: activations are scaled per tensor
            micro = F.cross_entropy(model(half).flatten(0, 1), half.flatten()) / 2
            micro.backward()
            loss += micro.item()
        opt.step()
        opt.zero_grad()
        want.append(loss)
    for losses, weights, stale_differs in got:
        assert losses == pytest.approx(want, rel=1e-5)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-6, msg=k)
        assert stale_differs
