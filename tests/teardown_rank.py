"""One rank of the teardown stress test (run as a script by tests/teardown_stress.py).

It starts the group, runs a few collectives and exits right after the last one:
the moment at which gloo used to abort the process ("terminate called without
an active exception"). TEARDOWN selects the ending:
  shutdown  distlib.shutdown(), as launch.py does
  atexit    no shutdown() call: distlib's exit handler must tear the group down
  raw       plain torch.distributed, never destroyed: the bug, for comparison
"""

import os
import sys

import torch
import torch.distributed as dist

import distlib

mode = os.environ.get("TEARDOWN", "shutdown")
if mode == "raw":
    dist.init_process_group("gloo")
    t = torch.ones(1000)
    dist.all_reduce(t)
    sys.exit(0)

ctx = distlib.init("gloo", timeout_s=120)
t = torch.full((1000,), float(ctx.rank + 1))
distlib.all_reduce(t)
assert t[0].item() == ctx.world_size * (ctx.world_size + 1) / 2, t[0].item()
names = distlib.all_gather_object(f"rank{ctx.rank}")
assert names == [f"rank{r}" for r in range(ctx.world_size)], names
u = torch.ones(1000)
distlib.all_reduce(u)  # the last collective: nothing but the teardown after it
if mode == "shutdown":
    distlib.shutdown()
