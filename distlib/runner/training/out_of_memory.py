"""A run that ran out of GPU memory all the same: one line instead of torch's traceback.

The memory plan (memory_plan.py) refuses at the start a step that cannot fit, with what would. A step
the plan let through can still run out: what the plan does not count (the CUDA context, NCCL's and
cuBLAS's buffers, the allocator's fragmentation, a compiled graph's temporaries) outgrew its margin
(run.memory_margin_gib, run.memory_margin_fraction). ``OutOfMemory`` then says where (the step), what
the plan said, what the step reached (``torch.cuda.max_memory_allocated``) and asked for, and, in the
words of the plan's refusal, what would fit: the plan's modes with the margin that this run has shown
it needs (at least the device's memory less the plan's peak, plus the allocation that failed). A
``DistlibError``: exit 2 on every rank (the ranks whose peer ran out say it after it, ``outcome.py``).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import re

import torch

from distlib.errors import DistlibError
from distlib.runner.config import Config
from distlib.runner.training.memory_plan import MemoryPlan, _plan_here, size

# how long a rank that ran out of memory measures the plan's other modes for its advice (in a process of
# its own, as the plan's refusal does); past it, the advice names the plan's command instead
EVERY_MODE_S = 60.0

# torch's message: "CUDA out of memory. Tried to allocate 1.96 GiB. GPU 0 has a total capacity of ..."
_TRIED = re.compile(r"Tried to allocate (\d+(?:\.\d+)?) (B|KiB|MiB|GiB|TiB)")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_SIZE = r"(\d+(?:\.\d+)?) (B|KiB|MiB|GiB|TiB)"
# "... this process has 79.17 GiB memory in use. Of the allocated memory 74.89 GiB is allocated by PyTorch,
# and 2.20 GiB is reserved by PyTorch but unallocated."
_IN_USE = re.compile(rf"this process has {_SIZE} memory in use")
_BY_TORCH = re.compile(rf"{_SIZE} is allocated by PyTorch")
_UNALLOCATED = re.compile(rf"{_SIZE} is reserved by PyTorch but unallocated")


class OutOfMemory(DistlibError):
    """A step (or the warm-up, an evaluation) that ran out of GPU memory: one line, with what would fit."""


def tried_bytes(e: BaseException) -> int | None:
    """The allocation that failed, as torch's message gives it; None when it does not."""
    m = _TRIED.search(str(e))
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def _bytes(pattern: re.Pattern[str], text: str) -> int | None:
    m = pattern.search(text)
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def uncounted(e: BaseException) -> str:
    """What torch's message says lay outside the tensors when the allocation failed, in the terms of
    the plan's margin: the allocator's reserve that no tensor used (fragmentation; what
    ``expandable_segments`` gives back) and the process's memory outside the allocator (the CUDA
    context, NCCL's and cuBLAS's buffers); "" when the message does not give them."""
    text = str(e)
    in_use, by_torch, unallocated = (_bytes(p, text) for p in (_IN_USE, _BY_TORCH, _UNALLOCATED))
    if unallocated is None:
        return ""
    out = f"; of the rest, {size(unallocated)} was reserved by torch's allocator but not in use"
    if unallocated >= 2**30 and "expandable_segments" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        out += " (fragmentation: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True gives it back)"
    if in_use is not None and by_torch is not None:
        out += f" and {size(max(0, in_use - by_torch - unallocated))} was outside it (CUDA context, NCCL, cuBLAS)"
    return out


def every_mode(cfg: Config, plan: MemoryPlan, timeout_s: float = EVERY_MODE_S) -> MemoryPlan:
    """``plan`` with every dist.shard and checkpointing mode measured (the start measured the recipe's
    alone, unless it was refused), in a spawned process given ``timeout_s``; ``plan`` itself past it."""
    if len(plan.modes) > 1 or any(len(m.steps) > 1 for m in plan.modes.values()):
        return plan
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # its exit ends the child, done or not
        try:
            outcome, result = pool.apply_async(_plan_here, (cfg, plan.world_size, plan.gpu_bytes, True, {})).get(
                timeout_s
            )
        except Exception:  # out of time, or the child failed: the advice without the other modes
            return plan
    return result if outcome == "ok" else plan


def out_of_memory(e: BaseException, *, where: str, rank: int, device: torch.device,
                  plan: MemoryPlan | None) -> OutOfMemory:  # fmt: skip
    """The ``OutOfMemory`` of ``e`` (a ``torch.OutOfMemoryError``) raised ``where`` ("at step 12", "in the
    warm-up"). ``plan``: the run's memory plan at its start (None: none was made), with every mode
    measured for the advice (``every_mode``) or the recipe's own alone."""
    tried = tried_bytes(e)
    reached = ""
    total = None
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        reached = f"; it reached {size(torch.cuda.max_memory_allocated(device))} allocated"
        reached += f" and asked for {size(tried)} more" if tried else ""
        reached += f" of the GPU's {size(total)}"
    reached += uncounted(e)
    said = ""
    advice = ("; python -m distlib.runner.plan RECIPE --nproc N shows what fits (train.activation_checkpointing, "
              "dist.shard, a smaller train.batch_size, more ranks)")  # fmt: skip
    if plan is not None and plan.gpu_bytes is not None:
        said = f"; the memory plan said {size(plan.peak())} with a {size(plan.margin)} margin"
        # the run needed more than the device: what the plan does not count is at least the rest of the device,
        # and the allocation that failed
        shown = plan.gpu_bytes - plan.peak() + (tried or 0)
        if len(plan.modes) > 1 or any(len(m.steps) > 1 for m in plan.modes.values()):
            advice = dataclasses.replace(plan, margin=max(plan.margin, shown)).advice()
        advice += f"; or a margin of at least {size(shown)} (run.memory_margin_gib) so the plan refuses what cannot fit"
    return OutOfMemory(f"out of GPU memory {where} on rank {rank}{reached}{said}{advice}")
