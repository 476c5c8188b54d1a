"""Start-up of a compiled training step: GradSync + compile_for_sync against DDP + torch.compile.

    python bench/compile_startup.py --nproc 2                       # ResNet18-CIFAR, both modes, cold then warm
    python bench/compile_startup.py --nproc 2 --modes distlib --runs warm --cache-dir /tmp/ic
    python bench/compile_startup.py --nproc 2 --device cpu --model small_cnn --batch 8 --image-size 16

For each mode, the same ``torchrun --standalone`` command is run twice: first with an empty inductor
cache (``TORCHINDUCTOR_CACHE_DIR``, one per mode, under ``--cache-dir``), then again with the cache
the first run left (warm: what a user's second launch sees). Rank 0 reports the time of each phase
(torch import, init, model, first step, second step, the mean of the next steps), the compile
counters (graphs compiled, recompilations, inductor's FX graph cache and AOTAutograd's cache: hits,
misses, bypasses) and the whole command's wall time, measured here. Modes: ``distlib``
(``GradSync`` + ``distlib.compile_for_sync``), ``ddp`` (``torch.compile(DDP(model))``) and ``plain``
(``GradSync`` + ``torch.compile(model)``: one graph, no split), all with inductor's default mode,
bf16 autocast and channels_last on GPUs. ``--compile-times`` prints dynamo's ``compile_times()``
table of each run (where the compile time went).
"""

from __future__ import annotations

import time

_T_START = time.time()  # before torch is imported: the child's import time is part of its start-up

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("distlib", "ddp", "plain")
_TAG = "COMPILE_STARTUP "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=raw,
                                epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    p.add_argument("--nproc", type=int, default=2, help="processes (torchrun --nproc-per-node), default 2")
    p.add_argument("--modes", type=lambda s: s.split(","), default=["distlib", "ddp"],
                   help="comma-separated of distlib,ddp,plain (default distlib,ddp)")  # fmt: skip
    p.add_argument("--runs", choices=["both", "cold", "warm"], default="both",
                   help="cold (empty cache), warm (the cache as it is), or both in that order (default)")  # fmt: skip
    p.add_argument("--cache-dir", default=None, help="where each mode's inductor cache lives (default: a new temp dir)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA when present")
    p.add_argument("--model", choices=["resnet18_cifar", "small_cnn"], default="resnet18_cifar")
    p.add_argument("--width", type=int, default=16, help="small_cnn's width")
    p.add_argument("--batch", type=int, default=512, help="images per process (default 512)")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="steps after the first two, timed as a mean (default 10)")
    p.add_argument("--compile-times", action="store_true", help="print dynamo's compile_times() table of each run")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the mode, in a torchrun worker
    return p.parse_args(argv)


# ---- the worker (under torchrun) ------------------------------------------------------------------
def _counters() -> dict:
    from torch._dynamo.utils import counters

    keep = {
        "graphs": counters["stats"].get("unique_graphs", 0),
        "recompiles": sum(counters["recompiles"].values()),
    }
    for group in ("inductor", "aot_autograd"):
        for key, value in counters[group].items():
            if "cache" in key:
                keep[f"{group}.{key}"] = value
    return keep


def child(args: argparse.Namespace) -> None:
    t_import = time.time()
    import torch
    import torch.nn.functional as F
    from torch import nn

    sys.path.insert(0, ROOT)
    import distlib
    from distlib.runner.models.vision import build_model

    times = {"import_s": time.time() - t_import}
    t = time.time()
    ctx = distlib.init("auto" if args.device == "auto" else ("nccl" if args.device == "cuda" else "gloo"))
    device = ctx.device
    times["init_s"] = time.time() - t
    t = time.time()

    class Model(nn.Module):
        """The model under a class of this file: dynamo does not compile a frame of torch.nn's own
        (a bare nn.Sequential) that it is handed directly, as DDP's forward hands it the module."""

        def __init__(self, body: nn.Module):
            super().__init__()
            self.body = body

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    torch.manual_seed(0)
    model = Model(build_model(args.model, 10, args.width)).to(device)
    gpu = device.type == "cuda"
    if gpu:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sync = None
    if args.child == "distlib":
        sync = distlib.GradSync(model)
        net = distlib.compile_for_sync(model, sync)
    elif args.child == "plain":  # one graph, no split (the overlap is lost): what the split itself costs
        sync = distlib.GradSync(model)
        net = torch.compile(model)
    else:
        net = torch.compile(nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if gpu else None))
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=g).to(device)
    if gpu:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.batch,), generator=g).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu)
    times["model_s"] = time.time() - t

    def step() -> float:
        t0 = time.time()
        with autocast:
            loss = F.cross_entropy(net(x), y)
        loss.backward()
        if sync is not None:
            sync.wait()
        opt.step()
        opt.zero_grad()
        if gpu:
            torch.cuda.synchronize()
        distlib.barrier()  # the slowest rank's time
        return time.time() - t0

    times["first_step_s"] = step()
    times["second_step_s"] = step()
    later = [step() for _ in range(args.steps)]
    times["later_step_s"] = sum(later) / max(len(later), 1)
    times["start_to_steady_s"] = time.time() - _T_START  # the child's own start, not torchrun's
    out = {"mode": args.child, "world_size": ctx.world_size, "device": str(device), **times, **_counters()}
    if ctx.is_main:
        print(_TAG + json.dumps(out), flush=True)
        if args.compile_times:  # where the compile time went, by dynamo's and inductor's own phases
            print(torch._dynamo.utils.compile_times(repr="str"), flush=True)
    distlib.shutdown()


# ---- the driver -----------------------------------------------------------------------------------
def _run(mode: str, phase: str, cache: str, args: argparse.Namespace) -> dict:
    if phase == "cold" and os.path.isdir(cache):
        import shutil

        shutil.rmtree(cache)
    os.makedirs(cache, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           os.path.abspath(__file__), "--child", mode, "--device", args.device, "--model", args.model,
           "--width", str(args.width), "--batch", str(args.batch), "--image-size", str(args.image_size),
           "--steps", str(args.steps)] + (["--compile-times"] if args.compile_times else [])  # fmt: skip
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": ROOT}
    t = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.time() - t
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_TAG)]
    if args.compile_times:
        table = proc.stdout.split(_TAG, 1)[-1].split("\n", 1)[-1]
        print(f"--- {mode} {phase}: compile_times ---\n{table}", flush=True)
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        return {"mode": mode, "phase": phase, "error": f"exit status {proc.returncode}", "command_s": wall}
    return {"phase": phase, **json.loads(lines[-1][len(_TAG) :]), "command_s": wall}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}: choose from {', '.join(MODES)}")
    root = args.cache_dir or tempfile.mkdtemp(prefix="compile_startup_")
    phases = ["cold", "warm"] if args.runs == "both" else [args.runs]
    rows = []
    for mode in args.modes:
        for phase in phases:
            row = _run(mode, phase, os.path.join(root, mode), args)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\ninductor caches under {root}")
    print(f"{'mode':8} {'cache':5} {'command s':>9} {'import':>6} {'init':>5} {'1st step':>8} {'2nd':>6} {'later':>6} "
          f"{'graphs':>6} {'recomp':>6}  cache counters")  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:8} {r['phase']:5} {r['command_s']:9.1f}  {r['error']}")
            continue
        caches = ", ".join(f"{k}={v}" for k, v in r.items() if "cache" in k)
        print(f"{r['mode']:8} {r['phase']:5} {r['command_s']:9.1f} {r['import_s']:6.1f} {r['init_s']:5.1f} "
              f"{r['first_step_s']:8.2f} {r['second_step_s']:6.3f} {r['later_step_s']:6.3f} {r['graphs']:6} "
              f"{r['recompiles']:6}  {caches}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
