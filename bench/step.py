"""Benchmarks: all_reduce bus bandwidth and training-step throughput (from the repository root).

    torchrun --nproc-per-node=2 -m bench.step all             # both, on 2 GPUs (NCCL)
    torchrun --nproc-per-node=2 -m bench.step allreduce       # bus bandwidth table, like nccl-tests
    torchrun --nproc-per-node=2 -m bench.step step            # ResNet18-CIFAR images/s per mode
    python bench/step.py step --modes single-eager,single-graph   # one process
    python bench/step.py step --modes fallback                # one process driving every GPU

allreduce: raw ``torch.distributed.all_reduce`` of one buffer against GradSync's bucketed
all_reduce of the same bytes (a small first bucket, then ``--bucket-mb`` each, launched back to
back, as GradSync does), once per ``--groups`` value n (bucket i on communicator i % n, as
``GradSync(comm_groups=n)`` does), and the gradient sync of a synthetic ``--model-params`` model
through a real GradSync for each n. Bus bandwidth as nccl-tests defines it:
bytes * 2 (n - 1) / n / time.

step: training images/s on synthetic data kept on the device (bf16 autocast and channels_last on
GPUs), ``--batch`` images per GPU, for the modes single-eager, single-graph (one GPU each, every
rank alone), ddp-eager (DistributedDataParallel, the anchor), ddp-compile (DDP under
torch.compile(mode="reduce-overhead"), i.e. with CUDA graphs; GPUs only), distlib-eager, distlib-graph
(GradSync, without and with whole-step CUDA graph capture; once per ``--comm-groups`` value, the
rows of n > 1 named e.g. ``distlib-graph:g2``), fallback (one process drives all its GPUs:
distlib.Replicas, timed by bench/fallback_bench.py), distlib-compile (GradSync around
``distlib.compile_for_sync(model, sync)``: compiled, bucket all_reduces still overlapped) and
ddp-compile-default (``torch.compile(DDP(model))``, default mode), distlib-compile-graph (the
compiled model's kernels replayed inside distlib's whole-step CUDA graph, CapturedStep) and
single-compile-graph (the same on one GPU, every rank alone). Runs on CPU/gloo too, with small
sizes.

Every figure is the median of the timed steps (iterations for allreduce) after the warm-up, the
slowest rank's. The last lines printed are a short summary table; ``--json PATH`` writes every
result. BENCHMARKS.md, "Training step" and "Gradient all_reduce".
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

if __package__ in (None, ""):  # run as `python bench/step.py`: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import distlib  # noqa: E402
from distlib.distributed.collectives import comm_groups  # noqa: E402
from distlib.parallel import buckets  # noqa: E402
from distlib.parallel.grad_sync import GradSync  # noqa: E402
from distlib.runner.models.vision import build_model  # noqa: E402
from distlib.runner.observability.environment import collect_environment  # noqa: E402
from distlib.step.cuda_graph import CapturedStep  # noqa: E402

# torch.compile (default mode) of GradSync's model through compile_for_sync, and of DDP (DDPOptimizer);
# the -graph ones replay the compiled kernels inside distlib's own whole-step CUDA graph
COMPILE_MODES = ("distlib-compile", "ddp-compile-default", "distlib-compile-graph", "single-compile-graph")
MODES = (
    "single-eager", "single-graph", "ddp-eager", "ddp-compile", "distlib-eager", "distlib-graph", "fallback",
    *COMPILE_MODES,
)  # fmt: skip
MULTI_RANK = ("ddp-eager", "ddp-compile", "distlib-eager", "distlib-graph", *COMPILE_MODES[:3])
_MB = 2**20


class BenchUnavailable(RuntimeError):
    """A mode that cannot run here (the message says why); reported in the table, not fatal."""


# ---- helpers ------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    return distlib.all_reduce(t, op="max").item()


def step_times(fn: Callable[[], None], steps: int, warmup: int, device: torch.device) -> list[float]:
    """Seconds of each of ``steps`` calls of ``fn``, after ``warmup`` untimed ones (every rank must
    call it). On a GPU from CUDA events recorded between the calls, so the timed window has no host
    synchronisation in it; on the CPU from the wall clock."""
    for _ in range(warmup):
        fn()
    _sync(device)
    distlib.barrier()
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        events[0].record()
        for event in events[1:]:
            fn()
            event.record()
        torch.cuda.synchronize(device)
        return [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]
    stamps = [time.perf_counter()]
    for _ in range(steps):
        fn()
        stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


def _timed(fn: Callable[[], None], iters: int, warmup: int, device: torch.device) -> float:
    """Median seconds per call of ``fn``, the slowest rank's (every rank must call it)."""
    return max_over_ranks(statistics.median(step_times(fn, iters, warmup, device)), device)


def _busbw(nbytes: int, seconds: float, world: int) -> float:
    """GB/s as nccl-tests defines bus bandwidth for all_reduce."""
    return nbytes * 2 * (world - 1) / world / seconds / 1e9


def bucket_bounds(numel: int, element_size: int, bucket_mb: float, first_bucket_mb: float) -> list[tuple[int, int]]:
    """(start, stop) element ranges of a flat buffer cut as GradSync cuts its buckets."""
    return buckets.bounds(numel, element_size, int(bucket_mb * _MB), int(first_bucket_mb * _MB))


def watchdog(seconds: float) -> None:
    """Dump every thread's stack and exit if the next phase hangs (a hang must say where)."""
    faulthandler.cancel_dump_traceback_later()
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, exit=True)


def free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# ---- allreduce ----------------------------------------------------------------------------
def bench_allreduce(args: argparse.Namespace, ctx) -> dict:
    world = ctx.world_size
    if world < 2:
        raise BenchUnavailable("allreduce needs >= 2 ranks: start it with torchrun --nproc-per-node=N")
    device = ctx.device
    avg = dist.ReduceOp.AVG if ctx.backend == "nccl" else None
    # new_group is a collective: created here on every rank, in the same order, and shared
    groups = {n: comm_groups(n) for n in sorted({1, *args.groups})}
    rows = []
    for mb in args.sizes_mb:
        watchdog(args.hang_timeout_s)
        numel = max(1, int(mb * _MB) // 4)
        buf = torch.randn(numel, device=device)
        iters = args.iters if mb < 64 else max(5, args.iters // 4)
        raw = _timed(lambda buf=buf: dist.all_reduce(buf), iters, 3, device)
        nbytes = numel * 4
        row = {"bytes": nbytes, "raw_us": raw * 1e6, "raw_busbw": _busbw(nbytes, raw, world), "bucketed": []}
        views = [buf[a:b] for a, b in bucket_bounds(numel, 4, args.bucket_mb, args.first_bucket_mb)]
        row["buckets"] = len(views)
        for n in args.groups:
            buck = _timed(lambda n=n, views=views: _bucketed(views, groups[n], avg, world), iters, 3, device)
            row["bucketed"].append(
                {"groups": n, "us": buck * 1e6, "busbw": _busbw(nbytes, buck, world), "ratio": raw / buck}
            )
        if args.also_bucket_mb > 0:  # one communicator
            alt = [buf[a:b] for a, b in bucket_bounds(numel, 4, args.also_bucket_mb, args.first_bucket_mb)]
            buck = _timed(lambda alt=alt: _bucketed(alt, groups[1], avg, world), iters, 3, device)
            row["alt_buckets"] = len(alt)
            row["alt_bucketed_us"] = buck * 1e6
            row["alt_bucketed_busbw"] = _busbw(nbytes, buck, world)
            row["alt_ratio"] = raw / buck
        rows.append(row)
    free(device)
    model_sync = []
    for n in args.groups:
        model_sync.append(_bench_model_sync(args, ctx, n))
        free(device)  # the last model's buffers are gone before the next one is built
    watchdog(0)
    return {
        "rows": rows,
        "model_sync": model_sync,
        "groups": args.groups,
        "bucket_mb": args.bucket_mb,
        "also_bucket_mb": args.also_bucket_mb,
        "world": world,
    }


def _bucketed(views: list[torch.Tensor], groups: list, avg, world: int) -> None:
    """GradSync's launches: every bucket's async all_reduce back to back, bucket i on
    ``groups[i % n]`` (the same order on every rank), then wait for all."""
    works = []
    for i, v in enumerate(views):
        if avg is None:
            v.div_(world)  # gloo has no AVG: GradSync pre-divides
        works.append(dist.all_reduce(v, op=avg or dist.ReduceOp.SUM, group=groups[i % len(groups)], async_op=True))
    for w in works:
        w.wait()


class _Synthetic(nn.Module):
    """``n_params`` parameters in equal 2-D tensors (about 2M elements each): a stand-in for a
    large model's gradients."""

    def __init__(self, n_params: int):
        super().__init__()
        per = max(1, min(2**21, n_params // 8))
        cols = 1024 if per >= 1024 else per
        count = max(1, n_params // (per - per % cols))
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(per // cols, cols)) for _ in range(count))


def _bench_model_sync(args: argparse.Namespace, ctx, groups: int) -> dict:
    """GradSync's sync time (``comm_groups=groups``) for a synthetic model with every gradient
    ready at once (no backward to overlap with), against one raw all_reduce of the same bytes."""
    watchdog(args.hang_timeout_s)
    device, world = ctx.device, ctx.world_size
    model = _Synthetic(int(args.model_params)).to(device)
    sync = GradSync(
        model, bucket_mb=args.bucket_mb, first_bucket_mb=args.first_bucket_mb, broadcast=False, comm_groups=groups
    )
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    order = sorted(sync._slots, key=lambda s: -s.index)  # backward order: last layer first

    def step():
        for s in order:
            sync._on_ready(s)
        sync.wait()

    step()  # the first synced step attaches the bucket views (and settles the layout)
    seconds = _timed(step, max(3, args.iters // 4), 2, device)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    flat = torch.randn(nbytes // 4, device=device)
    raw = _timed(lambda: dist.all_reduce(flat), max(3, args.iters // 4), 2, device)
    out = {
        "groups": groups,
        "params": sum(p.numel() for p in model.parameters()),
        "bytes": nbytes,
        "buckets": len(sync.buckets),
        "sync_ms": seconds * 1e3,
        "sync_busbw": _busbw(nbytes, seconds, world),
        "raw_ms": raw * 1e3,
        "raw_busbw": _busbw(nbytes, raw, world),
        "ratio": raw / seconds,
    }
    sync.close()
    return out


def format_allreduce(res: dict) -> str:
    alt = res["also_bucket_mb"] > 0
    groups = res["groups"]
    lines = [
        f"all_reduce fp32, {res['world']} ranks, bus bandwidth GB/s (nccl-tests definition); "
        f"g<n> = GradSync's buckets of {res['bucket_mb']:g} MB launched back to back, bucket i on "
        f"communicator i % n" + (f"; alt = buckets of {res['also_bucket_mb']:g} MB, one communicator" if alt else ""),
        f"{'bytes':>12} {'raw us':>10} {'raw GB/s':>9} {'buckets':>8}"
        + "".join(f" {f'g{n} GB/s':>9} {'ratio':>6}" for n in groups)
        + (f" {'buckets':>8} {'alt GB/s':>9} {'ratio':>6}" if alt else ""),
    ]
    for r in res["rows"]:
        line = f"{r['bytes']:>12} {r['raw_us']:>10.1f} {r['raw_busbw']:>9.2f} {r['buckets']:>8}"
        line += "".join(f" {b['busbw']:>9.2f} {b['ratio']:>6.3f}" for b in r["bucketed"])
        if alt:
            line += f" {r['alt_buckets']:>8} {r['alt_bucketed_busbw']:>9.2f} {r['alt_ratio']:>6.3f}"
        lines.append(line)
    for m in res["model_sync"]:
        lines.append(
            f"synthetic model, {m['params'] / 1e6:.1f}M params ({m['bytes'] / _MB:.0f} MB of fp32 gradients), "
            f"{m['buckets']} buckets on {m['groups']} communicator(s): GradSync sync {m['sync_ms']:.3f} ms = "
            f"{m['sync_busbw']:.2f} GB/s; one raw all_reduce {m['raw_ms']:.3f} ms = {m['raw_busbw']:.2f} GB/s; "
            f"ratio {m['ratio']:.3f}"
        )
    return "\n".join(lines)


# ---- step ---------------------------------------------------------------------------------
@dataclass
class StepResult:
    mode: str
    world: int = 0
    per_gpu_batch: int = 0
    step_ms: float | None = None
    images_per_s: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def _make_inputs(args, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=g).to(device)
    if args.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, 10, (args.batch,), generator=g).to(device)


def _build(args, device, fused: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build_model(args.model, 10, args.width).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    kw = {"fused": True} if fused else {}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4, **kw)
    return model, opt


def _loss_fn(model: nn.Module, device: torch.device, bf16: bool) -> Callable[..., torch.Tensor]:
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    def loss_fn(x, y):
        with autocast:
            return F.cross_entropy(model(x), y, label_smoothing=0.2)

    return loss_fn


def _eager_step(loss_fn, opt, sync, x, y, mark_step: bool = False) -> Callable[[], None]:
    """One training step: forward, backward, GradSync's wait (when there is one), optimizer step."""

    def step() -> None:
        if mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        loss = loss_fn(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if sync is not None:
            sync.wait()
        opt.step()

    return step


def _grad_sync(model: nn.Module, args, groups: int) -> GradSync:
    """The GradSync of every distlib mode: the benchmark's bucket sizes, communicators and buffer setting."""
    return GradSync(model, bucket_mb=args.bucket_mb, first_bucket_mb=args.first_bucket_mb, comm_groups=groups,
                    broadcast_buffers=args.broadcast_buffers)  # fmt: skip


def _run_compiled_mode(mode: str, args, ctx, groups: int = 1) -> StepResult:
    """One of COMPILE_MODES: a torch.compile'd model (compiled in the warm-up), stepped eagerly or,
    for the -graph modes, inside a CapturedStep (compiled kernels replayed in distlib's CUDA graph)."""
    from distlib.step.compile import compile_for_sync

    device, world = ctx.device, ctx.world_size
    graph = mode.endswith("-graph")
    if mode in MULTI_RANK and world < 2:
        raise BenchUnavailable("needs >= 2 ranks (torchrun --nproc-per-node=N)")
    if graph and device.type != "cuda":
        raise BenchUnavailable("CUDA graphs need a GPU")
    model, opt = _build(args, device, fused=graph)
    x, y = _make_inputs(args, device)
    sync = None
    extra: dict = {}
    if mode.startswith("distlib"):
        sync = _grad_sync(model, args, groups)
        net = compile_for_sync(model, sync, backend=args.compile_backend)
    elif mode.startswith("single"):
        net = torch.compile(model, backend=args.compile_backend)
    else:
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=args.bucket_mb
        )
        net = torch.compile(ddp, backend=args.compile_backend)
    loss_fn = _loss_fn(net, device, args.precision == "bf16" and device.type == "cuda")
    captured = None
    if graph:
        captured = CapturedStep(model, opt, loss_fn, sync, warmup_steps=3)

        def step():
            captured(x, y)
    else:
        step = _eager_step(loss_fn, opt, sync, x, y)
    seconds = _timed(step, args.steps, args.warmup, device)
    if sync is not None:
        extra["bucket_mb"] = [round(b / _MB, 2) for b in sync.bucket_sizes()]
        extra["comm_groups"] = groups
    if captured is not None:
        extra["captured"] = captured.captured
        captured.close()
    if sync is not None:
        sync.close()
    torch._dynamo.reset()  # the next mode compiles afresh
    used = world if mode in MULTI_RANK else 1
    name = f"{mode}:g{groups}" if groups > 1 else mode
    return StepResult(name, used, args.batch, seconds * 1e3, args.batch * used / seconds, extra=extra)


def _run_mode(mode: str, args, ctx, groups: int = 1) -> StepResult:
    if mode in COMPILE_MODES:
        return _run_compiled_mode(mode, args, ctx, groups)
    device = ctx.device
    world = ctx.world_size
    bf16 = args.precision == "bf16" and device.type == "cuda"
    graph = mode.endswith("graph")
    if mode in MULTI_RANK and world < 2:
        raise BenchUnavailable("needs >= 2 ranks (torchrun --nproc-per-node=N)")
    if (graph or mode == "ddp-compile") and device.type != "cuda":
        raise BenchUnavailable("CUDA graphs need a GPU")
    model, opt = _build(args, device, fused=graph)
    x, y = _make_inputs(args, device)
    sync = None
    net = model
    extra: dict = {}
    if mode in ("ddp-eager", "ddp-compile"):
        net = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=args.bucket_mb
        )
        if mode == "ddp-compile":  # the strongest stock baseline: compiled, with CUDA graphs
            net = torch.compile(net, mode="reduce-overhead")
    elif mode.startswith("distlib"):
        sync = _grad_sync(model, args, groups)
    loss_fn = _loss_fn(net, device, bf16)
    captured = None
    if graph:
        captured = CapturedStep(model, opt, loss_fn, sync, warmup_steps=3)

        def step():
            captured(x, y)
    else:
        # a new step for the CUDA graph trees of reduce-overhead: the last outputs are dead
        step = _eager_step(loss_fn, opt, sync, x, y, mark_step=mode == "ddp-compile")

    seconds = _timed(step, args.steps, args.warmup, device)
    if sync is not None:
        extra["bucket_mb"] = [round(b / _MB, 2) for b in sync.bucket_sizes()]
        extra["comm_groups"] = groups
    if captured is not None:
        extra["captured"] = captured.captured
        captured.close()
    used = world if mode in MULTI_RANK else 1
    if sync is not None:
        sync.close()
    name = f"{mode}:g{groups}" if groups > 1 else mode
    return StepResult(name, used, args.batch, seconds * 1e3, args.batch * used / seconds, extra=extra)


def fallback_step(args: argparse.Namespace) -> StepResult:
    """The fallback mode: one process drives every GPU of its node (torch.cuda.comm), measured
    by ``bench.fallback_bench.benchmark_step`` (with its per-GPU CUDA graphs). Reports
    'not available' where no GPU is visible."""
    from bench.fallback_bench import benchmark_step

    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise BenchUnavailable("not available: the fallback mode drives GPUs and none is visible")
    ips = benchmark_step(
        args.batch,
        steps=args.steps,
        warmup=args.warmup,
        bf16=args.precision == "bf16",
        channels_last=args.channels_last,
        model_fn=lambda: build_model(args.model, 10, args.width),
    )
    return StepResult("fallback", gpus, args.batch, args.batch * gpus / ips * 1e3, ips, extra={"cuda_graph": True})


def bench_step(args: argparse.Namespace, ctx) -> list[StepResult]:
    if ctx.device.type == "cuda":
        torch.backends.cudnn.benchmark = args.cudnn_benchmark
    results = []
    # GradSync's modes once per --comm-groups value (n > 1 named mode:g<n>), the others once
    runs = [(m, n) for m in args.modes for n in (args.comm_groups if m.startswith("distlib") else [1])]
    for mode, groups in runs:
        watchdog(args.hang_timeout_s)
        distlib.barrier()
        try:
            if mode == "fallback":
                if ctx.world_size > 1:
                    raise BenchUnavailable("one process for all GPUs: `python -m bench.step step --modes fallback`")
                res = fallback_step(args)
            elif mode == "ddp-compile" or mode in COMPILE_MODES:
                try:  # a compiler failure (no triton, an unsupported op) is this row's note, not fatal
                    res = _run_mode(mode, args, ctx, groups)
                except BenchUnavailable:
                    raise
                except Exception as e:
                    raise BenchUnavailable(f"torch.compile failed: {type(e).__name__}: {str(e)[:200]}") from e
            else:
                res = _run_mode(mode, args, ctx, groups)
        except BenchUnavailable as e:
            res = StepResult(f"{mode}:g{groups}" if groups > 1 else mode, note=str(e))
        free(ctx.device)
        results.append(res)
        if ctx.is_main and not args.quiet:
            print(f"  {_step_row(res, None)}", file=sys.stderr, flush=True)
    watchdog(0)
    return results


def _step_row(r: StepResult, ddp: float | None) -> str:
    if r.note:
        return f"{r.mode:<22} {'-':>5} {'-':>9} {'-':>9} {'-':>11} {'-':>8}  {r.note}"
    ratio = f"{r.images_per_s / ddp:.3f}" if ddp else "-"
    extra = " ".join(f"{k}={v}" for k, v in r.extra.items())
    return (
        f"{r.mode:<22} {r.world:>5} {r.per_gpu_batch:>9} {r.step_ms:>9.2f} {r.images_per_s:>11.0f} {ratio:>8}  {extra}"
    )


def format_step(results: list[StepResult], args) -> str:
    ddp = next((r.images_per_s for r in results if r.mode == "ddp-eager" and not r.note), None)
    precision = args.precision if torch.cuda.is_available() and args.device != "cpu" else "fp32"
    lines = [
        f"training step, {args.model}, {args.batch} images per GPU, synthetic data on the device, "
        f"{precision}{', channels_last' if args.channels_last else ''}",
        f"{'mode':<22} {'GPUs':>5} {'batch/GPU':>9} {'step ms':>9} {'images/s':>11} {'vs DDP':>8}",
    ]
    lines += [_step_row(r, ddp) for r in results]
    return "\n".join(lines)


# ---- summary, environment, CLI --------------------------------------------------------------
def summary(out: dict) -> list[tuple[str, str]]:
    """The targets, measured (only what this run measured)."""
    rows = []
    steps = {r["mode"]: r for r in out.get("step", []) if not r["note"]}
    if "ddp-eager" in steps and "distlib-eager" in steps:
        ratio = steps["distlib-eager"]["images_per_s"] / steps["ddp-eager"]["images_per_s"]
        rows.append(("distlib eager / DDP eager (target >= 1.0)", f"{ratio:.3f}"))
    if "distlib-graph" in steps:
        r = steps["distlib-graph"]
        rows.append(
            (f"distlib graph images/s on {r['world']} GPU(s) (target >= 115k on 2)", f"{r['images_per_s']:.0f}")
        )
        if "ddp-eager" in steps:
            ratio = r["images_per_s"] / steps["ddp-eager"]["images_per_s"]
            rows.append(("distlib graph / DDP eager (target >= 1.9)", f"{ratio:.3f}"))
    if "ddp-compile" in steps:  # against the strongest stock baseline: DDP under compile(mode="reduce-overhead")
        base = steps["ddp-compile"]["images_per_s"]
        for name, r in steps.items():
            if name.split(":")[0] in ("distlib-graph", "distlib-compile-graph"):
                label = f"{name} images/s (target >= 135k) / DDP reduce-overhead (target >= 1.35)"
                rows.append((label, f"{r['images_per_s']:.0f} / {r['images_per_s'] / base:.3f}"))
    for name, r in steps.items():
        if ":g" in name and name.split(":")[0] in steps:  # GradSync on several communicators vs one
            ratio = r["images_per_s"] / steps[name.split(":")[0]]["images_per_s"]
            rows.append((f"{name} / {name.split(':')[0]}", f"{ratio:.3f}"))
    ar = out.get("allreduce")
    if ar:
        big = [r for r in ar["rows"] if r["bytes"] >= 64 * _MB]
        for i, n in enumerate(ar["groups"]):
            if big:
                worst = min(r["bucketed"][i]["ratio"] for r in big)
                label = f"bucketed / raw bus bandwidth, {n} communicator(s), min over >= 64 MB (target >= 0.95)"
                rows.append((label, f"{worst:.3f}"))
        for m in ar["model_sync"]:
            label = f"synthetic model: GradSync sync ({m['groups']} communicator(s)) / one raw all_reduce"
            rows.append((label, f"{m['ratio']:.3f}"))
    return rows


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def _counts(text: str) -> list[int]:
    """Comma-separated integers >= 1, without repeats (argparse reports a bad value)."""
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return list(dict.fromkeys(values))


def parse_args(argv: list[str]) -> argparse.Namespace:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA when present")
    common.add_argument("--json", metavar="PATH", help="write every result to this JSON file (rank 0)")
    common.add_argument("--bucket-mb", type=float, default=25.0, help="GradSync/DDP bucket size (default 25)")
    common.add_argument("--first-bucket-mb", type=float, default=1.0, help="GradSync's first bucket (default 1)")
    common.add_argument("--hang-timeout-s", type=float, default=300.0, help="dump stacks and exit if a phase hangs")
    common.add_argument("--quiet", action="store_true", help="no progress lines")

    ar = argparse.ArgumentParser(add_help=False)
    ar.add_argument(
        "--sizes-mb", type=_floats, default=[1, 4, 16, 64, 256, 1024], help="comma-separated (default 1,...,1024)"
    )
    ar.add_argument("--iters", type=int, default=20, help="timed iterations per size (a quarter from 64 MB)")
    ar.add_argument(
        "--also-bucket-mb", type=float, default=100.0, help="a second bucket size to compare (0: none; default 100)"
    )
    ar.add_argument("--model-params", type=float, default=100e6, help="synthetic model size (default 100e6)")
    ar.add_argument(
        "--groups",
        type=_counts,
        default=[1, 2, 4],
        help="communicators the buckets go to round-robin: a column per value (comma-separated; default 1,2,4)",
    )

    st = argparse.ArgumentParser(add_help=False)
    st.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES), help=f"comma-separated of {MODES}")
    st.add_argument("--model", choices=["resnet18_cifar", "small_cnn"], default="resnet18_cifar")
    st.add_argument("--width", type=int, default=16, help="small_cnn's width")
    st.add_argument("--batch", type=int, default=512, help="images per GPU (default 512)")
    st.add_argument("--image-size", type=int, default=32)
    st.add_argument("--steps", type=int, default=50, help="timed steps per mode")
    st.add_argument(
        "--broadcast-buffers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GradSync modes: rank 0's buffers broadcast before each forward, as DDP's default (the default); "
        "--no-broadcast-buffers measures without it",
    )
    st.add_argument("--warmup", type=int, default=10, help="untimed steps first (graph modes capture in them)")
    st.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="autocast dtype on GPUs")
    st.add_argument("--no-channels-last", dest="channels_last", action="store_false")
    st.add_argument(
        "--no-cudnn-benchmark", dest="cudnn_benchmark", action="store_false", help="cuDNN's heuristics, no autotuning"
    )
    st.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend of distlib-compile, ddp-compile-default"
    )
    st.add_argument(
        "--comm-groups",
        type=_counts,
        default=[1],
        help="GradSync's comm_groups for the distlib modes, comma-separated: a row per value (default 1)",
    )

    p = argparse.ArgumentParser(
        prog="python -m bench.step", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("allreduce", parents=[common, ar], help="all_reduce bus bandwidth: raw vs GradSync's buckets")
    sub.add_parser("step", parents=[common, st], help="training images/s per mode")
    sub.add_parser("all", parents=[common, ar, st], help="allreduce, then step")
    args = p.parse_args(argv)
    for m in getattr(args, "modes", []):
        if m not in MODES:
            p.error(f"unknown mode {m!r}; modes: {', '.join(MODES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    backend = {"auto": "auto", "cpu": "gloo", "cuda": "nccl"}[args.device]
    ctx = distlib.init(backend, timeout_s=max(600.0, args.hang_timeout_s))
    out: dict = {"environment": collect_environment(ctx), "command": args.command, "args": vars(args)}
    texts = []
    try:
        if args.command in ("allreduce", "all"):
            try:
                out["allreduce"] = bench_allreduce(args, ctx)
                texts.append(format_allreduce(out["allreduce"]))
            except BenchUnavailable as e:
                texts.append(f"allreduce: {e}")
        if args.command in ("step", "all"):
            results = bench_step(args, ctx)
            out["step"] = [asdict(r) for r in results]
            texts.append(format_step(results, args))
        if ctx.is_main:
            rows = summary(out)
            out["summary"] = dict(rows)
            text = "\n\n".join(texts)
            if rows:
                width = max(len(k) for k, _ in rows)
                text += "\n\nsummary\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
            print(text, flush=True)
            if args.json:
                os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=2, default=str)
        return 0
    finally:
        distlib.shutdown()


if __name__ == "__main__":
    sys.exit(main())
