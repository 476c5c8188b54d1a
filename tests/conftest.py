"""Shared test helpers: the repository root, a free port, real gloo ranks, and the gpus(n) marker.

``@pytest.mark.gpus(n)`` marks a test that needs ``n`` CUDA GPUs: it is selected by ``-m gpu``
and skipped where fewer GPUs are visible.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpus(n): needs n CUDA GPUs; implies the gpu marker; skipped with fewer")


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, queue, env, backend, init_timeout_s):
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    import distlib

    try:
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
) -> list[Any]:
    """Call ``fn(ctx, *args)`` on ``world_size`` ranks (gloo, or ``backend``); returns the results in rank order.

    ``fn`` must be importable (defined at module level) since ranks are spawned.
    ``init_timeout_s`` is the collective timeout given to ``distlib.init``.
    Raises AssertionError with every failing rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue, env or {}, backend, init_timeout_s))
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
