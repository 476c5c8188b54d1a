"""Many short multi-rank jobs that exit right after their last collective.

Each rank is a fresh ``python`` process, so every job ends with a real interpreter
finalization, where the gloo abort happened. Used by tests/library/test_teardown.py, and
runnable by hand to measure: ``[WIDEN=1] python tests/library/teardown_stress.py raw|shutdown|atexit JOBS``.
Measured on the 2-core machine: raw 1-7 of 20-30 rank processes aborted depending on the
machine's load, raw with WIDEN=1 8 of 10; shutdown and atexit 0 of 50, with and without WIDEN.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.conftest import ROOT, free_port  # noqa: E402

RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "teardown_rank.py")


def _start_job(world_size: int, mode: str, extra_env: dict[str, str]) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(
            os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            OMP_NUM_THREADS="1", TEARDOWN=mode,
            PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra_env,
        )  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, RANK_SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    return procs


def run_jobs(
    world_sizes: list[int], mode: str, parallel: int = 2, timeout: float = 120, env: dict[str, str] | None = None
) -> list[str]:
    """Run one job per entry of ``world_sizes``, ``parallel`` at a time; returns a
    description of every rank that did not exit 0 (empty: all clean)."""
    failures: list[str] = []
    pending = list(world_sizes)
    running: list[tuple[int, list[subprocess.Popen]]] = []
    deadline = time.monotonic() + timeout
    while pending or running:
        while pending and len(running) < parallel:
            w = pending.pop(0)
            running.append((w, _start_job(w, mode, env or {})))
        w, procs = running.pop(0)
        for rank, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                failures.append(f"world {w} rank {rank}: timed out\n{out[-2000:]}")
                continue
            if p.returncode != 0:
                failures.append(f"world {w} rank {rank}: exit code {p.returncode}\n{out[-2000:]}")
    return failures


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "shutdown"
    jobs = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    t0 = time.monotonic()
    fails = run_jobs([2, 3] * (jobs // 2) + [2] * (jobs % 2), mode, timeout=3600)
    for f in fails:
        print(f.splitlines()[0], "|", next((ln for ln in f.splitlines() if "terminate" in ln), ""))
    ranks = sum([2, 3] * (jobs // 2) + [2] * (jobs % 2))
    print(f"mode={mode}: {len(fails)} of {ranks} rank processes failed in {jobs} jobs, {time.monotonic() - t0:.1f} s")
