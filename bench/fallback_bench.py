"""The fallback mode against nn.DataParallel and DDP, in one call on one multi-GPU node.

ResNet18-CIFAR, bf16 autocast, channels_last, synthetic data on the GPU, SGD; 512 images per
GPU by default. nn.DataParallel, DDP eager and one GPU eager come from the baseline script
(bench/baselines/rn18_throughput.py, run as subprocesses); the fallback mode (eager, and with
per-replica CUDA graphs) runs in this process, followed by where a fallback step's time goes.

    python bench/fallback_bench.py [--anchor bench/baselines] [--batch 512] [--json out.json]

BENCHMARKS.md, "Fallback mode".
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from distlib import Replicas  # noqa: E402

_RESULT = re.compile(r"RESULT .*step_ms=([\d.]+) images_per_s=([\d.]+)")


# ---- the fallback mode's step, timed through Replicas' public API ---------------------------


def _sync(devices: Sequence[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def _bench_setup(per_gpu_batch, devices, cuda_graph, bf16, channels_last, model_fn, seed=0):
    from distlib.runner.models.vision import resnet18_cifar

    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if devices is None else list(devices)
    if not devices:
        raise ValueError("benchmark_step needs at least one device (no GPU is visible)")
    root = torch.device("cuda", devices[0]) if isinstance(devices[0], int) else torch.device(devices[0])
    torch.manual_seed(seed)
    if root.type == "cuda":
        torch.backends.cudnn.benchmark = True
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = (model_fn or resnet18_cifar)().to(root).to(memory_format=fmt)
    replicas = Replicas(model, devices, cuda_graph=cuda_graph)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    n = per_gpu_batch * replicas.num_devices
    x = torch.randn(n, 3, 32, 32, device=root).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (n,), device=root)
    ce = nn.CrossEntropyLoss(label_smoothing=0.2)

    def loss_fn(out, t):
        return ce(out.float(), t)

    dtype = torch.bfloat16 if bf16 and root.type == "cuda" else None
    return replicas, opt, x, y, loss_fn, dtype


def benchmark_step(
    per_gpu_batch: int = 512,
    steps: int = 40,
    warmup: int = 10,
    *,
    devices: Sequence[torch.device | str | int] | None = None,
    cuda_graph: bool = True,
    bf16: bool = True,
    channels_last: bool = True,
    model_fn: Callable[[], nn.Module] | None = None,
) -> float:
    """Training images/s of the fallback mode on one node: ResNet18-CIFAR (or ``model_fn()``),
    synthetic data on the root GPU, SGD on the root, ``per_gpu_batch`` images per GPU.

    ``devices=None``: every visible GPU. Timed from the first to the last of ``steps``
    steps after ``warmup`` untimed ones (which include the graph capture).
    """
    replicas, opt, x, y, loss_fn, dtype = _bench_setup(
        per_gpu_batch, devices, cuda_graph, bf16, channels_last, model_fn
    )

    def step():
        replicas.train_step(x, y, loss_fn, autocast_dtype=dtype)
        opt.step()

    for _ in range(warmup):
        step()
    _sync(replicas.devices)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(replicas.devices)
    return x.shape[0] * steps / (time.perf_counter() - t0)


def _forward_alone(replicas: Replicas, i: int, x: torch.Tensor, y: torch.Tensor, loss_fn, dtype) -> torch.Tensor:
    """Replica ``i``'s forward and loss, as Replicas runs it (its GPU current, autocast)."""
    d = replicas.devices[i]
    guard = torch.cuda.device(d) if d.type == "cuda" else contextlib.nullcontext()
    with guard, torch.autocast(d.type, dtype=dtype, enabled=dtype is not None):
        return loss_fn(replicas.models[i](x), y)


def step_breakdown(
    per_gpu_batch: int = 512,
    iters: int = 10,
    *,
    devices: Sequence[torch.device | str | int] | None = None,
    cuda_graph: bool = True,
    bf16: bool = True,
    channels_last: bool = True,
    model_fn: Callable[[], nn.Module] | None = None,
) -> dict[str, tuple[float, float]]:
    """Where a fallback step's time goes: each phase run alone, ``iters`` times, with the
    GPUs synchronized before and after. Returns ``{phase: (host_ms, done_ms)}``: host_ms is
    the time until the call returns (the launches), done_ms until every GPU has finished.
    When host_ms ≈ done_ms the phase is bound by the host's launches, not by the GPUs.
    ``step`` is a whole step (train_step + optimizer) without synchronization inside.
    """
    replicas, opt, x, y, loss_fn, dtype = _bench_setup(
        per_gpu_batch, devices, cuda_graph, bf16, channels_last, model_fn
    )
    devs = replicas.devices
    for _ in range(3):  # warm-up, and the graph capture
        replicas.train_step(x, y, loss_fn, autocast_dtype=dtype)
        opt.step()
    xs, ys = replicas.scatter(x), replicas.scatter(y)

    def timed(fn) -> tuple[float, float]:
        host = done = 0.0
        for _ in range(iters):
            _sync(devs)
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            _sync(devs)
            t2 = time.perf_counter()
            host += t1 - t0
            done += t2 - t0
        return host / iters * 1e3, done / iters * 1e3

    out: dict[str, tuple[float, float]] = {}
    out["broadcast_parameters"] = timed(replicas.broadcast_parameters)
    out["scatter"] = timed(lambda: (replicas.scatter(x), replicas.scatter(y)))
    out["forward_backward (all GPUs)"] = timed(lambda: replicas.forward_backward(xs, ys, loss_fn, autocast_dtype=dtype))

    # the same work on GPU 0 alone (how well do the GPUs overlap?): a one-GPU Replicas of a copy
    solo = Replicas(copy.deepcopy(replicas.root), [devs[0]], cuda_graph=replicas.cuda_graph)
    solo.forward_backward(xs[:1], ys[:1], loss_fn, autocast_dtype=dtype)  # its capture, untimed
    out["  forward_backward of GPU 0 alone"] = timed(
        lambda: solo.forward_backward(xs[:1], ys[:1], loss_fn, autocast_dtype=dtype)
    )
    if not replicas.cuda_graph:
        n = replicas.num_devices

        def forwards():
            return [_forward_alone(replicas, i, xs[i], ys[i], loss_fn, dtype) for i in range(n)]

        for i in range(n):
            out[f"  forward of replica {i} alone"] = timed(
                lambda i=i: _forward_alone(replicas, i, xs[i], ys[i], loss_fn, dtype)
            )
        out[f"  forward of all {n}, issued from one thread"] = timed(forwards)
        host = done = 0.0
        for _ in range(iters):  # backward alone: the forward is done and synchronized first
            losses = forwards()
            _sync(devs)
            t0 = time.perf_counter()
            torch.autograd.backward(losses)
            t1 = time.perf_counter()
            _sync(devs)
            host += t1 - t0
            done += time.perf_counter() - t0
        out[f"  backward of all {n} (one call; a worker thread per GPU)"] = (host / iters * 1e3, done / iters * 1e3)
    out["reduce_gradients"] = timed(replicas.reduce_gradients)
    out["optimizer step (root)"] = timed(opt.step)

    def step():
        replicas.train_step(x, y, loss_fn, autocast_dtype=dtype)
        opt.step()

    out["step"] = timed(step)
    return out


def run_anchor(anchor: str, mode: str, batch: int, nproc: int = 0, steps: int = 40, warm: int = 10) -> dict | None:
    script = os.path.join(anchor, "rn18_throughput.py")
    env = {**os.environ, "MODE": mode, "BATCH": str(batch), "STEPS": str(steps), "WARM": str(warm)}
    cmd = [sys.executable, script]
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script]
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    m = _RESULT.search(proc.stdout)
    if proc.returncode != 0 or not m:
        print(f"anchor {mode} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}", flush=True)
        return None
    print(f"  anchor {mode}: {float(m.group(2)):.0f} images/s ({time.perf_counter() - t:.0f} s)", flush=True)
    return {"images_per_s": float(m.group(2)), "step_ms": float(m.group(1))}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--anchor", default=os.path.join(ROOT, "bench", "baselines"), help="folder of rn18_throughput.py")
    p.add_argument("--batch", type=int, default=512, help="images per GPU")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--model",
        choices=["anchor", "distlib"],
        default="anchor",
        help="anchor: the anchor's ResNet18 (the network of the DP/DDP figures); distlib: models.py's",
    )
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args(argv)
    n = torch.cuda.device_count()
    if n == 0:
        print("error: no GPU visible; this benchmark needs a node with GPUs", file=sys.stderr)
        return 2
    have_anchor = os.path.isfile(os.path.join(args.anchor, "rn18_throughput.py"))
    model_fn = None
    if args.model == "anchor":
        if not have_anchor:
            print(
                f"error: no rn18_throughput.py in {args.anchor}; pass --anchor DIR or --model distlib", file=sys.stderr
            )
            return 2
        sys.path.insert(0, args.anchor)
        from common import ResNet18  # the anchor's model: the same network as the DP/DDP figures

        model_fn = ResNet18
    print(f"{n} GPU(s): {torch.cuda.get_device_name(0)}; torch {torch.__version__}; {args.batch} images per GPU; "
          f"model: {args.model}'s ResNet18-CIFAR", flush=True)  # fmt: skip

    results: dict[str, dict] = {}
    if have_anchor:
        print("anchors (subprocesses):", flush=True)
        for name, mode, nproc, steps, warm in [
            ("1 GPU eager (anchor)", "single", 0, args.steps, 10),
            (f"DDP eager, {n} GPUs (anchor)", "ddp", n, args.steps, 10),
            (f"nn.DataParallel, {n} GPUs (anchor)", "dp", 0, 10, 3),  # ~0.8 s a step: fewer steps
        ]:
            r = run_anchor(args.anchor, mode, args.batch, nproc, steps, warm)
            if r:
                results[name] = r
    print("fallback mode (this process):", flush=True)
    for name, devices, graph in [
        (f"fallback eager, {n} GPUs", None, False),
        (f"fallback + per-replica CUDA graphs, {n} GPUs", None, True),
        ("fallback + CUDA graph, 1 GPU", [0], True),
    ]:
        t = time.perf_counter()
        try:  # one failure must not cost the rest of the run
            ips = benchmark_step(args.batch, args.steps, 10, devices=devices, cuda_graph=graph, model_fn=model_fn)
        except Exception:
            print(f"  {name} FAILED:\n{traceback.format_exc()[-3000:]}", flush=True)
            continue
        gpus = n if devices is None else len(devices)
        results[name] = {"images_per_s": ips, "step_ms": args.batch * gpus / ips * 1e3}
        print(f"  {name}: {ips:.0f} images/s ({time.perf_counter() - t:.0f} s)", flush=True)

    dp = next((r["images_per_s"] for k, r in results.items() if "DataParallel" in k), None)
    ddp = next((r["images_per_s"] for k, r in results.items() if k.startswith("DDP")), None)
    print("\n| mode | images/s | step ms | vs nn.DataParallel | vs DDP eager |\n|---|---|---|---|---|")
    for name, r in results.items():
        vs_dp = f"{r['images_per_s'] / dp:.1f}x" if dp else "-"
        vs_ddp = f"{r['images_per_s'] / ddp:.2f}x" if ddp else "-"
        print(f"| {name} | {r['images_per_s']:.0f} | {r['step_ms']:.2f} | {vs_dp} | {vs_ddp} |")
    best = max(
        (v["images_per_s"] for k, v in results.items() if k.startswith("fallback") and f"{n} GPUs" in k), default=0
    )
    if dp and ddp and best:
        ok_dp, ok_ddp = best >= 50 * dp, best >= 0.9 * ddp
        print(f"\ntargets: fallback >= 50x nn.DataParallel: {best / dp:.1f}x {'MET' if ok_dp else 'MISSED'}; "
              f">= 0.9x DDP eager: {best / ddp:.2f}x {'MET' if ok_ddp else 'MISSED'}")  # fmt: skip

    breakdowns = {}
    for graph in (False, True):
        label = "per-replica CUDA graphs" if graph else "eager"
        try:
            rows = step_breakdown(args.batch, 10, cuda_graph=graph, model_fn=model_fn)
        except Exception:
            print(f"\nbreakdown ({label}) FAILED:\n{traceback.format_exc()[-3000:]}", flush=True)
            continue
        breakdowns[label] = rows
        print(f"\nwhere a fallback step's time goes ({label}, {n} GPUs; each phase alone, GPUs synced around it)")
        print("| phase | host ms (launch) | done ms (GPUs finished) |\n|---|---|---|")
        for phase, (host, done) in rows.items():
            print(f"| {phase} | {host:.2f} | {'-' if done != done else f'{done:.2f}'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"gpus": n, "batch_per_gpu": args.batch, "results": results, "breakdown": breakdowns}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
