"""The tensor names of a Hugging Face folder against the model's own: transformers' conversion of
checkpoint names, as ``from_pretrained`` applies it.

transformers 5 keeps, per model family, the transforms from the names its checkpoints carry to
the model's (``conversion_mapping.get_model_conversion_mapping``): renamings (GPT-NeoX's
``embed_out`` is ``lm_head``; Mixtral's ``block_sparse_moe`` is ``mlp``) and conversions of several
tensors into one (each expert's ``w1`` and ``w3`` stacked into the fused ``experts.gate_up_proj``).
``save_pretrained`` writes the original names by default, so a folder has either. ``plan`` maps a
folder's names with those transforms (``core_model_loading.rename_source_key``, the function
``from_pretrained`` calls): a renamed tensor is read as it is stored, under its new name; the
tensors of a conversion are read whole and converted by transformers' own operations
(``WeightConverter.convert``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class Conversion:
    """Tensors of a folder (``sources``: file name, transformers' pattern it matched) that
    transformers converts into the model's ``target`` (and any other tensors the conversion makes)."""

    target: str
    converter: Any  # transformers' WeightConverter, this target's own copy
    sources: list[tuple[str, str]] = field(default_factory=list)

    def convert(self, model: nn.Module, read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Model name -> tensor: ``read(name)`` gives each source tensor whole."""
        for name, pattern in self.sources:
            self.converter.add_tensor(self.target, name, pattern, read(name))
        out = self.converter.convert(self.target, model=model, config=getattr(model, "config", None))
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}


@dataclass
class Plan:
    """How a folder's tensors fill a model: ``renamed`` (model name -> the name in the folder, the
    same or transformers' renaming), ``conversions`` (several tensors into one), ``unknown`` (names
    that are none of the model's)."""

    renamed: dict[str, str]
    conversions: list[Conversion]
    unknown: list[str]


def plan(model: nn.Module, names: Iterable[str]) -> Plan:
    """The folder's ``names`` against ``model``'s state dict, through transformers' conversion
    mapping of its family when it is a transformers model (``from_pretrained``'s renaming: its
    base-model prefix added or dropped too); names taken as they are otherwise."""
    targets = dict.fromkeys(model.state_dict(), True)  # transformers asks .get(name) is not None
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    except ImportError:
        transforms = None
    else:
        transforms = get_model_conversion_mapping(model) if isinstance(model, PreTrainedModel) else None
    if transforms is None:
        return Plan({n: n for n in names if n in targets}, [], sorted(n for n in names if n not in targets))
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None)
    renamed: dict[str, str] = {}
    conversions: dict[str, Conversion] = {}
    unknown: list[str] = []
    for name in sorted(names, key=dot_natural_key):  # experts in their order, as from_pretrained collects them
        new, pattern = rename_source_key(name, renamings, converters, prefix, targets)
        if new not in targets and name in targets:  # already the model's name
            new, pattern = name, None
        if new not in targets:
            unknown.append(name)
        elif pattern is None:
            renamed[new] = name
        else:
            conversion = conversions.get(new)
            if conversion is None:
                conversion = conversions[new] = Conversion(new, copy.deepcopy(by_pattern[pattern]))
            conversion.sources.append((name, pattern))
    return Plan(renamed, list(conversions.values()), unknown)


__all__ = ["Conversion", "Plan", "plan"]
