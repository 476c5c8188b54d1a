"""The causal-LM task's side of ``data.name: chat`` (runner/data/chat.py): the data tokenized once
per node before every rank reads it, the recipe checks that packing needs (attention that keeps
documents apart), and the answer check: greedy answers of the model to held-out prompts, compared
exactly with the expected ones."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
from torch import nn

import distlib
from distlib.distributed.process_group import Context
from distlib.reliability.failures import shared_errors
from distlib.runner import components
from distlib.runner.config import Config, ConfigError
from distlib.runner.data.chat import ChatSet
from distlib.runner.data.errors import DataError

# transformers' attention implementations whose masks keep packed documents apart in a batch of
# several rows (the packed-sequence mask from position_ids); flash attention's varlen path does it
# only for a batch of one row
ISOLATING = ("auto", "sdpa", "eager", "flex_attention")


def chat_problems(cfg: Config) -> list[str]:
    """What a recipe with ``data.name: chat`` cannot run with, found before any rank starts."""
    problems = []
    packing = cfg.data.args.get("packing", True)
    model = cfg.model.name
    if cfg.dist.mode == "fallback":
        problems.append("data.name=chat with dist.mode=fallback: the fallback mode's replicas take tensor batches; "
                        "use dist.mode=process_per_gpu")  # fmt: skip
    if model == "hf_causal_lm":
        attn = cfg.model.args.get("attn_implementation", "auto")
        if packing and attn not in ISOLATING:
            problems.append(f"model.args.attn_implementation={attn} with data.args.packing=true: transformers cannot "
                            "keep packed documents apart in attention with it (a batch of several rows); use "
                            "sdpa, eager or flex_attention, or set data.args.packing=false")  # fmt: skip
        if not cfg.data.args.get("tokenizer") and not cfg.model.args.get("pretrained"):
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


def check_model(model: nn.Module, name: str) -> None:
    """A model built from a factory whose class the recipe check could not see: the same rule."""
    if not takes_positions(model.forward):
        raise ConfigError([f"data.name=chat with model.name={name}: its forward takes no input_ids and position_ids, "
                           "so packed documents would attend to each other; give it those arguments, or use "
                           "model.name=hf_causal_lm"])  # fmt: skip


def open_chat(cfg: Config, ctx: Context, log: Any = None) -> ChatSet:
    """The chat data, tokenized and cached by the first rank of each node while the others wait,
    then read by every rank. A collective: a DataError on any rank stops every rank with its line."""
    provided = {"root": cfg.data.root, "cache_dir": cfg.data.cache_dir,
                "pretrained": cfg.model.args.get("pretrained") or ""}  # fmt: skip
    built = None
    with shared_errors(DataError):
        if ctx.local_rank == 0:
            built = components.build("data", "chat", cfg.data.args, provided=provided)
    with shared_errors(DataError):
        data = built or components.build("data", "chat", cfg.data.args, provided=provided)
    if ctx.is_main and log is not None:
        log.info("%s", data.describe())
    return data


@torch.no_grad()
def answer_accuracy(model: nn.Module, data: ChatSet, ctx: Context, autocast: contextlib.AbstractContextManager,
                    max_new_tokens: int = 0) -> float | None:  # fmt: skip
    """The share of ``data.answers`` (held-out prompts) the model answers exactly: greedy decoding
    until a special token (the end of turn), the text stripped. Each rank takes every W-th prompt;
    every rank runs as many forwards (a fully sharded model's forward is a collective). A collective."""
    answers = data.answers
    if not answers:
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(data.tokenizer, local_files_only=True)
    stop = set(data.stats.get("stop_ids", [])) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    if not max_new_tokens:
        max_new_tokens = max(len(tok(a, add_special_tokens=False)["input_ids"]) for _, a in answers) + 2
    mine = list(range(ctx.rank, len(answers), ctx.world_size))
    rounds = -(-len(answers) // ctx.world_size)
    correct = torch.zeros((), dtype=torch.float64, device=ctx.device)
    was_training = model.training
    model.eval()
    for k in range(rounds):
        index = mine[k] if k < len(mine) else mine[0] if mine else 0  # a repeat: same forwards, not counted
        prompt, answer = answers[index]
        ids = list(prompt)
        out: list[int] = []
        for _ in range(max_new_tokens):
            x = torch.tensor([ids[-data.max_length :]], device=ctx.device)
            pos = torch.arange(x.shape[1], device=ctx.device).unsqueeze(0)
            with autocast:
                logits = model(input_ids=x, position_ids=pos)
            logits = logits[0] if isinstance(logits, tuple) else logits
            nxt = int(logits[0, -1].argmax())
            ids.append(nxt)
            out.append(nxt)
        end = next((i for i, t in enumerate(out) if t in stop), len(out))
        text = tok.decode(out[:end], skip_special_tokens=True).strip()
        if k < len(mine) and text == answer:
            correct += 1
    model.train(was_training)
    distlib.all_reduce(correct)
    return correct.item() / len(answers)


__all__ = ["ISOLATING", "answer_accuracy", "chat_problems", "check_model", "open_chat"]
