"""GradSync's options together with the features they touch, against DDP.

A rank that ran out of data shadows the others' steps under ``join()``: it must issue the same
collectives they do, so every option that changes what a step sends (``comm_groups``: which
communicator carries each bucket; ``compress="bf16"``: what travels) must reach the shadowing
too. With ``compress="bf16"`` the marks that say which rank used a parameter travel in the bf16
copy as well. Each option is tested alone elsewhere; here it meets the other feature.
"""

from __future__ import annotations

import pytest

from tests.conftest import run_ranks
from tests.library.test_ddp_oracle import BOUND, MLP, TINY, _case, _one_rank_branch

BF16_BOUND = 2e-2  # relative: bf16 rounding of three steps' averaged gradients


def _uneven_with_options(ctx) -> dict:
    many = {"bucket_cap_mb": 1e-4}
    return {
        "comm_groups=2, a bucket per parameter, rank 0 has 2 more": _case(
            ctx, MLP, join=True, extra=2, ddp_kw=many, sync_kw={**TINY, "comm_groups": 2}
        ),
        "comm_groups=3, rank 1 has 1 more": _case(
            ctx, MLP, join=True, extra=1, extra_rank=1, ddp_kw=many, sync_kw={**TINY, "comm_groups": 3}
        ),
        "compress=bf16, rank 0 has 2 more": _case(ctx, MLP, join=True, extra=2, sync_kw={"compress": "bf16"}),
    }


def _all(ctx) -> dict:
    return {"uneven": _uneven_with_options(ctx), "one rank uses": _compressed_with_a_parameter_one_rank_uses(ctx)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """Every case of this file in one pair of rank processes (starting ranks costs seconds)."""
    return run_ranks(_all, 2, timeout=120, init_timeout_s=20)


def test_join_with_comm_groups_and_compression_matches_ddp(two_ranks):
    for res in (r["uneven"] for r in two_ranks):
        for name, r in res.items():
            bound = BF16_BOUND if "bf16" in name else BOUND
            assert r["diff"] <= bound, (name, r["diff"])
        assert res["compress=bf16, rank 0 has 2 more"]["diff"] > 0  # the compression did take place


def _compressed_with_a_parameter_one_rank_uses(ctx) -> dict:
    return {
        f"compress=bf16, a branch used on rank 0 only, {opt}": _case(
            ctx,
            lambda: MLP(branch=True),
            opt=opt,
            on_step=_one_rank_branch,
            sync_kw={**TINY, "compress": "bf16"},
            ddp_kw={"find_unused_parameters": True},
            steps=4,
        )
        for opt in ("sgd", "adamw")
    }


def test_compression_with_a_parameter_one_rank_uses_matches_ddp(two_ranks):
    """Rank 1 never uses the branch: it must still take rank 0's gradient for it (halved), not keep
    ``.grad`` None as for a parameter no rank used, or the two ranks' weights part."""
    for res in (r["one rank uses"] for r in two_ranks):
        for name, r in res.items():
            assert r["diff"] <= BF16_BOUND, (name, r["diff"])
            assert r["none_sync"] == r["none_ddp"] == [], (name, r)
