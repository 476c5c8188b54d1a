"""Sharded checkpoints with torch.distributed.checkpoint: every rank writes its own shards.

``<dir>/step000000042/`` holds DCP's ``.metadata`` and ``__<rank>_<i>.distcp`` files and
``commit.json`` (step, world size, fingerprint, every file's size, ``.metadata``'s CRC-32 and its
own: integrity.py). It is written as ``<dir>/.partial-step000000042/`` and renamed once every rank
finished: a directory with the final name is a committed checkpoint; one is deleted by renaming it
out of that name first (layout.py). docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.utils._pytree import tree_map_only

from distlib.checkpoint import disk, writeback
from distlib.checkpoint.integrity import crc32_on, file_crc32, file_sha256, records_intact, seal, unseal
from distlib.checkpoint.layout import COMMITTED, PARTIAL, discard, fsync_dir, leftovers, step_name
from distlib.checkpoint.staging import pin_in_place
from distlib.checkpoint.state import CheckpointError, differences
from distlib.distributed import collectives, process_group
from distlib.log import get_logger

FORMAT = "distlib-sharded-checkpoint"
# 1: every file's sha256 in commit.json (read still); 2: sizes, the records' CRC-32s checked on load (read still);
# 3: also the CRC-32 of .metadata (a plain pickle, no records of its own) and of commit.json itself
VERSION = 3
MARKER = "commit.json"
_NAME = COMMITTED
# the checkpointers with an asynchronous save in flight: kept alive until it is committed (shutdown()
# holds its hooks weakly, and a save must not be lost with a checkpointer the caller let go of)
_IN_FLIGHT: set[ShardedCheckpointer] = set()
_PARTIAL = PARTIAL
STAGING = ("auto", "device", "host")


# DCP warns on every save and load without a process group that it assumes one process: world size 1 is
# meant. The async save warns from its own thread, where a catch_warnings block would not reach.
warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)", category=UserWarning)


def _own_files(directory: str, rank: int) -> dict[str, dict[str, Any]]:
    """The size of every shard file this rank wrote (DCP names them ``__<rank>_<i>.distcp``); rank 0
    also takes DCP's ``.metadata``. No hash: reading the files back would be a second pass over the
    data; each record's CRC-32, computed by torch.save as it writes, is checked on load instead."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith(f"__{rank}_") or (rank == 0 and name == ".metadata"):
            out[name] = {"bytes": os.path.getsize(os.path.join(directory, name))}
    return out


def _fsync_files(paths: list[str], threads: int) -> None:
    """Each file's data on the disk (as many at once as ``threads``): what a commit must follow."""
    sync = fsync_dir  # a file's data as a directory's entries: open, fsync, close
    if len(paths) <= 1 or threads <= 1:
        for path in paths:
            sync(path)
        return
    from concurrent.futures import ThreadPoolExecutor

    try:
        with ThreadPoolExecutor(min(threads, len(paths))) as pool:
            list(pool.map(sync, paths))
    except RuntimeError:  # at interpreter exit (the exit hook committing a save in flight): no new threads
        for path in paths:
            sync(path)


def model_fingerprint(objects: Mapping[str, Any]) -> dict[str, str]:
    """The name, global shape and dtype of every tensor of the modules among ``objects`` (DTensors
    count with their global shape, so a sharded and a replicated model have the same fingerprint)."""
    tensors = {}
    for name, obj in objects.items():
        if isinstance(obj, nn.Module):
            for key, t in obj.state_dict().items():
                tensors[f"{name}.{key}"] = f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
    return tensors


def _layout(state: Any, prefix: str = "") -> list[Any]:
    """Every tensor's place, shape and dtype: the host copy an async save keeps must still fit."""
    if isinstance(state, Mapping):
        return [x for k, v in state.items() for x in _layout(v, f"{prefix}/{k}")]
    if isinstance(state, (list, tuple)):
        return [x for i, v in enumerate(state) for x in _layout(v, f"{prefix}/{i}")]
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return [(prefix, tuple(local.shape), local.dtype, local.device)]
    return []


# what torch says whenever a ShardedTensor (a ShardedOptimizer's state) is used as a tensor
SHARDED_TENSOR_DEPRECATED = "Please use DTensor instead and we are deprecating ShardedTensor"


@contextlib.contextmanager
def _sharded_tensors_quiet() -> Iterator[None]:
    """torch's FutureWarning that ShardedTensor is deprecated, held back. A ShardedOptimizer's state is
    ShardedTensors (a rank's range of each flat parameter: DTensor cannot shard unevenly), and their
    shape, dtype and device go through ``__torch_function__``, which torch has deprecated: a warning
    per rank in every optimizer-sharded save and resume (from our layout, torch's host copy and
    DCP's planner) that the user can do nothing about. On the calling thread (save, resume): an async
    save's background write uses no ShardedTensor as a tensor, and no catch_warnings of its own that
    could race this one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SHARDED_TENSOR_DEPRECATED, category=FutureWarning)
        yield


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor of this rank's data: a DTensor's local tensor, a ShardedTensor's one local shard."""
    if hasattr(t, "to_local"):
        return t.to_local()
    if hasattr(t, "local_shards"):
        shards = t.local_shards()
        return shards[0].tensor if shards else torch.empty(0)
    return t


def _host_tensors(state: Any) -> list[torch.Tensor]:
    """Every plain tensor holding the data of ``state``'s tensors: DTensors' local tensors, ShardedTensors' shards."""
    if isinstance(state, Mapping):
        return [t for v in state.values() for t in _host_tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _host_tensors(v)]
    if not isinstance(state, torch.Tensor):
        return []
    if hasattr(state, "local_shards"):
        return [s.tensor for s in state.local_shards()]
    return [_local(state)]


def _host_copy(state: Any) -> Any:
    """Empty host tensors of ``state``'s layout (``_create_cpu_state_dict``'s), made without copying: torch's
    helper moves each DTensor to the host whole before it replaces its data with an empty tensor
    (under FSDP2, a pageable copy of the state: 14 s of a 1.5B GPT's save on an H200)."""
    from torch.distributed._state_dict_utils import _create_cpu_state_dict
    from torch.distributed.tensor import DTensor

    def empty(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, DTensor):  # plain tensors and ShardedTensors: torch's own
            return _create_cpu_state_dict({"t": t})["t"]
        # the DTensor's spec (mesh, placements, global shape) around an empty host tensor, built
        # directly: a DTensor op to make it (``t.to("meta")``, its dispatch each time) took 2.2 s
        # for the 1.5B GPT's 1,165 tensors on an H200, paid by the first save before training goes on
        return DTensor(empty(t.to_local()), t._spec, requires_grad=False)

    return tree_map_only(torch.Tensor, empty, state)


def _stage_into(state: Any, host: Any, copy: Callable[[torch.Tensor, torch.Tensor], None]) -> Any:
    """``state`` with its tensors replaced by their counterparts in ``host`` (the same structure), each
    filled by ``copy(source, target)`` (local tensors: a DTensor's, a ShardedTensor's shard), and its
    other values as they are now."""
    if isinstance(state, Mapping):
        return {k: _stage_into(v, host[k], copy) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_stage_into(v, h, copy) for v, h in zip(state, host))
    if not isinstance(state, torch.Tensor):
        return state
    copy(_local(state), _local(host))
    return host


_BOUNCE = 64 << 20  # bytes of each page-locked buffer a device-staged copy goes through to the host
_BOUNCES = 4


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _to_host(pairs: list[tuple[torch.Tensor, torch.Tensor]], bounce: list[torch.Tensor], stream: Any) -> None:
    """Copy each ``(device tensor, host tensor)`` of ``pairs`` into its host tensor (contiguous, plain
    memory), dropping each device tensor once copied. A copy from the GPU into pageable memory holds
    the driver's locks for its whole length (the training's launches wait: 12 s lost to 17.4 GiB on an
    H200), so the bytes go through a few page-locked buffers instead: the copies to them asynchronous
    on ``stream``, each buffer then copied into place on the CPU while the next ones fill."""

    def chunks() -> Any:
        while pairs:
            source, target = pairs.pop(0)
            if not target.is_contiguous():  # no host copy made by this module is; a plain copy then
                target.copy_(source)
                continue
            src, dst = _flat_bytes(source), _flat_bytes(target)
            del source  # the device copy goes with its last chunk
            for a in range(0, src.numel(), _BOUNCE):
                yield src[a : a + _BOUNCE], dst[a : a + _BOUNCE]

    in_flight: list[tuple[torch.Tensor, torch.Tensor, Any]] = []
    free = list(bounce)
    todo = chunks()

    def issue() -> None:
        for src, dst in todo:
            buf = free.pop()[: src.numel()]
            with torch.cuda.stream(stream):
                buf.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            in_flight.append((buf, dst, event))
            if not free:
                return

    issue()
    while in_flight:
        buf, dst, event = in_flight.pop(0)
        event.synchronize()
        dst.copy_(buf)
        free.append(buf._base if buf._base is not None else buf)
        issue()


def _device_bytes(layout: list[Any]) -> int:
    return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype, device in layout if device.type == "cuda")


def _room_on_device(layout: list[Any]) -> bool:
    """Whether the GPU's memory outside torch's cache holds a copy of the state's GPU tensors with 10% and
    1 GiB to spare: by the first save the cache holds what the training's steps take at their peak, so
    a copy there takes nothing the steps need."""
    devices = {device for *_, device in layout if device.type == "cuda"}
    need = _device_bytes(layout)
    free = min(torch.cuda.mem_get_info(device)[0] for device in devices)
    return free >= need * 1.1 + 2**30


def _owner(opt: Any, objects: Mapping[str, Any]) -> nn.Module | None:
    """The module among ``objects`` whose parameters ``opt`` steps, for DCP's helpers (which key its state by
    their names); None for an optimizer with a ``state_dict`` format of its own, or stepping other tensors."""
    if not isinstance(opt, torch.optim.Optimizer) or type(opt).state_dict is not torch.optim.Optimizer.state_dict:
        return None
    first = next((p for g in opt.param_groups for p in g["params"]), None)
    for obj in objects.values():
        if isinstance(obj, nn.Module) and any(p is first for p in obj.parameters()):
            return obj
    return None


def _model_options(frozen: bool) -> StateDictOptions:
    """DCP's options for a module's state: without ``frozen``, the parameters that do not require grad
    left out (and not required back on load)."""
    return StateDictOptions() if frozen else StateDictOptions(ignore_frozen_params=True, strict=False)


def _plain(name: str) -> str:
    """A parameter's name without the wrappers' parts (compile's, activation checkpointing's)."""
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def _frozen_names(module: nn.Module) -> set[str]:
    """Every name of every parameter of ``module`` that does not require grad, tied ones included."""
    return {_plain(n) for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _keeps_frozen(module: nn.Module, frozen: bool) -> bool:
    """Whether ``module``'s frozen parameters go into the checkpoint: always with ``frozen``; without it
    only for a module none of whose parameters trains (a weight average, kept outside autograd: all
    of it is state that no model rebuilds)."""
    return frozen or not any(p.requires_grad for p in module.parameters())


def _shared_frozen(objects: Mapping[str, Any], frozen: bool) -> set[int]:
    """Without ``frozen``: the frozen parameters of the modules that train others, which a module that
    trains none (``distlib.EMA``'s average) shares with them; left out of its state as of theirs."""
    if frozen:
        return set()
    modules = [o for o in objects.values() if isinstance(o, nn.Module)]
    return {id(p) for m in modules if any(q.requires_grad for q in m.parameters())
            for p in m.parameters() if not p.requires_grad}  # fmt: skip


def _shared_names(module: nn.Module, shared: set[int]) -> set[str]:
    return {_plain(n) for n, p in module.named_parameters(remove_duplicate=False) if id(p) in shared}


def _state_dicts(objects: Mapping[str, Any], frozen: bool = True) -> dict[str, Any]:
    """What DCP saves or loads into, per object: modules and optimizers through DCP's state_dict helpers
    (FSDP2 DTensors stay sharded, optimizer state is keyed by parameter name; ``frozen=False``: a module's
    parameters that do not require grad left out), plain dicts as they are, anything else its ``state_dict()``."""
    out: dict[str, Any] = {}
    shared = _shared_frozen(objects, frozen)
    for name, obj in objects.items():
        if isinstance(obj, nn.Module):
            keep = _keeps_frozen(obj, frozen)
            out[name] = get_model_state_dict(obj, options=_model_options(keep))
            # DCP leaves out one name of each; a tied frozen weight's other names too, and what an
            # average shares with a model
            drop = _frozen_names(obj) if not keep else _shared_names(obj, shared)
            if drop:
                out[name] = {k: v for k, v in out[name].items() if _plain(k) not in drop}
        elif (model := _owner(obj, objects)) is not None:
            out[name] = get_optimizer_state_dict(model, obj)
        elif isinstance(obj, dict):
            out[name] = obj
        elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
            out[name] = obj.state_dict()
        else:
            raise CheckpointError(
                f"cannot checkpoint {name!r} ({type(obj).__name__}): give an object with state_dict() and "
                "load_state_dict(), or a plain dict"
            )
    return out


def _load_into(objects: Mapping[str, Any], states: Mapping[str, Any], frozen: bool = True) -> None:
    # the modules first: a ShardedOptimizer whose checkpoint has no fp32 masters (a plain optimizer's)
    # takes them from its parameters
    shared = _shared_frozen(objects, frozen)
    for name, obj in sorted(objects.items(), key=lambda item: not isinstance(item[1], nn.Module)):
        state = states[name]
        if isinstance(obj, nn.Module):
            keep = _keeps_frozen(obj, frozen)
            options = _model_options(keep)
            if keep and _shared_names(obj, shared):
                # an average's shared frozen parameters are the model's, rebuilt with it: not in the state
                options = StateDictOptions(strict=False)
            set_model_state_dict(obj, state, options=options)
        elif (model := _owner(obj, objects)) is not None:
            set_optimizer_state_dict(model, obj, state)
        elif isinstance(obj, dict):
            pass  # DCP loaded into the dict itself
        else:
            obj.load_state_dict(state)


_MASTER = re.compile(r"\.state\..+\.master$")  # a ShardedOptimizer's fp32 copy of a non-fp32 parameter


def _is_master(fqn: str, name: str, objects: Mapping[str, Any]) -> bool:
    return (
        fqn.startswith(f"{name}.")
        and isinstance(objects[name], torch.optim.Optimizer)
        and bool(_MASTER.search(fqn[len(name) :]))
    )


def _fit_to_saved(states: dict[str, Any], saved: Mapping[str, Any], where: str) -> list[Callable[[], None]]:
    """Let every tensor of ``states`` load the saved tensor of its key that holds the same elements
    in another shape; returns what copies them into place once DCP has loaded.

    A ShardedOptimizer keeps each parameter's state flat (a ShardedTensor of the parameter's number
    of elements, each rank a range of it); a plain optimizer, and FSDP2's, in the parameter's shape.
    A whole tensor loads through a view of the saved shape (in place); a ShardedTensor or a DTensor
    through a temporary whole tensor of the saved shape, from which it takes its own part (this
    rank's host or GPU memory holds, for the moment of the load, the whole state of the parameters it
    has a part of). Another number of elements raises CheckpointError.
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    flat, paths = flatten_state_dict(states)
    after: list[Callable[[], None]] = []
    for fqn, value in flat.items():
        meta = saved.get(fqn)
        if not isinstance(value, torch.Tensor) or not isinstance(meta, TensorStorageMetadata):
            continue
        shape, want = tuple(value.size()), tuple(meta.size)
        if shape == want:
            continue
        if math.prod(shape) != math.prod(want):
            raise CheckpointError(
                f"checkpoint {where} holds {fqn} with shape {list(want)}, this run's has {list(shape)}: another "
                "model or optimizer; resume with the one that saved it, or use another checkpoint directory"
            )
        path = paths[fqn]
        if isinstance(value, ShardedTensor):
            shards = value.local_shards()
            if len(shards) != 1 or len(shards[0].metadata.shard_offsets) != 1:
                continue  # no part of it here (DCP reads nothing for it), or a layout this does not convert
            local, lo = shards[0].tensor, shards[0].metadata.shard_offsets[0]
            whole = torch.empty(want, dtype=local.dtype, device=local.device)
            after.append(lambda t=local, w=whole, lo=lo, v=value, p=path: (
                t.copy_(w.reshape(-1)[lo : lo + t.numel()]), set_element(states, p, v)))  # fmt: skip
        elif isinstance(value, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local = value.to_local()
            size, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
            part = tuple(slice(o, o + n) for o, n in zip(offset, size))
            whole = torch.empty(want, dtype=local.dtype, device=local.device)
            after.append(lambda t=local, w=whole, part=part, v=value, p=path: (
                t.copy_(w.view(v.shape)[part]), set_element(states, p, v)))  # fmt: skip
        elif value.is_contiguous():
            whole = value.view(want)  # the same memory: DCP loads into the tensor itself
            after.append(lambda v=value, p=path: set_element(states, p, v))
        else:
            whole = torch.empty(want, dtype=value.dtype, device=value.device)
            after.append(lambda v=value, w=whole, p=path: (v.copy_(w.view(v.shape)), set_element(states, p, v)))
        set_element(states, path, whole)
    return after


def _drop(states: dict[str, Any], fqns: list[str]) -> None:
    """Remove the values of ``fqns`` from the nested ``states`` (nothing in the checkpoint to load into them)."""
    _, paths = flatten_state_dict(states)
    for fqn in fqns:
        *parents, last = paths[fqn]
        node: Any = states
        for key in parents:
            node = node[key]
        del node[last]


class _WriteErrors(FileSystem):
    """DCP's file system, keeping the first ``OSError`` of a write instead of raising it. DCP writes a
    rank's files in threads of its own: an error raised there prints its traceback (one per thread; a
    full disk fails them all) and DCP goes on with what the other threads wrote. Kept here, the save
    goes through DCP's steps on every rank alike and its caller raises the error afterwards
    (``ShardedCheckpointer.wait``), once, as one line."""

    def __init__(self) -> None:
        super().__init__()
        self.error: Exception | None = None
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        # a file written is handed to the disk as it grows (writeback.py): the fsync before the commit
        # then waits for its last pages, not for all of them
        try:
            with writeback.WritingBack(path) if mode == "wb" else super().create_stream(path, mode) as stream:
                yield stream
        except Exception as e:  # torch.save's zip writer turns a failed write into a RuntimeError of its own
            if not (isinstance(e, OSError) or disk.is_disk_full(e)):
                raise
            with self._lock:
                self.error = self.error or e


def _first_line(e: BaseException) -> str:
    """An error's message to its first line (DCP's CheckpointException carries every rank's traceback)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _bytes_of(directory: str) -> int:
    """The bytes of the files in ``directory``."""
    with os.scandir(directory) as entries:
        return sum(e.stat().st_size for e in entries if e.is_file())


def _global_bytes(state: Any) -> int:
    """The bytes a checkpoint of ``state`` holds over every rank: each tensor at its global size (a
    DTensor's, a ShardedTensor's; a replicated tensor is written once), plus the byte values."""
    if isinstance(state, Mapping):
        return sum(_global_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_global_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):  # a ShardedTensor has no element_size(): its dtype's
        return math.prod(state.size()) * state.dtype.itemsize
    if isinstance(state, (bytes, bytearray)):
        return len(state)
    return 0


class ShardedCheckpointer:
    """Saves and restores training state in ``directory`` with torch.distributed.checkpoint; keeps the
    newest ``keep`` committed checkpoints.

    Every rank writes the shards it holds (a replicated tensor is written once, by one rank) and reads
    the parts it needs on load, so a checkpoint saved at one world size loads at another. The
    directory must be one every rank sees (a shared file system across nodes). ``settings``: plain
    values that must be equal for a checkpoint to be valid for this run (like ``fingerprint``'s).
    ``write_threads``: files each rank writes at once (each thread copies its share from the GPU and
    writes it; 8 write at disk speed where one is at half of it). ``staging``: where an asynchronous
    save copies GPU state before its background write (docs/reliability.md): ``"device"``, into spare
    GPU memory (a copy at the GPU's memory speed: the training waits milliseconds; the background
    thread then copies it to host memory and frees it); ``"host"``, into page-locked host memory kept
    between saves (the first save page-locks it, about 2.3 GB/s, once per process); ``"auto"``, the
    device when its memory outside torch's cache holds the copy with 10% and 1 GiB to spare at the
    first save of a layout, else the host. ``frozen=False``: the modules' parameters that do not
    require grad (a frozen base under adapters) are neither saved nor loaded: whoever resumes
    rebuilds them as they were (from the same files or seed) before ``resume``.

    ``save``, ``wait``, ``resume`` and ``close`` are collectives: every rank must call them, in the
    same order.
    """

    def __init__(
        self,
        directory: str,
        *,
        keep: int = 3,
        settings: Mapping[str, Any] | None = None,
        verify: bool = True,
        write_threads: int = 8,
        staging: str = "auto",
        frozen: bool = True,
    ):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if write_threads < 1:
            raise ValueError(f"write_threads must be >= 1, got {write_threads}")
        if staging not in STAGING:
            raise ValueError(f"staging must be one of {', '.join(STAGING)}, got {staging!r}")
        self.write_threads = write_threads
        self.staging = staging
        self.frozen = frozen
        self.directory = directory
        self.keep = keep
        self.settings = dict(settings or {})
        self.verify = verify
        self._group: dist.ProcessGroup | None = None
        # the host copy of the state for this layout, whether its GPU tensors are staged on the device first,
        # and whether the copy is page-locked (what staging on the host needs; an in-place save does not)
        self._staging: list[Any] | None = None
        self._stream: Any = None  # the CUDA stream that stages
        self._bounce: list[torch.Tensor] = []  # page-locked buffers a device-staged copy goes to the host through
        self._staged_event: Any = None  # recorded on it after the copies of the save in flight
        self._reading: threading.Event | None = None  # set once an in-place save's write no longer reads the tensors
        self._hooked: set[int] = set()  # the optimizers whose step waits for staging
        self._pending: tuple[int, str, dict[str, Any], threading.Thread | None, dict[str, Any]] | None = None
        self._need = 0  # the bytes of the save in flight, over every rank
        # where the last committed save's time went, in seconds (``phases``)
        self.phases: dict[str, float] = {}
        self._phases: dict[str, float] = {}  # the save in flight's, so far
        # distlib.shutdown() (and the exit hook) commit a save still in flight, and drop this object's group
        process_group.on_shutdown(self._at_shutdown)

    # ---- directory --------------------------------------------------------------------

    def paths(self) -> list[str]:
        """Committed checkpoint directories, newest first (a partial one of an interrupted save is not listed)."""
        if not os.path.isdir(self.directory):
            return []
        found = [(int(m.group(1)), n) for n in os.listdir(self.directory) if (m := _NAME.match(n))]
        return [os.path.join(self.directory, n) for _, n in sorted(found, reverse=True)]

    def _partials(self) -> list[str]:
        if not os.path.isdir(self.directory):
            return []
        return [os.path.join(self.directory, n) for n in sorted(os.listdir(self.directory)) if _PARTIAL.match(n)]

    # ---- collectives --------------------------------------------------------------------

    def _pg(self) -> dist.ProcessGroup | None:
        """A gloo group of its own: DCP's planning collectives and the commit barrier run in it, so a
        background save never interleaves with the training's collectives (and works under NCCL)."""
        if not (dist.is_available() and dist.is_initialized()):
            return None  # world size 1 without a process group
        if self._group is None:
            # a collective: every rank is in save/resume here; the default group's timeout, not gloo's 30 minutes
            self._group = dist.new_group(backend="gloo", timeout=collectives._world_timeout())
        return self._group

    def _all_gather(self, obj: Any) -> list[Any]:
        group = self._pg()
        if group is None:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    def _fail_together(self, error: str | None) -> None:
        """Raise CheckpointError on every rank when any rank has an error: none hangs in a later collective."""
        errors = [e for e in self._all_gather(error) if e]
        if errors:
            raise CheckpointError(errors[0])

    # ---- save -----------------------------------------------------------------------------

    @_sharded_tensors_quiet()
    def save(self, step: int, objects: Mapping[str, Any], *, async_: bool = False, in_place: bool = False) -> None:
        """Write a checkpoint of ``objects`` (name -> module, optimizer, scheduler, plain dict, ...) at ``step``.

        With ``async_=True`` the state is copied (staged) to host memory, the write continues in a background
        thread and this returns; the checkpoint is committed by the next ``save``, ``wait`` or ``close``, once
        every rank finished writing. Waits for the previous save first. A collective: every rank must call
        it, in the same order, with the same ``step``. Raises CheckpointError on every rank when one cannot
        write (a leftover partial directory names itself and the fix).

        ``in_place`` (with ``async_``): nothing is staged; the background write reads the tensors where they
        are (from a GPU through a few page-locked buffers, on a stream of its own), and the next ``step()``
        of an optimizer among ``objects`` waits until it no longer does. For a save followed by work that
        changes no saved tensor, such as a final evaluation: it takes no GPU memory and blocks for no copy.
        The modules' buffers are still copied at the call (a forward in training mode changes them).
        """
        self.wait()
        t0 = time.perf_counter()
        phases = self._phases = {}
        rank = collectives.rank()
        partial = os.path.join(self.directory, f".partial-{step_name(step)}")
        error = None
        if rank == 0:
            if os.path.isdir(partial) and os.listdir(partial):
                error = (
                    f"{partial} is not empty: a save of step {step} was interrupted, or another run writes into "
                    f"{self.directory}; delete that directory (resume() deletes partial ones of this run), or give "
                    "each run its own checkpoint directory"
                )
            else:
                os.makedirs(partial, exist_ok=True)
        self._fail_together(error)
        marker = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "world_size": collectives.world_size(),
            "objects": sorted(objects),
            "fingerprint": {"tensors": model_fingerprint(objects), "settings": self.settings},
            "record_crc32": crc32_on(),
        }
        state = _state_dicts(objects, self.frozen)
        self._need = _global_bytes(state)  # what a full disk's message says the checkpoint needs
        files: dict[str, Any] = {}
        if async_:
            reading = threading.Event() if in_place else None
            staged, on_device = self._stage(state, objects, in_place=in_place)
            self._reading = reading
            staged_on_gpu = self._staged_event is not None  # else the write reads the tensors to its end

            def write() -> None:  # off the training thread: the write, DCP's finish step, the files' sizes
                errors = _WriteErrors()
                try:
                    t = time.perf_counter()
                    if on_device:  # the device copies (or, in place, the tensors themselves) to the host
                        _to_host(on_device, self._bounce, self._stream)
                    elif self._staged_event is not None:
                        self._staged_event.synchronize()
                    if reading is not None and staged_on_gpu:
                        reading.set()  # from a GPU: what the write reads is in host memory now
                    phases["to_host_s"] = time.perf_counter() - t
                    self._write_files(staged, partial, rank, files, phases, errors)
                except BaseException as e:  # reported by wait() on every rank
                    files["error"] = e
                finally:
                    if errors.error is not None:  # the first failed write: what DCP's own failure followed from
                        files["error"] = errors.error
                    if reading is not None:
                        reading.set()

            self._pg()  # a collective when it creates the group: here, on every rank, not in the thread
            thread = threading.Thread(target=write, name="distlib-checkpoint", daemon=True)
            thread.start()
            phases["call_s"] = time.perf_counter() - t0
            self._pending = (step, partial, marker, thread, files)
            _IN_FLIGHT.add(self)
            return
        phases["call_s"] = time.perf_counter() - t0
        errors = _WriteErrors()
        try:
            self._write_files(state, partial, rank, files, phases, errors)
        except (Exception, CheckpointException) as e:  # DCP's own is a BaseException
            files["error"] = e
        if errors.error is not None:
            files["error"] = errors.error
        self._pending = (step, partial, marker, None, files)
        self.wait()

    def _write_files(self, state: Any, partial: str, rank: int, files: dict[str, Any],
                     phases: dict[str, float], errors: _WriteErrors) -> None:  # fmt: skip
        """DCP's save of ``state`` into ``partial`` (``write_s``: its planning collectives and the writes),
        then this rank's files synced to the disk (``fsync_s``) and their sizes into ``files``. A failed
        write's error is kept in ``errors``."""
        t = time.perf_counter()
        dcp.save(state, storage_writer=self._writer(partial, errors), process_group=self._pg())
        phases["write_s"] = time.perf_counter() - t
        if errors.error is not None:
            return  # the caller raises it; nothing to sync
        t = time.perf_counter()
        own = _own_files(partial, rank)
        _fsync_files([os.path.join(partial, name) for name in own], self.write_threads)
        phases["fsync_s"] = time.perf_counter() - t
        files.update(own)

    def _writer(self, partial: str, errors: _WriteErrors) -> dcp.FileSystemWriter:
        """DCP's writer with ``write_threads`` files per rank, each written by its own thread (which
        copies its tensors from the GPU as it goes): one thread leaves the disk idle while it copies,
        and the copies idle while it writes (1.5B GPT + AdamW, 17.7 GiB, on an H200's host: 37.0 s
        with 1 thread, 18.5 s with 4, 15.5 s with 8; ``torch.save`` 35.7 s). Its files are not synced
        one by one as each thread ends (``sync_files``): ``_write_files`` syncs them all after, in
        as many threads, as fast and timed apart (before the commit either way). Its file system keeps
        a failed write's error in ``errors`` (``_WriteErrors``)."""
        writer = dcp.FileSystemWriter(partial, thread_count=self.write_threads, sync_files=False)
        writer.fs = errors
        return writer

    def _stage(self, state: dict[str, Any], objects: Mapping[str, Any], *,
               in_place: bool = False) -> tuple[dict[str, Any], list[Any]]:  # fmt: skip
        """A copy of ``state`` for the background write, and the device-to-host copies left to the write
        (``(device copy, host tensor)`` pairs, ``staging="device"``; ``in_place``: the GPU tensors
        themselves). The host copy is kept and reused while the layout stays the same (staging then
        copies, never allocates); ``in_place`` on the CPU makes none (the write reads the tensors).

        On a GPU the copies run on a stream of their own and this returns at once: the next
        ``optimizer.step()`` of an optimizer among ``objects`` (through a step pre-hook), and the write,
        wait for them; the forward and backward in between run meanwhile (they change no saved tensor
        but buffers, and buffers are copied on the current stream, before the next forward). Staged on
        the device, the copies are device-to-device (the state's size at the GPU's memory speed), and
        the write's thread copies them on to the host; staged on the host, they go straight into
        page-locked memory (at the link's speed). On the CPU the copy is made here, into plain memory.
        """
        layout = _layout(state)
        cuda = any(device.type == "cuda" for *_, device in layout)
        buffers = {b.data_ptr() for o in objects.values() if isinstance(o, nn.Module) for b in o.buffers()}
        for opt in (o for o in objects.values() if isinstance(o, torch.optim.Optimizer)):
            if id(opt) not in self._hooked:
                self._hooked.add(id(opt))
                opt.register_step_pre_hook(self._before_step)
        if in_place and not cuda:  # the write reads the tensors themselves; the buffers as of now
            self._staged_event = None
            return tree_map_only(torch.Tensor, lambda t: t.clone() if _local(t).data_ptr() in buffers else t,
                                 state), []  # fmt: skip
        if self._staging is None or self._staging[1] != layout:
            self._staging = None  # the old copy's memory goes back before the new one is taken
            on_device = cuda and (self.staging == "device" or (self.staging == "auto" and _room_on_device(layout)))
            self._staging = [_host_copy(state), layout, on_device, False]
        host, _, on_device, pinned = self._staging
        if cuda and not on_device and not in_place and not pinned:
            pin_in_place(_host_tensors(host))  # the staging copies run asynchronously at the link's speed
            self._staging[3] = True
        if not cuda:
            self._staged_event = None
            return _stage_into(state, host, lambda source, target: target.copy_(source)), []
        if (on_device or in_place) and not self._bounce:
            self._bounce = [torch.empty(_BOUNCE, dtype=torch.uint8, pin_memory=True) for _ in range(_BOUNCES)]
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())  # the state as of this step
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def copy(source: torch.Tensor, target: torch.Tensor) -> None:
            # module buffers (a state_dict holds them detached) on the current stream, before the next forward
            buffer = source.data_ptr() in buffers
            stream = torch.cuda.current_stream() if buffer else self._stream
            with torch.cuda.stream(stream):
                if not source.is_cuda:
                    target.copy_(source)
                elif in_place and not buffer and source.is_contiguous():
                    pairs.append((source, target))  # read where it is, by the write's thread
                elif on_device or in_place:
                    pairs.append((source.clone(memory_format=torch.contiguous_format), target))
                else:
                    target.copy_(source, non_blocking=True)

        staged = _stage_into(state, host, copy)
        self._stream.wait_stream(torch.cuda.current_stream())  # the buffers' copies too, nothing later
        self._staged_event = torch.cuda.Event()
        self._staged_event.record(self._stream)
        return staged, pairs

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """An optimizer's step changes the state being staged: its kernels wait for the staging copies
        (on the GPU, no wait on the host); after an in-place save, the host waits until the write no
        longer reads the tensors."""
        if self._reading is not None:
            self._reading.wait()
        if self._staged_event is not None:
            torch.cuda.current_stream().wait_event(self._staged_event)

    def wait_staged(self) -> None:
        """Block until the state of the save in flight is staged (on the host): for a step that changes
        the saved tensors other than through an optimizer's ``step()`` (a captured CUDA graph)."""
        if self._reading is not None:
            self._reading.wait()
        if self._staged_event is not None:
            self._staged_event.synchronize()

    def wait(self) -> None:
        """Wait for the save in flight (if any) on every rank, then commit it: rank 0 writes ``commit.json``
        into the partial directory and renames it to its final name, then deletes all but the newest
        ``keep``. A collective: every rank must call it, in the same order. Raises CheckpointError on
        every rank when any rank failed to write."""
        if self._pending is None:
            return
        step, partial, marker, thread, files = self._pending
        self._pending = None
        _IN_FLIGHT.discard(self)
        phases, t = self._phases, time.perf_counter()
        if thread is not None:
            thread.join()
            phases["waited_s"] = time.perf_counter() - t  # what was left of the write when this was called
        self._reading = None
        t = time.perf_counter()
        error = files.pop("error", None)
        problem = None
        if error is not None:
            problem = (disk.is_disk_full(error), f"rank {collectives.rank()} could not write checkpoint {partial}: "
                       f"{type(error).__name__}: {_first_line(error)}")  # fmt: skip
        self._fail_together_removing(step, partial, problem)
        every = self._all_gather(files)  # also the barrier: every rank's shards are on disk
        problem = None
        if collectives.rank() == 0:
            try:
                self._commit(step, partial, {**marker, "files": {k: v for f in every for k, v in f.items()}})
            except OSError as e:
                problem = (disk.is_disk_full(e), f"rank 0 could not commit checkpoint {partial}: {type(e).__name__}: "
                           f"{e}")  # fmt: skip
        self._fail_together_removing(step, partial, problem)
        phases["commit_s"] = time.perf_counter() - t  # the ranks' agreement, commit.json, the rename, old ones
        self.phases = {k: round(v, 3) for k, v in phases.items()}

    def _fail_together_removing(self, step: int, partial: str, problem: tuple[bool, str] | None) -> None:
        """When any rank could not write (``problem``: whether its disk was full, and its line), rank 0
        removes the partial directory (nothing completes it, and it holds the space it took) and every
        rank raises: ``DiskFull`` when a disk was full (what the checkpoint needs against what is free
        once the partial one is gone), else the first rank's CheckpointError. A collective."""
        problems = [p for p in self._all_gather(problem) if p]
        if not problems:
            return
        message = None
        if collectives.rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
            if any(full for full, _ in problems):
                committed = self.paths()
                # the tensors' bytes, or the last checkpoint's files when larger (their records' overhead)
                need = max(self._need, _bytes_of(committed[0]) if committed else 0)
                kept = (f"the committed checkpoints (the newest {os.path.basename(committed[0])}) are intact"
                        if committed else "no checkpoint was committed before")  # fmt: skip
                message = disk.describe(self.directory, f"checkpoint {step_name(step)}", need,
                                        f"; the partial save is removed, {kept}")  # fmt: skip
        message = self._all_gather(message)[0]  # also the barrier: the partial directory is gone
        if message is not None:
            raise disk.DiskFull(self.directory, f"checkpoint {step_name(step)}", self._need, message=message)
        raise CheckpointError(problems[0][1])

    def _commit(self, step: int, partial: str, marker: dict[str, Any]) -> None:
        # .metadata is a plain pickle (no CRC-32 of its own, and unpickled whole by every load): its CRC-32
        # here, and commit.json's own (``seal``), so that a changed byte of either is found before it is read
        marker["files"][".metadata"]["crc32"] = file_crc32(os.path.join(partial, ".metadata"))
        path = os.path.join(partial, MARKER)
        with open(path + ".tmp", "w") as f:
            json.dump(seal(marker), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        fsync_dir(partial)
        final = os.path.join(self.directory, step_name(step))
        discard(final)  # a step saved again (a run resumed from an older checkpoint): out of the name first
        os.replace(partial, final)  # the commit: a directory with the final name is complete
        fsync_dir(self.directory)
        for old in self.paths()[self.keep :]:
            discard(old)  # renamed before it is removed: never half a checkpoint under a committed name

    def written(self) -> bool:
        """Whether this rank has finished writing its part of the save in flight (or none is in flight), so
        that ``wait()`` would not wait for it here. Not a collective: a caller that commits as soon as every
        rank has written agrees on it with the others first, as the recipe runner does."""
        return self._pending is None or self._pending[3] is None or not self._pending[3].is_alive()

    def close(self) -> None:
        """Commit the save in flight, if any. A collective: every rank must call it, in the same order."""
        self.wait()

    def _at_shutdown(self, together: bool) -> None:
        """``distlib.shutdown()``'s call: commit the save in flight when every rank shuts down alike
        (``together``), else finish this rank's write only (its files complete, the checkpoint
        uncommitted: committing needs every rank); then drop the group, destroyed next."""
        try:
            if together:
                self.wait()
            elif self._pending is not None:
                step, partial, _, thread, files = self._pending
                self._pending = None
                _IN_FLIGHT.discard(self)
                if thread is not None:
                    thread.join()
                # its own write found the disk full: the partial directory goes, and the space it holds (a
                # partial one otherwise waits for the next run's resume, which deletes it)
                removed = collectives.rank() == 0 and disk.is_disk_full(files.get("error"))
                if removed:
                    shutil.rmtree(partial, ignore_errors=True)
                get_logger().warning(
                    "the checkpoint of step %d in %s is not committed%s: shutdown after a failure, and a commit "
                    "needs every rank; the previous checkpoint stays the one a resume loads", step, partial,
                    " (removed: its write found the disk full)" if removed else "",
                )  # fmt: skip
        finally:
            self._group, self._staging = None, None

    # ---- load -----------------------------------------------------------------------------

    def _read_marker(self, path: str) -> dict[str, Any]:
        marker_path = os.path.join(path, MARKER)
        try:
            with open(marker_path) as f:
                marker = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{marker_path}: unreadable ({type(e).__name__}: {e}); delete {path}") from e
        if not isinstance(marker, dict) or marker.get("format") != FORMAT or marker.get("version") not in (1, 2, 3):
            raise CheckpointError(f"{marker_path}: not a distlib sharded checkpoint of version 1 to {VERSION}")
        if not unseal(marker) or (marker["version"] >= 3 and "crc32" not in marker):
            raise CheckpointError(f"{marker_path}: checksum mismatch (the file is corrupted)")
        kinds = {"step": int, "world_size": int, "objects": list, "fingerprint": dict, "files": dict}
        wrong = [k for k, kind in kinds.items() if not isinstance(marker.get(k), kind)]
        if wrong or not all(isinstance(f, dict) and isinstance(f.get("bytes"), int) for f in marker["files"].values()):
            raise CheckpointError(f"{marker_path}: damaged ({', '.join(wrong) or 'files'} not as written)")
        return marker

    def _check_files(self, path: str, marker: Mapping[str, Any], *, alone: bool = False) -> str | None:
        """Every file present, of the size written; with ``verify``, this rank's share of the files (every
        world_size-th; ``alone``: every file) intact: the CRC-32 of every record (or the sha256 of a version
        1 checkpoint), of ``.metadata`` on every rank."""
        rank, world = (0, 1) if alone else (collectives.rank(), collectives.world_size())
        records: dict[str, list[tuple[int, int]]] | None = None
        for i, (name, want) in enumerate(sorted(marker["files"].items())):
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                return f"{file} is missing"
            size = os.path.getsize(file)
            if size != want["bytes"]:
                return f"{file} has {size} bytes, {want['bytes']} were written (truncated or overwritten)"
            # .metadata by every rank (the load unpickles it on each), the rest by one rank each
            if not self.verify or (i % world != rank and name != ".metadata"):
                continue
            if "sha256" in want:
                if file_sha256(file) != want["sha256"]:
                    return f"{file}: checksum mismatch (the file is corrupted)"
            elif "crc32" in want:
                if file_crc32(file) != want["crc32"]:
                    return f"{file}: checksum mismatch (the file is corrupted)"
            elif name != ".metadata" and marker.get("record_crc32", True):
                if records is None:
                    try:  # intact for a version 3 checkpoint (checked first: its name sorts first)
                        metadata = dcp.FileSystemReader(path).read_metadata()
                    except Exception as e:  # a version 2 checkpoint's .metadata, unchecked: any unpickling error
                        return f"{os.path.join(path, '.metadata')}: unreadable ({type(e).__name__}: {str(e)[:200]})"
                    records = {}
                    for info in metadata.storage_data.values():
                        records.setdefault(info.relative_path, []).append((info.offset, info.length))
                if not records_intact(file, records.get(name, [])):
                    return f"{file}: checksum mismatch (the file is corrupted)"
        return None

    @_sharded_tensors_quiet()
    def resume(self, objects: Mapping[str, Any], *, fallback: bool = False) -> int | None:
        """Load the newest committed checkpoint into ``objects`` in place; returns its step, or None when
        there is none (a fresh start). Every rank reads the parts of the shards it holds itself.

        Partial directories of interrupted saves are deleted first. A collective: every rank must call
        it, in the same order. Raises CheckpointError on every rank when the checkpoint is from another
        model or settings, or a shard file is missing or corrupt (it names the file and the fix).
        ``fallback``: a damaged checkpoint (its ``commit.json`` unreadable, a file missing, truncated or
        corrupt) is skipped instead, with a warning on every rank, for the next older one; CheckpointError
        when none is usable.
        """
        self.wait()
        log = get_logger()
        paths: list[str] = []
        if collectives.rank() == 0:
            for p in self._partials():
                log.warning("deleting %s, the partial directory of an interrupted save", p)
                shutil.rmtree(p, ignore_errors=True)
            for p in leftovers(self.directory):  # an old checkpoint's deletion, interrupted
                shutil.rmtree(p, ignore_errors=True)
            paths = self.paths()
        paths = self._all_gather(paths)[0]
        if not paths:
            return None
        skipped = 0
        for found in paths if fallback else paths[:1]:
            error, damaged = None, False
            try:
                try:
                    marker = self._read_marker(found)
                except CheckpointError:
                    damaged = True
                    raise
                diff = differences(
                    marker["fingerprint"], {"tensors": model_fingerprint(objects), "settings": self.settings}
                )
                missing = [n for n in objects if n not in marker["objects"]]
                if diff:
                    raise CheckpointError(
                        f"checkpoint {found} is from another model or settings:\n"
                        + "\n".join(f"  - {d}" for d in diff)
                        + f"\nuse another checkpoint directory than {self.directory}, or delete its checkpoints"
                    )
                if missing:
                    raise CheckpointError(
                        f"checkpoint {found} has no state for {', '.join(missing)} (it holds "
                        f"{', '.join(marker['objects'])}); save every object you resume"
                    )
                problem = self._check_files(found, marker)
                if problem:
                    damaged = True
                    raise CheckpointError(
                        f"checkpoint {found} is damaged: {problem}; delete {found} to resume from the previous one"
                    )
            except CheckpointError as e:
                error = str(e)
            # every rank checks its share of the files: all of them skip this checkpoint, or none
            errors = [(e, d) for e, d in self._all_gather((error, damaged)) if e]
            if not errors:
                break
            if not (fallback and all(d for _, d in errors)):
                raise CheckpointError(errors[0][0])
            log.warning("skipping checkpoint: %s", errors[0][0])
            skipped += 1
        else:
            raise CheckpointError(
                f"none of the {len(paths)} committed checkpoint(s) in {self.directory} is usable (see the warnings "
                "above); delete or move them away"
            )
        if skipped:
            log.warning("resuming from the older checkpoint %s", found)
        saved = dcp.FileSystemReader(found).read_metadata().state_dict_metadata
        for name, obj in objects.items():
            if isinstance(obj, dict):  # a plain dict takes the values saved under keys it lacks
                for fqn, meta in saved.items():
                    key = fqn[len(name) + 1 :] if fqn.startswith(f"{name}.") else ""
                    if key and "." not in key and key not in obj and isinstance(meta, BytesStorageMetadata):
                        obj[key] = None
        states = _state_dicts(objects, self.frozen)
        # a ShardedOptimizer's fp32 masters, absent from a plain optimizer's checkpoint: taken from the
        # parameters instead (load_state_dict); a plain optimizer has no place for them and steps the parameters
        mine = flatten_state_dict(states)[0]
        _drop(states, [k for k in mine if k not in saved and any(_is_master(k, n, objects) for n in objects)])
        # over every rank: a ShardedOptimizer's rank holds the state of the parameters in its slice only
        have = set().union(*self._all_gather(sorted(flatten_state_dict(states)[0])))
        lacking = {n: [k for k in saved if k.startswith(f"{n}.") and k not in have and not _is_master(k, n, objects)]
                   for n in objects}  # fmt: skip
        lacking = {n: keys for n, keys in lacking.items() if keys}
        if lacking:
            name, keys = next(iter(lacking.items()))
            raise CheckpointError(
                f"{name!r} ({type(objects[name]).__name__}) has no place for {len(keys)} value(s) checkpoint {found} "
                f"holds ({', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''}): its state_dict() must have "
                "every key and tensor before resume (create its state first, e.g. as its first step would)"
            )  # the same on every rank: every rank reads the same .metadata and gathers the same keys
        error, fitted = None, []
        try:
            fitted = _fit_to_saved(states, saved, found)  # a ShardedOptimizer's flat layout <-> parameters' shapes
        except CheckpointError as e:
            error = str(e)
        self._fail_together(error)
        try:
            dcp.load(states, storage_reader=dcp.FileSystemReader(found), process_group=self._pg())
            for put in fitted:
                put()
        except (Exception, CheckpointException) as e:  # DCP's own is a BaseException; corrupt bytes, a foreign file
            error = (
                f"checkpoint {found} could not be loaded ({type(e).__name__}: {str(e)[:300]}); "
                "delete it to resume from the previous one"
            )
        self._fail_together(error)
        _load_into(objects, states, self.frozen)
        log.info("resumed from %s (step %d, saved by %d rank(s))", found, marker["step"], marker["world_size"])
        return int(marker["step"])


def _resolve(checkpoint_dir: str) -> str:
    """A committed checkpoint directory itself, or the newest one in a checkpointer's directory."""
    if os.path.isfile(os.path.join(checkpoint_dir, MARKER)):
        return checkpoint_dir
    paths = ShardedCheckpointer(checkpoint_dir).paths()
    if not paths:
        raise CheckpointError(
            f"{checkpoint_dir} holds no committed sharded checkpoint (no {MARKER}); give a step directory or "
            "the directory a ShardedCheckpointer saved into"
        )
    return paths[0]


def verify(step_dir: str, *, records: bool = True) -> None:
    """Check the committed checkpoint ``step_dir`` in this process alone, as ``resume`` does over the ranks:
    ``commit.json`` and its CRC-32, every file's size, ``.metadata``'s CRC-32, and with ``records`` the CRC-32
    of every record of every shard file (a read of the whole checkpoint). Raises CheckpointError naming the
    damaged file."""
    checker = ShardedCheckpointer(os.path.dirname(step_dir.rstrip(os.sep)) or ".")
    marker = checker._read_marker(step_dir)
    if not records:
        marker = {**marker, "record_crc32": False}  # the records' CRC-32s not read: sizes and .metadata only
    problem = checker._check_files(step_dir, marker, alone=True)
    if problem:
        raise CheckpointError(f"checkpoint {step_dir} is damaged: {problem}")


def export_checkpoint(checkpoint_dir: str, path: str) -> str:
    """Write the checkpoint in ``checkpoint_dir`` (a step directory, or the newest in a checkpointer's
    directory) as one ``torch.save`` file: ``{name: state_dict}`` with whole tensors, so that
    ``model.load_state_dict(torch.load(path)["model"])`` works on a plain model. Run it in one process:
    it holds the whole state in host memory. Returns the checkpoint directory it exported."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    source = _resolve(checkpoint_dir)
    verify(source)  # every file, before anything is unpickled or written out
    dcp_to_torch_save(source, path)
    return source


def main(argv: list[str] | None = None) -> int:
    """``python -m distlib.checkpoint.sharded CHECKPOINT_DIR OUT.pt``: ``export_checkpoint`` from a shell."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m distlib.checkpoint.sharded", description=export_checkpoint.__doc__)
    p.add_argument("checkpoint_dir", help="a step directory, or the directory a ShardedCheckpointer saved into")
    p.add_argument("path", help="the torch.save file to write")
    args = p.parse_args(argv)
    try:
        source = export_checkpoint(args.checkpoint_dir, args.path)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.path} from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
