"""Checkpoints a resumed run can continue from exactly, written atomically by rank 0.

One file per checkpoint (``<dir>/epoch0003-step000000.pt``): the objects' state_dicts, the
position, per-rank RNG states, buffers and ``RankStateful`` states gathered to rank 0, a
fingerprint; only tensors and plain containers, read with ``torch.load(weights_only=True)``, after
the CRC-32 of every record of its zip (written by torch.save as it writes) is checked. docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from distlib.checkpoint.integrity import crc32_on, payload_sha256, zip_intact
from distlib.checkpoint.staging import pinned_empty
from distlib.checkpoint.state import (
    CheckpointError,
    RankStateful,
    Stateful,
    differences,
    fingerprint,
    rng_state,
    set_rng_state,
)
from distlib.distributed import collectives, process_group
from distlib.log import get_logger

FORMAT = "distlib-checkpoint"
VERSION = 2  # 1: a sha256 of the payload in "checksum" (computed before writing: read still); 2: records' CRC-32s
_NAME = re.compile(r"^epoch(\d+)-step(\d+)\.pt$")


@dataclass
class Resumed:
    """Where a run continues: ``epoch`` epochs completed, then ``step`` steps of the next one."""

    epoch: int = 0
    step: int = 0
    global_step: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    rank_extra: dict[str, Any] = field(default_factory=dict)  # this rank's own values
    path: str | None = None  # the checkpoint loaded, None for a fresh start


# ---- file handling ------------------------------------------------------------------------


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, Mapping):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _detached(obj: Any) -> Any:
    """``obj`` with its tensors detached, as they are; a view into a larger storage (a flat buffer's)
    copied to the host, since torch.save writes a tensor's whole storage."""
    if isinstance(obj, torch.Tensor):
        whole = obj.untyped_storage().nbytes() == obj.numel() * obj.element_size()
        return obj.detach() if whole else obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: _detached(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detached(v) for v in obj)
    return obj


def write_atomic(payload: Mapping[str, Any], path: str) -> None:
    """Write ``payload`` with torch.save so that ``path`` is either the old file or the
    whole new one: a temporary file in the same directory, fsync, rename, fsync the directory."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{os.path.basename(path)}")
    try:
        with open(tmp, "xb") as f:  # mode 0666 less the umask, like any other file the run writes
            torch.save(dict(payload), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)  # the rename itself must survive a crash
    finally:
        os.close(dfd)


def read_verified(path: str) -> dict[str, Any]:
    """Load a checkpoint file with weights_only=True and check its format and integrity: the CRC-32 of
    every record (version 2), or the sha256 of the payload (version 1).

    Raises CheckpointError saying what is wrong with the file.
    """
    intact = zip_intact(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, flipped bytes in the pickle, a foreign file
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {first})") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a distlib checkpoint")
    version = payload.get("version")
    if version not in (1, VERSION):
        raise CheckpointError(f"{path}: checkpoint format version {version!r}, expected 1 or {VERSION}")
    if version == 1:
        good = payload.get("checksum") == payload_sha256(payload)
    else:
        good = intact or payload.get("record_crc32") is False  # written with torch.save's CRC-32s off
    if not good:
        raise CheckpointError(f"{path}: checksum mismatch (the file is corrupted)")
    return payload


def load_in_place(obj: Stateful, state: dict[str, Any]) -> None:
    """``obj.load_state_dict(state)``, keeping the tensors ``obj`` already has.

    A captured CUDA graph reads and writes fixed memory: modules already copy
    into their tensors, but ``Optimizer.load_state_dict`` makes new state
    tensors (momentum buffers), so those are copied back into the old ones.
    """
    if not isinstance(obj, torch.optim.Optimizer):
        obj.load_state_dict(state)
        return
    old = {p: dict(s) for p, s in obj.state.items()}
    obj.load_state_dict(state)
    with torch.no_grad():
        for p, s in obj.state.items():
            for key, new in s.items():
                kept = old.get(p, {}).get(key)
                if torch.is_tensor(kept) and torch.is_tensor(new) and kept.shape == new.shape:
                    kept.copy_(new)  # same dtype and device: load_state_dict cast ``new`` like ``kept``
                    s[key] = kept


# ---- the checkpointer ---------------------------------------------------------------------


class Checkpointer:
    """Saves and restores training state in ``directory``; keeps the newest ``keep`` files.

    ``save`` and ``load`` are collectives: every rank must call them, in the
    same order. Rank 0 alone reads and writes files; the others receive the
    loaded state from it, so the directory need only exist on rank 0's node.
    """

    def __init__(self, directory: str, *, keep: int = 3, is_main: bool = True):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = directory
        self.keep = keep
        self.is_main = is_main
        self.last_saved: tuple[int, int] | None = None  # (epoch, step) of the checkpoint last saved or loaded
        self._writing: tuple[threading.Thread, dict[str, str]] | None = None  # rank 0's write in flight
        self._host: dict[tuple[str, ...], torch.Tensor] = {}  # the pinned host copies async saves stage into
        # distlib.shutdown() (and the exit hook) wait for a write in flight
        process_group.on_shutdown(self._at_shutdown)

    def paths(self) -> list[str]:
        """Checkpoint files, newest first (temporary files of an interrupted write are ignored)."""
        if not os.path.isdir(self.directory):
            return []
        found = []
        for name in os.listdir(self.directory):
            m = _NAME.match(name)
            if m:
                found.append(((int(m.group(1)), int(m.group(2))), os.path.join(self.directory, name)))
        return [p for _, p in sorted(found, reverse=True)]

    def clear(self) -> int:
        """Delete every checkpoint (rank 0 only); returns how many there were."""
        paths = self.paths() if self.is_main else []
        for p in paths:
            os.unlink(p)
        return len(paths)

    def save(
        self,
        objects: Mapping[str, Stateful],
        *,
        epoch: int,
        step: int,
        global_step: int,
        fingerprint: Mapping[str, Any],
        extra: Mapping[str, Any] | None = None,
        rank_extra: Mapping[str, Any] | None = None,
        async_: bool = False,
    ) -> str | None:
        """Write a checkpoint at ``epoch`` completed epochs plus ``step`` steps.

        Each object's ``state_dict()`` is stored once (rank 0's), and so is ``extra``; the
        ``rank_state_dict()`` of ``RankStateful`` objects and ``rank_extra`` per rank. A
        collective (it gathers every rank's RNG state and ``rank_extra``):
        every rank must call it. Returns the path on rank 0, None elsewhere.
        Raises CheckpointError on every rank when rank 0 cannot write it.

        ``async_=True``: rank 0 copies the state to host memory (pinned, kept between saves, on a GPU
        machine) and writes the file in a background thread; the checkpoint appears (renamed into
        place) when the write is done. The next ``save`` or ``wait()`` waits for it first (at most one
        in flight) and raises the CheckpointError of a write that failed, on every rank.
        """
        self.wait()
        buffers = {
            name: _to_cpu(dict(obj.named_buffers())) for name, obj in objects.items() if isinstance(obj, nn.Module)
        }
        own = {name: _to_cpu(obj.rank_state_dict()) for name, obj in objects.items() if isinstance(obj, RankStateful)}
        mine = {"rng": rng_state(), "buffers": buffers, "states": own, "extra": _to_cpu(dict(rank_extra or {}))}
        ranks = collectives.all_gather_object(mine)
        path = os.path.join(self.directory, f"epoch{epoch:04d}-step{step:06d}.pt")
        error = None
        if self.is_main:
            try:
                payload = {
                    "format": FORMAT,
                    "version": VERSION,
                    "position": {"epoch": epoch, "step": step, "global_step": global_step},
                    "world_size": len(ranks),
                    "fingerprint": _to_cpu(dict(fingerprint)),
                    "state": {name: obj.state_dict() for name, obj in objects.items()},
                    "ranks": ranks,
                    "extra": _to_cpu(dict(extra or {})),
                    "record_crc32": crc32_on(),
                }
                if not async_:
                    # GPU tensors as they are: torch.save copies each to the host as it writes it, so the
                    # copies and the writes interleave (a copy of everything first would add its time)
                    payload["state"] = _detached(payload["state"])
                    self._write(payload, path)
                else:
                    payload["state"] = self._stage(payload["state"], ())
                    staged = None
                    if torch.cuda.is_available() and torch.cuda.is_initialized():
                        staged = torch.cuda.Event()
                        staged.record()  # after the copies, on the stream the next steps run on: ordered before them
                    outcome: dict[str, str] = {}

                    def write() -> None:
                        try:
                            if staged is not None:
                                staged.synchronize()
                            self._write(payload, path)
                        except Exception as e:  # reported by the next save or wait(), on every rank
                            outcome["error"] = f"rank 0 could not write checkpoint {path}: {type(e).__name__}: {e}"

                    thread = threading.Thread(target=write, name="distlib-checkpoint", daemon=True)
                    thread.start()
                    self._writing = (thread, outcome)
            except Exception as e:
                error = f"rank 0 could not write checkpoint {path}: {type(e).__name__}: {e}"
        error = collectives.broadcast_object(error)  # every rank fails together, none hangs
        if error:
            raise CheckpointError(error)
        self.last_saved = (epoch, step)
        return path if self.is_main else None

    def _write(self, payload: dict[str, Any], path: str) -> None:
        write_atomic(payload, path)
        for old in self.paths()[self.keep :]:
            os.unlink(old)

    def _stage(self, obj: Any, key: tuple[str, ...]) -> Any:
        """A host copy of ``obj``'s tensors that later steps cannot change: into pinned memory kept
        between saves on a GPU machine, a plain copy on the CPU."""
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            host = self._host.get(key)
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                host = pinned_empty(t.shape, t.dtype) if t.is_cuda else torch.empty(t.shape, dtype=t.dtype)
                if t.is_cuda:
                    self._host[key] = host
            host.copy_(t, non_blocking=t.is_cuda)
            return host
        if isinstance(obj, Mapping):
            return {k: self._stage(v, (*key, str(k))) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._stage(v, (*key, str(i))) for i, v in enumerate(obj))
        return obj

    def wait(self) -> None:
        """Wait for the asynchronous write in flight, if any (rank 0), and raise its CheckpointError on
        every rank. A collective: every rank must call it, in the same order."""
        error = self._join()
        error = collectives.broadcast_object(error)
        if error:
            raise CheckpointError(error)

    def _join(self) -> str | None:
        if self._writing is None:
            return None
        thread, outcome = self._writing
        self._writing = None
        thread.join()
        return outcome.get("error")

    def _at_shutdown(self, together: bool) -> None:
        """``distlib.shutdown()``'s call: rank 0 finishes its write in flight (the file is renamed into
        place by the write itself: no other rank is needed); its error is raised there."""
        if self._writing is not None:
            error = self._join()
            if error:
                raise CheckpointError(error)

    def _find_latest(self) -> tuple[dict[str, Any] | None, str | None, list[str]]:
        """Rank 0: the newest readable checkpoint, its path, and the problems with newer ones."""
        problems = []
        for path in self.paths():
            try:
                return read_verified(path), path, problems
            except CheckpointError as e:
                problems.append(str(e))
        return None, None, problems

    def load(self, objects: Mapping[str, Stateful], *, fingerprint: Mapping[str, Any]) -> Resumed:
        """Restore ``objects`` and this rank's RNG from the newest valid checkpoint.

        A collective: every rank must call it. Returns ``Resumed()`` (a fresh
        start) when the directory holds no checkpoint. Falls back to an older
        checkpoint, with a warning, when the newest is corrupt. Raises
        CheckpointError on every rank when checkpoints exist but none is
        readable, or when the newest readable one is from another model or
        config (it names what differs).
        """
        log = get_logger()
        found: tuple[dict | None, str | None, list[str]] = (None, None, [])
        if self.is_main:
            found = self._find_latest()
        payload, path, problems = collectives.broadcast_object(found)
        for p in problems:
            log.warning("skipping checkpoint: %s", p)
        if payload is None:
            if problems:
                raise CheckpointError(
                    f"none of the {len(problems)} checkpoint(s) in {self.directory} is usable (see above); "
                    "move them away, or set run.resume=false to start over (this deletes them)"
                )
            return Resumed()
        if problems:
            log.warning("resuming from the older checkpoint %s", path)
        diff = differences(payload["fingerprint"], fingerprint)
        if diff:
            raise CheckpointError(
                f"checkpoint {path} is from another model or config:\n"
                + "\n".join(f"  - {d}" for d in diff)
                + "\nuse another run.out_dir, or set run.resume=false to start over (this deletes its checkpoints)"
            )
        missing = [name for name in objects if name not in payload["state"]]
        if missing:
            raise CheckpointError(f"checkpoint {path} has no state for {', '.join(missing)}")
        for name, obj in objects.items():
            load_in_place(obj, payload["state"][name])
        ranks = payload["ranks"]
        rank, world = collectives.rank(), collectives.world_size()
        mine: dict[str, Any] = {}
        if len(ranks) == world:
            set_rng_state(ranks[rank]["rng"])
            mine = ranks[rank]["extra"]
            own = ranks[rank].get("states", {})
            for name, obj in objects.items():
                if isinstance(obj, RankStateful):
                    if name not in own:
                        raise CheckpointError(f"checkpoint {path} has no per-rank state for {name}")
                    obj.load_rank_state_dict(own[name])
            with torch.no_grad():
                for name, obj in objects.items():
                    if isinstance(obj, nn.Module):
                        for buf_name, buf in obj.named_buffers():
                            buf.copy_(ranks[rank]["buffers"][name][buf_name])
        else:
            log.warning(
                "checkpoint written by %d rank(s), this run has %d: per-rank RNG states, buffers and values "
                "are not restored (every rank takes rank 0's buffers), so the run continues correctly but "
                "not bit-for-bit as an uninterrupted one would",
                len(ranks), world,
            )  # fmt: skip
        pos = payload["position"]
        self.last_saved = (pos["epoch"], pos["step"])
        return Resumed(pos["epoch"], pos["step"], pos["global_step"], payload["extra"], mine, path)

    def resume(
        self, objects: Mapping[str, Stateful], *, fingerprint: Mapping[str, Any], enabled: bool, epochs: int = 0
    ) -> Resumed:
        """``load`` when ``enabled`` (auto-resume); otherwise delete the old checkpoints and start
        fresh, so they cannot be taken for this run's. ``epochs``: the run's length, to say when
        it is already complete. A collective: every rank must call it."""
        log = get_logger()
        if not enabled:
            if self.clear():
                log.warning("resume disabled: deleted the old checkpoints in %s", self.directory)
            return Resumed()
        resumed = self.load(objects, fingerprint=fingerprint)
        if resumed.path and epochs and resumed.epoch >= epochs:
            log.warning(
                "%s is the final checkpoint: this run is complete, nothing to do "
                "(set run.resume=false or another run.out_dir to train again)", resumed.path,
            )  # fmt: skip
        elif resumed.path:
            log.info("resuming from %s: epoch %d, step %d", resumed.path, resumed.epoch, resumed.step)
        return resumed


# the shared parts (``state.py``) stay importable from here, where they were first defined
__all__ = ["Checkpointer", "CheckpointError", "RankStateful", "Resumed", "Stateful", "differences", "fingerprint",
           "read_verified", "rng_state", "set_rng_state", "write_atomic"]  # fmt: skip
