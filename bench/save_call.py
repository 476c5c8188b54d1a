"""Where the call of an in-place asynchronous save spends its time (the runner's final save: what the
final evaluation waits for), with the model replicated or under FSDP2, one process.

    python -m bench.save_call --shard full --size 1.5B      # on a GPU; also --shard none
    python -m bench.save_call --shard full --size tiny      # anywhere (gloo on the CPU)
    python -m bench.save_call --shard none --size 124M      # 1.4 GiB of state, on a CPU too
    python -m bench.save_call --shard none --size 124M --writeback off   # the files' pages left to the fsync

The GPT (1.5B: 48 x 1600, vocabulary 50304; tiny: 48 x 64, vocabulary 256: as many tensors) takes
one AdamW step, then ``ShardedCheckpointer.save(..., async_=True, in_place=True)`` runs twice into a
temporary directory (``--dir``, deleted after). Per save: the call (until it returns), the whole save
(until committed), and the time inside the save's steps (the state dicts, the fingerprint, the
layout, the host copy, the staging), each timed to the end of its GPU work; then the phases of the
whole save that the runner reports (``ShardedCheckpointer.phases``): the copies to the host, DCP's
writes, the files' fsync, the wait for the write, the commit.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

import distlib
from distlib.checkpoint import sharded, writeback
from distlib.runner.models.gpt import GPT, GPTConfig

SIZES = {
    "1.5B": GPTConfig(vocab_size=50304, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
    "124M": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=48, n_head=2, n_embd=64),
}
# ShardedCheckpointer.phases: where the whole save's time went, as the runner's summary.json reports it
PHASES = ["to_host_s", "write_s", "fsync_s", "waited_s", "commit_s"]
PARTS = ["_state_dicts", "get_model_state_dict", "get_optimizer_state_dict", "model_fingerprint", "_layout",
         "_host_copy", "_stage_into"]  # fmt: skip


def _timed(owner: Any, name: str, times: dict[str, float], cuda: bool) -> None:
    f = getattr(owner, name)

    @functools.wraps(f)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            if cuda:
                torch.cuda.synchronize()
            times[name] = times.get(name, 0.0) + time.perf_counter() - t

    setattr(owner, name, timed)


def run(shard: str, size: str, directory: str = "", saves: int = 2) -> list[dict[str, float]]:
    """The rows: one per save, in seconds."""
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    times: dict[str, float] = {}
    for name in PARTS:
        _timed(sharded, name, times, cuda)
    _timed(sharded.ShardedCheckpointer, "_stage", times, cuda)
    cfg = SIZES[size]
    torch.manual_seed(0)
    if shard == "full":
        dtype = torch.bfloat16 if cuda else None
        model = distlib.shard_model(lambda: GPT(cfg), param_dtype=dtype, reduce_dtype=torch.float32 if cuda else None,
                                    device=device)  # fmt: skip
    else:
        with torch.device(device):
            model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), device=device)
    with torch.autocast(device.type, torch.bfloat16, enabled=cuda and shard != "full"):
        model(x).float().mean().backward()
    opt.step()
    opt.zero_grad()
    if cuda:
        torch.cuda.synchronize()
    path = tempfile.mkdtemp(dir=directory or None)
    rows = []
    try:
        ck = sharded.ShardedCheckpointer(path, keep=1)
        for i in range(saves):
            times.clear()
            t = time.perf_counter()
            ck.save(i + 1, {"model": model, "optimizer": opt}, async_=True, in_place=True)
            call = time.perf_counter() - t
            ck.wait()
            total = time.perf_counter() - t
            rows.append({"save": i + 1, "call_s": call, "total_s": total, **times,
                         **{k: v for k, v in ck.phases.items() if k in PHASES}})  # fmt: skip
        ck.close()
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shard", choices=["none", "full"], default="full")
    p.add_argument("--size", choices=sorted(SIZES), default="1.5B")
    p.add_argument("--dir", default="", help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--saves", type=int, default=2)
    p.add_argument("--writeback", choices=["on", "off"], default="on")
    args = p.parse_args(argv)
    if args.writeback == "off":
        writeback.EVERY = 1 << 62  # never reached: every page waits for the fsync
    rows = run(args.shard, args.size, args.dir, args.saves)
    names = ["call_s", "total_s", *PARTS, "_stage", *PHASES]
    print(f"in-place asynchronous save, shard={args.shard}, {args.size} GPT, writeback {args.writeback}, seconds")
    print("| save | " + " | ".join(n.strip("_") for n in names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for r in rows:
        print(f"| {r['save']} | " + " | ".join(f"{r.get(n, 0.0):.2f}" for n in names) + " |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
