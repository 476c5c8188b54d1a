"""distlib: distributed training for PyTorch, small enough to drop into an existing script.

ctx = distlib.init()                       # torchrun, srun, mpirun or a PyTorchJob; or world size 1
loader = distlib.distributed_loader(ds, batch_size=64)
sync = distlib.GradSync(model)             # after loss.backward(): sync.wait()
net = distlib.compile_for_sync(model, sync)  # torch.compile, the all_reduces still overlapped
distlib.compile_blocks(distlib.find_blocks(model))  # or: each repeated block compiled, in place
...
distlib.shutdown()

Also here: ``Replicas`` (one process drives every GPU of its node), ``CapturedStep`` (a whole
training step as a CUDA graph), ``compile_blocks`` and ``checkpoint_blocks`` (compile and activation
checkpointing per block, the blocks from ``find_blocks``), ``EMA`` (a weight average the graph can
update), ``convert_to_float8`` (the blocks' matrix products in float8 through torchao: ``distlib[fp8]``),
``Checkpointer``, ``shard_model`` and ``FSDPSync`` (full sharding through FSDP2),
``ShardedCheckpointer`` and ``export_checkpoint`` (torch.distributed.checkpoint: per-rank shards),
``StopSignal`` (SIGTERM/SIGINT stop every rank at one step boundary), ``Watchdog`` (ends a rank that
stopped running), ``collectives``, and the errors they raise.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each public name and the module that defines it, imported at the name's first use: `import distlib`
# loads no torch, so a program that starts with it (the runner's command) can install its signal
# handlers before the seconds of torch's import; and torch.distributed.checkpoint and FSDP2 load only
# where used. `collectives` is the module itself.
_WHERE: dict[str, str] = {
    "Checkpointer": "distlib.checkpoint.checkpointer",
    "CheckpointError": "distlib.checkpoint.state",
    "EpochLoader": "distlib.data.sampler",
    "ExactDistributedSampler": "distlib.data.sampler",
    "LoaderError": "distlib.data.sampler",
    "distributed_loader": "distlib.data.sampler",
    "collectives": "distlib.distributed.collectives",
    "all_gather_object": "distlib.distributed.collectives",
    "all_reduce": "distlib.distributed.collectives",
    "barrier": "distlib.distributed.collectives",
    "broadcast": "distlib.distributed.collectives",
    "broadcast_object": "distlib.distributed.collectives",
    "reduce": "distlib.distributed.collectives",
    "sync_buffers": "distlib.distributed.collectives",
    "ModelMismatchError": "distlib.distributed.model_check",
    "Context": "distlib.distributed.process_group",
    "EnvError": "distlib.distributed.process_group",
    "init": "distlib.distributed.process_group",
    "shutdown": "distlib.distributed.process_group",
    "ArgumentError": "distlib.errors",
    "DistlibError": "distlib.errors",
    "get_logger": "distlib.log",
    "find_blocks": "distlib.parallel.blocks",
    "Replicas": "distlib.parallel.comm_fallback",
    "GradSync": "distlib.parallel.grad_sync",
    "GradSyncError": "distlib.parallel.grad_sync",
    "GradSyncTimeout": "distlib.parallel.grad_sync",
    "ShardedOptimizer": "distlib.parallel.sharded_optimizer",
    "ShardingError": "distlib.parallel.sharded_optimizer",
    "StopSignal": "distlib.reliability.stop",
    "Watchdog": "distlib.reliability.watchdog",
    "checkpoint_blocks": "distlib.step.activation_checkpointing",
    "compile_blocks": "distlib.step.compile",
    "compile_for_sync": "distlib.step.compile",
    "CapturedStep": "distlib.step.cuda_graph",
    "CaptureUnsupported": "distlib.step.cuda_graph",
    "EMA": "distlib.step.ema",
    "Float8Error": "distlib.step.float8",
    "convert_to_float8": "distlib.step.float8",
    "float8_layers": "distlib.step.float8",
    "precompute_float8_scales": "distlib.step.float8",
    "ShardedCheckpointer": "distlib.checkpoint.sharded",
    "export_checkpoint": "distlib.checkpoint.sharded",
    "FSDPSync": "distlib.parallel.fsdp",
    "shard_model": "distlib.parallel.fsdp",
    "build_converted": "distlib.parallel.deferred_init",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'distlib' has no attribute {name!r}")
    module = importlib.import_module(where)
    value = module if name == "collectives" else getattr(module, name)
    globals()[name] = value  # the next use is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


if TYPE_CHECKING:  # what static tools read: the same names, imported
    from distlib.checkpoint.checkpointer import Checkpointer
    from distlib.checkpoint.sharded import ShardedCheckpointer, export_checkpoint
    from distlib.checkpoint.state import CheckpointError
    from distlib.data.sampler import EpochLoader as EpochLoader  # returned by distributed_loader; kept importable
    from distlib.data.sampler import ExactDistributedSampler, LoaderError, distributed_loader
    from distlib.distributed import collectives
    from distlib.distributed.collectives import (
        all_gather_object,
        all_reduce,
        barrier,
        broadcast,
        broadcast_object,
        reduce,
        sync_buffers,
    )
    from distlib.distributed.model_check import ModelMismatchError
    from distlib.distributed.process_group import Context, EnvError, init, shutdown
    from distlib.errors import ArgumentError, DistlibError
    from distlib.log import get_logger
    from distlib.parallel.blocks import find_blocks
    from distlib.parallel.comm_fallback import Replicas
    from distlib.parallel.deferred_init import build_converted
    from distlib.parallel.fsdp import FSDPSync, shard_model
    from distlib.parallel.grad_sync import GradSync, GradSyncError, GradSyncTimeout
    from distlib.parallel.sharded_optimizer import ShardedOptimizer, ShardingError
    from distlib.reliability.stop import StopSignal
    from distlib.reliability.watchdog import Watchdog
    from distlib.step.activation_checkpointing import checkpoint_blocks
    from distlib.step.compile import compile_blocks, compile_for_sync
    from distlib.step.cuda_graph import CapturedStep, CaptureUnsupported
    from distlib.step.ema import EMA
    from distlib.step.float8 import Float8Error, convert_to_float8, float8_layers, precompute_float8_scales

__version__ = "0.1.0"  # the one place the version is set (pyproject.toml reads it)

__all__ = [
    "ArgumentError",
    "CaptureUnsupported",
    "CapturedStep",
    "CheckpointError",
    "Checkpointer",
    "Context",
    "DistlibError",
    "EMA",
    "EnvError",
    "ExactDistributedSampler",
    "Float8Error",
    "FSDPSync",
    "GradSync",
    "GradSyncError",
    "GradSyncTimeout",
    "LoaderError",
    "ModelMismatchError",
    "Replicas",
    "ShardedCheckpointer",
    "ShardedOptimizer",
    "ShardingError",
    "StopSignal",
    "Watchdog",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "build_converted",
    "checkpoint_blocks",
    "collectives",
    "compile_blocks",
    "compile_for_sync",
    "convert_to_float8",
    "distributed_loader",
    "export_checkpoint",
    "find_blocks",
    "float8_layers",
    "get_logger",
    "init",
    "precompute_float8_scales",
    "reduce",
    "shard_model",
    "shutdown",
    "sync_buffers",
]
