"""Full sharding (``shard_model`` + ``FSDPSync``) against DDP as the oracle, on gloo ranks.

Each oracle case builds the sharded model (on the meta device, materialised shard by shard), copies
its initial weights (gathered) into a plain model wrapped in DDP in the same processes, trains both
the same way and compares every parameter after the last step: within 1e-5 relative (max |a - b| /
max |a| over each tensor). The same run checks the traps: gradients averaged on gloo, the clipping
norm over the whole model, no reduce-scatter in accumulation micro-batches, the model-state bytes
each rank holds.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distlib.runner.gpt import GPT, GPTConfig
from tests.conftest import run_ranks

BOUND = 1e-5  # relative
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
STEPS = 3
BATCH = 2  # sequences per rank and micro-batch


def _gpt() -> GPT:
    """The tiny GPT (tied embeddings) with a frozen parameter (the position embedding) and a module
    the forward never calls (an unused parameter)."""
    model = GPT(CFG)
    model.wpe.weight.requires_grad_(False)
    model.unused = nn.Linear(CFG.n_embd, CFG.n_embd)
    return model


def _groups(model: nn.Module, wd: float) -> list[dict]:
    """Weight decay on matrices only (not on norms and biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": wd},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(_groups(model, 0.1), lr=1e-2, foreach=False)
    return torch.optim.SGD(_groups(model, 1e-2), lr=0.1, momentum=0.9, foreach=False)


@torch.no_grad()
def _load(model: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """The gathered parameters into a plain model (the tied matrix once: it stays tied)."""
    for n, p in model.named_parameters():
        p.copy_(params[n])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()


def _batch(rank: int, step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=g)


def _loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())


@contextlib.contextmanager
def _counting(counts: dict[str, int]):
    """Count reduce-scatters and all-reduces issued through torch.distributed (FSDP2 calls
    ``dist.reduce_scatter_single`` on torch 2.14, ``dist.reduce_scatter_tensor`` on older ones)."""
    saved = {}
    for name in ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce"):
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def counted(*a, _fn=fn, _name=name, **k):
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*a, **k)

        setattr(dist, name, counted)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _case(ctx, kind: str, accum: int, clip: float, accumulate: str = "unsharded") -> dict:
    from distlib.parallel.fsdp import FSDPSync, shard_model

    model = shard_model(_gpt, device="cpu")
    sync = FSDPSync(model, accumulate=accumulate)
    start = {n: p.full_tensor() for n, p in model.named_parameters()}
    ref = _gpt()
    _load(ref, start)
    ddp = DDP(ref, find_unused_parameters=True)
    opt, ref_opt = _optimizer(kind, model), _optimizer(kind, ref)
    out = {"tied": model.lm_head.weight is model.wte.weight, "no_sync_collectives": 0, "synced_reduce_scatters": 0}
    norms = []
    for step in range(STEPS):
        for k in range(accum):
            last = k == accum - 1
            counts: dict[str, int] = {}
            with _counting(counts), contextlib.nullcontext() if last else sync.no_sync():
                _loss(model, _batch(ctx.rank, step, k)).div(accum).backward()
            if last:
                out["synced_reduce_scatters"] += counts.get("reduce_scatter_single", 0) + counts.get(
                    "reduce_scatter_tensor", 0
                )
            else:
                out["no_sync_collectives"] += sum(counts.values())
                # nothing reduced yet: the sharded gradients are not there
                out["no_sync_grads"] = sum(p.grad is not None for p in model.parameters())
            with contextlib.nullcontext() if last else ddp.no_sync():
                _loss(ddp, _batch(ctx.rank, step, k)).div(accum).backward()
        sync.wait()
        if step == 0:  # averaged over the ranks, as DDP's (gloo: no silent sum)
            out["grad_diff"] = max(
                _rel(p.grad, model.get_parameter(n).grad.full_tensor())
                for n, p in ref.named_parameters()
                if p.grad is not None
            )
            out["grads_none"] = sorted(n for n, p in model.named_parameters() if p.grad is None)
        if clip:
            norms.append((sync.clip_grad_norm_(clip), torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    out["diff"] = max(_rel(p, model.get_parameter(n).full_tensor()) for n, p in ref.named_parameters())
    out["norm_diff"] = max((_rel(b, a) for a, b in norms), default=0.0)
    out["clipped"] = not clip or any(b.item() > clip for _, b in norms)
    # model state this rank holds: its 1/world of parameters, gradients and optimizer state
    _loss(model, _batch(ctx.rank, 9, 0)).backward()
    _loss(ddp, _batch(ctx.rank, 9, 0)).backward()
    full = sum(p.numel() * p.element_size() for p in ref.parameters())
    full += sum(p.grad.numel() * p.grad.element_size() for p in ref.parameters() if p.grad is not None)
    full += sum(v.numel() * v.element_size() for s in ref_opt.state.values() for v in s.values())
    out["state_bytes"] = sync.model_state_bytes(opt)
    out["formula_bytes"] = full / ctx.world_size
    del ddp  # drop the reference to the group before shutdown
    return out


def _oracle(ctx) -> dict:
    return {
        "adamw_accum2_clip": _case(ctx, "adamw", accum=2, clip=0.5),
        "sgd_momentum_clip": _case(ctx, "sgd", accum=1, clip=0.5),
        "sgd_accum2_sharded": _case(ctx, "sgd", accum=2, clip=0.0, accumulate="sharded"),
    }


@pytest.mark.parametrize("world", [1, 2, 4])
def test_full_sharding_matches_ddp(world):
    """AdamW and SGD with momentum, weight-decay groups, clipping, accumulation, unused and frozen
    parameters, tied embeddings: the same weights as DDP after 3 steps, 1e-5 relative; the traps."""
    for rank, res in enumerate(run_ranks(_oracle, world, timeout=240)):
        for name, r in res.items():
            print(f"world {world} rank {rank} | {name} | {r}")
            assert r["tied"], name
            assert r["diff"] <= BOUND, (name, r["diff"])
            assert r["grad_diff"] <= BOUND, (name, "gradients not averaged as DDP's", r["grad_diff"])
            assert r["grads_none"] == ["unused.bias", "unused.weight", "wpe.weight"], (name, r["grads_none"])
            assert r["norm_diff"] <= BOUND and r["clipped"], (name, "clipping norm", r["norm_diff"], r["clipped"])
            assert r["synced_reduce_scatters"] > 0 or world == 1, name
            if name.endswith("sharded"):  # every micro-batch reduce-scattered: the shards accumulate
                assert r["no_sync_collectives"] > 0 or world == 1, name
            elif "no_sync_grads" in r:
                assert r["no_sync_collectives"] == 0, (name, "collectives in no_sync micro-batches")
                assert r["no_sync_grads"] == 0, name
            assert abs(r["state_bytes"] / r["formula_bytes"] - 1) <= 0.01, (name, r["state_bytes"], r["formula_bytes"])


class _Buffered(nn.Module):
    """Blocks with a non-persistent buffer computed in the constructor and a persistent one."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.norm = nn.LayerNorm(8)
        self.register_buffer("mask", torch.tril(torch.ones(8, 8)) * 3.0, persistent=False)
        self.register_buffer("scale", torch.arange(8.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x @ self.mask) * self.scale
        return self.norm(x)


def _init_checks(ctx) -> dict:
    from distlib.parallel.fsdp import ShardingError, shard_model

    out: dict = {}
    # buffers keep their constructor values through meta init; default reset_parameters per module
    rng = torch.get_rng_state()
    model = shard_model(_Buffered, block_types=[nn.Linear], device="cpu")
    out["rng_kept"] = torch.equal(rng, torch.get_rng_state())
    out["mask"] = torch.equal(model.mask, torch.tril(torch.ones(8, 8)) * 3.0)
    out["scale"] = torch.equal(model.scale, torch.arange(8.0))
    out["norm_ones"] = torch.equal(model.norm.weight.full_tensor(), torch.ones(8))
    w = model.layers[0].weight.full_tensor()
    out["finite"] = bool(torch.isfinite(w).all()) and w.abs().max().item() <= 1 / 8**0.5 + 1e-6
    out["shards_differ"] = ctx.world_size == 1 or not torch.equal(w[:4], w[4:])
    # a GPT through its own reset_parameters: every rank gathers the same model
    gpt = shard_model(lambda: GPT(CFG), device="cpu")
    out["gpt"] = {n: p.full_tensor() for n, p in gpt.named_parameters()}
    out["gpt_ln_ones"] = torch.equal(gpt.blocks[0].ln_1.weight.full_tensor(), torch.ones(CFG.n_embd))
    out["gpt_std"] = gpt.wte.weight.full_tensor().std().item()
    # a model already built: rank 0's weights, whatever each rank built
    torch.manual_seed(ctx.rank)
    built = _Buffered()
    rank0 = [t.clone() for t in built.state_dict().values()]
    sharded = shard_model(built, blocks=list(built.layers), device="cpu")
    out["built"] = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in sharded.state_dict().items()}
    out["rank0_values"] = rank0
    errors = []
    for bad in (
        lambda: shard_model(_Buffered, blocks=[], block_types=[nn.Linear]),
        lambda: shard_model(_Buffered(), blocks=[nn.Linear(2, 2)]),
        lambda: shard_model(lambda: 3),
    ):
        try:
            bad()
        except ShardingError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_meta_init_buffers_and_same_weights(world):
    """Built on the meta device: buffers (a non-persistent one too) hold their constructor values,
    parameters their init (no garbage, no shard repeating another); every rank gathers the same
    model; a model passed built is rank 0's on every rank; the caller's random state is kept; bad
    arguments raise ShardingError."""
    res = run_ranks(_init_checks, world, timeout=240)
    for r in res:
        assert r["mask"] and r["scale"], "a buffer lost its constructor value"
        assert r["rng_kept"], "shard_model changed the caller's random state"
        assert r["norm_ones"] and r["finite"] and r["shards_differ"]
        assert r["gpt_ln_ones"] and 0.015 < r["gpt_std"] < 0.025, r["gpt_std"]
        assert len(r["errors"]) == 3, r["errors"]
        for n, t in r["gpt"].items():
            assert torch.equal(t, res[0]["gpt"][n]), n
        for t, want in zip(r["built"].values(), res[0]["rank0_values"]):
            assert torch.equal(t, want)


def _capture_refused(ctx) -> list[str]:
    from distlib import CapturedStep, CaptureUnsupported
    from distlib.parallel.fsdp import FSDPSync, ShardingError, shard_model

    model = shard_model(lambda: GPT(CFG), device="cpu")
    opt = torch.optim.AdamW(model.parameters(), fused=False, capturable=True)
    out = []
    try:
        CapturedStep(model, opt, lambda x: _loss(model, x), FSDPSync(model))
    except CaptureUnsupported as e:
        out.append(str(e))
    try:
        FSDPSync(nn.Linear(2, 2))
    except ShardingError as e:
        out.append(str(e))
    try:
        FSDPSync(model).join()
    except ShardingError as e:
        out.append(str(e))
    return out


def test_captured_step_refuses_a_sharded_model():
    """FSDP2 has no CUDA-graph support: CapturedStep says so, naming the cause; FSDPSync needs a sharded
    model and has no join()."""
    (msgs,) = run_ranks(_capture_refused, 1)
    assert len(msgs) == 3, msgs
    assert "fully_shard" in msgs[0] and "cuda_graph=false" in msgs[0], msgs[0]
    assert "shard_model" in msgs[1], msgs[1]


def _on_gpus(ctx) -> dict:
    """bf16 mixed precision (fp32 reduce) on NCCL against DDP under bf16 autocast: close, not equal
    (FSDP2 also runs the norms and the logits in bf16). SGD: updates proportional to the gradients."""
    from distlib.parallel.fsdp import FSDPSync, shard_model

    torch.backends.cuda.matmul.allow_tf32 = False
    model = shard_model(_gpt, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    sync = FSDPSync(model)
    start = {n: p.full_tensor() for n, p in model.named_parameters()}
    ref = _gpt().to(ctx.device)
    _load(ref, start)
    ddp = DDP(ref, device_ids=[ctx.device.index], find_unused_parameters=True)
    opt, ref_opt = _optimizer("sgd", model), _optimizer("sgd", ref)
    losses = []
    for step in range(STEPS):
        idx = _batch(ctx.rank, step, 0).to(ctx.device)
        loss = _loss(model, idx)
        loss.backward()
        sync.wait()
        norm = sync.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref_loss = _loss(ddp, idx)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((loss.item(), ref_loss.item(), norm.item(), ref_norm.item()))
    diff = max(_rel(p, model.get_parameter(n).full_tensor()) for n, p in ref.named_parameters())
    dtype = str(model.wte.weight.dtype)
    del ddp
    return {"losses": losses, "diff": diff, "dtype": dtype}


@pytest.mark.gpus(1)
def test_full_sharding_one_gpu_bf16():
    """World size 1 on a GPU is FSDP2's own path too (a one-rank group): bf16 compute, fp32 master weights."""
    _check_gpu(run_ranks(_on_gpus, 1, backend="nccl", timeout=300))


@pytest.mark.gpus(2)
def test_full_sharding_two_gpus_nccl_bf16():
    """NCCL + bf16 mixed precision on 2 GPUs: losses and clipping norms within bf16 rounding of DDP's."""
    _check_gpu(run_ranks(_on_gpus, 2, backend="nccl", timeout=300))


def _check_gpu(results: list[dict]) -> None:
    for r in results:
        print(r)
        assert r["dtype"] == "torch.float32", "sharded master weights must stay fp32"
        for loss, ref_loss, norm, ref_norm in r["losses"]:
            assert abs(loss - ref_loss) <= 2e-2 * abs(ref_loss), (loss, ref_loss)
            assert abs(norm - ref_norm) <= 5e-2 * ref_norm, (norm, ref_norm)
        assert r["diff"] <= 1e-2, r["diff"]
