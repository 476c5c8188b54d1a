"""docs/from_ddp.md's sharded idioms, checked on two public scripts' patterns at 2 gloo ranks.

- A GPT trainer with DDP and torch's ``ZeroRedundancyOptimizer`` (nanoGPT's loop: AdamW with
  weight-decay groups, gradient accumulation through ``require_backward_grad_sync``, torch's
  global-norm clipping) against its port to ``GradSync(shard="optimizer")`` +
  ``sync.sharded_optimizer`` + ``sync.clip_grad_norm_``, saved and resumed halfway with
  ``ShardedCheckpointer``.
- torch's FSDP2 example loop (``fully_shard`` per block then the root, Adam) with torch's clipping,
  against its port to ``distlib.shard_model`` + ``FSDPSync``, saved and resumed halfway.

The ports follow the page's idioms literally; each step's loss equals the original's (relative difference <= 1e-6).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import distlib
from tests.conftest import run_ranks

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 32, 8, 16, 2, 2
STEPS, SAVE_AT, ACCUM = 4, 2, 2
BOUND = 1e-6  # relative: a few fp32 ulps at a loss of 10 (the summation order of gloo's reductions)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, WIDTH)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A GPT as the public trainers write it: token and position embeddings, blocks, tied head."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    data = torch.randint(VOCAB, (2, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _groups(model: nn.Module) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


# ---- DDP + ZeroRedundancyOptimizer ---------------------------------------------------------------
def _zero_original(rank: int) -> list[float]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = GPT()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddp = DDP(model)
    opt = ZeroRedundancyOptimizer(_groups(model), optimizer_class=torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95))
    losses = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            ddp.require_backward_grad_sync = micro == ACCUM - 1
            _, loss = ddp(*_batch(rank, step, micro))
            (loss / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _zero_port(rank: int, directory: str) -> list[float]:
    def build():
        torch.manual_seed(0)
        model = GPT()
        sync = distlib.GradSync(model, shard="optimizer")
        opt = sync.sharded_optimizer(torch.optim.AdamW, _groups(model), lr=1e-2, betas=(0.9, 0.95))
        return model, sync, opt

    model, sync, opt = build()
    ck = distlib.ShardedCheckpointer(directory)
    losses = []
    for step in range(STEPS):
        if step == SAVE_AT:  # a new process would do this: build, then resume
            ck.save(step, {"model": model, "optimizer": opt})
            model, sync, opt = build()
            assert ck.resume({"model": model, "optimizer": opt}) == step
        for micro in range(ACCUM):
            sync.require_backward_grad_sync = micro == ACCUM - 1
            _, loss = model(*_batch(rank, step, micro))
            (loss / ACCUM).backward()
        sync.wait()
        sync.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    ck.close()
    return losses


def _zero_case(ctx, directory: str) -> tuple[list[float], list[float]]:
    return _zero_original(ctx.rank), _zero_port(ctx.rank, directory)


def test_zero_redundancy_gpt_loop_ported_to_optimizer_sharding(tmp_path):
    for original, port in run_ranks(_zero_case, 2, str(tmp_path)):
        assert max(abs(a - b) / abs(a) for a, b in zip(original, port, strict=True)) <= BOUND, (original, port)


# ---- torch's FSDP2 example --------------------------------------------------------------------
def _fsdp2_original(rank: int) -> list[float]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        _, loss = model(*_batch(rank, step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _fsdp2_port(rank: int, directory: str) -> list[float]:
    def build():
        torch.manual_seed(0)
        model = distlib.shard_model(GPT)  # built as the original builds it, then sharded
        return model, distlib.FSDPSync(model), torch.optim.Adam(model.parameters(), lr=1e-2)

    model, sync, opt = build()
    ck = distlib.ShardedCheckpointer(directory)
    losses = []
    for step in range(STEPS):
        if step == SAVE_AT:
            ck.save(step, {"model": model, "optimizer": opt})
            model, sync, opt = build()
            assert ck.resume({"model": model, "optimizer": opt}) == step
        _, loss = model(*_batch(rank, step))
        loss.backward()
        sync.wait()
        sync.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    ck.close()
    return losses


def _fsdp2_case(ctx, directory: str) -> tuple[list[float], list[float]]:
    return _fsdp2_original(ctx.rank), _fsdp2_port(ctx.rank, directory)


def test_fsdp2_example_loop_ported_to_shard_model(tmp_path):
    for original, port in run_ranks(_fsdp2_case, 2, str(tmp_path)):
        assert max(abs(a - b) / abs(a) for a, b in zip(original, port, strict=True)) <= BOUND, (original, port)
