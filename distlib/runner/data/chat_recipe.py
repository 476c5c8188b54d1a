"""What ``data.name: chat`` needs of the rest of a recipe, checked before any rank starts (the
config's recipe check calls it with the settings it reads): attention that keeps packed documents
apart, a model called with ``input_ids`` and ``position_ids``, a tokenizer."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from torch import nn

from distlib.runner import components

# transformers' attention implementations whose masks keep packed documents apart in a batch of
# several rows (the packed-sequence mask from position_ids); flash attention's varlen path does it
# only for a batch of one row
ISOLATING = ("auto", "sdpa", "eager", "flex_attention")


def chat_problems(data_args: dict[str, Any], model: str, model_args: dict[str, Any], dist_mode: str) -> list[str]:
    """What a recipe with ``data.name: chat`` cannot run with (``data.args``, ``model.name``,
    ``model.args``, ``dist.mode``), found before any rank starts."""
    problems = []
    packing = data_args.get("packing", True)
    if dist_mode == "fallback":
        problems.append("data.name=chat with dist.mode=fallback: the fallback mode's replicas take tensor batches; "
                        "use dist.mode=process_per_gpu")  # fmt: skip
    if model == "hf_causal_lm":
        attn = model_args.get("attn_implementation", "auto")
        if packing and attn not in ISOLATING:
            problems.append(f"model.args.attn_implementation={attn} with data.args.packing=true: transformers cannot "
                            "keep packed documents apart in attention with it (a batch of several rows); use "
                            "sdpa, eager or flex_attention, or set data.args.packing=false")  # fmt: skip
        if not data_args.get("tokenizer") and not model_args.get("pretrained"):
            problems.append("data.args.tokenizer: needed (a tokenizer folder) when model.args.pretrained gives none")
    elif model in ("gpt", "resnet18_cifar", "small_cnn"):
        problems.append(f"data.name=chat with model.name={model}: chat batches call the model with input_ids and "
                        "position_ids (each document's positions); use model.name=hf_causal_lm")  # fmt: skip
    else:
        with contextlib.suppress(ValueError):
            fn = components.resolve("model", model)
            cls = fn if inspect.isclass(fn) else inspect.signature(fn).return_annotation
            if inspect.isclass(cls) and issubclass(cls, nn.Module) and not takes_positions(cls.forward):
                problems.append(f"data.name=chat with model.name={model}: its forward takes no input_ids and "
                                "position_ids, so packed documents would attend to each other; give it those "
                                "arguments, or use model.name=hf_causal_lm")  # fmt: skip
    return problems


def takes_positions(forward: Any) -> bool:
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return True  # cannot tell: the first batch will
    return "position_ids" in params and "input_ids" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


__all__ = ["ISOLATING", "chat_problems", "takes_positions"]
