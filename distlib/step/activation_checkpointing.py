"""Activation checkpointing per block: keep less of the forward for backward, recompute the rest.

``checkpoint_blocks(blocks, "full")`` keeps only each block's input and recomputes the whole block
during backward (``torch.utils.checkpoint`` without reentrancy); ``"selective"`` keeps what is
expensive to recompute and cheap to keep, as torchtitan's op-level policy: the outputs of the
attention kernels and of every other matrix product, and recomputes the rest (normalisations,
activations, the other matrix products). Memory: full keeps one tensor per block; selective keeps
about half of a block's matmul outputs and its attention outputs; none keeps everything.

The block stays where it is (its class is swapped for a subclass whose ``forward`` checkpoints,
as FSDP2's ``fully_shard`` does): parameter names, ``state_dict`` and ``isinstance`` are unchanged,
so checkpoints, optimizers and GradSync see the same model. It composes with ``compile_blocks``
(dynamo traces the checkpoint as one region), GradSync, ``shard_model`` and ``CapturedStep``.
Outside autograd (``torch.no_grad()``: evaluation, generation) a block runs plainly.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["checkpoint_blocks", "checkpointing_of"]

Mode = Literal["full", "selective"]

_aten = torch.ops.aten
_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default}
# kept in selective mode: attention (its recomputation costs as much as its forward) and the
# matmuls (every other one; torchtitan's default op-level policy)
_ATTENTION = {
    getattr(_aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(_aten, name)
}


def _selective_contexts():
    """A fresh policy for each checkpointed call: it counts the matmuls of that forward (and of its
    recomputation, separately) and keeps the odd-numbered ones."""
    counts: collections.Counter[str] = collections.Counter()

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in _MATMULS:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            keep = counts[key] % 2 == 1
        else:
            keep = func in _ATTENTION
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class _Checkpointed:
    """Mixed in front of a block's class: its forward, checkpointed."""

    _distlib_checkpointing: Mode

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = super().forward  # type: ignore[misc]
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        if self._distlib_checkpointing == "selective":
            return checkpoint(inner, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)


@functools.cache
def _checkpointed_class(cls: type) -> type:
    return type(f"Checkpointed{cls.__name__}", (_Checkpointed, cls), {"__module__": cls.__module__})


def checkpoint_blocks(blocks: Iterable[nn.Module], mode: Mode) -> int:
    """Checkpoint each block's activations (``mode``: ``"full"`` or ``"selective"``, see the module's
    docstring), in place. Apply it before ``compile_blocks``; with ``shard_model``, to its result's
    blocks. Returns the number of blocks changed; a block already checkpointed takes the new mode."""
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode must be 'full' or 'selective', got {mode!r}")
    n = 0
    for block in blocks:
        if not isinstance(block, nn.Module):
            raise TypeError(f"checkpoint_blocks needs nn.Modules, got {type(block).__name__}")
        if getattr(block, "_compiled_call_impl", None) is not None:
            raise ValueError("checkpoint_blocks: a block is compiled already; checkpoint first, then compile")
        if not isinstance(block, _Checkpointed):
            block.__class__ = _checkpointed_class(type(block))
        block._distlib_checkpointing = mode
        n += 1
    return n


def checkpointing_of(module: nn.Module) -> str:
    """``"full"``, ``"selective"`` or ``"none"``: how ``module`` checkpoints its activations."""
    return module._distlib_checkpointing if isinstance(module, _Checkpointed) else "none"
