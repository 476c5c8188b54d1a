"""Where in backward GradSync's bucket all_reduces start: eager, torch.compile, and the fixes.

    torchrun --standalone --nproc-per-node=2 bench/compile_overlap.py --modes eager,compile,sync

Modes: eager; compile (torch.compile(model)); sync (distlib.compile_for_sync); ddpopt (torch's
DDPOptimizer as the backend, with GradSync's bucket sizes as caps); ca (torch.compile(model), the
backward under compiled autograd); blocks (``Module.compile()`` on every largest submodule whose
parameters lie in one bucket).
``--backend aot_eager`` skips inductor's C++ compilation (same graphs, same autograd nodes).

For each mode, after warm-up steps, one backward is recorded: the time of each bucket launch as a
fraction of the backward's wall time, and the fraction of the backward's compute nodes (autograd
nodes other than AccumulateGrad: ops in eager, one per compiled graph otherwise) executed before
each launch. Runs on CPU (gloo) with small images.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import distlib  # noqa: E402
from distlib.parallel.grad_sync import GradSync  # noqa: E402
from distlib.runner.models.vision import build_model  # noqa: E402


def compute_nodes(root) -> list:
    """Every autograd node reachable from ``root`` except AccumulateGrad."""
    seen, stack, out = set(), [root], []
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        if type(n).__name__ != "AccumulateGrad":
            out.append(n)
        stack.extend(f for f, _ in n.next_functions)
    return out


def _backward(loss, ca_backend):
    """loss.backward(), through compiled autograd when ``ca_backend`` is given."""
    if ca_backend is None:
        loss.backward()
        return
    from torch._dynamo import compiled_autograd

    with compiled_autograd._enable(torch.compile(backend=ca_backend)):
        loss.backward()


def record(model, sync, x, y, events, ca_backend=None) -> tuple:
    """One step; returns step and backward seconds, (time fraction, node fraction) per launch, and the
    number of compute nodes."""
    t_step = time.perf_counter()
    loss = F.cross_entropy(model(x), y)
    nodes = compute_nodes(loss.grad_fn)
    done = [0]
    handles = [n.register_hook(lambda *_: done.__setitem__(0, done[0] + 1)) for n in nodes]
    events.clear()
    events.append(("count", done))
    t0 = time.perf_counter()
    _backward(loss, ca_backend)
    t1 = time.perf_counter()
    sync.wait()
    t2 = time.perf_counter()
    for h in handles:
        h.remove()
    launches = [(t, c) for kind, t, c in events[1:]]
    return t2 - t_step, t1 - t0, [((t - t0) / (t1 - t0), c / len(nodes)) for t, c in launches], len(nodes)


def compile_blocks(model, sync, backend) -> None:
    """Compile in place every largest module whose parameters all lie in one bucket."""
    bucket_of = {id(s.param): s.bucket.index for s in sync._slots}

    def visit(m):
        touched = {bucket_of[id(p)] for p in m.parameters() if id(p) in bucket_of}
        if not touched:
            return
        if len(touched) == 1:
            m.compile(backend=backend)
            return
        for c in m.children():
            visit(c)

    visit(model)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--modes", default="eager,compile,blocks")
    p.add_argument("--model", default="resnet18_cifar")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--first-bucket-mb", type=float, default=1.0)
    args = p.parse_args()
    ctx = distlib.init("gloo")
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size)
    y = torch.randint(0, 10, (args.batch,))
    try:
        for mode in args.modes.split(","):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = build_model(args.model, 10, 16)
            sync = GradSync(model, args.bucket_mb, first_bucket_mb=args.first_bucket_mb)
            events: list = []
            launch = sync._launch

            def traced(bucket, launch=launch, events=events):
                if events:
                    events.append(("launch", time.perf_counter(), events[0][1][0]))
                launch(bucket)

            sync._launch = traced
            net = model
            t_compile = time.perf_counter()
            if mode == "compile":
                net = torch.compile(model, backend=args.backend)
            elif mode == "blocks":
                compile_blocks(model, sync, args.backend)
            elif mode == "sync":
                from distlib.step.compile import compile_for_sync

                net = compile_for_sync(model, sync, backend=args.backend)
            elif mode == "ddpopt":
                from torch._dynamo import lookup_backend
                from torch._dynamo.backends.distributed import DDPOptimizer

                ddpo = DDPOptimizer(
                    int(args.bucket_mb * 2**20), lookup_backend(args.backend), int(args.first_bucket_mb * 2**20)
                )
                net = torch.compile(model, backend=ddpo.compile_fn)
            elif mode == "ca":
                net = torch.compile(model, backend=args.backend)
            ca = args.backend if mode == "ca" else None
            for _ in range(args.steps):
                _backward(F.cross_entropy(net(x), y), ca)
                sync.wait()
            t_compile = time.perf_counter() - t_compile
            results = [record(net, sync, x, y, events, ca) for _ in range(3)]
            step, secs, launches, n = min(results, key=lambda r: r[0])
            if ctx.is_main:
                txt = " ".join(f"b{i}:t={tf:.2f},n={nf:.2f}" for i, (tf, nf) in enumerate(launches))
                print(
                    f"{mode:8} step {step * 1e3:7.1f} ms, backward {secs * 1e3:7.1f} ms, {n:4d} nodes, "
                    f"warm-up {t_compile:5.1f} s | {txt}",
                    flush=True,
                )
            sync.close()
    finally:
        distlib.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
