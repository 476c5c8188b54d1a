"""A model for a test of a run that runs out of GPU memory, on the CPU: ``model.name:
tests.runner.out_of_memory_model:gpt_out_of_memory``, the built-in GPT whose ``at_step``-th training
forward on rank ``on_rank`` raises ``torch.OutOfMemoryError`` with CUDA's message, as a step that
outgrew the GPU does."""

from __future__ import annotations

import os

import torch

from distlib.runner.models.gpt import gpt

MESSAGE = ("CUDA out of memory. Tried to allocate 1.96 GiB. GPU 0 has a total capacity of 79.18 GiB of which "
           "1.21 GiB is free. Of the allocated memory 76.80 GiB is allocated by PyTorch")  # fmt: skip


def gpt_out_of_memory(vocab_size: int = 256, block_size: int = 64, n_layer: int = 2, n_head: int = 4,
                      n_embd: int = 64, at_step: int = 3, on_rank: int = 1) -> torch.nn.Module:  # fmt: skip
    model = gpt(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    calls = [0]

    def forward_pre_hook(module: torch.nn.Module, args: object) -> None:
        if module.training and int(os.environ.get("RANK", "0")) == on_rank:
            calls[0] += 1
            if calls[0] == at_step:
                raise torch.OutOfMemoryError(MESSAGE)

    model.register_forward_pre_hook(forward_pre_hook)
    return model
