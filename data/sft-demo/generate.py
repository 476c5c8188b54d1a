"""Writes the fine-tuning demo's files (recipes/sft_demo.yaml): a character-level tokenizer with a
chat template (``tokenizer/``, built with the ``tokenizers`` library) and conversations whose
answers can be checked (``train.jsonl``): "What is 3+5?" -> "8". Deterministic: running it again
writes the same files.

    python data/sft-demo/generate.py
"""

from __future__ import annotations

import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
SPECIAL = ["<pad>", "<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# ChatML-like: each turn a role token, its content and <|end|>; the generation prompt a role token
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SYSTEMS = ["You add numbers.", "", "", ""]


def tokenizer(path: str) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(SPECIAL + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|end|>", pad_token="<pad>",
                                   additional_special_tokens=SPECIAL[2:])  # fmt: skip
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)


def conversations(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        messages = []
        if system := rng.choice(SYSTEMS):
            messages.append({"role": "system", "content": system})
        if rng.random() < 0.3:  # an earlier turn: two turns trained in one conversation
            c, d = rng.randint(0, 9), rng.randint(0, 9)
            messages += [{"role": "user", "content": f"What is {c}+{d}?"},
                         {"role": "assistant", "content": str(c + d)}]  # fmt: skip
        messages += [{"role": "user", "content": f"What is {a}+{b}?"}, {"role": "assistant", "content": str(a + b)}]
        rows.append({"messages": messages})
    return rows


def main() -> None:
    tokenizer(os.path.join(HERE, "tokenizer"))
    with open(os.path.join(HERE, "train.jsonl"), "w") as f:
        for row in conversations(2000, seed=0):
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
