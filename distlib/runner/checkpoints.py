"""The run's checkpoints in ``<run>/checkpoints``, in the format ``dist.shard`` needs.

Replicated training (``dist.shard=none``) keeps ``distlib.Checkpointer`` (one file written by rank 0).
Sharded training saves through ``distlib.ShardedCheckpointer``: every rank writes its own shards,
and a checkpoint loads at another world size. The per-rank values the trainer keeps (each rank's
RNG state, buffers and ``rank_state_dict()``s) travel in it as one small replicated object. The two
formats never stand in for each other: a resume that finds the other one stops and says what to do.
Design: docs/sharding.md ("With the runner").
"""

from __future__ import annotations

import io
import os
import re
import shutil
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from distlib.checkpoint.checkpointer import Checkpointer, CheckpointError, RankStateful, rng_state, set_rng_state
from distlib.distributed import collectives
from distlib.log import get_logger

# ShardedCheckpointer's directory names, committed and partial; the replicated path does not import it:
# torch.distributed.checkpoint adds more than a second to the start-up
_SHARDED = re.compile(r"^(\.partial-)?step\d{9}$")


class RunCheckpoints:
    """``resume`` at the start of a run, ``save`` at a position. Both are collectives: every rank
    must call them, in the same order."""

    directory: str

    def resume(self, *, enabled: bool, epochs: int) -> None:
        """Load the newest valid checkpoint into the objects (``enabled``), or delete every old one."""
        raise NotImplementedError

    def save(self, *, epoch: int, step: int, global_step: int, async_: bool = False) -> None:
        """``async_``: staged to host memory and written in the background (at most one in flight: the
        next save waits for it, and ``distlib.shutdown()`` finishes it), as atomically as a synchronous one."""
        raise NotImplementedError

    def wait_staged(self) -> None:
        """Block until the save in flight is staged: for a step whose optimizer runs inside a CUDA graph."""


def _other_format(found: list[str], directory: str, saved: str, here: str) -> CheckpointError:
    return CheckpointError(
        f"{directory} holds checkpoints of {saved} training ({os.path.basename(found[0])}), this run has {here}: "
        "the two formats do not load into each other; resume with the dist.shard they were saved with, "
        "or set run.resume=false (this deletes them), or use another run.out_dir"
    )


class ReplicatedCheckpoints(RunCheckpoints):
    """``distlib.Checkpointer``: one file per checkpoint, written by rank 0."""

    def __init__(self, directory: str, objects: Mapping[str, Any], fingerprint: dict[str, Any], *, keep: int,
                 is_main: bool):  # fmt: skip
        self.directory, self.objects, self.fingerprint = directory, objects, fingerprint
        self.checkpointer = Checkpointer(directory, keep=keep, is_main=is_main)

    def resume(self, *, enabled: bool, epochs: int) -> None:
        if not enabled:
            _delete_sharded(self.directory)
        elif found := collectives.broadcast_object(_sharded_paths(self.directory) if collectives.rank() == 0 else None):
            raise _other_format(found, self.directory, "sharded (dist.shard=optimizer or full)", "dist.shard=none")
        self.checkpointer.resume(self.objects, fingerprint=self.fingerprint, enabled=enabled, epochs=epochs)

    def save(self, *, epoch: int, step: int, global_step: int, async_: bool = False) -> None:
        self.checkpointer.save(self.objects, epoch=epoch, step=step, global_step=global_step,
                               fingerprint=self.fingerprint, async_=async_)  # fmt: skip


def _sharded_paths(directory: str) -> list[str]:
    """The sharded checkpoints in ``directory``, committed or partial, in name order."""
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    return [os.path.join(directory, n) for n in names if _SHARDED.match(n)]


def _delete_sharded(directory: str) -> None:
    """Every committed and partial sharded checkpoint in ``directory`` (rank 0), then a barrier."""
    if collectives.rank() == 0:
        paths = _sharded_paths(directory)
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
        if paths:
            get_logger().warning("resume disabled: deleted the old checkpoints in %s", directory)
    collectives.barrier()


class RankStates:
    """Every rank's own values, gathered into one replicated object of a sharded checkpoint: its
    RNG states, the buffers of the modules (BatchNorm statistics follow each rank's batches) and the
    ``rank_state_dict()`` of the ``RankStateful`` objects. ``gather()`` (a collective) before a save;
    after a load at the same world size each rank takes its own back. At another world size a
    rank's RNG and buffers have no owner: the RNG continues, the buffers are the checkpoint's
    (rank 0's), and each ``RankStateful`` gets ``load_rank_state_dict(mean)``, the mean of the saved
    ones, which keeps any mean over the ranks (the epoch's training loss) what it was."""

    def __init__(self, objects: Mapping[str, Any]):
        self.objects = objects
        self._saved = b""

    def gather(self) -> None:
        buffers = {n: {k: b.detach().cpu() for k, b in o.named_buffers()} for n, o in self.objects.items()
                   if isinstance(o, nn.Module)}  # fmt: skip
        own = {n: _cpu(o.rank_state_dict()) for n, o in self.objects.items() if isinstance(o, RankStateful)}
        ranks = collectives.all_gather_object({"rng": rng_state(), "buffers": buffers, "states": own})
        buf = io.BytesIO()
        torch.save(ranks, buf)
        self._saved = buf.getvalue()  # one opaque value: DCP writes it once and reads it whole at any world size

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": self._saved}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ranks = torch.load(io.BytesIO(state["ranks"]), weights_only=True)
        rank, world = collectives.rank(), collectives.world_size()
        if len(ranks) == world:
            mine = ranks[rank]
            set_rng_state(mine["rng"])
            with torch.no_grad():
                for name, obj in self.objects.items():
                    if isinstance(obj, nn.Module):
                        for key, b in obj.named_buffers():
                            b.copy_(mine["buffers"][name][key])
            for name, obj in self.objects.items():
                if isinstance(obj, RankStateful):
                    obj.load_rank_state_dict(mine["states"][name])
            return
        get_logger().warning(
            "checkpoint written by %d rank(s), this run has %d: each rank's RNG state is not restored and the "
            "buffers are the checkpoint's, so a model that draws random numbers in training (dropout) or keeps "
            "per-rank statistics continues correctly but not bit for bit as an uninterrupted run would",
            len(ranks), world,
        )  # fmt: skip
        for name, obj in self.objects.items():
            if isinstance(obj, RankStateful):
                obj.load_rank_state_dict(_mean([r["states"][name] for r in ranks]))


def _cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _mean(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean over the ranks of each tensor; other values rank 0's."""
    return {k: torch.stack([s[k] for s in states]).mean(0) if isinstance(v, torch.Tensor) else v
            for k, v in states[0].items()}  # fmt: skip


class ShardedRunCheckpoints(RunCheckpoints):
    """``distlib.ShardedCheckpointer``: every rank writes its shards into ``step<global step>/``."""

    def __init__(self, directory: str, objects: Mapping[str, Any], settings: dict[str, Any], *, keep: int):
        from distlib.checkpoint.sharded import ShardedCheckpointer

        self.directory = directory
        self.ranks = RankStates(objects)
        self.objects = {**objects, "rank_states": self.ranks}
        self.checkpointer = ShardedCheckpointer(directory, keep=keep, settings=settings)
        self.replicated = Checkpointer(directory, is_main=collectives.rank() == 0)  # to find its files

    def resume(self, *, enabled: bool, epochs: int) -> None:
        if not enabled:
            _delete_sharded(self.directory)
            if self.replicated.clear():
                get_logger().warning("resume disabled: deleted the old checkpoints in %s", self.directory)
            collectives.barrier()
            return
        if found := collectives.broadcast_object(self.replicated.paths() if collectives.rank() == 0 else None):
            raise _other_format(found, self.directory, "replicated (dist.shard=none)", "a sharded dist.shard")
        try:
            step = self.checkpointer.resume(self.objects)
        except CheckpointError as e:  # the same on every rank
            raise CheckpointError(f"{e}\n(or set run.resume=false to start over: this deletes them; or use another "
                                  "run.out_dir)") from e  # fmt: skip
        if step is None:
            return
        state, path, log = self.objects["train_state"], self.checkpointer.paths()[0], get_logger()
        if epochs and state.epoch >= epochs:
            log.warning("%s is the final checkpoint: this run is complete, nothing to do "
                        "(set run.resume=false or another run.out_dir to train again)", path)  # fmt: skip
        else:
            log.info("resuming from %s: epoch %d, step %d", path, state.epoch, state.step)

    def save(self, *, epoch: int, step: int, global_step: int, async_: bool = False) -> None:
        self.ranks.gather()
        self.checkpointer.save(global_step, self.objects, async_=async_)

    def wait_staged(self) -> None:
        self.checkpointer.wait_staged()


def build_checkpoints(
    directory: str,
    objects: Mapping[str, Any],
    *,
    shard: str,
    fingerprint: dict[str, Any],
    keep: int,
    is_main: bool,
) -> RunCheckpoints:
    """The checkpoints of a run with ``dist.shard=shard``: sharded ones unless it is "none" (the
    settings of ``fingerprint`` and dist.shard checked on resume, the tensors' global shapes by
    ShardedCheckpointer itself), replicated ones otherwise."""
    if shard != "none":
        # optimizer and full save the optimizer state in other layouts (flat slices, DTensors of each
        # parameter's shape): dist.shard is part of what a checkpoint is valid for
        return ShardedRunCheckpoints(directory, objects, {**fingerprint["settings"], "dist.shard": shard}, keep=keep)
    return ReplicatedCheckpoints(directory, objects, fingerprint, keep=keep, is_main=is_main)
