"""The run's checkpoints in ``<run>/checkpoints``: ``distlib.ShardedCheckpointer`` in every ``dist.shard`` mode.

Every rank writes its part of each checkpoint into ``step<global step>/``: the shards it holds
(``dist.shard=optimizer|full``) and its share of what every rank holds (DCP's planner spreads a
replicated model and its optimizer state over the ranks, so with ``dist.shard=none`` each of N
ranks writes about 1/N of it). The directory must be one every rank sees. The per-rank values
the trainer keeps (each rank's RNG state, buffers and ``rank_state_dict()``s) travel in it as one
small replicated object. One-file checkpoints (``distlib.Checkpointer``'s format) are refused by
name. Design: docs/sharding.md ("With the runner").
"""

from __future__ import annotations

import datetime
import io
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from distlib.checkpoint.layout import COMMITTED, DELETING, PARTIAL, discard
from distlib.checkpoint.state import CheckpointError, RankStateful, rng_state, set_rng_state
from distlib.distributed import collectives
from distlib.log import get_logger

if TYPE_CHECKING:
    from distlib.checkpoint.sharded import ShardedCheckpointer

# ShardedCheckpointer's directory names, committed and partial, and distlib.Checkpointer's file names: the
# run finds them without importing sharded.py. torch.distributed.checkpoint is imported at the first save,
# or at a resume that has a checkpoint to load: by then the optimizer has imported torch._dynamo, which
# shares most of its modules (about 0.04 s then, 0.45 s before it)
_KINDS = {
    "committed": COMMITTED,
    "partial": PARTIAL,
    "deleting": DELETING,  # a deletion a crash interrupted (never under a committed name)
    "one_file": re.compile(r"^epoch\d+-step\d+\.pt$"),
    "probe": re.compile(r"^\.rank0-[0-9a-f]{32}$"),  # left by a run that died at its start
}


def _listing(directory: str, *, delete: bool) -> dict[str, list[str]]:
    """Rank 0: the committed and the one-file checkpoints in ``directory``, in name order; partial
    directories of interrupted saves deleted, with a warning (``delete``: every checkpoint)."""
    log = get_logger()
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    found = {kind: [os.path.join(directory, n) for n in names if pattern.match(n)] for kind, pattern in _KINDS.items()}
    for p in found.pop("probe"):
        os.unlink(p)
    for p in found.pop("partial"):
        log.warning("deleting %s, the partial directory of an interrupted save", p)
        shutil.rmtree(p, ignore_errors=True)
    for p in found.pop("deleting"):
        shutil.rmtree(p, ignore_errors=True)
    if delete and (found["committed"] or found["one_file"]):
        for p in found["committed"]:
            discard(p)  # out of its committed name first: a kill in the middle leaves no half checkpoint
        for p in found["one_file"]:
            os.unlink(p)
        log.warning("resume disabled: deleted the old checkpoints in %s", directory)
        found = {"committed": [], "one_file": []}
    return found


def _one_file(found: list[str], directory: str) -> CheckpointError:
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    return CheckpointError(
        f"{directory} holds one-file checkpoints ({os.path.basename(found[0])}{more}): distlib.Checkpointer's format, "
        "which the runner no longer loads: it saves and resumes step<N>/ directories (ShardedCheckpointer) in every "
        "dist.shard mode; set run.resume=false to start over (this deletes them), or use another run.out_dir "
        "(torch.load(path, weights_only=True)['state'] still reads their state dicts)"
    )


def _check_shared(directory: str, probe: str, where: str) -> None:
    """Every rank sees the file ``probe`` that rank 0 wrote into ``directory`` (``where``, as rank 0 resolves
    it): each rank writes its part of every checkpoint there, and a resume reads all of them (a collective)."""
    if collectives.world_size() == 1:
        return
    seen = collectives.all_gather_object(os.path.isfile(os.path.join(directory, probe)))
    if collectives.rank() == 0:
        os.unlink(os.path.join(directory, probe))
    if not all(seen):
        blind = ", ".join(str(r) for r, s in enumerate(seen) if not s)
        raise CheckpointError(
            f"rank(s) {blind} do not see the checkpoint directory of rank 0, {where}: every rank writes its part of "
            "each checkpoint there, so run.out_dir must be on a file system every node shares (an absolute path, "
            "the same on every node)"
        )


class RankStates:
    """Every rank's own values, gathered into one replicated object of a checkpoint: its RNG states,
    the buffers of the modules (BatchNorm statistics follow each rank's batches) and the
    ``rank_state_dict()`` of the ``RankStateful`` objects. ``gather()`` (a collective) before a save;
    after a load at the same world size each rank takes its own back. At another world size a
    rank's RNG and buffers have no owner: the RNG continues, the buffers are the checkpoint's
    (of a buffer that every rank holds, DCP writes one rank's), and each ``RankStateful`` gets
    ``load_rank_state_dict(mean)``, the mean of the saved ones, which keeps any mean over the ranks
    (the epoch's training loss) what it was."""

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


class RunCheckpoints:
    """Every save and load of a run goes through here: ``resume`` at the start of a run, ``save`` at a
    position (``distlib.ShardedCheckpointer`` into ``step<global step>/``, created at the first save or at
    a resume that loads a checkpoint), ``save_weights`` for a run that keeps only its final weights. All
    are collectives: every rank must call them, in the same order, and so is ``commit_if_written``."""

    def __init__(self, directory: str, objects: Mapping[str, Any], settings: dict[str, Any], *, keep: int,
                 timeout_s: float = 300.0, staging: str = "auto"):  # fmt: skip
        self.directory, self.settings, self.keep, self.timeout_s = directory, settings, keep, timeout_s
        self.staging = staging
        self.ranks = RankStates(objects)
        self.objects = {**objects, "rank_states": self.ranks}
        self._checkpointer: ShardedCheckpointer | None = None
        self._in_flight = False  # a background save not yet committed
        self._group: dist.ProcessGroup | None = None  # where the ranks agree that it is written
        self._flag = torch.zeros(1, dtype=torch.int32)  # 1: this rank is still writing
        self._work: Any = None  # the all_reduce of the flags, one call behind
        self._gather_s = 0.0  # the last save's gathering of the ranks' own values

    @property
    def checkpointer(self) -> ShardedCheckpointer:
        if self._checkpointer is None:
            from distlib.checkpoint.sharded import ShardedCheckpointer

            # frozen=False: a frozen parameter (a LoRA model's base) is rebuilt by the model at every start
            # (from model.args.pretrained or its config and the seed); the checkpoint holds what trains
            self._checkpointer = ShardedCheckpointer(self.directory, keep=self.keep, settings=self.settings,
                                                     staging=self.staging, frozen=False)  # fmt: skip
        return self._checkpointer

    def resume(self, *, enabled: bool) -> None:
        """Load the newest usable checkpoint into the objects (``enabled``; an older one, with a warning, when
        the newest is damaged), or delete every old one. Partial directories of interrupted saves are deleted."""
        found = None
        if collectives.rank() == 0:
            found = {**_listing(self.directory, delete=not enabled), "probe": f".rank0-{uuid.uuid4().hex}",
                     "where": os.path.abspath(self.directory)}  # fmt: skip
            if collectives.world_size() > 1:
                os.makedirs(self.directory, exist_ok=True)
                open(os.path.join(self.directory, found["probe"]), "w").close()
        found = collectives.broadcast_object(found)
        _check_shared(self.directory, found["probe"], found["where"])
        if found["one_file"]:
            raise _one_file(found["one_file"], self.directory)
        if not found["committed"]:
            return  # a fresh start: nothing imports torch.distributed.checkpoint yet
        try:
            step = self.checkpointer.resume(self.objects, fallback=True)
        except CheckpointError as e:  # the same on every rank
            raise CheckpointError(f"{e}\n(or set run.resume=false to start over: this deletes them; or use another "
                                  "run.out_dir)") from e  # fmt: skip
        if step is not None:
            state = self.objects["train_state"]
            path = os.path.join(self.directory, f"step{step:09d}")
            get_logger().info("resuming from %s: epoch %d, step %d", path, state.epoch, state.step)

    def save(self, *, epoch: int, step: int, global_step: int, async_: bool = False, in_place: bool = False) -> None:
        """``async_``: staged to host memory and written in the background (at most one in flight: the
        next save waits for it), committed by ``commit_if_written`` once every rank has written it, by
        ``finish``, the next save, or ``distlib.shutdown()``; as atomically as a synchronous one.
        ``in_place``: not staged, the write reads the tensors where they are (ShardedCheckpointer's):
        for the final save, which nothing but evaluation and sampling follows."""
        self._settle()
        t = time.perf_counter()
        self.ranks.gather()
        self._gather_s = time.perf_counter() - t
        self.checkpointer.save(global_step, self.objects, async_=async_, in_place=in_place)
        if async_:
            self._in_flight = True
            if self._group is None and collectives.world_size() > 1:  # a collective: every rank saves here
                self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))

    def save_weights(self, directory: str, *, global_step: int, names: tuple[str, ...] = ("model", "ema")) -> None:
        """The objects ``names`` alone (the model and its weight average, those the run has), into
        ``directory/step<global step>/``, synchronously, the newest one kept (run.final_checkpoint=weights):
        what ``python -m distlib.runner.export`` reads, without the optimizer state (twice the weights with
        AdamW) that only a resume needs. A background save in flight is left to commit as usual. A
        collective: every rank must call it."""
        from distlib.checkpoint.sharded import ShardedCheckpointer

        objects = {name: self.objects[name] for name in names if name in self.objects}
        # frozen=False: a frozen parameter (a LoRA model's base) is rebuilt by the model at every start
        ShardedCheckpointer(directory, keep=1, frozen=False).save(global_step, objects)

    @property
    def phases(self) -> dict[str, float]:
        """Where the last committed save's seconds went on this rank: the ranks' own values gathered
        (``gather_s``), the call (``call_s``: the state dicts, the staging's start), the copies to the host
        (``to_host_s``), DCP's writes (``write_s``), syncing the files (``fsync_s``), what was left of the
        write when it was waited for (``waited_s``) and the commit (``commit_s``); ShardedCheckpointer's."""
        if self._checkpointer is None or not self._checkpointer.phases:
            return {}
        return {"gather_s": round(self._gather_s, 3), **self._checkpointer.phases}

    def commit_if_written(self) -> None:
        """Commit the background save once every rank has written its part: after every step, so that it
        appears when written rather than at the next save (a crash in between would lose it). The ranks
        agree one call behind, through an asynchronous all_reduce over a gloo group of its own: the
        write is never waited for. A collective: every rank must call it, at the same steps."""
        if not self._in_flight:
            return
        if self._group is None:  # one process
            if self.checkpointer.written():
                self._in_flight = False
                self.checkpointer.wait()
            return
        if self._work is not None:
            self._work.wait()  # issued a step ago: done, or about to be
            self._work = None
            if not int(self._flag.item()):  # no rank still writing
                self._in_flight = False
                self.checkpointer.wait()
                return
        self._flag.fill_(0 if self.checkpointer.written() else 1)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)

    def finish(self) -> None:
        """Wait for the background save in flight (if any) and commit it. A collective: every rank must call it."""
        self._settle()
        if self._checkpointer is not None:
            self._checkpointer.wait()

    def _settle(self) -> None:
        """Finish the agreement in flight (every rank has one): the next save commits the write itself."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._in_flight = False

    def wait_staged(self) -> None:
        """Block until the save in flight is staged: for a step whose optimizer runs inside a CUDA graph."""
        if self._checkpointer is not None:
            self._checkpointer.wait_staged()


def build_checkpoints(directory: str, objects: Mapping[str, Any], *, shard: str, fingerprint: dict[str, Any],
                      keep: int, timeout_s: float = 300.0, staging: str = "auto") -> RunCheckpoints:  # fmt: skip
    """The checkpoints of a run with ``dist.shard=shard``: the settings of ``fingerprint`` and
    dist.shard checked on resume, the tensors' global shapes by ShardedCheckpointer itself.
    ``timeout_s``: of the collectives that commit a background save (dist.timeout_s); ``staging``:
    ShardedCheckpointer's (run.checkpoint_staging)."""
    # the three modes save the optimizer state in other layouts (whole tensors, flat slices, DTensors of
    # each parameter's shape): dist.shard is part of what a checkpoint is valid for
    settings = {**fingerprint["settings"], "dist.shard": shard}
    return RunCheckpoints(directory, objects, settings, keep=keep, timeout_s=timeout_s, staging=staging)
