"""describe(): a collective's timeout or lost peer becomes a message; other errors are left alone.
shared_errors(): which rank's error the others raise."""

from __future__ import annotations

import pytest

from distlib.distributed import collectives
from distlib.reliability.failures import describe, shared_errors

GLOO_TIMEOUT = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv"
NCCL_TIMEOUT = (
    "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, "
    "NumelOut=1, Timeout(ms)=600000) ran for 600042 milliseconds before timing out."
)
GLOO_RESET = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error: Connection reset by peer"


def raised(message: str) -> RuntimeError:
    try:
        raise RuntimeError(message)
    except RuntimeError as e:
        return e


def test_a_gloo_timeout_says_who_waited_where_and_how_long():
    text = describe(raised(GLOO_TIMEOUT), rank=3, timeout_s=10)
    assert text.startswith("rank 3 timed out waiting for the other ranks in a collective (called from tests/")
    assert "after 10 s (dist.timeout_s)" in text and "Timed out waiting 10000ms" in text


def test_an_nccl_timeout_is_described_too():
    text = describe(raised(NCCL_TIMEOUT), rank=1, timeout_s=600)
    assert text is not None and text.startswith("rank 1 timed out waiting for the other ranks in a collective")
    assert "after 600 s (dist.timeout_s)" in text


def test_a_lost_peer_is_named_as_such():
    text = describe(raised(GLOO_RESET), rank=0, timeout_s=10)
    assert text.startswith("rank 0 lost the connection to another rank in a collective")


def test_a_peer_gone_while_gloo_connects_is_a_lost_peer():
    """The gloo connect of a new group whose peer's process ended meanwhile: a DistNetworkError whose text
    names neither gloo nor a collective."""
    import torch.distributed as dist

    try:
        raise dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed. Did the remote "
                                    "server shutdown or crash?")  # fmt: skip
    except RuntimeError as e:
        text = describe(e, rank=1, timeout_s=10)
    assert text is not None and text.startswith("rank 1 lost the connection to another rank in"), text


def test_other_errors_are_not_described():
    assert describe(raised("CUDA out of memory"), rank=0, timeout_s=10) is None
    assert describe(raised("the DataLoader timed out"), rank=0, timeout_s=10) is None
    assert describe(ValueError("gloo timed out"), rank=0, timeout_s=10) is None


def test_shared_errors_raises_the_first_failing_ranks_error_on_the_others(monkeypatch):
    """Ranks 1 and 2 of 3 failed, each in its own way; rank 0 (here) raises rank 1's error. The
    gather's result is given by hand: every rank's outcome, in rank order."""
    outcomes = [None, (KeyError, "'a' on rank 1"), (ValueError, "b on rank 2")]
    monkeypatch.setattr(collectives, "all_gather_object", lambda mine: outcomes)
    with pytest.raises(KeyError, match=r"\(on rank 1\) 'a' on rank 1"), shared_errors(KeyError, ValueError):
        pass
