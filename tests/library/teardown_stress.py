"""Many short multi-rank jobs that exit right after their last collective.

Each job is one ``python`` process that imports torch and distlib and then forks its ranks
(2 s of imports once instead of once a rank); each rank runs teardown_rank.py and ends with a
real interpreter finalization, where the gloo abort happened. Used by
tests/library/test_teardown.py, and runnable by hand to measure:
``[WIDEN=1] python tests/library/teardown_stress.py raw|shutdown|atexit JOBS``.
Measured on the 2-core machine with a fresh ``python`` process a rank: raw 1-7 of 20-30 rank
processes aborted depending on the machine's load (0 of 25 on an idle machine), raw with WIDEN=1
8 of 10; shutdown and atexit 0 of 50, with and without WIDEN. With forked ranks: raw with WIDEN=1
8 of 10, raw 0 of 25 on an idle machine (as fresh processes then).
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "teardown_rank.py")
EXIT_LINE = "teardown_stress: exit code of rank "


def _start_job(world_size: int, mode: str, extra_env: dict[str, str]) -> subprocess.Popen:
    if ROOT not in sys.path:  # run by hand
        sys.path.insert(0, ROOT)
    from tests.conftest import free_port

    env = dict(
        os.environ, WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", TEARDOWN=mode,
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra_env,
    )  # fmt: skip
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--job", str(world_size)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def _job(world_size: int) -> int:
    """One job, in its own process: import what every rank imports (torch, distlib: 2 s), then fork
    the ranks. Each rank runs teardown_rank.py as ``__main__`` and ends with this interpreter's own
    exit (finalization, atexit), where the abort happened; its exit code is printed for run_jobs.
    torch._dynamo is left to the rank's optimizer, as in a training script: imported here before the
    fork (2 s less a job), raw with WIDEN=1 aborted 0 of 10 rank processes instead of 9 of 10, so the
    test could no longer fail."""
    import torch.distributed  # noqa: F401

    import distlib  # noqa: F401

    ranks = {}
    for rank in range(world_size):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the rank: nothing of the loop's state matters to it
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
            runpy.run_path(RANK_SCRIPT, run_name="__main__")
            sys.exit(0)  # leaves through the interpreter's exit, as `python teardown_rank.py` does
        ranks[pid] = rank
    for pid, rank in ranks.items():
        _, status = os.waitpid(pid, 0)
        print(f"{EXIT_LINE}{rank} {os.waitstatus_to_exitcode(status)}", flush=True)
    return 0


def run_jobs(
    world_sizes: list[int], mode: str, parallel: int = 2, timeout: float = 120, env: dict[str, str] | None = None
) -> list[str]:
    """Run one job per entry of ``world_sizes``, ``parallel`` at a time; returns a
    description of every rank that did not exit 0 (empty: all clean)."""
    failures: list[str] = []
    pending = list(world_sizes)
    running: list[tuple[int, subprocess.Popen]] = []
    deadline = time.monotonic() + timeout
    while pending or running:
        while pending and len(running) < parallel:
            w = pending.pop(0)
            running.append((w, _start_job(w, mode, env or {})))
        w, job = running.pop(0)
        try:
            out, _ = job.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)  # the job and its ranks
            out, _ = job.communicate()
            failures.append(f"world {w}: timed out\n{out[-2000:]}")
            continue
        codes = dict(line[len(EXIT_LINE) :].split() for line in out.splitlines() if line.startswith(EXIT_LINE))
        if job.returncode != 0 or len(codes) != w:
            failures.append(
                f"world {w}: the job exited {job.returncode} with {len(codes)} rank(s) reported\n{out[-2000:]}"
            )
        failures += [f"world {w} rank {r}: exit code {c}\n{out[-2000:]}" for r, c in codes.items() if c != "0"]
    return failures


if __name__ == "__main__" and sys.argv[1:2] == ["--job"]:
    sys.exit(_job(int(sys.argv[2])))
if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "shutdown"
    jobs = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    t0 = time.monotonic()
    fails = run_jobs([2, 3] * (jobs // 2) + [2] * (jobs % 2), mode, timeout=3600)
    for f in fails:
        print(f.splitlines()[0], "|", next((ln for ln in f.splitlines() if "terminate" in ln), ""))
    ranks = sum([2, 3] * (jobs // 2) + [2] * (jobs % 2))
    print(f"mode={mode}: {len(fails)} of {ranks} rank processes failed in {jobs} jobs, {time.monotonic() - t0:.1f} s")
