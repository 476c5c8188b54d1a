"""Shared test helpers: the repository root, a free port, real gloo ranks, and the gpus(n) marker.

``@pytest.mark.gpus(n)`` marks a test that needs ``n`` CUDA GPUs: it is selected by ``-m gpu``
and skipped where fewer GPUs are visible.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver as forkserver
import os
import pickle
import random
import socket
import threading
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpus(n): needs n CUDA GPUs; implies the gpu marker; skipped with fewer")
    # pytest-xdist workers share the cores: each gets its part, for its own torch and the processes it
    # starts (2 workers on 2 cores: one thread each; two OpenMP threads cost 20% more CPU then)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        import torch

        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


@pytest.hookimpl(tryfirst=True)  # before -m deselects: a gpus(n) test counts as a gpu test
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    have = torch.cuda.device_count()
    for item in items:
        mark = item.get_closest_marker("gpus")
        if mark is None:
            continue
        need = mark.args[0] if mark.args else 1
        item.add_marker(pytest.mark.gpu)
        if have < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), {have} visible"))


def _ephemeral_ports() -> range:
    """The ports the kernel gives outgoing connections (and ``bind(0)``)."""
    try:
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_port() -> int:
    """A port for a rendezvous host, free now and outside the ephemeral range: a port taken from
    ``bind(0)`` is one the kernel also hands to outgoing connections (every gloo pair of the tests
    running beside this one opens some), so one can take it before rank 0 listens (EADDRINUSE)."""
    ephemeral = _ephemeral_ports()
    candidates = [p for p in range(10000, 32768) if p not in ephemeral] or list(range(10000, 32768))
    rng = random.Random()  # seeded by the OS: each test process draws its own
    for _ in range(100):
        port = rng.choice(candidates)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use
            return port
    with socket.socket() as s:  # every try taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flip_a_tensor_byte(step_dir: str, file_name: str) -> None:
    """Flip one byte of a tensor's data in the DCP shard file ``file_name`` of a checkpoint directory:
    the file's size and every zip and pickle structure intact, the record's CRC-32 no longer."""
    import io
    import struct
    import zipfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(step_dir).read_metadata()
    items = [info for index, info in metadata.storage_data.items() if info.relative_path == file_name
             and isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata)]  # fmt: skip
    largest = max(items, key=lambda info: info.length)
    path = os.path.join(step_dir, file_name)
    data = bytearray(open(path, "rb").read())
    record = bytes(data[largest.offset : largest.offset + largest.length])
    with zipfile.ZipFile(io.BytesIO(record)) as z:
        member = next(i for i in z.infolist() if "/data/" in i.filename)
    name_len, extra_len = struct.unpack("<HH", record[member.header_offset + 26 : member.header_offset + 30])
    start = largest.offset + member.header_offset + 30 + name_len + extra_len  # the tensor's bytes
    data[start + member.file_size // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


# The fork server imports these once; each rank forks from it with them in place. A rank's test
# module imports them anyway, except torch._dynamo (1.3 s), which the first optimizer imports;
# distlib.init() imports torch.distributed.nn.functional, the part of it that matters to
# distlib, before it starts the group either way.
_RANK_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "distlib", "tests.conftest"]
_forkserver_lock = threading.Lock()


def _rank_context(start_method: str) -> mp.context.BaseContext:
    """The multiprocessing context the ranks start from. "forkserver": each rank is forked (about
    0.1 s) from a server process that has imported ``_RANK_PRELOAD`` and done nothing else: one
    thread, no OpenMP pool, no process group, no CUDA. "spawn": each rank is a fresh interpreter
    (2-3 s of imports) that ends with a real interpreter exit; a forked rank ends with os._exit."""
    ctx = mp.get_context(start_method)
    if start_method != "forkserver":
        return ctx
    with _forkserver_lock:  # the server starts once per pytest process; later calls find it running
        ctx.set_forkserver_preload(_RANK_PRELOAD)
        # it imports from this checkout (Python 3.11's server ignores the parent's sys.path), with one
        # OpenMP and BLAS thread; the ranks get the parent's environment back (_worker)
        saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "OMP_NUM_THREADS")}
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, saved["PYTHONPATH"]) if p)
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return ctx


class _Stdio:
    """The parent's stdout and stderr when a rank starts (pytest captures them per test), sent to the
    rank with it: a forked rank would otherwise write to the fork server's, captured by an older test."""

    def __reduce__(self):  # runs while the rank is being started, where DupFd can send a descriptor
        return tuple, ((reduction.DupFd(1), reduction.DupFd(2)),)


def _worker(fn, rank, world_size, port, args, queue, backend, init_timeout_s, rank_env, torchrun_vars, stdio):
    for fd, dup in enumerate(stdio, start=1):
        os.dup2(dup.detach(), fd)
    # a forked rank inherits the fork server's environment: it gets its own, as a spawned one does
    os.environ.clear()
    os.environ.update(rank_env)
    if torchrun_vars:
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    import distlib

    try:
        here = os.path.dirname(os.path.abspath(distlib.__file__))
        assert here == os.path.join(ROOT, "distlib"), f"the ranks imported {here}, not this checkout's distlib"
        ctx = distlib.init(backend, timeout_s=init_timeout_s)
        try:
            result = fn(ctx, *args)
        finally:
            distlib.shutdown()
        # plain pickle copies tensors; the queue's own pickler would share them through file
        # descriptors that die with this process (EOFError in the parent)
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report every failure, including SystemExit, to the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120,
    env: dict | None = None,
    backend: str = "gloo",
    init_timeout_s: float = 60,
    start_method: str = "forkserver",
    rank_envs: list[dict[str, str]] | None = None,
) -> list[Any]:
    """Call ``fn(ctx, *args)`` on ``world_size`` ranks (gloo, or ``backend``); returns the results in rank order.

    ``fn`` must be importable (defined at module level): it reaches the ranks pickled.
    ``init_timeout_s`` is the collective timeout given to ``distlib.init``.
    ``start_method``: "forkserver" (fast, see ``_rank_context``), or "spawn" where a rank must be a
    fresh interpreter that exits as one (teardown at interpreter exit). NCCL ranks are spawned.
    ``rank_envs``: each rank's whole environment, in place of this process's and of torchrun's
    variables (ranks started by another launcher; ``env`` does not apply).
    Raises AssertionError with every failing rank's traceback.
    """
    if rank_envs is not None and len(rank_envs) != world_size:
        raise ValueError(f"{len(rank_envs)} rank_envs for {world_size} ranks")
    ctx = _rank_context("spawn" if backend == "nccl" else start_method)
    queue = ctx.Queue()
    port = free_port()
    envs = rank_envs or [{**os.environ, **(env or {})}] * world_size
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, world_size, port, args, queue, backend, init_timeout_s, envs[r], rank_envs is None, _Stdio()),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise AssertionError(f"rank process exit codes {[p.exitcode for p in procs]}")
    return [results[r] for r in range(world_size)]
