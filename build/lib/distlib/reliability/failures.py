"""How an error on some ranks becomes a clean, explained exit on all of them.

``shared_errors`` raises one rank's expected error on every rank, ``describe`` explains a
collective's timeout or lost connection, ``abort`` tears down without the final barrier.
docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback
from collections.abc import Iterator

import torch.distributed as dist

from distlib.distributed import collectives

_TIMEOUT_MARKERS = ("timed out", "timeout")
_PEER_LOST_MARKERS = ("connection closed", "connection reset", "broken pipe", "connection refused", "closed by peer")


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


def describe(exc: BaseException, *, rank: int, timeout_s: float) -> str | None:
    """A clear message when ``exc`` is a collective that timed out or lost a peer, else None."""
    if not isinstance(exc, RuntimeError):
        return None
    # a library error that wraps the collective's own (GradSync's timeout with its join() hint) counts as it
    text = " ".join(str(x) for x in (exc, exc.__cause__) if x is not None).lower()
    op, caller = _collective_and_caller(exc)
    if not op and not any(m in text for m in ("gloo", "nccl", "c10d")):
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
        return (
            f"rank {rank} lost the connection to another rank in {where}: that rank's process exited "
            f"or was killed; its own error and torchrun's failure summary name it. [{first_line}]"
        )
    return None


def abort(wait_s: float = 10.0) -> None:
    """Destroy the process group without a barrier (for error paths); safe without one.

    A communicator with a collective stuck on a dead peer (NCCL) can block its
    destruction: after ``wait_s`` the process exits with code 1 at once (the
    error has been reported by then; waiting would only leave a hung worker).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return

    def destroy() -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    worker = threading.Thread(target=destroy, name="distlib-abort", daemon=True)
    worker.start()
    worker.join(wait_s)
    if worker.is_alive():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
