"""What a checkpoint costs training: synchronous save, asynchronous save, and ``torch.save`` of the same state.

    python -m bench.checkpoint_stall --mb 40                      # one process (CPU, or the GPU with --device cuda)
    torchrun --standalone --nproc-per-node=2 -m bench.checkpoint_stall --device cuda --fsdp

The model is a stack of square Linear layers with ``--mb`` MB of fp32 parameters and AdamW (so the
checkpoint is about 3x that). For each checkpointer (``ShardedCheckpointer``: DCP, every rank writes
its part; ``Checkpointer``: one file written by rank 0; the latter only without ``--fsdp``), medians
over ``--repeats`` saves of:

- ``sync save``: ``save()`` until it returns (the checkpoint committed);
- ``async blocked``: ``save(..., async_=True)`` until it returns (the state staged, or its copies queued
  on a GPU);
- ``steps slower``: how much longer the ``--after`` training steps that follow the asynchronous save
  take than as many steps without a save in flight (staging and the background write compete with them);
- ``async cost``: blocked + steps slower, what the asynchronous save costs training in all.

The anchor is ``torch.save`` of the same state (model and optimizer ``state_dict()``) into one file,
with fsync as the checkpointers do, by rank 0 (after a copy to the host on a GPU). The commit of an
asynchronous save is waited for outside the timings. Printed as a table, with each figure's ratio
to the anchor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn

import distlib
from distlib.distributed import collectives


def _torch_save(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """A new file each time, as a checkpoint is (rewriting one file in the page cache would flatter it)."""
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    if collectives.rank() == 0:
        if os.path.exists(path):
            os.unlink(path)
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=40.0, help="fp32 parameter megabytes")
    p.add_argument("--width", type=int, default=1024, help="features of each square Linear layer")
    p.add_argument("--repeats", type=int, default=5, help="saves of each kind (the median is reported)")
    p.add_argument("--after", type=int, default=3, help="training steps timed after each asynchronous save")
    p.add_argument("--batch", type=int, default=8, help="rows of each training step's input")
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
    x = torch.randn(args.batch, args.width, device=device)

    def step() -> None:
        model(x).square().mean().backward()
        if not args.fsdp:
            for q in model.parameters():
                collectives.all_reduce(q.grad, "mean")
        opt.step()
        opt.zero_grad()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed(fn: Callable[[], None]) -> float:
        sync()
        collectives.barrier()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    def steps() -> None:
        for _ in range(args.after):
            step()

    rows: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        root = collectives.broadcast_object(d)
        for _ in range(3):
            step()
        plain = statistics.median(timed(steps) for _ in range(args.repeats))
        anchor = statistics.median(
            timed(lambda: _torch_save(os.path.join(root, "anchor.pt"), model, opt)) for _ in range(args.repeats)
        )
        kinds: dict[str, tuple[Callable[[int], None], Callable[[int], None], Callable[[], None]]] = {}
        sharded = distlib.ShardedCheckpointer(os.path.join(root, "sharded"), keep=2)
        objects = {"model": model, "optimizer": opt}
        kinds["ShardedCheckpointer"] = (
            lambda i: sharded.save(i, objects),
            lambda i: sharded.save(i, objects, async_=True),
            sharded.close,
        )
        if not args.fsdp:
            one = distlib.Checkpointer(os.path.join(root, "file"), keep=2, is_main=ctx.is_main)
            fp = {"tensors": {}, "settings": {}}

            def save_one(i: int, async_: bool = False) -> None:
                one.save(objects, epoch=i, step=0, global_step=i, fingerprint=fp, async_=async_)

            kinds["Checkpointer"] = (save_one, lambda i: save_one(i, True), one.wait)
        for name, (save, save_async, wait) in kinds.items():
            sync_s, blocked, slower = [], [], []
            for i in range(args.repeats):
                sync_s.append(timed(lambda i=i, save=save: save(2 * i)))
                before = timed(steps)  # the same steps without a save in flight, just before (a busy machine drifts)
                blocked.append(timed(lambda i=i, save_async=save_async: save_async(2 * i + 1)))
                slower.append(timed(steps) - before)
                wait()
            b, s = statistics.median(blocked), statistics.median(slower)
            rows += [
                (f"{name} sync save", statistics.median(sync_s)),
                (f"{name} async blocked", b),
                (f"{name} {args.after} steps slower", s),
                (f"{name} async cost", b + max(s, 0.0)),
            ]
    if ctx.is_main:
        params = sum(q.numel() for q in model.parameters()) * 4 / 2**20
        print(
            f"world {ctx.world_size} {device.type}{' fsdp' if args.fsdp else ''}: {params:.0f} MB of parameters "
            f"(+ AdamW); {args.after} steps {plain * 1e3:.1f} ms"
        )
        print(f"| {'what':<40} | {'ms':>8} | {'x torch.save':>12} |")
        print(f"|{'-' * 42}|{'-' * 10}|{'-' * 14}|")
        for what, t in [("torch.save (anchor)", anchor), *rows]:
            print(f"| {what:<40} | {t * 1e3:>8.0f} | {t / anchor:>12.2f} |")
    distlib.shutdown()


if __name__ == "__main__":
    main()
