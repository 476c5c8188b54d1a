"""One rank of the teardown stress test (run as a script by tests/library/teardown_stress.py).

Like a training script: it starts the group, builds an optimizer (whose first
construction imports torch._dynamo), runs a few collectives and exits right
after the last one: the moment at which gloo aborted the process ("terminate
called without an active exception"). TEARDOWN selects the ending:
  shutdown  distlib.shutdown(), as launch.py does
  atexit    no shutdown() call: distlib's exit handler must tear the group down
  raw       plain torch.distributed and destroy_process_group(): the bug, for comparison
WIDEN=1 makes the race certain instead of occasional: a completion callback keeps
gloo's worker thread busy with the finished collective (0.3 s, without the GIL)
while the main thread goes on to exit, as a descheduled worker thread does by chance.
"""

import os
import time

import torch
import torch.distributed as dist

import distlib


def last_collective() -> None:
    t = torch.ones(1000)
    if os.environ.get("WIDEN") != "1":
        dist.all_reduce(t)
        return
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    fut.then(lambda _: time.sleep(0.3))  # runs on the worker thread, after fut is marked done
    del work
    fut.wait()


mode = os.environ.get("TEARDOWN", "shutdown")
if mode == "raw":
    dist.init_process_group("gloo")
    opt = torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.1)
    last_collective()
    dist.destroy_process_group()
    raise SystemExit(0)

ctx = distlib.init("gloo", timeout_s=120)
opt = torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.1)
t = torch.full((1000,), float(ctx.rank + 1))
distlib.all_reduce(t)
assert t[0].item() == ctx.world_size * (ctx.world_size + 1) / 2, t[0].item()
names = distlib.all_gather_object(f"rank{ctx.rank}")
assert names == [f"rank{r}" for r in range(ctx.world_size)], names
last_collective()  # nothing but the teardown after it
if mode == "shutdown":
    distlib.shutdown()
