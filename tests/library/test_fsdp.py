"""Full sharding (``shard_model`` + ``FSDPSync``) against DDP as the oracle, on gloo ranks.

Each oracle case builds the sharded model with ``shard_model(builder)``, copies its initial weights
(gathered) into a plain model wrapped in DDP in the same processes, trains both the same way and
compares every parameter after the last step: within 1e-5 relative (max |a - b| / max |a| over each
tensor). That tests the step alone; the build is tested by the same cases with DDP over the plain
build (the builder called under the same seed, no weights copied) and by the comparison of the
weights and the random state after ``shard_model`` with a plain build's at 1, 2 and 3 ranks. The
same run checks the traps: gradients averaged on gloo, the clipping norm over the whole model, no
reduce-scatter in accumulation micro-batches, the model-state bytes each rank holds.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distlib.runner.models.gpt import GPT, GPTConfig
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


def _case(ctx, kind: str, accum: int, clip: float, accumulate: str = "unsharded", plain: bool = False) -> dict:
    """``plain``: the DDP model is built on its own (``torch.manual_seed(seed); _gpt()``, as a
    replicated script does) rather than given the sharded model's initial weights, so that
    ``shard_model``'s own build is under test too, not only the step."""
    from distlib.parallel.fsdp import FSDPSync, shard_model

    torch.manual_seed(1234)
    model = shard_model(_gpt, device="cpu")
    sync = FSDPSync(model, accumulate=accumulate)
    if plain:
        torch.manual_seed(1234)
        ref = _gpt()
    else:
        start = {n: p.full_tensor() for n, p in model.named_parameters()}
        ref = _gpt()
        _load(ref, start)
    ddp = DDP(ref, find_unused_parameters=True)
    opt, ref_opt = _optimizer(kind, model), _optimizer(kind, ref)
    out = {"tied": model.lm_head.weight is model.wte.weight, "no_sync_collectives": 0, "synced_reduce_scatters": 0}
    norms, losses = [], []
    for step in range(STEPS):
        losses.append([0.0, 0.0])
        for k in range(accum):
            last = k == accum - 1
            counts: dict[str, int] = {}
            with _counting(counts), contextlib.nullcontext() if last else sync.no_sync():
                loss = _loss(model, _batch(ctx.rank, step, k)).div(accum)
                loss.backward()
            losses[-1][0] += loss.item()
            if last:
                out["synced_reduce_scatters"] += counts.get("reduce_scatter_single", 0) + counts.get(
                    "reduce_scatter_tensor", 0
                )
            else:
                out["no_sync_collectives"] += sum(counts.values())
                # nothing reduced yet: the sharded gradients are not there
                out["no_sync_grads"] = sum(p.grad is not None for p in model.parameters())
            with contextlib.nullcontext() if last else ddp.no_sync():
                ref_loss = _loss(ddp, _batch(ctx.rank, step, k)).div(accum)
                ref_loss.backward()
            losses[-1][1] += ref_loss.item()
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
    out["loss_diff"] = max(abs(a - b) / abs(b) for a, b in losses)
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
            assert r["loss_diff"] <= BOUND, (name, r["loss_diff"])
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


def _plain_oracle(ctx) -> dict:
    return {
        "adamw_accum2_clip": _case(ctx, "adamw", accum=2, clip=0.5, plain=True),
        "sgd_momentum": _case(ctx, "sgd", accum=1, clip=0.0, plain=True),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_shard_model_of_a_builder_trains_as_ddp_over_the_plain_build(world):
    """``shard_model(builder)`` against DDP over the same builder called plainly under the same seed,
    each model built on its own (the oracle above gives DDP the sharded model's weights, which tests
    the step but not the build): every step's loss and the weights after the last within 1e-5
    relative (AdamW's weights within 3e-5: it divides each gradient by its own running magnitude, so
    the rounding of a differently ordered sum in a near-zero component reaches the weight almost
    whole), at 2 and 3 ranks (3: every parameter split unevenly, FSDP2's padded shards)."""
    for rank, res in enumerate(run_ranks(_plain_oracle, world, timeout=240)):
        for name, r in res.items():
            print(f"world {world} rank {rank} | {name} | loss {r['loss_diff']:.2e} weights {r['diff']:.2e}")
            assert r["loss_diff"] <= BOUND, (name, "losses", r["loss_diff"])
            assert r["diff"] <= (3 * BOUND if name.startswith("adamw") else BOUND), (name, "weights", r["diff"])
            assert r["clipped"], name


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


class _RootReset(_Buffered):
    """torch's FSDP2 example's trap: the root's ``reset_parameters()`` does not reach its layers."""

    def reset_parameters(self) -> None:
        self.norm.reset_parameters()


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.full_tensor() if hasattr(t, "full_tensor") else t.clone() for n, t in model.state_dict().items()}


def _init_checks(ctx) -> dict:
    from distlib.parallel.fsdp import ShardingError, shard_model

    out: dict = {}
    # a builder: the weights, buffers and random state after it of a plain build under the same stream
    torch.manual_seed(5)
    model = shard_model(_Buffered, block_types=[nn.Linear], device="cpu")
    out["buffered"], out["buffered_rng"] = _whole(model), torch.get_rng_state()
    out["mask"] = torch.equal(model.mask, torch.tril(torch.ones(8, 8)) * 3.0)
    out["scale"] = torch.equal(model.scale, torch.arange(8.0))
    # seed=: torch.manual_seed(seed) first; a GPT through its own initialisation
    torch.manual_seed(99)
    gpt = shard_model(lambda: GPT(CFG), device="cpu", seed=0)
    out["gpt"], out["gpt_rng"] = _whole(gpt), torch.get_rng_state()

    # init=: the parameters on the meta device, made whole, init(model) on the whole (unsharded)
    # tensors; the buffers keep their constructor values
    def init(m: nn.Module) -> None:
        for layer in m.layers:
            layer.weight.copy_(torch.arange(64.0).view(8, 8))
            layer.bias.zero_()
        m.norm.reset_parameters()

    inited = shard_model(_Buffered, block_types=[nn.Linear], device="cpu", init=init)
    out["init_whole"] = torch.equal(inited.layers[1].weight.full_tensor(), torch.arange(64.0).view(8, 8))
    out["init_buffers"] = torch.equal(inited.mask, torch.tril(torch.ones(8, 8)) * 3.0)
    # a model passed built: rank 0's weights, whatever each rank built
    torch.manual_seed(ctx.rank)
    built = _Buffered()
    rank0 = [t.clone() for t in built.state_dict().values()]
    sharded = shard_model(built, blocks=list(built.layers), device="cpu")
    out["built"] = list(_whole(sharded).values())
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

    # left uninitialised: named, on every rank alike
    def partial(m: nn.Module) -> None:  # forgets the norm
        for layer in m.layers:
            layer.reset_parameters()

    with torch.device("meta"):
        meta = _RootReset()
    uninitialised = []
    for bad in (
        lambda: shard_model(_Buffered, block_types=[nn.Linear], device="cpu", init=partial),
        lambda: shard_model(meta, block_types=[nn.Linear], device="cpu"),
    ):
        try:
            bad()
            uninitialised.append("")
        except ShardingError as e:
            uninitialised.append(str(e))
    out["uninitialised"] = uninitialised
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shard_model_builds_the_plain_builds_weights_at_every_world_size(world):
    """A builder gives the weights and buffers of the same builder called plainly under the same
    random stream (``seed=``: after ``torch.manual_seed(seed)``), and leaves the random state where
    the plain build does; buffers (a non-persistent one too) hold their constructor values;
    ``init=`` runs on the whole tensors; a model passed built is rank 0's on every rank; what an
    init leaves uninitialised (a forgotten layer, a root ``reset_parameters()`` that does not reach
    the layers, a buffer made on the meta device) is a ShardingError naming it; bad arguments raise
    ShardingError."""
    torch.manual_seed(5)
    plain, plain_rng = _Buffered().state_dict(), torch.get_rng_state()
    torch.manual_seed(0)
    plain_gpt, plain_gpt_rng = GPT(CFG).state_dict(), torch.get_rng_state()
    res = run_ranks(_init_checks, world, timeout=240)
    for r in res:
        assert r["mask"] and r["scale"], "a buffer lost its constructor value"
        assert r["init_whole"] and r["init_buffers"]
        for got, want in ((r["buffered"], plain), (r["gpt"], plain_gpt)):
            assert got.keys() == want.keys()
            for n, t in want.items():
                assert torch.equal(got[n], t), n
        assert torch.equal(r["buffered_rng"], plain_rng), "the random state after shard_model is not a plain build's"
        assert torch.equal(r["gpt_rng"], plain_gpt_rng), "the random state after shard_model(seed=0)"
        assert len(r["errors"]) == 3, r["errors"]
        for t, want in zip(r["built"], res[0]["rank0_values"]):
            assert torch.equal(t, want)
        forgot, root = r["uninitialised"]
        assert "init(model) left 2 tensor(s)" in forgot and "norm.weight, norm.bias" in forgot, forgot
        assert "_RootReset's reset_parameters() left 6 tensor(s)" in root, root
        for name in ("layers.0.weight", "layers.1.bias", "mask", "scale"):
            assert name in root, (name, root)
        assert "norm.weight" not in root and "init=" in root, root


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
    (FSDP2 also runs the norms and the logits in bf16). SGD: updates proportional to the gradients.
    Each model built on its own from the same seed, on the GPU."""
    from distlib.parallel.fsdp import FSDPSync, shard_model

    torch.backends.cuda.matmul.allow_tf32 = False
    model = shard_model(_gpt, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, seed=0)
    sync = FSDPSync(model)
    torch.manual_seed(0)
    with torch.device(ctx.device):  # built on the GPU, as shard_model builds: the same weights
        ref = _gpt()
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
