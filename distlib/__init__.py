"""distlib: distributed training for PyTorch, small enough to drop into an existing script.

ctx = distlib.init()                       # torchrun, srun, mpirun or a PyTorchJob; or world size 1
loader = distlib.distributed_loader(ds, batch_size=64)
sync = distlib.GradSync(model)             # after loss.backward(): sync.wait()
...
distlib.shutdown()
"""

from distlib.collectives import (
    all_gather_object,
    all_reduce,
    barrier,
    broadcast,
    broadcast_object,
    reduce,
    sync_buffers,
)
from distlib.comm_fallback import Replicas
from distlib.grad_sync import GradSync
from distlib.log import get_logger
from distlib.process_group import Context, EnvError, init, shutdown
from distlib.sampler import EpochLoader, ExactDistributedSampler, distributed_loader

__version__ = "0.1.0"  # the one place the version is set (pyproject.toml reads it)

__all__ = [
    "Context",
    "EnvError",
    "EpochLoader",
    "ExactDistributedSampler",
    "GradSync",
    "Replicas",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "distributed_loader",
    "get_logger",
    "init",
    "reduce",
    "shutdown",
    "sync_buffers",
]
