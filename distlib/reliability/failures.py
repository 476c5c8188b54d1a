"""How an error on some ranks becomes a clean, explained exit on all of them.

``shared_errors`` raises one rank's expected error on every rank, ``describe`` explains a
collective's timeout or lost connection, ``abort`` tears down without the final barrier.
``report`` leaves word in the process group's store of why a rank ends, before it leaves the
group: a peer whose collective then fails reads it (``peer_reports``) and says the same, or names
the rank that ended without a word. docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator

import torch.distributed as dist

from distlib.distributed import collectives, process_group

_TIMEOUT_MARKERS = ("timed out", "timeout")
_PEER_LOST_MARKERS = (
    "connection closed", "connection reset", "broken pipe", "connection refused", "closed by peer",
    "connection was likely closed",  # gloo's connect when the peer's process ended meanwhile (a DistNetworkError)
)  # fmt: skip


@contextlib.contextmanager
def shared_errors(*types: type[BaseException]) -> Iterator[None]:
    """Run the block on every rank; if it raises one of ``types`` on any rank, raise it on all.

    The exit is a collective (an all_gather of the outcome): every rank must run
    the block, and the block must not raise other exceptions on some ranks only.
    The first failing rank's exception type and message are raised, prefixed
    with its rank when it is not this one.
    """
    error: BaseException | None = None
    try:
        yield
    except types as e:
        error = e
    outcomes = collectives.all_gather_object(None if error is None else (type(error), str(error)))
    if error is not None:
        raise error
    for rank, outcome in enumerate(outcomes):
        if outcome is not None:
            typ, message = outcome
            raise typ(f"(on rank {rank}) {message}")


def _collective_and_caller(exc: BaseException) -> tuple[str, str]:
    """The torch.distributed function that failed ("" when the traceback shows none, as for
    ``work.wait()``) and the innermost frame outside torch that led to it."""
    frames = traceback.extract_tb(exc.__traceback__)
    torch_dir = os.sep + "torch" + os.sep
    c10d = [i for i, f in enumerate(frames) if f.filename.endswith(os.path.join("distributed", "distributed_c10d.py"))]
    op = frames[c10d[-1]].name if c10d else ""
    outside = [f for f in frames[: c10d[-1] if c10d else len(frames)] if torch_dir not in f.filename]
    if not outside:
        return op, ""
    f = outside[-1]
    path = f.filename if f.filename.startswith("<") else os.path.relpath(f.filename)
    return op, f"{path}:{f.lineno} in {f.name}"


def describe(
    exc: BaseException, *, rank: int, timeout_s: float, lost: dict[int, str | None] | None = None
) -> str | None:
    """A clear message when ``exc`` is a collective that timed out or lost a peer, else None.

    ``lost``: the ranks that are gone, each with what it said of its end (``report``) or None (it
    ended without a word: killed, or a crash): named in the message of a lost connection."""
    if not isinstance(exc, RuntimeError):
        return None
    # a library error that wraps the collective's own (GradSync's timeout with its join() hint) counts as it
    text = " ".join(str(x) for x in (exc, exc.__cause__) if x is not None).lower()
    op, caller = _collective_and_caller(exc)
    if not op and not isinstance(exc, dist.DistError) and not any(m in text for m in ("gloo", "nccl", "c10d")):
        return None  # not a collective's failure
    where = (op or "a collective") + (f" (called from {caller})" if caller else "")
    first_line = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    if any(m in text for m in _TIMEOUT_MARKERS):
        return (
            f"rank {rank} timed out waiting for the other ranks in {where} after {timeout_s:g} s "
            f"(dist.timeout_s): another rank stalled or died. The stalled rank is named by a "
            f"'[distlib watchdog]' line, a dead one by torchrun's failure summary. [{first_line}]"
        )
    if any(m in text for m in _PEER_LOST_MARKERS):
        if lost:
            names = ", ".join(str(r) for r in sorted(lost))
            why = "; ".join(
                f"rank {r} failed: {said}" if said else
                f"rank {r} ended without a word (killed: SIGKILL, the OOM killer; or a crash): torchrun's failure "
                "summary says how"
                for r, said in sorted(lost.items())
            )  # fmt: skip
            return f"rank {rank} lost the connection to rank {names} in {where}: {why}. [{first_line}]"
        return (
            f"rank {rank} lost the connection to another rank in {where}: that rank's process exited "
            f"or was killed; its own error and torchrun's failure summary name it. [{first_line}]"
        )
    return None


_REPORT_KEY = "distlib/outcome/"


def _store() -> dist.Store | None:
    """The default group's store (torchrun's agent hosts it: it outlives any worker), or None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def report(code: int, message: str) -> None:
    """Leave word for the peers of why this rank ends (its exit ``code`` and one-line ``message``), in
    the default group's store: call it before leaving the group, so that a peer whose collective
    fails because of it finds it there. Not a collective; does nothing without a process group, and
    never raises (the store's host may be gone too)."""
    store = _store()
    if store is None:
        return
    with contextlib.suppress(Exception):
        store.set(f"{_REPORT_KEY}{collectives.rank()}", json.dumps({"code": code, "message": message}))


def peer_reports(wait_s: float = 1.0) -> dict[int, dict | None]:
    """What every other rank reported (``report``: ``{"code", "message"}``), None for a rank that has not,
    after waiting up to ``wait_s`` for every one of them: a rank that failed alike reports at once, one
    killed never does. Empty without a process group or a reachable store. Not a collective."""
    store = _store()
    if store is None:
        return {}
    me, world = collectives.rank(), collectives.world_size()
    keys = {r: f"{_REPORT_KEY}{r}" for r in range(world) if r != me}
    out: dict[int, dict | None] = {}
    end = time.monotonic() + wait_s
    try:
        while True:
            for r, key in keys.items():
                if out.get(r) is None and store.check([key]):
                    out[r] = json.loads(store.get(key))
            missing = [r for r in keys if out.get(r) is None]
            if not missing or time.monotonic() >= end:
                return {r: out.get(r) for r in keys}
            time.sleep(0.05)
    except Exception:  # the store's host is gone (rank 0 hosts it without torchrun)
        return {r: out.get(r) for r in keys} if out else {}


def abort(wait_s: float = 10.0) -> None:
    """Destroy the process group without a barrier (for error paths); safe without one.

    What registered for shutdown finishes its local work first, as after ``distlib.shutdown(barrier=False)``
    (an asynchronous save in flight: its write joined, left uncommitted with a warning, nothing raised):
    its collectives then fail at once instead of running on a destroyed group. A communicator with a
    collective stuck on a dead peer (NCCL) can block its destruction: after ``wait_s`` the process
    exits with code 1 at once (the error has been reported by then; waiting would only leave a hung
    worker).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return

    def destroy() -> None:
        process_group.run_shutdown_hooks(together=False)  # their failures: their warnings said enough
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    worker = threading.Thread(target=destroy, name="distlib-abort", daemon=True)
    worker.start()
    worker.join(wait_s)
    if worker.is_alive():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
