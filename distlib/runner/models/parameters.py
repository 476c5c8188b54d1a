"""What the trainer asks of any model's parameters: how many there are, and which take weight decay."""

from __future__ import annotations

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on conv and linear weights only: not on norm weights, biases or embeddings
    (a weight tied to an embedding, like GPT's output layer, counts as the embedding)."""
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    params = [p for p in model.parameters() if p.requires_grad]  # each shared parameter once
    decay = [p for p in params if p.ndim > 1 and id(p) not in embedding]
    no_decay = [p for p in params if p.ndim <= 1 or id(p) in embedding]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@torch.no_grad()
def cast_frozen(model: nn.Module, dtype: torch.dtype | None) -> int:
    """The floating-point parameters that do not train (``requires_grad=False``: a LoRA model's base)
    turned to ``dtype`` in place, new parameters under the same names (on the meta device too): a
    frozen weight needs no fp32 master copy, the recipe's compute precision is all it is used in.
    None (fp32 training, or bf16 on a CPU) leaves them. Returns the number of parameters cast."""
    if dtype is None:
        return 0
    done: dict[int, nn.Parameter] = {}  # a tied parameter once, the same new one in each place
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is None or p.requires_grad or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
            m._parameters[name] = done[id(p)]
    return len(done)


__all__ = ["cast_frozen", "count_params", "count_trainable", "param_groups"]
