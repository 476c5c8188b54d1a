"""One chat row to token ids and the positions trained: the tokenizer's chat template (or a Jinja
file) renders the conversation once to text, which is tokenized once (``add_special_tokens=False``:
the template writes BOS itself); what is trained is found by character offsets.

The trained spans come from rendering prefixes, never from ``{% generation %}`` (most stock
templates lack it and transformers' assistant mask is then all zero): an assistant message ``i``
begins where the conversation up to it, rendered with the generation prompt, ends (the role header
is not trained) and ends where the conversation through it ends, trailing whitespace left out; the
end-of-turn text the template writes after the content (``<|im_end|>``, ``<|eot_id|>``, eos) is
inside that span, so the model learns to stop. A token is trained when its first character is in a
span. A template that renders the beginning of a conversation differently when more follows, or
that closes an assistant turn with nothing, is a DataError naming the row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from distlib.runner.data.errors import DataError

SHAPES = ("messages", "prompt_completion", "text")
TRAIN_ON = ("auto", "assistant", "completion", "all")
HOW_TO_GIVE_A_TEMPLATE = ("give one with data.args.template=path/to/chat_template.jinja (a Jinja chat template, "
                          "as transformers' model folders ship them)")  # fmt: skip


def load_tokenizer(folder: str, template: str = "") -> Any:
    """The tokenizer saved in ``folder`` (``save_pretrained``'s files; nothing downloaded), with the
    Jinja file ``template`` as its chat template when given."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise DataError(f"data.name=chat needs transformers: pip install 'distlib[hf]' ({e})") from e
    if not os.path.isdir(folder):
        raise DataError(f"data.args.tokenizer={folder!r}: no such folder (a tokenizer's save_pretrained folder)")
    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise DataError(f"data.args.tokenizer={folder!r}: cannot load a tokenizer: {type(e).__name__}: {first}") from e
    if not getattr(tok, "is_fast", False):
        raise DataError(f"data.args.tokenizer={folder!r}: a slow (Python) tokenizer has no character offsets; "
                        "save the tokenizer with tokenizer.json (a fast tokenizer)")  # fmt: skip
    if template:
        try:
            with open(template) as f:
                tok.chat_template = f.read()
        except OSError as e:
            raise DataError(f"data.args.template={template!r}: cannot read it: {e}") from e
    return tok


def template_text(tok: Any) -> str:
    """The chat template in use (for the cache key); "" when the tokenizer has none."""
    t = getattr(tok, "chat_template", None)
    return t if isinstance(t, str) else json.dumps(t, sort_keys=True) if t else ""


@dataclass
class Encoded:
    """A document: its token ids, which of them are training targets, and whether it was cut."""

    ids: np.ndarray  # int64 (L,)
    trained: np.ndarray  # bool (L,): token j is a target (predicted from the tokens before it)
    truncated: bool = False


class ChatEncoder:
    """Renders and tokenizes rows of one shape with ``tok``; ``train_on`` as in docs/fine_tuning.md."""

    def __init__(self, tok: Any, shape: str, train_on: str = "auto", max_length: int = 0):
        self.tok, self.shape, self.max_length = tok, shape, max_length
        self.train_on = {"messages": "assistant", "prompt_completion": "completion", "text": "all"}[shape] \
            if train_on == "auto" else train_on  # fmt: skip
        if shape == "text" and self.train_on != "all":
            raise DataError(f"data.args.train_on={train_on}: text rows have no prompt or assistant part; "
                            "set train_on=all (or auto)")  # fmt: skip
        self.special = set(getattr(tok, "all_special_ids", []) or [])
        self.special |= {i for i, t in getattr(tok, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
        self.eos = tok.eos_token_id

    # ---- rendering ------------------------------------------------------------------------

    def needs_template(self, row: Mapping[str, Any]) -> bool:
        return self.shape == "messages" or (self.shape == "prompt_completion" and not isinstance(row["prompt"], str))

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Any, generation: bool) -> str:
        clean = [{k: v for k, v in m.items() if k != "train"} for m in messages]
        kwargs = {"tools": tools} if tools else {}
        return self.tok.apply_chat_template(clean, tokenize=False, add_generation_prompt=generation, **kwargs)

    def encode(self, row: Mapping[str, Any], where: str) -> Encoded:
        """The token ids of ``row`` and the positions trained; ``where`` names the row in errors."""
        if self.needs_template(row) and not getattr(self.tok, "chat_template", None):
            raise DataError(f"{where}: the tokenizer has no chat template to render messages with: "
                            f"{HOW_TO_GIVE_A_TEMPLATE}")  # fmt: skip
        try:
            if self.shape == "messages":
                text, spans, eot = self._messages(row, where)
                return self._tokenize(text, spans, eot, where, special=False)
            if self.shape == "prompt_completion":
                if isinstance(row["prompt"], str):
                    text = row["prompt"] + row["completion"]
                    start = 0 if self.train_on == "all" else len(row["prompt"])
                    return self._tokenize(text, [(start, len(text))], [], where, special=True)
                text, spans, eot = self._conversation_completion(row, where)
                return self._tokenize(text, spans, eot, where, special=False)
            return self._tokenize(row["text"], [(0, len(row["text"]))], [], where, special=True)
        except DataError:
            raise
        except Exception as e:  # the template's own refusal (raise_exception) or a Jinja error
            first = (str(e).strip().splitlines() or [""])[0]
            raise DataError(f"{where}: the chat template cannot render this row: {type(e).__name__}: {first}") from e

    def _messages(self, row: Mapping[str, Any], where: str) -> tuple[str, list[tuple[int, int]], list[tuple]]:
        msgs, tools = row["messages"], row.get("tools")
        full = self.render(msgs, tools, generation=False)
        if self.train_on == "all":
            return full, [(0, len(full))], []
        chosen = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and m.get("train", True) is not False]
        if self.train_on == "completion":  # the last assistant turn only
            last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
            chosen = [i for i in chosen if i == last]
        spans, eot = [], []
        for i in chosen:
            start = self._prefix(full, self.render(msgs[:i], tools, generation=True), where, i)
            end = self._prefix(full, self.render(msgs[: i + 1], tools, generation=False), where, i + 1)
            end = start + len(full[start:end].rstrip())
            spans.append((start, end))
            eot.append((start, end, msgs[i].get("content"), f"messages[{i}]"))
        return full, spans, eot

    def _conversation_completion(self, row: Mapping[str, Any], where: str) -> tuple[str, list, list]:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        tools = row.get("tools")
        full = self.render([*prompt, *completion], tools, generation=False)
        if self.train_on == "all":
            return full, [(0, len(full))], []
        start = self._prefix(full, self.render(prompt, tools, generation=True), where, len(prompt))
        end = len(full.rstrip())
        return full, [(start, end)], [(start, end, completion[-1].get("content"), "completion")]

    @staticmethod
    def _prefix(full: str, prefix: str, where: str, n: int) -> int:
        if not full.startswith(prefix):
            raise DataError(f"{where}: the chat template renders the first {n} message(s) differently when more "
                            "follow, so the trained part cannot be found by prefixes; give a template that renders "
                            f"a conversation's start alike ({HOW_TO_GIVE_A_TEMPLATE}) or set train_on=all")  # fmt: skip
        return len(prefix)

    # ---- tokenizing -----------------------------------------------------------------------

    def _tokenize(self, text: str, spans: list[tuple[int, int]], eot: list[tuple], where: str,
                  special: bool) -> Encoded:  # fmt: skip
        """``special``: plain text (no template): the tokenizer's own BOS, and eos appended (trained
        when the text's end is)."""
        enc = self.tok(text, add_special_tokens=special, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        starts = offsets[:, 0]
        trained = np.zeros(len(ids), dtype=bool)
        for a, b in spans:
            trained |= (starts >= a) & (starts < b)
        if special and ids.size and offsets[-1, 1] == 0 and ids[-1] in self.special:  # a template-less EOS added
            trained[-1] = bool(spans and spans[-1][1] == len(text))
        if special and self.eos is not None and (ids.size == 0 or ids[-1] != self.eos):
            ids = np.append(ids, self.eos)  # the end of the text: what the model learns to stop with
            trained = np.append(trained, bool(spans and spans[-1][1] == len(text)))
        for a, b, content, field in eot:
            self._check_end_of_turn(text, starts, ids, a, b, content, where, field)
        truncated = bool(self.max_length and len(ids) > self.max_length)
        if truncated:  # keep the start: the prompt, and the beginning of the answer
            ids, trained = ids[: self.max_length], trained[: self.max_length]
        return Encoded(ids, trained, truncated)

    def _check_end_of_turn(self, text: str, starts: np.ndarray, ids: np.ndarray, a: int, b: int, content: Any,
                           where: str, field: str) -> None:  # fmt: skip
        """The span [a, b) of a trained turn must hold a token after its content: the end of turn."""
        seg, body = text[a:b], content.strip() if isinstance(content, str) else ""
        at = seg.rfind(body) if body else 0
        if at >= 0:
            ok = bool(((starts >= a + at + len(body)) & (starts < b)).any()) and bool(seg[at + len(body) :].strip())
        else:  # the template changed the content: the last trained token must be a special one
            inside = np.nonzero((starts >= a) & (starts < b))[0]
            ok = bool(inside.size) and int(ids[inside[-1]]) in self.special
        if not ok:
            raise DataError(f"{where}: {field}: the chat template writes nothing after the assistant's content "
                            "to close its turn, so the model would never learn to stop; give a template that ends "
                            f"each assistant turn with an end-of-turn token such as {{{{ eos_token }}}} "
                            f"({HOW_TO_GIVE_A_TEMPLATE})")  # fmt: skip

    def prompt_ids(self, row: Mapping[str, Any]) -> tuple[list[int], str] | None:
        """For the answer check: the ids of the row's prompt (the conversation before its last
        assistant message, with the generation prompt) and the answer expected; None when the row
        has none."""
        if self.shape == "messages":
            msgs = row["messages"]
            if not msgs or msgs[-1]["role"] != "assistant" or not isinstance(msgs[-1].get("content"), str):
                return None
            text = self.render(msgs[:-1], row.get("tools"), generation=True)
            answer = msgs[-1]["content"]
            special = False
        elif self.shape == "prompt_completion":
            completion = row["completion"]
            answer = completion if isinstance(completion, str) else completion[-1].get("content")
            if not isinstance(answer, str):
                return None
            if isinstance(row["prompt"], str):
                text, special = row["prompt"], True
            else:
                text, special = self.render(row["prompt"], row.get("tools"), generation=True), False
        else:
            return None
        ids = self.tok(text, add_special_tokens=special)["input_ids"]
        if special and ids and ids[-1] in self.special and ids[-1] == self.eos:
            ids = ids[:-1]  # a tokenizer that appends eos: the prompt goes on
        return list(ids), answer.strip()


__all__ = ["SHAPES", "TRAIN_ON", "ChatEncoder", "Encoded", "load_tokenizer", "template_text"]
