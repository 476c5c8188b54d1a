"""One rank of a script whose ending distlib.shutdown() (or the exit hook) must make clean (run by
tests/library/test_teardown.py under torchrun: a real interpreter exit, its stderr read).

MODE selects what the script does before it ends:
  fsdp          trains a shard_model model with FSDPSync and AdamW, then distlib.shutdown()
  async         ShardedCheckpointer.save(..., async_=True), then distlib.shutdown() without close()
  async-atexit  the same save, then the script ends without shutdown() or close(): the exit hook
CKPT_DIR: the checkpoint directory of the async modes.
"""

import os

import torch
from torch import nn

import distlib


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


mode = os.environ["MODE"]
ctx = distlib.init("gloo", timeout_s=60)
torch.manual_seed(0)
if mode == "fsdp":
    model = distlib.shard_model(net, block_types=[nn.Linear])
    sync = distlib.FSDPSync(model)
else:
    model = net()
    sync = distlib.GradSync(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
ck = distlib.ShardedCheckpointer(os.environ.get("CKPT_DIR", "unused"), keep=2) if mode != "fsdp" else None
for step in range(3):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 10 + ctx.rank))
    model(x).square().mean().backward()
    sync.wait()
    opt.step()
    opt.zero_grad()
if ck is not None:
    ck.save(3, {"model": model, "optimizer": opt}, async_=True)  # neither wait() nor close() follows
if mode != "async-atexit":
    distlib.shutdown()
