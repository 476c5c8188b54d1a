"""A batch's inputs as the step, the trainer and the evaluation handle them: a tensor, or a mapping
of tensors (a chat batch's ``input_ids`` and ``position_ids``), which the model is called with as
keyword arguments (``model(**x)``). Micro-batches slice every tensor along dim 0; moving to the
device moves every value."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

Inputs = torch.Tensor | Mapping[str, torch.Tensor]


def to_device(x: Inputs, device: torch.device) -> Inputs:
    """``x`` (each of its values) on ``device``, copied asynchronously from pinned memory."""
    if isinstance(x, Mapping):
        return {k: v.to(device, non_blocking=True) for k, v in x.items()}
    return x.to(device, non_blocking=True)


def rows(x: Inputs) -> int:
    """The batch size: dim 0 of the tensor, or of the mapping's first value."""
    return next(iter(x.values())).shape[0] if isinstance(x, Mapping) else x.shape[0]


def micro_batch(x: Inputs, k: int, n: int) -> Inputs:
    """The ``k``-th of ``n`` equal slices of ``x`` along dim 0 (every value of a mapping)."""
    m = rows(x) // n
    if isinstance(x, Mapping):
        return {key: v[k * m : (k + 1) * m] for key, v in x.items()}
    return x[k * m : (k + 1) * m]


def call_model(model: nn.Module, x: Inputs, **kwargs: Any) -> Any:
    """``model(**x)`` for a mapping, ``model(x)`` for a tensor."""
    return model(**x, **kwargs) if isinstance(x, Mapping) else model(x, **kwargs)


def flatten(x: Inputs) -> tuple[list[torch.Tensor], list[str] | None]:
    """``x``'s tensors in a list, and the keys that ``unflatten`` puts them back under (None: a tensor)."""
    if isinstance(x, Mapping):
        return list(x.values()), list(x.keys())
    return [x], None


def unflatten(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], keys: list[str] | None) -> Inputs:
    return dict(zip(keys, tensors)) if keys is not None else tensors[0]
