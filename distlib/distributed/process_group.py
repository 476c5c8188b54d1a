"""Process group set-up and teardown.

``init()`` reads the launcher's environment (torchrun, srun, a PyTorchJob or
mpirun: see ``distlib.distributed.launchers``; or finds none: world size 1, no process group,
every collective a no-op), binds the process to its GPU and starts the process
group. ``shutdown()`` tears it down without the gloo abort at exit (see its
docstring for the cause).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import importlib
import os
import re
import sys
import traceback
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlib.distributed import collectives
from distlib.distributed.launchers import PER_NODE_FLAG, EnvError, EnvInfo, detect
from distlib.log import get_logger, set_rank


@dataclass(frozen=True)
class Context:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str  # "nccl", "gloo", or "none" at world size 1 without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def node_rank(self) -> int:
        return self.rank // max(self.local_world_size, 1)


def parse_env(env: Mapping[str, str] | None = None) -> EnvInfo | None:
    """Read the launcher's variables (torchrun, srun, a PyTorchJob, mpirun). None when no launcher's
    are set (a plain ``python`` run).

    Raises EnvError naming what is missing or wrong when they are half set or contradictory.
    """
    return detect(os.environ if env is None else env)


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'auto', 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise EnvError("backend 'nccl' needs a GPU, and this process sees none; use 'gloo' or 'auto'")
    return backend


def _restart_safe_store(info: EnvInfo, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, a store whose keys are new for each restart of the workers; None otherwise.

    torchrun's agent keeps one store for the whole job, and torch's own keys carry
    no attempt number: after ``--max-restarts`` restarts the workers, the new ranks
    read the dead ranks' gloo/NCCL addresses and fail with "Connection refused".
    TORCHELASTIC_RESTART_COUNT is the same on every node (a peer's death fails
    the workers of every node, and each agent counts one restart).
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, info.world_size, is_master=False, timeout=timeout)  # the agent hosts it
    return dist.PrefixStore(f"distlib/attempt{attempt}", store)


def _gpu_index(info: EnvInfo, n_gpus: int, gpus_per_process: int, env: Mapping[str, str]) -> int:
    """This process's GPU among those it sees: its local rank, or the first when srun gave each task its
    own GPUs (``--gpus-per-task``: each task sees only its own)."""
    if gpus_per_process > 1 or info.local_world_size <= n_gpus:
        return info.local_rank
    if info.launcher == "srun" and n_gpus >= 1 and "SLURM_GPUS_PER_TASK" in env:
        return 0
    raise EnvError(
        f"{info.local_world_size} processes on this node but only {n_gpus} GPU(s) visible; "
        f"start {n_gpus} or fewer per node ({PER_NODE_FLAG.get(info.launcher, '--nproc-per-node')})"
    )


_CONTEXT: Context | None = None


_timeout_s = 300.0  # init()'s collective timeout, also the bound of shutdown()'s barrier
_atexit_registered = False


def _explicit(init_method: str | None, rank: int | None, world_size: int | None) -> EnvInfo | None:
    """The rendezvous given as arguments (an ``mp.spawn`` script's ``--dist-url``), or None when none is."""
    if init_method is None and rank is None and world_size is None:
        return None
    if init_method is None or rank is None or world_size is None:
        given = [
            n for n, v in (("init_method", init_method), ("rank", rank), ("world_size", world_size)) if v is not None
        ]
        raise EnvError(
            f"init() got {', '.join(given)} but not all of init_method, rank and world_size: pass the three "
            "(as dist.init_process_group takes them, e.g. init_method='tcp://HOST:PORT', rank=the process's index "
            "in the job, world_size=the number of processes), or none of them to read the launcher's environment"
        )
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise EnvError(f"init(): rank must be in [0, world_size) and world_size >= 1, got rank={rank!r} "
                       f"world_size={world_size!r}")  # fmt: skip
    gpus = torch.cuda.device_count()
    per_node = min(world_size, gpus) if gpus else world_size  # one node unless there are fewer GPUs than processes
    return EnvInfo(rank=rank, local_rank=rank % per_node, world_size=world_size, local_world_size=per_node,
                   launcher="init_method")  # fmt: skip


def init(
    backend: str = "auto",
    timeout_s: float = 300.0,
    *,
    gpus_per_process: int = 1,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> Context:
    """Start the process group from the launcher's environment and bind this process's device.

    torchrun, srun, a Kubeflow PyTorchJob and mpirun are read (``distlib.distributed.launchers``);
    without any launcher's variables this is world size 1: no process group is
    started and the collectives of distlib are no-ops (``os.environ`` is not changed: read the
    rank and world size from the returned ``Context``, not from torchrun's variables). Under
    a launcher other than torchrun, the MASTER_ADDR and MASTER_PORT it derived are exported to this
    process's environment, where torch's rendezvous reads them. ``gpus_per_process`` > 1
    (the cuda.comm fallback mode) skips the one-GPU-per-process check.

    ``init_method``, ``rank`` and ``world_size`` (all three, as ``dist.init_process_group`` takes
    them: scripts started by ``mp.spawn`` with ``--dist-url tcp://HOST:PORT``) replace the
    launcher's environment; the local rank is then ``rank`` modulo the GPUs this process sees (or
    ``rank`` without GPUs: one node). A rank that does not arrive within ``timeout_s`` makes every
    waiting rank raise EnvError saying how many joined and what to check.
    """
    global _CONTEXT, _timeout_s, _atexit_registered
    explicit = _explicit(init_method, rank, world_size)
    info = explicit if explicit is not None else parse_env()
    name = resolve_backend(backend)
    if info is None:
        # os.environ is left as it is: RANK and WORLD_SIZE there would tell a child process that
        # tests `"RANK" in os.environ` (nanoGPT's and the tutorials' idiom) that torchrun started it
        info = EnvInfo(rank=0, local_rank=0, world_size=1, local_world_size=1)
    set_rank(info.rank)
    if name == "nccl":
        device = torch.device("cuda", _gpu_index(info, torch.cuda.device_count(), gpus_per_process, os.environ))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if info.world_size > 1 and not dist.is_initialized():
        if explicit is None:
            os.environ["MASTER_ADDR"] = str(info.master_addr)  # torchrun's own values, or those the launcher gave
            os.environ["MASTER_PORT"] = str(info.master_port)
        # torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when it is
        # imported, which torch._dynamo does (the first optimizer imports it). Imported after the group
        # exists, it would keep the group alive past destroy_process_group(), and with it gloo's worker
        # threads (see shutdown()). Imported now, its defaults are None, which means the same.
        importlib.import_module("torch.distributed.nn.functional")

        kwargs = {}
        if name == "nccl":
            kwargs["device_id"] = device  # binds the communicator to this GPU, eager init
        timeout = datetime.timedelta(seconds=timeout_s)
        if explicit is not None:
            kwargs["init_method"] = init_method
        else:
            kwargs["store"] = _restart_safe_store(info, timeout)
        if explicit is not None:
            where = f"init_method={init_method}"
        else:
            where = f"MASTER_ADDR={os.environ['MASTER_ADDR']} MASTER_PORT={os.environ['MASTER_PORT']}"
        try:
            dist.init_process_group(backend=name, timeout=timeout, rank=info.rank, world_size=info.world_size, **kwargs)
        except dist.DistNetworkError as e:  # rank 0 hosts the store on MASTER_PORT when torchrun does not
            if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
                picks = {"torchrun": "let torchrun pick one with --standalone", "init_method": "change init_method"}
                pick = picks.get(info.launcher, "set MASTER_PORT")
                raise EnvError(
                    f"cannot start the process group: {where} is already in use by another process "
                    f"(another job, or a leftover one); choose a free port: {pick}"
                ) from e
            raise _not_joined(info, where, timeout_s, str(e)) from e
        except dist.DistStoreError as e:  # the store's host waited for the other ranks in vain
            raise _not_joined(info, where, timeout_s, str(e)) from e
        _timeout_s = timeout_s
        if not _atexit_registered:
            atexit.register(_shutdown_at_exit)
            _atexit_registered = True
    _CONTEXT = Context(
        rank=info.rank,
        local_rank=info.local_rank,
        world_size=info.world_size,
        local_world_size=info.local_world_size,
        device=device,
        backend=name if info.world_size > 1 else "none",
    )
    get_logger().info("initialized: world_size=%d backend=%s device=%s", info.world_size, _CONTEXT.backend, device)
    return _CONTEXT


def _not_joined(info: EnvInfo, where: str, timeout_s: float, torch_message: str) -> EnvError:
    """The rendezvous did not complete within the timeout: how many ranks arrived, and what to check."""
    first = torch_message.strip().splitlines()[0] if torch_message.strip() else "no detail"
    joined = re.search(r"(\d+)/(\d+) clients joined", torch_message)
    if joined:  # this rank hosts the store: it knows how many arrived
        count = f"only {joined.group(1)} of {joined.group(2)} ranks joined the rendezvous"
    else:
        count = f"rank {info.rank} could not reach the rendezvous host (rank 0)"
    return EnvError(
        f"{count} at {where} within timeout_s={timeout_s:g} s ({first}). Check that every rank was started "
        f"(world size {info.world_size}: on every node the same command with the same MASTER_ADDR, MASTER_PORT and "
        "number of nodes, and its own node rank), that the address is rank 0's host and reachable from the others, "
        "and that the port is open (no firewall) and the same everywhere"
    )


def context() -> Context | None:
    """The context of the last ``init()``, or None."""
    return _CONTEXT


_SHUTDOWN_HOOKS: list[weakref.WeakMethod] = []


def on_shutdown(method: Callable[[bool], None]) -> None:
    """Have ``shutdown()`` (and the exit hook) call ``method(together)`` before it tears anything
    down, while the method's object lives (it is held weakly), in the order of registration.

    ``together`` is True when every rank shuts down cleanly (no exception propagating): the method
    may then run collectives, which every rank reaches in the same order as every rank registered
    the same objects in the same order. False after a failure: local work only (a peer may be gone).
    The modules above this one register here instead of being imported by it: ShardedCheckpointer and
    Checkpointer (to commit a save still in flight), CapturedStep (to release its graph first).
    """
    global _atexit_registered
    _SHUTDOWN_HOOKS[:] = [h for h in _SHUTDOWN_HOOKS if h() is not None]
    _SHUTDOWN_HOOKS.append(weakref.WeakMethod(method))
    if not _atexit_registered:  # also at world size 1 without a group: a save in flight is finished at exit
        atexit.register(_shutdown_at_exit)
        _atexit_registered = True


def run_shutdown_hooks(*, together: bool) -> list[tuple[type[Exception], str]]:
    """Call the live ``on_shutdown`` hooks now (each once: they are dropped), as ``shutdown()`` does
    first; the failures' types and texts (not the exceptions: their frames may hold a group).
    ``failures.abort()`` calls it with ``together=False`` before destroying the group."""
    hooks = [h() for h in _SHUTDOWN_HOOKS]
    _SHUTDOWN_HOOKS.clear()
    failures = []
    for hook in hooks:
        if hook is None:
            continue
        try:
            hook(together)
        except Exception as e:
            failures.append((type(e), str(e)))
    return failures


def shutdown(*, barrier: bool | None = None) -> None:
    """Tear the process group down; safe to call twice, or without ``init()``.

    ``barrier``: first wait for every rank (bounded by ``init``'s timeout), so no
    rank tears down while a peer still exchanges data with it. None (default):
    wait unless an exception is propagating, since a failed peer may never
    arrive and torchrun stops the job once this rank exits. A collective when
    it waits: every rank must call it, in the same order.

    First an asynchronous save still in flight (``ShardedCheckpointer.save(..., async_=True)``
    without ``wait()`` or ``close()``) is finished: committed when every rank shuts down alike
    (with the barrier), else only written by this rank and left uncommitted (a warning says so).
    A save that fails raises CheckpointError here, once the group is torn down.

    Why the group must really be destroyed here (the gloo abort at exit): a
    gloo worker thread drops its reference to a finished collective *after*
    the caller has returned, and if that reference is the last one to a tensor
    that Python also sees, releasing it needs the GIL. When the process exits
    first, CPython ends that thread with ``pthread_exit`` inside a noexcept C++
    destructor and the process aborts with "terminate called without an
    active exception". ``destroy_process_group()`` prevents it only if it
    actually destroys the ProcessGroupGloo, whose destructor joins the worker
    threads with the GIL released. A group still referenced elsewhere keeps its
    threads alive: default arguments of torch.distributed.nn.functional (see
    ``init()``; released here), torch's device meshes and FSDP2's modules (a
    ``shard_model`` or ``fully_shard`` model; released here), the frames of a
    failed collective (cleared here), a DistributedDataParallel model or a stored
    group handle (reported).
    """
    if barrier is None:
        barrier = sys.exc_info()[0] is None
    _teardown(barrier=barrier, together=barrier)


def _teardown(*, barrier: bool, together: bool) -> None:
    global _CONTEXT
    hook_failures = run_shutdown_hooks(together=together)  # before anything is torn down: a commit is a collective
    _CONTEXT = None
    failure = None
    if dist.is_available() and dist.is_initialized():
        if barrier:
            try:
                _final_barrier()
            except Exception as e:  # a peer gone or stalled; keep only the text, the frames hold the group
                failure = f"{type(e).__name__}: {e}"
        collectives.forget_groups()
        _destroy()
    if failure is not None:
        raise RuntimeError(f"not every rank reached the final barrier of shutdown(): {failure}")
    if hook_failures:  # raised as the first one's type (a save's CheckpointError)
        raise hook_failures[0][0]("; ".join(text for _, text in hook_failures))


def _final_barrier() -> None:
    backend = dist.get_backend()
    if backend == "nccl":
        torch.cuda.synchronize()
        dist.barrier(device_ids=[torch.cuda.current_device()])
    elif backend == "gloo":
        # names the ranks that did not arrive instead of waiting silently
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=_timeout_s), wait_all_ranks=True)
    else:
        dist.barrier()


def _all_groups() -> list[dist.ProcessGroup]:
    """Every group started so far (the default one and those of ``new_group``)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", None) or {})
    return groups or ([dist.group.WORLD] if dist.group.WORLD is not None else [])


def _destroy() -> None:
    group = dist.group.WORLD
    alive = weakref.ref(group) if group is not None else None
    groups = [weakref.ref(g) for g in _all_groups()]
    del group
    dist.destroy_process_group()
    if any(g() is not None for g in groups):
        _release_holders([ref() for ref in groups])  # a function: no local name here keeps a group
        # The frames of a failed collective, kept by the exception in flight, or a reference cycle
        # may be what holds it; the traceback still prints without the frames' locals.
        if sys.exc_info()[2] is not None:
            traceback.clear_frames(sys.exc_info()[2])
        gc.collect()
    if alive is not None and alive() is not None:
        get_logger().warning(
            "the process group is still referenced after shutdown (a DistributedDataParallel model, a "
            "group handle or a Work object?): its gloo worker threads stay alive and the process may abort "
            "at exit ('terminate called without an active exception'); drop those references before "
            "distlib.shutdown()"
        )


def _release_holders(groups: list[dist.ProcessGroup | None]) -> None:
    dead = [g for g in groups if g is not None]
    for group in dead:
        _release_known_holders(group)
    _release_meshes({id(g) for g in dead})


def _release_meshes(dead: set[int]) -> None:
    """Drop the destroyed groups that torch's device meshes and FSDP2's objects keep.

    ``destroy_process_group()`` forgets its groups, but a ``DeviceMesh`` keeps those of its
    dimensions (``_pg_registry``, where torch has it) and FSDP2's per-module mesh info keeps its
    mesh's (``shard_process_group``, ``reduce_scatter_process_group``, ...): every model made by
    ``shard_model`` (or ``fully_shard``) and every DTensor's mesh holds the group for as long as the
    model lives. The meshes are found among the objects the garbage collector tracks (a mesh's
    dict of groups is not tracked itself: ``gc.get_referrers`` does not see it). The model stays
    usable for what needs no communication (its local shards, ``to_local()``); a new ``init()``
    cannot revive it.
    """
    if "torch.distributed.device_mesh" not in sys.modules:
        return  # neither a mesh nor FSDP2 was used
    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance(): it reads obj.__class__, which some of torch's objects warn about
        fsdp = str(getattr(kind, "__module__", "")).startswith("torch.distributed.fsdp._fully_shard")
        if not (fsdp or issubclass(kind, DeviceMesh)):
            continue
        attributes = getattr(obj, "__dict__", None)
        for name, value in list(attributes.items()) if isinstance(attributes, dict) else ():
            if isinstance(value, dist.ProcessGroup) and id(value) in dead:
                attributes[name] = None
            elif isinstance(value, dict):
                for key in [k for k, v in value.items() if isinstance(v, dist.ProcessGroup) and id(v) in dead]:
                    del value[key]


def _release_known_holders(group: object) -> None:
    """Reset default arguments that captured ``group`` (torch.distributed.nn.functional, when it was
    imported after the group started) to None, which means the default group, as they did."""
    module = sys.modules.get("torch.distributed.nn.functional")
    for fn in vars(module).values() if module is not None else ():
        defaults = getattr(fn, "__defaults__", None)
        if isinstance(defaults, tuple) and any(d is group for d in defaults):
            fn.__defaults__ = tuple(None if d is group else d for d in defaults)


def _shutdown_at_exit() -> None:
    """A script that never called ``shutdown()``: destroy the group while the
    interpreter is still whole (no barrier: the peers may be gone). A save still in
    flight is committed when the script ended without an uncaught exception (every
    rank that saved exits alike: the commit is a collective)."""
    clean = getattr(sys, "last_value", None) is None  # set when the interpreter printed an uncaught exception
    if _SHUTDOWN_HOOKS or (dist.is_available() and dist.is_initialized()):
        try:
            _teardown(barrier=False, together=clean)
        except Exception as e:  # nothing to raise to at exit
            get_logger().error("at exit: %s", e)
