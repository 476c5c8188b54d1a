"""A decoder-only transformer (GPT-2's layout), readable top to bottom.

Pre-norm blocks of causal self-attention (``scaled_dot_product_attention``: flash attention on
GPUs) and a 4x GELU MLP, learned position embeddings, the output layer tied to the token
embedding. GPT-2 small is ``GPTConfig(n_layer=12, n_head=12, n_embd=768)``; vocabulary 256 for
bytes, 50304 (GPT-2's 50257 padded to a multiple of 64) for GPT-2 tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 256  # bytes
    block_size: int = 256  # the longest sequence (positions)
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = False  # biases in the linear layers and LayerNorms (GPT-2 has them; faster without)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} must be a multiple of n_head={cfg.n_head}")
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return F.dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)), self.dropout, self.training)

    def forward_cached(self, x: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
        """``forward`` for the tokens at positions ``cache.length`` on, their keys and values kept in
        ``cache``: a prefill (from position 0, causal), or one new token, which attends to the whole
        buffer with the positions not yet written masked out: every decode step has the same shapes
        (no kernel plan or compilation per sequence length)."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        start = cache.length
        k, v = cache.append(layer, k, v)
        drop = self.dropout if self.training else 0.0
        if start == 0:
            y = F.scaled_dot_product_attention(q, k[:, :, :t], v[:, :, :t], dropout_p=drop, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.mask(start + 1), dropout_p=drop)
        return F.dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(F.gelu(self.fc(x))), self.dropout, self.training)


class Block(nn.Module):
    """One transformer layer; the unit that sharding wraps (``fully_shard`` per block)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def forward_cached(self, x: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
        x = x + self.attn.forward_cached(self.ln_1(x), cache, layer)
        return x + self.mlp(self.ln_2(x))


class KVCache:
    """The keys and values of every layer for the positions decoded so far, in buffers of
    ``block_size`` positions (allocated zeroed at the first write, in the dtype the layers compute in:
    a masked-out position must hold no NaN that an additive mask would carry into the softmax)."""

    def __init__(self, n_layer: int, block_size: int):
        self.block_size = block_size
        self.length = 0  # positions held
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer
        self._positions: torch.Tensor | None = None

    def mask(self, length: int) -> torch.Tensor:
        """(1, 1, 1, block_size): True at the first ``length`` positions, those a new token attends to."""
        if self._positions is None:
            self._positions = torch.arange(self.block_size, device=self.keys[0].device)
        return (self._positions < length).view(1, 1, 1, -1)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` (batch, heads, new positions, head size) after the held positions of
        ``layer``; returns the layer's whole buffers (``block_size`` positions, those after the held
        and new ones zero). The last layer's call advances ``length``."""
        start, t = self.length, k.shape[2]
        if start and t > 1:
            raise ValueError("KVCache: several new positions after the first call (only a prefill may add many)")
        if start + t > self.block_size:
            raise ValueError(f"KVCache: {start + t} positions, more than block_size={self.block_size}")
        if self.keys[layer] is None:
            shape = (k.shape[0], k.shape[1], self.block_size, k.shape[3])
            self.keys[layer] = k.new_zeros(shape)
            self.values[layer] = v.new_zeros(shape)
        keys, values = self.keys[layer], self.values[layer]
        keys[:, :, start : start + t] = k
        values[:, :, start : start + t] = v
        if layer == len(self.keys) - 1:
            self.length = start + t
        return keys, values


class GPT(nn.Module):
    """``logits = model(idx)``: idx is (batch, time) token ids, logits (batch, time, vocab)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.reset_parameters()

    def tie_weights(self) -> None:
        """One matrix embeds tokens and scores them. Again after ``to_empty()`` (meta-device
        construction), which gives each module its own copy of a shared parameter."""
        self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2's initialisation: normal(0, 0.02), the residual projections scaled down by
        sqrt(2 * n_layer), zero biases, unit LayerNorms. Also what a model built on the meta
        device runs once its storage exists."""
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.cfg.n_layer))
            elif p.ndim >= 2:
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith("weight"):  # LayerNorm
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)

    takes_head = True  # forward(idx, head=): the output layer applied by the loss (runner/tasks/chunked_loss.py)

    def forward(self, idx: torch.Tensor, head: Callable[[torch.Tensor, nn.Module], Any] | None = None) -> Any:
        """The logits of ``idx``; with ``head``, ``head(hidden states, lm_head)`` in their place (a loss
        that applies the output layer itself, chunk by chunk, inside this forward)."""
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"a sequence of {t} tokens is longer than block_size={self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x) if head is None else head(x, self.lm_head)

    def forward_cached(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The logits of ``idx``, the tokens at positions ``cache.length`` on, the earlier ones' keys
        and values read from ``cache`` (and these added to it). Eager on purpose, beside ``forward``:
        it is what ``generate`` runs, never through a compiled ``__call__`` (a sequence that grows by
        one token a step would recompile it at every length)."""
        start, t = cache.length, idx.shape[1]
        pos = torch.arange(start, start + t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for i, block in enumerate(self.blocks):
            x = block.forward_cached(x, cache, i)
        return self.lm_head(self.ln_f(x))

    def num_params(self, embeddings: bool = True) -> int:
        """Parameters, the tied matrix counted once; without the position embedding if not ``embeddings``."""
        n = sum(p.numel() for p in self.parameters())
        return n if embeddings else n - self.wpe.weight.numel()

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward and backward): 6 per weight of the matrix products and
        12 * n_layer * n_embd * seq_len for attention (PaLM's appendix B, as nanoGPT counts MFU)."""
        return 6 * self.num_params(embeddings=False) + 12 * self.cfg.n_layer * self.cfg.n_embd * seq_len

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None, kv_cache: bool = True) -> torch.Tensor:  # fmt: skip
        """Append ``new_tokens`` sampled tokens to ``idx`` (batch, time), the last block_size as context;
        ``temperature`` 0: the most likely token (greedy). ``kv_cache``: each step runs the new token
        only, with the keys and values of the earlier ones kept (``KVCache``), until the sequence
        outgrows block_size: from then on the window of the last block_size tokens moves every step
        and each step runs it whole, as without the cache (learned positions: every token's position
        changes). A model sharded by FSDP2 always runs whole windows, through its forward hooks."""
        block = self.cfg.block_size
        sharded = any(type(p).__name__ == "DTensor" for p in self.parameters())
        cache = None
        for _ in range(new_tokens):
            if not kv_cache or sharded:
                logits = self(idx[:, -block:])
            elif cache is None or cache.length == block:  # the first step, or the window moved: fill it anew
                cache = KVCache(self.cfg.n_layer, block)
                logits = self.forward_cached(idx[:, -block:], cache)
            else:
                logits = self.forward_cached(idx[:, -1:], cache)
            logits = logits[:, -1, :].float()
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def gpt(
    vocab_size: int = 256,
    block_size: int = 256,
    n_layer: int = 6,
    n_head: int = 6,
    n_embd: int = 384,
    dropout: float = 0.0,
    bias: bool = False,
) -> nn.Module:
    """The recipes' ``model.name: gpt`` (GPT-2 small: n_layer=12, n_head=12, n_embd=768)."""
    return GPT(GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias))
