"""Which launcher started this process, and the world it describes.

torchrun, a Kubeflow PyTorchJob, SLURM's ``srun`` and ``mpirun`` (Open MPI, MPICH, Intel MPI) each
describe the world in their own environment variables; ``detect`` turns any of them into one EnvInfo,
or refuses with a message naming the variables to set. The launcher closest to the process wins:
torchrun's variables over MPI's over SLURM's (``srun torchrun``, ``mpirun`` inside an sbatch job).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from distlib.errors import DistlibError


class EnvError(DistlibError, RuntimeError):
    """The distributed environment is incomplete or contradictory."""


@dataclass(frozen=True)
class EnvInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    launcher: str = "none"  # "torchrun", "pytorchjob", "srun", "mpirun", "init_method" (given to init), "none"
    master_addr: str | None = None  # rank 0's host and port (the rendezvous), None at world size 1
    master_port: int | None = None


TORCHRUN_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
PYTORCHJOB_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
OMPI = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
PMI = ("PMI_RANK", "PMI_SIZE")  # MPICH's and Intel MPI's Hydra; MPI_LOCALRANKID/MPI_LOCALNRANKS when given

# Ports derived from a job id (srun, mpirun) lie in 20000-29999: unprivileged and outside Linux's default
# ephemeral range (32768-60999), from which outgoing connections take theirs.
PORT_BASE = 20000
# mpirun without MASTER_PORT and without a job id to derive one from: torchrun's default port.
DEFAULT_PORT = 29500

# how each launcher is told to start fewer processes per node (for the one-GPU-per-process check)
PER_NODE_FLAG = {
    "torchrun": "--nproc-per-node",
    "pytorchjob": "one process per pod",
    "srun": "--ntasks-per-node",
    "mpirun": "--npernode (Open MPI) or -ppn (MPICH, Intel MPI)",
}


def detect(env: Mapping[str, str]) -> EnvInfo | None:
    """The world described by ``env``; None when no launcher's variables are set (one plain process).

    Raises EnvError naming what is missing, wrong, or contradictory, and how to launch instead.
    """
    if _one_process(env):
        return None
    if any(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        if "LOCAL_RANK" not in env and all(k in env for k in PYTORCHJOB_REQUIRED):
            return _pytorchjob(env)
        return _torchrun(env)
    in_srun_step = "SLURM_STEP_NUM_TASKS" in env  # set by srun for the tasks it starts, not in the batch script
    mpi = _mpi(_without_srun_pmi(env) if in_srun_step else env)
    if in_srun_step and (mpi is None or _agrees_with_slurm(mpi, env)):
        # mpirun inside a SLURM job starts its daemons with srun: their step variables describe the
        # daemons, not the ranks, and disagree with MPI's on every rank.
        return _srun(env)
    if mpi is not None:
        return mpi
    _refuse_slurm_batch(env)
    if "MASTER_ADDR" in env or "MASTER_PORT" in env:
        return _torchrun(env)  # refuses: the rest of torchrun's variables are missing
    return None


# ---- torchrun and PyTorchJob ------------------------------------------------------------------


def _one_process(env: Mapping[str, str]) -> bool:
    """torchrun's variables for a world of one process and no rendezvous (what ``distlib.init()`` sets
    at world size 1, which child processes inherit): complete as they are, nothing to connect to."""
    single = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    return (
        env.get("WORLD_SIZE") == "1"
        and all(env.get(k, v) == v for k, v in single.items())
        and "MASTER_ADDR" not in env
        and "MASTER_PORT" not in env
    )


def _torchrun(env: Mapping[str, str]) -> EnvInfo:
    present = [k for k in TORCHRUN_REQUIRED if k in env]
    missing = [k for k in TORCHRUN_REQUIRED if k not in env]
    if missing:
        raise EnvError(
            f"distributed environment is half set: {', '.join(present)} present but "
            f"{', '.join(missing)} missing; start with torchrun, which sets all of them, or set RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT for one process per machine (as a PyTorchJob does), "
            "or set none of them for one process"
        )
    world, rank, local_rank = _ints(env, "WORLD_SIZE", "RANK", "LOCAL_RANK")
    local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
    _check(world, rank, local_rank, local_world, names=("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    return EnvInfo(rank, local_rank, world, local_world, "torchrun", env["MASTER_ADDR"], _port(env, "MASTER_PORT"))


def _pytorchjob(env: Mapping[str, str]) -> EnvInfo:
    """RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT without LOCAL_RANK: one process per pod (or machine)."""
    nproc = env.get("PET_NPROC_PER_NODE", "")
    if nproc.isdigit() and int(nproc) > 1:
        # the operator counts nproc processes per pod in WORLD_SIZE, but RANK is the pod's index
        raise EnvError(
            f"PET_NPROC_PER_NODE={nproc}: this PyTorchJob runs {nproc} processes per pod, which needs torchrun "
            "as the container's command (torchrun reads the PET_* variables and sets LOCAL_RANK); "
            "start `torchrun train.py`, or set nprocPerNode to 1 to start `python train.py` once per pod"
        )
    world, rank = _ints(env, "WORLD_SIZE", "RANK")
    local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else 1
    if local_world < 1 or world % local_world:
        raise EnvError(
            f"LOCAL_WORLD_SIZE={local_world} must be >= 1 and divide WORLD_SIZE={world} "
            "(without LOCAL_RANK the local rank is RANK % LOCAL_WORLD_SIZE); set LOCAL_RANK, or start with torchrun"
        )
    local_rank = rank % local_world
    _check(world, rank, local_rank, local_world, names=("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    return EnvInfo(rank, local_rank, world, local_world, "pytorchjob", env["MASTER_ADDR"], _port(env, "MASTER_PORT"))


# ---- srun -------------------------------------------------------------------------------------

_SLURM_NAMES = ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE")


def _srun(env: Mapping[str, str]) -> EnvInfo:
    how = "start the processes with `srun python train.py` (inside sbatch or salloc), which sets them"
    for key in ("SLURM_PROCID", "SLURM_LOCALID"):
        if key not in env:
            raise EnvError(f"srun's SLURM_STEP_NUM_TASKS is set but {key} is missing; {how}")
    world, rank, local_rank = _ints(env, "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if world == 1:
        _check(world, rank, local_rank, 1, names=_SLURM_NAMES)
        return EnvInfo(rank, local_rank, 1, 1, "srun")
    local_world = _slurm_local_world(env, world, how)
    _check(world, rank, local_rank, local_world, names=_SLURM_NAMES)
    addr = env.get("MASTER_ADDR")
    if addr is None:
        addr = _slurm_master_host(env, rank, how)
    if "MASTER_PORT" in env:
        port = _port(env, "MASTER_PORT")
    else:
        if "SLURM_JOB_ID" not in env:
            raise EnvError(f"SLURM_JOB_ID is missing, and distlib derives the port from it; set MASTER_PORT, or {how}")
        job = _int(env, "SLURM_JOB_ID")
        step = _int(env, "SLURM_STEP_ID") if env.get("SLURM_STEP_ID", "").isdigit() else 0
        port = slurm_port(job, step)
    return EnvInfo(rank, local_rank, world, local_world, "srun", addr, port)


def slurm_port(job_id: int, step_id: int = 0) -> int:
    """The TCP port of an srun step's rendezvous: 20000-29999, from the job id's last three digits and the step id's
    last digit, so the same on every task of the step, and different for concurrent steps and recent jobs."""
    return PORT_BASE + (job_id % 1000) * 10 + step_id % 10


def _slurm_local_world(env: Mapping[str, str], world: int, how: str) -> int:
    """The number of this step's tasks on this node."""
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if key not in env:
            continue
        counts = expand_tasks_per_node(env[key])
        if sum(counts) != world:
            continue  # SLURM_TASKS_PER_NODE describes the job, not this step, under srun --preserve-env
        if len(set(counts)) == 1:
            return counts[0]
        if "SLURM_NODEID" not in env:
            raise EnvError(f"{key}={env[key]} differs between nodes and SLURM_NODEID is missing; {how}")
        node = _int(env, "SLURM_NODEID")
        if not 0 <= node < len(counts):
            raise EnvError(f"SLURM_NODEID={node} is not a node of {key}={env[key]}")
        return counts[node]
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int(env, "SLURM_NTASKS_PER_NODE")
    raise EnvError(f"cannot tell how many tasks run on this node: SLURM_STEP_TASKS_PER_NODE is missing; {how}")


def _slurm_master_host(env: Mapping[str, str], rank: int, how: str) -> str:
    """The first host of the step's nodes, where srun places task 0 (block and cyclic distributions)."""
    key = next((k for k in ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST") if k in env), None)
    if key is None:
        raise EnvError(
            f"SLURM_STEP_NODELIST is missing, and distlib takes rank 0's host from it; set MASTER_ADDR, or {how}"
        )
    try:
        host = expand_hostlist(env[key])[0]
    except ValueError as e:
        raise EnvError(f"{key}: {e}; set MASTER_ADDR to the host of rank 0") from None
    here = env.get("SLURMD_NODENAME")
    if rank == 0 and here is not None and here != host:  # e.g. --distribution=arbitrary
        raise EnvError(
            f"rank 0 runs on {here} but the first host of {key}={env[key]} is {host}; "
            "set MASTER_ADDR to rank 0's host (export MASTER_ADDR=... before srun)"
        )
    return host


def _refuse_slurm_batch(env: Mapping[str, str]) -> None:
    """A SLURM job asking for several tasks, but this process was not started by srun (the batch script or
    an salloc shell): running alone would silently use one task of the allocation."""
    raw = env.get("SLURM_NTASKS", "")
    if raw.isdigit() and int(raw) > 1:
        raise EnvError(
            f"SLURM_NTASKS={raw} but this process was not started by srun (SLURM_STEP_NUM_TASKS is missing): "
            f"start the {raw} tasks with `srun python train.py` in the batch script, or use torchrun; "
            "for one process, use `srun -n 1 python train.py` or unset SLURM_NTASKS"
        )


# ---- mpirun -----------------------------------------------------------------------------------


def _mpi(env: Mapping[str, str]) -> EnvInfo | None:
    how = (
        "start with `mpirun -np N python train.py` (Open MPI, which sets all of them) or `mpiexec -n N` "
        "(MPICH, Intel MPI: PMI_RANK, PMI_SIZE)"
    )
    if any(k in env for k in OMPI):
        missing = [k for k in OMPI if k not in env]
        if missing:
            raise EnvError(f"Open MPI's environment is half set: {', '.join(missing)} missing; {how}")
        rank, world, local_rank, local_world = _ints(env, *OMPI)
        names = (OMPI[1], OMPI[0], OMPI[2], OMPI[3])
        job_id = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid")
    elif any(k in env for k in PMI):
        missing = [k for k in PMI if k not in env]
        if missing:
            raise EnvError(f"the MPI environment is half set: {', '.join(missing)} missing; {how}")
        rank, world = _ints(env, *PMI)
        if "MPI_LOCALRANKID" in env and "MPI_LOCALNRANKS" in env:
            local_rank, local_world = _ints(env, "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
        elif world == 1:
            local_rank, local_world = 0, 1
        else:
            raise EnvError(
                f"PMI_SIZE={world} but MPI_LOCALRANKID and MPI_LOCALNRANKS, which say which process of its node "
                f"this is, are missing; {how}, or start with torchrun"
            )
        names = ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
        job_id = None
    else:
        return None
    _check(world, rank, local_rank, local_world, names=names)
    if world == 1:
        return EnvInfo(rank, local_rank, 1, 1, "mpirun")
    if "MASTER_ADDR" in env:
        addr = env["MASTER_ADDR"]
    elif local_world == world:
        addr = "127.0.0.1"  # every rank on this node
    else:
        raise EnvError(
            f"mpirun started {world} processes on more than one node ({names[3]}={local_world}) and MASTER_ADDR "
            "is not set: distlib cannot tell rank 0's host; pass it to every rank, e.g. "
            "`mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500 ...` (Open MPI) or "
            "`mpiexec -genv MASTER_ADDR <host> ...` (MPICH, Intel MPI)"
        )
    if "MASTER_PORT" in env:
        port = _port(env, "MASTER_PORT")
    elif job_id:
        port = PORT_BASE + zlib.crc32(job_id.encode()) % 10000  # the same on every rank, unlike hash()
    else:
        port = DEFAULT_PORT
    return EnvInfo(rank, local_rank, world, local_world, "mpirun", addr, port)


def _agrees_with_slurm(mpi: EnvInfo, env: Mapping[str, str]) -> bool:
    return env.get("SLURM_PROCID") == str(mpi.rank) and env.get("SLURM_STEP_NUM_TASKS") == str(mpi.world_size)


def _without_srun_pmi(env: Mapping[str, str]) -> Mapping[str, str]:
    """``env`` without PMI_* that srun's own PMI plugin (``srun --mpi=pmi2``) set for the same ranks."""
    same_rank = env.get("PMI_RANK") == env.get("SLURM_PROCID")
    same_size = env.get("PMI_SIZE", env.get("SLURM_STEP_NUM_TASKS")) == env.get("SLURM_STEP_NUM_TASKS")
    if "PMI_RANK" in env and same_rank and same_size:
        return {k: v for k, v in env.items() if k not in PMI}
    return env


# ---- SLURM's compressed lists -----------------------------------------------------------------


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list in order: ``gpu[01-04,07],cpu3`` is gpu01, gpu02, gpu03, gpu04, gpu07, cpu3.

    A range keeps the zero padding of its start (``[08-11]``: 08, 09, 10, 11); several bracket groups in one
    name multiply (``r[1-2]n[1-2]``: r1n1, r1n2, r2n1, r2n2). Raises ValueError naming a malformed list.
    """
    items, depth, start = [], 0, 0
    for i, c in enumerate(hostlist):
        if c == "[":
            if depth:
                raise ValueError(f"nested '[' in host list {hostlist!r}")
            depth = 1
        elif c == "]":
            if not depth:
                raise ValueError(f"']' without '[' in host list {hostlist!r}")
            depth = 0
        elif c == "," and not depth:
            items.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unclosed '[' in host list {hostlist!r}")
    items.append(hostlist[start:])
    hosts = []
    for item in items:
        if not item.strip():
            raise ValueError(f"empty host name in host list {hostlist!r}")
        hosts.extend(_expand_host(item.strip(), hostlist))
    return hosts


def _expand_host(item: str, hostlist: str) -> list[str]:
    if "[" not in item:
        return [item]
    open_at = item.index("[")
    close_at = item.index("]", open_at)
    prefix, body, rest = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    values = []
    for part in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if m is None:
            raise ValueError(f"{part!r} in [{body}] is not a number or a range lo-hi, in host list {hostlist!r}")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"range {lo}-{hi} runs backwards in host list {hostlist!r}")
        values.extend(f"{n:0{len(lo)}d}" for n in range(int(lo), int(hi) + 1))
    suffixes = _expand_host(rest, hostlist)
    return [f"{prefix}{v}{s}" for v in values for s in suffixes]


def expand_tasks_per_node(spec: str) -> list[int]:
    """SLURM's tasks per node, one count per node: ``4(x2),3`` is [4, 4, 3]."""
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise EnvError(f"tasks per node {spec!r}: {part!r} is not a count or count(xN)")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


# ---- integers and ranges ----------------------------------------------------------------------


def _int(env: Mapping[str, str], key: str) -> int:
    raw = env[key]
    try:
        return int(raw)
    except ValueError:
        raise EnvError(f"{key}={raw!r} is not an integer") from None


def _ints(env: Mapping[str, str], *keys: str) -> list[int]:
    return [_int(env, k) for k in keys]


def _port(env: Mapping[str, str], key: str) -> int:
    port = _int(env, key)
    if not 0 < port < 65536:
        raise EnvError(f"{key}={port} is not a TCP port (1-65535)")
    return port


def _check(world: int, rank: int, local_rank: int, local_world: int, *, names: tuple[str, str, str, str]) -> None:
    """Every range problem at once, in the launcher's own variable names."""
    w, r, lr, lw = names
    problems = []
    if world < 1:
        problems.append(f"{w}={world} must be >= 1")
    if not 0 <= rank < max(world, 1):
        problems.append(f"{r}={rank} must be in [0, {w}={world})")
    if not 0 <= local_rank < max(local_world, 1):
        problems.append(f"{lr}={local_rank} must be in [0, {lw}={local_world})")
    if local_world > world >= 1:
        problems.append(f"{lw}={local_world} must be <= {w}={world}")
    if problems:
        raise EnvError("; ".join(problems))
