"""``shard_model`` never holds the whole model: built on the meta device, each parameter made whole
on its own from the recorded initialisation, each rank keeping its rows.

At a simulated world size (torch's fake process group: real shard shapes and memory, collectives do
nothing) each rank's shards are compared row for row with the same rows of a plain build, and the
peak of the memory allocated on the host while ``shard_model`` runs (counted by torch's profiler:
every allocation and free of the CPU allocator, in order) is bounded by the shards plus a few
parameters. On real gloo ranks a transformers model from a config and an initialisation that
cannot be replayed (a fallback, with a warning) give the plain build's weights, and ``empty=True``
shards without values.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distlib.runner.models.gpt import GPT, GPTConfig
from tests.conftest import run_ranks

BIG = GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=4, n_embd=128)


def peak_bytes(fn):
    """``fn()``'s result and the peak of the host memory allocated while it ran, above what was
    allocated before (the CPU allocator's allocations and frees, as torch's profiler records them)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())  # fmt: skip
    now = top = 0
    for e in events:
        now += e.nbytes()
        top = max(top, now)
    return out, top


def _simulated(ctx, rank: int, world: int) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from distlib.parallel.fsdp import shard_model

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model, peak = peak_bytes(lambda: shard_model(lambda: GPT(BIG), device="cpu"))
        shards = {n: p.to_local().clone() for n, p in model.named_parameters()}
        held = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
        rng = torch.get_rng_state()
        del model
    finally:
        dist.destroy_process_group()
    return {"shards": shards, "peak": peak, "held": held, "rng": rng}


@pytest.mark.parametrize("rank", [0, 5])
def test_a_simulated_rank_of_8_holds_its_rows_of_the_plain_build_and_never_the_whole_model(rank):
    """Rank ``rank`` of 8 (fake process group): every shard equals its rows of the plain build under
    the same seed, the random state after it is the plain build's, and the host memory allocated
    while shard_model runs peaks at the shards plus a few parameters: under a third of the whole
    model (the build used to make the whole model first)."""
    world = 8
    torch.manual_seed(0)
    plain = GPT(BIG)
    plain_rng = torch.get_rng_state()
    (r,) = run_ranks(_simulated, 1, rank, world, timeout=240)
    whole = sum(p.numel() * p.element_size() for p in plain.parameters())
    largest = max(p.numel() * p.element_size() for p in plain.parameters())
    for n, p in plain.named_parameters():
        chunks = list(torch.chunk(p.detach(), world, dim=0))
        want = chunks[rank] if rank < len(chunks) else p.new_empty((0, *p.shape[1:]))
        assert torch.equal(r["shards"][n], want), n
    assert torch.equal(r["rng"], plain_rng), "the random state after shard_model is not a plain build's"
    # the shards, one whole parameter being replayed, its rows and a scratch draw, FSDP2's padding
    assert r["peak"] <= r["held"] + 4 * largest + 64 * 1024, (r["peak"], r["held"], largest, whole)
    assert r["peak"] < whole / 3, (r["peak"], whole)


class _Derived(nn.Module):
    """A parameter initialised from another (the second layer the first's transpose): cannot be
    replayed one parameter at a time."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        with torch.no_grad():
            self.blocks[1].weight.copy_(self.blocks[0].weight.t())


class _Truncated(nn.Module):
    """torch's ``trunc_normal_`` (which resamples the values out of bounds) and ``orthogonal_`` (a QR
    of a temporary): each recorded as one operation."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        for b in self.blocks:
            nn.init.trunc_normal_(b.weight, std=0.02)
        nn.init.orthogonal_(self.blocks[0].weight)


class _Padded(nn.Module):
    """An embedding whose padding row is not row 0: its initialisation zeroes row 3 through a view
    of the weight that starts 3 rows in (a replay that loses the view's offset zeroes row 0)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 8, padding_idx=3)
        self.head = nn.Linear(8, 40)


# pad_token_id 5: transformers zeroes that row of the embedding through a view 5 rows in
_LLAMA = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=96, tie_word_embeddings=False, pad_token_id=5)  # fmt: skip


def _llama():
    from distlib.runner.models.hf_causal_lm import hf_causal_lm

    return hf_causal_lm(config=_LLAMA)


def _gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def _builds(ctx) -> dict:
    import logging

    from distlib.parallel.fsdp import shard_model

    out = {}
    out["llama"] = _gathered(shard_model(_llama, device="cpu", seed=0))
    out["truncated"] = _gathered(shard_model(_Truncated, device="cpu", seed=0))
    out["padded"] = _gathered(shard_model(_Padded, device="cpu", seed=0))
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger = logging.getLogger("distlib")
    logger.addHandler(handler)
    try:
        out["derived"] = _gathered(shard_model(_Derived, device="cpu", seed=0))
    finally:
        logger.removeHandler(handler)
    out["warnings"] = warnings
    empty = shard_model(lambda: GPT(BIG), device="cpu", seed=0, empty=True)
    out["empty_nan"] = all(bool(torch.isnan(p.to_local()).all()) for p in empty.parameters())
    out["empty_rng"] = torch.get_rng_state()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_transformers_model_and_a_fallback_give_the_plain_builds_weights(world):
    """A transformers Llama from a config, sharded at 2 and 3 gloo ranks, gathers to the plain build
    under the same seed, and so does a model initialised with ``trunc_normal_`` and ``orthogonal_``,
    and embeddings whose padding row (3; the Llama's 5) is zeroed through a view with an offset;
    an initialisation that cannot be replayed per parameter falls back to the whole build with a
    warning that says so, and still gives the plain weights; ``empty=True``
    shards NaN and draws nothing."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    llama = {n: p.detach() for n, p in _llama().named_parameters()}
    torch.manual_seed(0)
    derived = {n: p.detach() for n, p in _Derived().named_parameters()}
    torch.manual_seed(0)
    truncated = {n: p.detach() for n, p in _Truncated().named_parameters()}
    torch.manual_seed(0)
    padded = {n: p.detach() for n, p in _Padded().named_parameters()}
    # the padding rows are zero and row 0 is not: a replay that zeroes the wrong row differs
    for weight, pad in ((padded["embed.weight"], 3), (llama["hf.model.embed_tokens.weight"], 5)):
        assert not weight[pad].any() and weight[0].all()
    torch.manual_seed(0)
    untouched = torch.get_rng_state()
    for r in run_ranks(_builds, world, timeout=240):
        pairs = (r["llama"], llama), (r["derived"], derived), (r["truncated"], truncated), (r["padded"], padded)
        for got, want in pairs:
            assert got.keys() == want.keys()
            for n, t in want.items():
                assert torch.equal(got[n], t), n
        (warned,) = r["warnings"]  # for the derived one only
        assert "_Derived's initialisation cannot be replayed one parameter at a time" in warned, warned
        assert "built whole" in warned, warned
        assert r["empty_nan"]
        assert torch.equal(r["empty_rng"], untouched)


def _simulated_on_gpu(ctx) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from distlib.parallel.fsdp import shard_model

    cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=16, n_head=16, n_embd=1024)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    with device:
        plain = GPT(cfg)
    want = {n: torch.chunk(p.detach(), 8, dim=0)[0].clone() for n, p in plain.named_parameters()}
    whole = sum(p.numel() * p.element_size() for p in plain.parameters())
    largest = max(p.numel() * p.element_size() for p in plain.parameters())
    del plain
    torch.cuda.empty_cache()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        torch.manual_seed(0)
        model = shard_model(lambda: GPT(cfg), device=device)
        peak = torch.cuda.max_memory_allocated() - before
        held = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
        equal = all(torch.equal(p.to_local(), want[n]) for n, p in model.named_parameters())
    finally:
        dist.destroy_process_group()
    return {"peak": peak, "held": held, "whole": whole, "largest": largest, "equal": equal}


@pytest.mark.gpus(1)
def test_on_a_gpu_a_simulated_rank_of_8_never_holds_the_whole_model():
    """A 0.25B GPT on the GPU at a simulated world size of 8: rank 0's shards are its rows of the
    plain build on the GPU, and the GPU memory allocated while shard_model runs peaks at the shards
    plus a few parameters (the embedding, 206 MB, is the largest), under half the whole model."""
    (r,) = run_ranks(_simulated_on_gpu, 1, timeout=300)
    assert r["equal"]
    assert r["peak"] <= r["held"] + 3 * r["largest"] + 64 * 2**20, r
    assert r["peak"] < r["whole"] / 2, r
