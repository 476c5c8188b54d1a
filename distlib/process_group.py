"""Process group set-up and teardown.

``init()`` reads torchrun's environment (or finds none: world size 1, no process
group, every collective a no-op), binds the process to its GPU and starts the
process group. ``shutdown()`` tears it down without the gloo abort at exit.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlib.log import get_logger, set_rank

_ENV_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class EnvError(RuntimeError):
    """The distributed environment is incomplete or contradictory."""


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


@dataclass(frozen=True)
class EnvInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int


def parse_env(env: dict[str, str] | None = None) -> EnvInfo | None:
    """Read torchrun's variables. None when none is set (a plain ``python`` run).

    Raises EnvError naming what is missing or wrong when they are half set.
    """
    env = os.environ if env is None else env
    present = [k for k in _ENV_REQUIRED if k in env]
    if not present:
        return None
    missing = [k for k in _ENV_REQUIRED if k not in env]
    if missing:
        raise EnvError(
            f"distributed environment is half set: {', '.join(present)} present but "
            f"{', '.join(missing)} missing; start with torchrun, or set none of them for one process"
        )
    values = {}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        raw = env.get(key)
        if raw is None:
            continue
        try:
            values[key] = int(raw)
        except ValueError:
            raise EnvError(f"{key}={raw!r} is not an integer") from None
    world = values["WORLD_SIZE"]
    rank = values["RANK"]
    local_rank = values["LOCAL_RANK"]
    local_world = values.get("LOCAL_WORLD_SIZE", world)
    problems = []
    if world < 1:
        problems.append(f"WORLD_SIZE={world} must be >= 1")
    if not 0 <= rank < max(world, 1):
        problems.append(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
    if not 0 <= local_rank < max(local_world, 1):
        problems.append(f"LOCAL_RANK={local_rank} must be in [0, LOCAL_WORLD_SIZE={local_world})")
    if problems:
        raise EnvError("; ".join(problems))
    return EnvInfo(rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world)


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


_CONTEXT: Context | None = None


def init(backend: str = "auto", timeout_s: float = 300.0, *, gpus_per_process: int = 1) -> Context:
    """Start the process group from torchrun's environment and bind this process's device.

    Without torchrun's variables this is world size 1: no process group is
    started and the collectives of distlib are no-ops. ``gpus_per_process`` > 1
    (the cuda.comm fallback mode) skips the one-GPU-per-process check.
    """
    global _CONTEXT
    info = parse_env()
    name = resolve_backend(backend)
    if info is None:
        info = EnvInfo(rank=0, local_rank=0, world_size=1, local_world_size=1)
    set_rank(info.rank)
    if name == "nccl":
        n_gpus = torch.cuda.device_count()
        if gpus_per_process == 1 and info.local_world_size > n_gpus:
            raise EnvError(
                f"{info.local_world_size} processes on this node but only {n_gpus} GPU(s) visible; "
                f"use --nproc-per-node={n_gpus} or fewer"
            )
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if info.world_size > 1 and not dist.is_initialized():
        kwargs = {}
        if name == "nccl":
            kwargs["device_id"] = device  # binds the communicator to this GPU, eager init
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            dist.init_process_group(
                backend=name,
                timeout=timeout,
                rank=info.rank,
                world_size=info.world_size,
                store=_restart_safe_store(info, timeout),
                **kwargs,
            )
        except dist.DistNetworkError as e:  # rank 0 hosts the store on MASTER_PORT when torchrun does not
            where = f"MASTER_ADDR={os.environ['MASTER_ADDR']} MASTER_PORT={os.environ['MASTER_PORT']}"
            if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
                raise EnvError(
                    f"cannot start the process group: {where} is already in use by another process "
                    "(another job, or a leftover one); choose a free port, or let torchrun pick one "
                    "with --standalone"
                ) from e
            raise EnvError(f"cannot start the process group at {where}: {str(e).splitlines()[0]}") from e
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


def context() -> Context | None:
    """The context of the last ``init()``, or None."""
    return _CONTEXT


def shutdown() -> None:
    """Tear the process group down; safe to call twice, or without ``init()``.

    A final barrier first: with gloo, a rank that destroys its group while a
    peer is still inside the last collective closes sockets under it, and the
    peer's gloo thread aborts the process ("terminate called without an
    active exception").
    """
    global _CONTEXT
    _CONTEXT = None
    from distlib.cuda_graph import release_graphs

    release_graphs()  # a live graph holding NCCL work makes ncclCommDestroy wait forever
    if not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "nccl":
            torch.cuda.synchronize()
        dist.barrier()
    finally:
        dist.destroy_process_group()
