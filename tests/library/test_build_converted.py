"""``build_converted``: a model built and converted (a frozen base cast to bf16, as LoRA's) one parameter
at a time gives the plain build's weights after the same conversion, bit for bit, and never holds the
plain build's fp32 parameters all at once.

The host memory allocated while it runs is counted by torch's profiler (every allocation and free of
the CPU allocator, in order), as for ``shard_model``; on a GPU, ``max_memory_allocated``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distlib.parallel.deferred_init import build_converted
from tests.library.test_sharded_build import _LLAMA, _Derived, _Padded, _Truncated, peak_bytes


class _Adapted(nn.Module):
    """A frozen base (an embedding tied to the output layer, blocks initialised with ``trunc_normal_``
    and ``orthogonal_``, a norm created with values) with small trainable adapters beside it."""

    def __init__(self, vocab: int = 1024, width: int = 256, layers: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=7)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        for b in self.blocks:
            nn.init.trunc_normal_(b.weight, std=0.02)
        nn.init.orthogonal_(self.blocks[0].weight)
        self.norm = nn.Parameter(torch.ones(width))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("inv_freq", torch.arange(width, dtype=torch.float32) / width)
        for p in self.parameters():
            p.requires_grad_(False)
        self.adapters = nn.ModuleList(nn.Linear(width, 4, bias=False) for _ in range(layers))


def cast_frozen(model: nn.Module) -> None:
    """What the runner does to a LoRA model on a GPU: every frozen parameter to bf16, new parameters
    under the same names (a tied one stays tied)."""
    done: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and not p.requires_grad:
                done.setdefault(id(p), nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False))
                m._parameters[name] = done[id(p)]


def plain(build, convert=cast_frozen) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(3)
    model = build()
    convert(model)
    return model, torch.get_rng_state()


def converted(build, convert=cast_frozen) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(3)
    model = build_converted(build, convert, "cpu")
    return model, torch.get_rng_state()


def assert_same(got: nn.Module, want: nn.Module) -> None:
    got_p, want_p = dict(got.named_parameters()), dict(want.named_parameters())
    assert got_p.keys() == want_p.keys()
    for n, w in want_p.items():
        g = got_p[n]
        assert g.dtype == w.dtype and g.requires_grad == w.requires_grad, n
        assert g.device.type == "cpu", n
        assert torch.equal(g, w), n
    for (n, g), (_, w) in zip(got.named_buffers(), want.named_buffers(), strict=True):
        assert torch.equal(g, w), n


def test_a_frozen_base_cast_to_bf16_is_the_plain_builds_cast_and_never_whole_in_fp32():
    """The values, dtypes, trainability, tie and buffers of a plain build followed by the cast, the
    random state after it the plain build's, and the host memory allocated on the way: the converted
    model plus a few of its fp32 parameters, well under the plain build's fp32 model."""
    want, want_rng = plain(_Adapted)
    (got, got_rng), peak = peak_bytes(lambda: converted(_Adapted))
    assert_same(got, want)
    assert got.head.weight is got.embed.weight
    assert got.embed.weight.dtype == torch.bfloat16 and got.adapters[0].weight.dtype == torch.float32
    assert torch.equal(got_rng, want_rng)
    held = sum(p.numel() * p.element_size() for p in got.parameters())
    fp32 = sum(p.numel() * 4 for p in got.parameters())
    largest = max(p.numel() * 4 for p in got.parameters())
    assert peak <= held + 3 * largest + 256 * 1024, (peak, held, largest)
    assert peak < 0.8 * fp32, (peak, fp32)


@pytest.mark.parametrize("build", [_Truncated, _Padded], ids=["trunc-orthogonal", "padding-row-3"])
def test_initialisations_replayed_through_views_and_whole_ops_give_the_plain_values(build):
    """trunc_normal_, orthogonal_ and a padding row zeroed through a view with an offset, each frozen
    and cast: the plain values (a replay that lost the view's offset would zero row 0)."""

    def frozen() -> nn.Module:
        m = build()
        m.requires_grad_(False)
        return m

    want, want_rng = plain(frozen)
    got, got_rng = converted(frozen)
    assert_same(got, want)
    assert torch.equal(got_rng, want_rng)


def test_an_initialisation_that_cannot_be_replayed_falls_back_to_the_plain_build():
    """A parameter initialised from another (unreplayable one at a time): built whole, then converted,
    with the plain build's values and random state."""

    def frozen() -> nn.Module:
        m = _Derived()
        m.blocks[0].requires_grad_(False)
        return m

    want, want_rng = plain(frozen)
    got, got_rng = converted(frozen)
    assert_same(got, want)
    assert got.blocks[0].weight.dtype == torch.bfloat16 and got.blocks[1].weight.dtype == torch.float32
    assert torch.equal(got_rng, want_rng)


def test_a_transformers_model_with_peft_adapters_is_the_plain_builds_cast():
    """The runner's LoRA model (a transformers Llama, padding row 5, with peft's adapters on every
    Linear of the blocks): the plain build and cast, bit for bit, adapters and all."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from distlib.runner.models.hf_causal_lm import hf_causal_lm

    def build() -> nn.Module:
        return hf_causal_lm(config=_LLAMA, lora={"r": 4, "alpha": 8})

    want, want_rng = plain(build)
    got, got_rng = converted(build)
    assert_same(got, want)
    frozen = [n for n, p in got.named_parameters() if not p.requires_grad]
    assert frozen and all(dict(got.named_parameters())[n].dtype == torch.bfloat16 for n in frozen)
    assert any(p.requires_grad for p in got.parameters())
    assert torch.equal(got_rng, want_rng)


def _gpu_peak() -> dict:
    device = torch.device("cuda", 0)

    def build() -> nn.Module:
        return _Adapted(vocab=4096, width=2048, layers=24)

    torch.manual_seed(0)
    with device:
        want = build()
    cast_frozen(want)
    want = {n: p.detach().clone() for n, p in want.named_parameters()}
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = build_converted(build, cast_frozen, device)
    peak = torch.cuda.max_memory_allocated() - before
    return {
        "peak": peak,
        "held": sum(p.numel() * p.element_size() for p in model.parameters()),
        "fp32": sum(p.numel() * 4 for p in model.parameters()),
        "largest": max(p.numel() * 4 for p in model.parameters()),
        "equal": all(torch.equal(p, want[n]) for n, p in model.named_parameters()),
    }


@pytest.mark.gpus(1)
def test_on_a_gpu_a_frozen_base_is_never_whole_in_fp32():
    """On the GPU: the plain values, and the GPU memory allocated while it builds peaks at the bf16
    model plus a few fp32 parameters, under 0.8 of the fp32 model that the plain build makes first."""
    r = _gpu_peak()
    assert r["equal"]
    assert r["peak"] <= r["held"] + 3 * r["largest"] + 64 * 2**20, r
    assert r["peak"] < 0.8 * r["fp32"], r
