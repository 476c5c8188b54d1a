"""The causal-LM task's side of ``data.name: chat`` (runner/data/chat.py): the data tokenized once
per node before every rank reads it, the built model checked as the recipe check
(runner/data/chat_recipe.py) checks its name, and the answer check: greedy answers of the model
to held-out prompts, compared exactly with the expected ones."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

import distlib
from distlib.distributed.process_group import Context
from distlib.reliability.failures import shared_errors
from distlib.runner import components
from distlib.runner.config import Config, ConfigError
from distlib.runner.data.chat import ChatSet
from distlib.runner.data.chat_recipe import takes_positions
from distlib.runner.data.errors import DataError


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


__all__ = ["answer_accuracy", "check_model", "open_chat"]
