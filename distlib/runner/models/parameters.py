"""What the trainer asks of any model's parameters: how many there are, and which take weight decay."""

from __future__ import annotations

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


__all__ = ["count_params", "param_groups"]
