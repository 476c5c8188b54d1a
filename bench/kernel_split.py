"""Where a training step's time goes: torch.profiler's kernels (on a GPU; the CPU's operators
without one) summed into a few kinds of work, per step, so that two loops on the same model can be
set side by side (``bench.hf_families --profile``).

The kinds, by the kernel's name, the first that matches: ``loss`` (log-softmax, NLL, cross-entropy),
``attention`` (flash / memory-efficient / flex / cuDNN attention kernels, an eager softmax),
``matmul`` (cuBLAS, CUTLASS, inductor's matmul templates, aten's mm), ``norm`` (a fused kernel with
an rsqrt: RMSNorm and LayerNorm), ``optimizer`` (AdamW's fused and foreach kernels), ``copy``
(copies, fills, concatenation, casts not fused into other work) and ``other`` (the remaining
pointwise and reduction kernels).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

KINDS: list[tuple[str, re.Pattern[str]]] = [
    ("loss", re.compile(r"log_softmax|nll_loss|cross_entropy|logsumexp")),
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|flex|cudnn.*(?:mha|sdpa)|softmax")),
    (
        "matmul",
        re.compile(
            r"gemm|nvjet|cutlass|xmma|cublas|matmul|\bmm\b|aten::(?:mm|addmm|bmm|baddbmm)\b"
            r"|_mm_|tem_fused_(?:add)?mm|addmm|bmm"
        ),
    ),  # fmt: skip
    ("norm", re.compile(r"rsqrt|norm")),
    ("optimizer", re.compile(r"adam|foreach|multi_tensor")),
    ("copy", re.compile(r"copy|memcpy|memset|fill|\bcat\b")),
]
FUSED = ("triton_", "cpp_fused")  # inductor's kernels: a cast fused in ("_to_copy") does not make one a copy


def kind(name: str) -> str:
    """The kind of work of a kernel (or CPU operator) named ``name``."""
    low = name.lower()
    for k, pattern in KINDS:
        if pattern.search(low) and not (k == "copy" and low.startswith(FUSED)):
            return k
    return "other"


def entries(prof: Any) -> list[dict]:
    """``prof.key_averages()`` as plain rows (what ``bench/baselines/hf_loop.py --profile-json`` writes)."""
    return [
        {
            "name": e.key,
            "device": str(e.device_type).rsplit(".", 1)[-1],
            "self_cpu_us": float(e.self_cpu_time_total),
            "self_device_us": float(getattr(e, "self_device_time_total", 0.0) or 0.0),
            "count": int(e.count),
            # a record_function range (Optimizer.step#AdamW.step) also shows as device time: its kernels'
            "annotation": bool(getattr(e, "is_user_annotation", False)),
        }
        for e in prof.key_averages()
    ]


def split(rows: list[dict], steps: int, top: int = 12) -> dict:
    """Milliseconds a step of each kind, and the ``top`` kernels by time: the device's kernels where the
    profile has any, else the CPU's operators (their self time)."""
    rows = [r for r in rows if not r.get("annotation")]  # a range over kernels counted already: not one
    kernels = [r for r in rows if r["device"] != "CPU" and r["self_device_us"] > 0]
    on_device = bool(kernels)
    if not on_device:
        kernels = [r for r in rows if r["self_cpu_us"] > 0]
    key = "self_device_us" if on_device else "self_cpu_us"
    kinds: dict[str, float] = {}
    for r in kernels:
        k = kind(r["name"])
        kinds[k] = kinds.get(k, 0.0) + r[key] / 1e3 / steps
    ranked = sorted(kernels, key=lambda r: -r[key])[:top]
    return {
        "on": "device" if on_device else "cpu",
        "ms_per_step": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "total_ms": round(sum(kinds.values()), 3),
        "top": [[r["name"][:120], round(r[key] / 1e3 / steps, 3), kind(r["name"])] for r in ranked],
    }


def table(runner: dict, baseline: dict, step_ms: Sequence[float | None] = (None, None)) -> str:
    """Two splits side by side: each kind's milliseconds a step, and the difference. ``step_ms``: each
    side's timed step (runner, loop), from its tokens/s: then two more rows, the step and the part
    of it in which no kernel ran (the step less the kernels: launches, the host's work, syncs), where
    both splits are of device kernels."""
    a, b = runner["ms_per_step"], baseline["ms_per_step"]
    kinds = sorted(set(a) | set(b), key=lambda k: -max(a.get(k, 0.0), b.get(k, 0.0)))
    lines = ["| kind | runner ms/step | loop ms/step | loop - runner |", "|---|---|---|---|"]
    for k in kinds:
        lines.append(f"| {k} | {a.get(k, 0.0):.2f} | {b.get(k, 0.0):.2f} | {b.get(k, 0.0) - a.get(k, 0.0):+.2f} |")
    ta, tb = runner["total_ms"], baseline["total_ms"]
    lines.append(f"| total | {ta:.2f} | {tb:.2f} | {tb - ta:+.2f} |")
    sa, sb = step_ms
    if sa is not None and sb is not None and runner["on"] == baseline["on"] == "device":  # the CPU's ops overlap
        lines.append(f"| timed step | {sa:.2f} | {sb:.2f} | {sb - sa:+.2f} |")
        lines.append(f"| no kernel running | {sa - ta:.2f} | {sb - tb:.2f} | {(sb - tb) - (sa - ta):+.2f} |")
    return "\n".join(lines)
