"""The fallback mode against nn.DataParallel and DDP, in one call on one multi-GPU node.

ResNet18-CIFAR, bf16 autocast, channels_last, synthetic data on the GPU, SGD; 512 images per
GPU by default. nn.DataParallel, DDP eager and one GPU eager come from the baseline script
(bench/baselines/rn18_throughput.py, run as subprocesses); the fallback mode (eager, and with
per-replica CUDA graphs) runs in this process, followed by where a fallback step's time goes.

    python bench/fallback_bench.py [--baselines bench/baselines] [--batch 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from distlib.comm_fallback import benchmark_step, step_breakdown  # noqa: E402

_RESULT = re.compile(r"RESULT .*step_ms=([\d.]+) images_per_s=([\d.]+)")


def run_baseline(baselines: str, mode: str, batch: int, nproc: int = 0, steps: int = 40, warm: int = 10) -> dict | None:
    script = os.path.join(baselines, "rn18_throughput.py")
    env = {**os.environ, "MODE": mode, "BATCH": str(batch), "STEPS": str(steps), "WARM": str(warm)}
    cmd = [sys.executable, script]
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script]
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    m = _RESULT.search(proc.stdout)
    if proc.returncode != 0 or not m:
        print(f"baseline {mode} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}", flush=True)
        return None
    print(f"  baseline {mode}: {float(m.group(2)):.0f} images/s ({time.perf_counter() - t:.0f} s)", flush=True)
    return {"images_per_s": float(m.group(2)), "step_ms": float(m.group(1))}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baselines", default=os.path.join(ROOT, "bench", "baselines"), help="folder of rn18_throughput.py")
    p.add_argument("--batch", type=int, default=512, help="images per GPU")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--model",
        choices=["baseline", "distlib"],
        default="baseline",
        help="baseline: the baseline's ResNet18 (the network of the DP/DDP figures); distlib: models.py's",
    )
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args(argv)
    n = torch.cuda.device_count()
    if n == 0:
        print("error: no GPU visible; this benchmark needs a node with GPUs", file=sys.stderr)
        return 2
    have_baselines = os.path.isfile(os.path.join(args.baselines, "rn18_throughput.py"))
    model_fn = None
    if args.model == "baseline":
        if not have_baselines:
            msg = f"error: no rn18_throughput.py in {args.baselines}; pass --baselines DIR or --model distlib"
            print(msg, file=sys.stderr)
            return 2
        sys.path.insert(0, args.baselines)
        from common import ResNet18  # the baseline's model: the same network as the DP/DDP figures

        model_fn = ResNet18
    print(f"{n} GPU(s): {torch.cuda.get_device_name(0)}; torch {torch.__version__}; {args.batch} images per GPU; "
          f"model: {args.model}'s ResNet18-CIFAR", flush=True)  # fmt: skip

    results: dict[str, dict] = {}
    if have_baselines:
        print("baselines (subprocesses):", flush=True)
        for name, mode, nproc, steps, warm in [
            ("1 GPU eager (baseline)", "single", 0, args.steps, 10),
            (f"DDP eager, {n} GPUs (baseline)", "ddp", n, args.steps, 10),
            (f"nn.DataParallel, {n} GPUs (baseline)", "dp", 0, 10, 3),  # ~0.8 s a step: fewer steps
        ]:
            r = run_baseline(args.baselines, mode, args.batch, nproc, steps, warm)
            if r:
                results[name] = r
    print("fallback mode (this process):", flush=True)
    for name, devices, graph in [
        (f"fallback eager, {n} GPUs", None, False),
        (f"fallback + per-replica CUDA graphs, {n} GPUs", None, True),
        ("fallback + CUDA graph, 1 GPU", [0], True),
    ]:
        t = time.perf_counter()
        try:  # one failure must not cost the rest of the device call
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
