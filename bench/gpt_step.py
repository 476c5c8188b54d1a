"""GPT training step: tokens/s, MFU and peak memory per GPU, distlib against torch's own ways.

    torchrun --nproc-per-node=2 -m bench.gpt_step --sizes 355M,1.5B        # every mode, 2 GPUs
    torchrun --nproc-per-node=2 -m bench.gpt_step --sizes 1.5B,6.7B,10B,13B --modes ddp,fsdp2,zero-redundancy
    python -m bench.gpt_step --sizes 124M                                  # one GPU: every mode, world size 1

The model is ``distlib.runner.models.gpt.GPT`` (SDPA attention, tied embeddings, no biases) on random
tokens kept on the device, ``--batch`` sequences of ``--seq-len`` tokens per GPU, AdamW (fused on
GPUs; no weight decay on 1-D parameters), gradients clipped to norm ``--clip``, bf16 autocast
(FSDP2: ``MixedPrecisionPolicy`` with bf16 parameters and fp32 gradient reduction instead).
Each figure is the median of ``--steps`` steps after ``--warmup`` (compilation and CUDA-graph
capture happen in the warm-up), the slowest rank's. MFU = model FLOPs per token
(``GPT.flops_per_token``) × tokens/s per GPU / the GPU's dense bf16 peak (``--peak-tflops``, else
from the GPU's name). Peak memory: ``torch.cuda.max_memory_allocated``, the largest rank's.

Modes (``--modes a,b``): single-compile (each rank alone: a plain one-GPU ``torch.compile`` loop),
ddp, ddp-compile (``torch.compile(DDP(model))``), zero-redundancy (DDP + torch's
``ZeroRedundancyOptimizer``), fsdp2 (``fully_shard`` per block, then the root, as torch's tutorials
wrap a transformer; built on the meta device), fsdp2-compile (the same with each block compiled),
distlib (GradSync, eager), distlib-compile (GradSync around ``compile_for_sync``), distlib-graph
(``compile_for_sync`` inside ``CapturedStep``: the whole step one CUDA graph), and the slots
distlib-zero and distlib-fsdp (distlib's optimizer and full sharding; "not available" until the
library has them).

A mode that runs out of GPU memory is reported as "OOM" and the run goes on with the next (and
skips the mode for models with more parameters), so one command finds the largest model each mode
trains (if only some ranks fail, the ranks can no longer agree on the collectives in flight: the
run then stops after printing what it has). One JSON line per result as it comes (``--json PATH``
keeps them all), a table last. Every mode runs at world size 1 (distlib's collectives are no-ops;
torch's DDP, ZeroRedundancyOptimizer and FSDP2 get a one-rank group). Runs on CPU/gloo with tiny
sizes (``--device cpu --sizes 2x64 --vocab 256 --seq-len 32``). BENCHMARKS.md, "GPT training step".
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

if __package__ in (None, ""):  # run as `python bench/gpt_step.py`: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import distlib  # noqa: E402
from bench.step import BenchUnavailable, free, max_over_ranks, step_times, watchdog  # noqa: E402
from distlib.runner.models.gpt import GPT, GPTConfig  # noqa: E402
from distlib.runner.observability.environment import collect_environment  # noqa: E402

MODES = (
    "single-compile", "ddp", "ddp-compile", "zero-redundancy", "fsdp2", "fsdp2-compile",
    "distlib", "distlib-compile", "distlib-graph", "distlib-zero", "distlib-zero-compile", "distlib-zero-graph",
    "distlib-fsdp",
)  # fmt: skip
SINGLE = ("single-compile",)  # every rank alone: no collective in the step
# name -> (n_layer, n_head, n_embd); any other size is written LAYERSxWIDTH (heads of 64)
SIZES = {
    "124M": (12, 12, 768),
    "355M": (24, 16, 1024),
    "1.5B": (48, 25, 1600),
    "6.7B": (32, 32, 4096),
    "10B": (48, 32, 4096),
    "13B": (40, 40, 5120),
}
# dense bf16 tensor-core peak, TFLOP/s, by a word of torch.cuda.get_device_name()
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "GH200": 989.0, "A100": 312.0, "A800": 312.0}
_GIB = 2**30


def parse_size(text: str) -> tuple[int, int, int]:
    """(n_layer, n_head, n_embd) of a named size or of ``LAYERSxWIDTH``."""
    if text in SIZES:
        return SIZES[text]
    m = re.fullmatch(r"(\d+)x(\d+)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"unknown size {text!r}: one of {', '.join(SIZES)}, or LAYERSxWIDTH")
    layers, width = int(m.group(1)), int(m.group(2))
    return layers, max(1, width // 64), width


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if re.search(rf"\b{k}\b", name)), None)


@dataclass
class GptResult:
    mode: str
    size: str
    params: int = 0
    world: int = 0
    tokens_per_gpu_step: int = 0
    step_ms: float | None = None
    tokens_per_s: float | None = None  # all GPUs of the mode
    tokens_per_s_per_gpu: float | None = None
    mfu: float | None = None
    peak_mem_gib: float | None = None
    note: str = ""


class ModeFailed(Exception):
    """A mode failed on some rank; ``fatal`` when not every rank failed (their collectives no longer match)."""

    def __init__(self, note: str, fatal: bool):
        super().__init__(note)
        self.note, self.fatal = note, fatal


def _failure(e: BaseException) -> tuple[int, str]:
    """(1, "OOM") for an out-of-memory error anywhere in the exception's chain (compilers wrap it), else (2, why)."""
    chain, cur = [], e
    while cur is not None and len(chain) < 10:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    if any(isinstance(c, torch.cuda.OutOfMemoryError) or "out of memory" in str(c).lower() for c in chain):
        return 1, "OOM"
    if isinstance(e, BenchUnavailable):
        return 2, str(e)
    return 2, f"{type(e).__name__}: {str(e)[:200]}"


class Agreement:
    """Every rank learns whether any rank failed, over a gloo group: a rank that failed may have
    left a collective of the training step's process group unmatched."""

    def __init__(self, world: int):
        self.group = dist.new_group(backend="gloo") if world > 1 else None  # a collective: every rank, once

    def run(self, fn: Callable[[], object]) -> object:
        out, status = None, (0, "")
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - any failure of a mode is its row's note
            status = _failure(e)
        statuses = [status]
        if self.group is not None:
            statuses = [None] * dist.get_world_size()
            dist.all_gather_object(statuses, status, group=self.group)
        failed = [s for s in statuses if s[0]]
        if failed:
            raise ModeFailed(failed[0][1], fatal=len(failed) < len(statuses))
        return out

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


# ---- building a mode ------------------------------------------------------------------------
def _optimizer_args(model: nn.Module, args, device: torch.device, capturable: bool = False) -> tuple[list, dict]:
    """AdamW's parameter groups (no weight decay on 1-D parameters) and settings, the same in every mode."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    kw = {"lr": args.lr, "betas": (0.9, 0.95), "fused": device.type == "cuda"}
    if capturable:  # torch's check before a CUDA-graph capture asks Adam(W) for it, fused or not
        kw["capturable"] = True
    return groups, kw


def _optimizer(
    model: nn.Module, args, device: torch.device, zero: bool = False, capturable: bool = False
) -> torch.optim.Optimizer:
    groups, kw = _optimizer_args(model, args, device, capturable)
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW, **kw,
                                      weight_decay=args.weight_decay)  # fmt: skip
        opt.add_param_group(groups[1])
        return opt
    return torch.optim.AdamW(groups, **kw)


def _fsdp2(model_fn: Callable[[], GPT], device: torch.device, compile_blocks: bool, backend: str) -> GPT:
    """Stock FSDP2 as torch's tutorials wrap a transformer: built on the meta device, ``fully_shard``
    per block (compiled first, for fsdp2-compile), then the root, then materialised and initialised."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = model_fn()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if device.type != "cuda":
        mp = MixedPrecisionPolicy()  # fp32 on the CPU, as every other mode there
    for i, block in enumerate(model.blocks):
        if compile_blocks:
            block = torch.compile(block, backend=backend)
            model.blocks[i] = block
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device=device)  # DTensor parameters are swapped in place: the tied matrix stays one
    model.reset_parameters()
    assert model.lm_head.weight is model.wte.weight
    return model


def _build(mode: str, cfg: GPTConfig, args, ctx) -> tuple[Callable[[], None], Callable[[], None]]:
    """(step, close) of one mode; every rank must call it (DDP, GradSync and FSDP2 broadcast or shard)."""
    device, backend = ctx.device, args.compile_backend
    if mode.startswith(("ddp", "zero", "fsdp2")) and not dist.is_initialized():
        # world size 1 without torchrun: torch's DDP, ZeroRedundancyOptimizer and FSDP2 need a process
        # group even for one rank (distlib's modes run without one; shard_model makes its own)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)  # fmt: skip
    graph = mode.endswith("-graph")  # the whole step as one CUDA graph (CapturedStep)
    if graph and device.type != "cuda":
        raise BenchUnavailable("CUDA graphs need a GPU")
    torch.manual_seed(0)
    x = torch.randint(cfg.vocab_size, (args.batch, cfg.block_size), device=device)
    y = torch.roll(x, -1, dims=1)
    # FSDP2 (stock and distlib's): bf16 through its mixed-precision policy, not autocast
    bf16 = device.type == "cuda" and not mode.startswith(("fsdp2", "distlib-fsdp"))
    sync, closers = None, []
    opt = None
    if mode.startswith("fsdp2"):
        model = _fsdp2(lambda: GPT(cfg), device, mode == "fsdp2-compile", backend)
        net = model
    elif mode == "distlib-fsdp":
        import distlib

        half = torch.bfloat16 if device.type == "cuda" else None
        model = distlib.shard_model(lambda: GPT(cfg), param_dtype=half, reduce_dtype=half and torch.float32,
                                    device=device)  # fmt: skip
        net = model
        sync = distlib.FSDPSync(model)
    else:
        with torch.device(device):
            model = GPT(cfg)
        net = model
        if mode in ("ddp", "ddp-compile", "zero-redundancy"):
            ids = [device.index] if device.type == "cuda" else None
            net = nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=args.bucket_mb)
            if mode == "ddp-compile":
                net = torch.compile(net, backend=backend)
        elif mode.startswith("distlib"):
            from distlib.parallel.grad_sync import GradSync
            from distlib.step.compile import compile_for_sync

            zero = mode.startswith("distlib-zero")
            sync = GradSync(
                model, bucket_mb=args.bucket_mb, first_bucket_mb=args.first_bucket_mb, comm_groups=args.comm_groups,
                shard="optimizer" if zero else "none",
            )  # fmt: skip
            closers.append(sync.close)
            if mode not in ("distlib", "distlib-zero"):
                net = compile_for_sync(model, sync, backend=backend)
            if zero:  # the same groups and settings as every other mode, stepped on this rank's slice
                groups, kw = _optimizer_args(model, args, device, capturable=graph)
                opt = sync.sharded_optimizer(torch.optim.AdamW, groups, **kw)
        elif mode == "single-compile":
            net = torch.compile(model, backend=backend)
    if opt is None:
        opt = _optimizer(model, args, device, zero=mode == "zero-redundancy", capturable=graph)
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast:
            logits = net(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))

    def clip() -> None:
        if sync is not None:  # the global norm, whether each rank holds all gradients or a shard
            sync.clip_grad_norm_(args.clip)
        else:
            torch.nn.utils.clip_grad_norm_(params, args.clip)

    if graph:
        from distlib.step.cuda_graph import CapturedStep

        captured = CapturedStep(model, opt, loss_fn, sync, warmup_steps=3, before_step=clip)
        closers.insert(0, captured.close)

        def step() -> None:
            captured(x, y)
    else:

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn(x, y).backward()
            if sync is not None:
                sync.wait()
            clip()
            opt.step()

    def close() -> None:
        for c in closers:
            c()

    return step, close


def model_config(size: str, args) -> tuple[GPTConfig, int, int]:
    """The GPT of ``size``, its parameter count and its training FLOPs per token (built on the meta device)."""
    n_layer, n_head, n_embd = parse_size(size)
    cfg = GPTConfig(args.vocab, args.seq_len, n_layer, n_head, n_embd, 0.0, False)
    with torch.device("meta"):
        meta = GPT(cfg)
    return cfg, meta.num_params(), meta.flops_per_token(args.seq_len)


def run_mode(mode: str, size: str, args, ctx, agree: Agreement) -> GptResult:
    device, world = ctx.device, ctx.world_size
    cfg, params, flops = model_config(size, args)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    close = lambda: None  # noqa: E731
    try:
        step, close = agree.run(lambda: _build(mode, cfg, args, ctx))
        for _ in range(args.warmup):  # compilation, capture and the optimizer state's first allocation
            agree.run(step)
        times = agree.run(lambda: step_times(step, args.steps, 0, device))
        seconds = max_over_ranks(statistics.median(times), device)
    finally:
        close()
    used = 1 if mode in SINGLE else world
    tokens = args.batch * args.seq_len
    peak = peak_tflops(device, args.peak_tflops)
    per_gpu = tokens / seconds
    mem = None
    if device.type == "cuda":
        mem = max_over_ranks(torch.cuda.max_memory_allocated(device) / _GIB, device)
    return GptResult(
        mode, size, params, used, tokens, seconds * 1e3, per_gpu * used, per_gpu,
        flops * per_gpu / (peak * 1e12) if peak else None, mem,
    )  # fmt: skip


def _clear(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()  # the next mode compiles afresh
    free(device)


def bench(args, ctx) -> tuple[list[GptResult], bool]:
    """Every (size, mode); the second value is False when the run had to stop early."""
    agree = Agreement(ctx.world_size)
    results = []
    oom_at: dict[str, int] = {}  # mode -> the fewest parameters it ran out of memory with
    for size in args.sizes:
        params = model_config(size, args)[1]
        for mode in args.modes:
            watchdog(args.hang_timeout_s)
            fatal = False
            if params >= oom_at.get(mode, params + 1):  # a larger model than one it could not hold
                res = GptResult(mode, size, params, note="OOM (at a smaller size already)")
            else:
                try:
                    res = run_mode(mode, size, args, ctx, agree)
                except ModeFailed as e:
                    res, fatal = GptResult(mode, size, params, note=e.note), e.fatal
                    if e.note == "OOM":
                        oom_at[mode] = min(params, oom_at.get(mode, params))
            _clear(ctx.device)
            results.append(res)
            if ctx.is_main:
                print(json.dumps({"gpt_step": asdict(res)}), flush=True)
            if fatal:
                return results, False
    watchdog(0)
    agree.close()
    return results, True


def format_table(results: list[GptResult], args, peak: float | None) -> str:
    lines = [
        f"GPT training step, {args.batch} x {args.seq_len} tokens per GPU, vocabulary {args.vocab}, median of "
        f"{args.steps} steps; MFU against {f'{peak:g} TFLOP/s' if peak else 'no known peak (--peak-tflops)'}",
        f"{'size':<6} {'params':>8} {'mode':<16} {'GPUs':>4} {'step ms':>9} {'tokens/s/GPU':>12} {'MFU':>6} "
        f"{'peak GiB':>8}",
    ]
    for r in results:
        if r.note:
            lines.append(f"{r.size:<6} {'':>8} {r.mode:<16} {'-':>4} {'-':>9} {'-':>12} {'-':>6} {'-':>8}  {r.note}")
            continue
        mfu = f"{100 * r.mfu:.1f}%" if r.mfu is not None else "-"
        mem = f"{r.peak_mem_gib:.1f}" if r.peak_mem_gib is not None else "-"
        lines.append(
            f"{r.size:<6} {r.params / 1e6:>7.1f}M {r.mode:<16} {r.world:>4} {r.step_ms:>9.2f} "
            f"{r.tokens_per_s_per_gpu:>12.0f} {mfu:>6} {mem:>8}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpt_step", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", type=lambda s: [v for v in s.split(",") if v], default=["124M", "355M", "1.5B"],
                   help=f"comma-separated: {', '.join(SIZES)} or LAYERSxWIDTH (default 124M,355M,1.5B)")  # fmt: skip
    p.add_argument("--modes", type=lambda s: [v for v in s.split(",") if v], default=list(MODES),
                   help=f"comma-separated of {', '.join(MODES)} (default all)")  # fmt: skip
    p.add_argument("--batch", type=int, default=16, help="sequences per GPU (default 16)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--vocab", type=int, default=50304, help="vocabulary size (default 50304)")
    p.add_argument("--steps", type=int, default=30, help="timed steps (the median is reported; default 30)")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps first (default 8)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping (default 1.0)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP/GradSync bucket size (default 25)")
    p.add_argument("--first-bucket-mb", type=float, default=1.0, help="GradSync's first bucket (default 1)")
    p.add_argument("--comm-groups", type=int, default=2, help="GradSync's communicators (default 2, the runner's)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak per GPU (default: from its name)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA when present")
    p.add_argument("--json", metavar="PATH", help="write every result to this JSON file (rank 0)")
    p.add_argument("--hang-timeout-s", type=float, default=900.0, help="dump stacks and exit if a mode hangs")
    args = p.parse_args(argv)
    for m in args.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; modes: {', '.join(MODES)}")
    for s in args.sizes:
        try:
            parse_size(s)
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    backend = {"auto": "auto", "cpu": "gloo", "cuda": "nccl"}[args.device]
    ctx = distlib.init(backend, timeout_s=max(600.0, args.hang_timeout_s))
    torch.backends.cuda.matmul.allow_tf32 = True  # the fp32 matmuls outside autocast, as the baseline has them
    results, complete = bench(args, ctx)
    environment = collect_environment(ctx) if complete else {}  # a collective: every rank
    if ctx.is_main:
        text = format_table(results, args, peak_tflops(ctx.device, args.peak_tflops))
        if not complete:
            text += "\nstopped early: a mode failed on some ranks only (see its row)"
        print(text, flush=True)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            out = {"environment": environment, "args": vars(args), "results": [asdict(r) for r in results]}
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2, default=str)
    if not complete:  # a teardown could wait forever on the collective a failed rank left unmatched
        sys.stdout.flush()
        os._exit(1)
    distlib.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
