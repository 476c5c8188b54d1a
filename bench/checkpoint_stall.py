"""How long ShardedCheckpointer.save blocks training: synchronous vs asynchronous, and a training step.

    python -m bench.checkpoint_stall --mb 40                      # one process (CPU, or the GPU with --device cuda)
    torchrun --standalone --nproc-per-node=2 -m bench.checkpoint_stall --device cuda --fsdp

The model is a stack of square Linear layers with ``--mb`` MB of fp32 parameters and AdamW (so the
checkpoint is about 3x that). Each figure is the median over ``--repeats`` saves; the async save's
stall is the time ``save(..., async_=True)`` takes to return, its write finishing during the next
steps; the commit (``close``) is waited for outside the timing.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch import nn

import distlib
from distlib.distributed import collectives


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=40.0, help="fp32 parameter megabytes")
    p.add_argument("--width", type=int, default=1024, help="features of each square Linear layer")
    p.add_argument("--repeats", type=int, default=5, help="saves of each kind (the median is reported)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (this rank's GPU)")
    p.add_argument("--fsdp", action="store_true", help="fully_shard every layer (needs a process group)")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = p.parse_args()
    ctx = distlib.init()
    device = torch.device(args.device if args.device == "cpu" else ctx.device)
    layers = max(1, round(args.mb * 2**20 / 4 / (args.width * args.width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(layers)]).to(device)
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (ctx.world_size,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, args.width, device=device)

    def step() -> None:
        model(x).square().mean().backward()
        if not args.fsdp:
            for q in model.parameters():
                collectives.all_reduce(q.grad, "mean")
        opt.step()
        opt.zero_grad()

    def timed(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        collectives.barrier()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        root = collectives.broadcast_object(d)
        ck = distlib.ShardedCheckpointer(root, keep=2)
        for _ in range(3):
            step()
        steps = [timed(step) for _ in range(args.repeats)]
        sync, stall = [], []
        for i in range(args.repeats):
            sync.append(timed(lambda i=i: ck.save(2 * i, {"model": model, "optimizer": opt})))
            stall.append(timed(lambda i=i: ck.save(2 * i + 1, {"model": model, "optimizer": opt}, async_=True)))
            step()
            ck.close()
    if ctx.is_main:
        params = sum(q.numel() for q in model.parameters()) * 4 / 2**20
        s, a, st = statistics.median(sync), statistics.median(stall), statistics.median(steps)
        print(
            f"world {ctx.world_size} {device.type}{' fsdp' if args.fsdp else ''}: {params:.0f} MB of parameters; "
            f"step {st * 1e3:.1f} ms; sync save {s * 1e3:.0f} ms; async save stall {a * 1e3:.0f} ms "
            f"({a / s:.2f}x sync, {a / st:.1f} steps)"
        )
    distlib.shutdown()


if __name__ == "__main__":
    main()
