"""Throughput figures a transformer user reads: tokens/s, MFU and peak GPU memory per rank.

MFU (model FLOPs utilization) is the model's training FLOPs per second over the GPUs' dense bf16
peak: ``tokens/s x FLOPs per token / (GPUs x peak)``, the peak taken from the GPU's name (or
``train.peak_tflops``). There is none on a CPU or an unknown GPU unless the recipe gives it.
"""

from __future__ import annotations

import torch
from torch import nn

import distlib

# dense bf16 tensor-core TFLOP/s per GPU (no sparsity), by a part of torch.cuda.get_device_name()
PEAK_BF16_TFLOPS = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100", 989.0),  # SXM; the PCIe card is 756
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("L4", 121.0),
    ("V100", 125.0),  # fp16: V100 has no bf16
    ("RTX 4090", 165.0),
    ("RTX 3090", 71.0),
)


def peak_tflops(device: torch.device, override: float = 0.0) -> float | None:
    """Dense bf16 TFLOP/s of one ``device``: ``override`` when > 0, else from the table; None when unknown."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for part, tflops in PEAK_BF16_TFLOPS:
        if part in name:
            return tflops
    return None


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: the model's own count (``flops_per_token``, as GPT has), else
    6 per parameter (forward and backward of its matrix products)."""
    if hasattr(model, "flops_per_token"):
        return float(model.flops_per_token(seq_len))
    return 6.0 * sum(p.numel() for p in model.parameters())


def gpus_per_process(mode: str) -> int:
    """The GPUs one process drives: every GPU of its node in ``dist.mode=fallback``, else one."""
    return max(1, torch.cuda.device_count()) if mode == "fallback" else 1


def mfu(tokens_per_s: float, flops_per_token: float, gpus: int, peak: float | None) -> float | None:
    """The fraction of the ``gpus``' peak the model's FLOPs reach; None without a peak."""
    if not peak:
        return None
    return tokens_per_s * flops_per_token / (gpus * peak * 1e12)


def allocated_peak(device: torch.device) -> int | None:
    """This process's peak allocated memory on ``device`` (bytes) since its start; None on a CPU."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def peak_memory_gib(device: torch.device) -> list[float] | None:
    """Every rank's peak allocated GPU memory (GiB, ``allocated_peak``) since the start, in rank
    order; None on a CPU. A collective (an all_gather) on a GPU: every rank must call it."""
    peak = allocated_peak(device)
    if peak is None:  # the same on every rank: no rank gathers
        return None
    return [round(v, 3) for v in distlib.all_gather_object(peak / 2**30)]
