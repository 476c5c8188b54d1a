"""A model's repeated blocks: the unit that per-block compile, activation checkpointing and full
sharding (``fully_shard`` per block) work on.

Transformers are a stack of identical layers; working per layer gives one compiled graph that every
layer reuses (dynamo traces it once), one recomputation region per layer, and one all-gather per
layer. ``find_blocks`` is the one place that decides what a model's blocks are.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["find_blocks"]

BlockClass = type | str | Iterable[type | str]


def _matcher(block_class: BlockClass):
    if isinstance(block_class, (type, str)):
        items = [block_class]
    elif isinstance(block_class, Iterable):
        items = list(block_class)
    else:
        items = [block_class]
    types = tuple(c for c in items if isinstance(c, type))
    # a name matches any class in the module's MRO: FSDP2 and activation checkpointing swap a block's
    # class for a subclass of it, and Hugging Face models list their layers by class name
    # (``_no_split_modules``)
    names = {c.rsplit(":", 1)[-1].rsplit(".", 1)[-1] for c in items if isinstance(c, str)}
    bad = [c for c in items if not isinstance(c, (type, str))]
    if bad or not items:
        raise TypeError(f"block_class: expected classes or class names, got {block_class!r}")

    def match(m: nn.Module) -> bool:
        return isinstance(m, types) or any(c.__name__ in names for c in type(m).__mro__)

    return match


def find_blocks(model: nn.Module, block_class: BlockClass | None = None) -> list[nn.Module]:
    """The model's blocks, in registration order; ``[]`` when it has none.

    ``block_class``: a class, a class name (``"Block"``, or ``"package.module:Block"``: the name
    after the last ``:`` or ``.`` counts), or several: every submodule of one of them, the outermost
    only (a match inside a match is part of that block). ``None``: the entries of ``model.blocks``
    when it is an ``nn.ModuleList`` or ``nn.Sequential`` (the built-in GPT and most transformer
    layouts).
    """
    if block_class is None:
        found = getattr(model, "blocks", None)
        return list(found) if isinstance(found, (nn.ModuleList, nn.Sequential)) else []
    match = _matcher(block_class)
    out: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():  # parents before their children
        if m is model or id(m) in inside:
            continue
        if match(m):
            out.append(m)
            inside.update(id(c) for c in m.modules())
    return out
