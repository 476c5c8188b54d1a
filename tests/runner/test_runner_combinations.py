"""Recipe keys in the combinations the other tests leave at their defaults, where the right value
and the plausible wrong one differ: ``loss.args`` beside ``train.label_smoothing``, a component's
``args`` beside what the runner provides, ``train.seed`` reaching a user's data set's order."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distlib.runner import components
from distlib.runner.config import load_config
from distlib.runner.tasks.task import Task, dataset_loaders
from distlib.runner.training.checkpoints import RankStates
from tests.conftest import run_ranks

OWN_DATA = ["data.name=examples.own_model.spirals:spirals", "data.args.n=120", "train.batch_size=8"]


def _loss_of(overrides: list[str]):
    cfg = load_config(None, overrides)
    return Task(cfg, None, 1, None).loss_fn()


def test_loss_args_reach_the_loss_and_win_over_train_label_smoothing():
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(6, 5, generator=g), torch.randint(0, 5, (6,), generator=g)

    def want(s: float) -> torch.Tensor:
        return F.cross_entropy(logits, targets, label_smoothing=s)

    # train.label_smoothing alone reaches a loss that takes it
    torch.testing.assert_close(_loss_of(["train.label_smoothing=0.1"])(logits, targets), want(0.1))
    # loss.args set it too: the loss's own argument wins (three values, none the default 0.2)
    got = _loss_of(["train.label_smoothing=0.1", "loss.args.label_smoothing=0.3"])(logits, targets)
    torch.testing.assert_close(got, want(0.3))


def test_a_components_args_win_over_what_the_runner_provides():
    def model(num_classes: int = 1, width: int = 2) -> tuple[int, int]:
        return num_classes, width

    fake = types.SimpleNamespace(model=model)
    sys.modules["_distlib_test_component"] = fake  # type: ignore[assignment]
    try:
        built = components.build(
            "model", "_distlib_test_component:model", {"num_classes": 7}, provided={"num_classes": 10, "width": 64}
        )
    finally:
        del sys.modules["_distlib_test_component"]
    assert built == (7, 64)  # the recipe's args, then the provided ones it takes and the recipe does not set


def _order(seed: int) -> list[int]:
    cfg = load_config(None, [*OWN_DATA, f"train.seed={seed}"])
    loader, _, _, _ = dataset_loaders(cfg, types.SimpleNamespace(device=torch.device("cpu")), 8)
    return [round(float(v), 6) for x, _ in loader for v in x[:, 0]]


def test_a_users_data_set_is_shuffled_by_train_seed():
    """The order of a user's data set follows ``train.seed`` (the same seed the same order, another
    seed another), as the image data's does."""
    a, b = _order(3), _order(3)
    assert a == b
    c = _order(4)
    assert len(c) == len(a) and c != a  # full batches of the same data, in another order


# ---- sharded runs: each rank's own values in the checkpoint ------------------------------------


class _Counter:
    """A RankStateful whose value differs on every rank (as the epoch's loss sum does)."""

    def __init__(self, value: float):
        self.value = torch.tensor(value)

    def rank_state_dict(self) -> dict:
        return {"sum": self.value.clone()}

    def load_rank_state_dict(self, state: dict) -> None:
        self.value = state["sum"].clone()


def _rank_states(ctx) -> dict:
    def objects(bn: nn.Module, counter: _Counter) -> dict:
        return {"model": bn, "loss": counter}

    bn = nn.BatchNorm1d(3)
    with torch.no_grad():
        bn.running_mean.fill_(10.0 + ctx.rank)  # each rank's statistics follow its own batches
    torch.manual_seed(100 + ctx.rank)
    saved = RankStates(objects(bn, _Counter(1.0 + 2.0 * ctx.rank)))
    saved.gather()
    want_draw = torch.rand(3)  # what this rank's RNG gives next
    state = saved.state_dict()
    fresh_bn, counter = nn.BatchNorm1d(3), _Counter(-1.0)
    torch.manual_seed(0)  # another state: the load must put this rank's back
    RankStates(objects(fresh_bn, counter)).load_state_dict(state)
    return {
        "running_mean": fresh_bn.running_mean.tolist(),
        "counter": float(counter.value),
        "rng": torch.equal(torch.rand(3), want_draw),
        "state": state,
    }


def test_each_rank_takes_back_its_own_values_and_another_world_size_their_mean():
    """RankStates (the per-rank part of a sharded run's checkpoint): at the same world size each rank
    gets back its own buffers, RNG state and RankStateful values (rank 1's differ from rank 0's);
    at another world size a RankStateful gets the mean of the saved ones."""
    res = run_ranks(_rank_states, 2)
    for rank, r in enumerate(res):
        assert r["running_mean"] == [10.0 + rank] * 3, (rank, r["running_mean"])
        assert r["counter"] == 1.0 + 2.0 * rank and r["rng"], (rank, r)
    counter = _Counter(-1.0)
    RankStates({"model": nn.BatchNorm1d(3), "loss": counter}).load_state_dict(res[0]["state"])  # 2 -> 1
    assert float(counter.value) == 2.0  # the mean of 1 and 3, not rank 0's


# ---- MFU: a GPU's name picks its own peak ------------------------------------------------------


def test_every_gpu_in_the_peak_table_gets_its_own_peak_not_one_its_name_contains(monkeypatch):
    """Names contain one another (H200 and H20, GB200 and B200, L40S and L4): each GPU's name gives
    its own row's peak, whatever the order of the table."""
    from distlib.runner.observability.throughput import PEAK_BF16_TFLOPS, peak_tflops

    for part, tflops in PEAK_BF16_TFLOPS:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, part=part: f"NVIDIA {part}")
        assert peak_tflops(torch.device("cuda", 0)) == tflops, part


# ---- the GPT model: what no loss curve shows ---------------------------------------------------


def test_gpt_is_causal_and_its_embedding_scores_the_tokens():
    """A position's logits read only the tokens up to it (a model that sees the next token learns
    faster, and every loss test would pass); the token embedding is the output matrix, after a
    meta-device build's ``to_empty()`` too."""
    from distlib.runner.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)).eval()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 32, (2, 16), generator=g)
    later = idx.clone()
    later[:, 9:] = (idx[:, 9:] + 1) % 32  # other tokens from position 9 on
    a, b = model(idx), model(later)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)
    assert not torch.allclose(a[:, 9:], b[:, 9:])
    assert model.lm_head.weight is model.wte.weight
    with torch.device("meta"):
        meta = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16))
    meta.to_empty(device="cpu")
    meta.tie_weights()
    assert meta.lm_head.weight is meta.wte.weight


def test_model_args_of_the_gpt_recipe_reach_the_model():
    """``model: {name: gpt, args: ...}``: every argument, each a value other than its default and
    than the others, reaches the model (dropout and bias too, which no loss curve of the demo shows)."""
    import dataclasses

    from distlib.runner.models.gpt import gpt

    args = {"vocab_size": 40, "block_size": 12, "n_layer": 3, "n_head": 2, "n_embd": 8, "dropout": 0.25, "bias": True}
    model = gpt(**args)
    assert dataclasses.asdict(model.cfg) == args
    assert any(n.endswith("bias") for n, _ in model.named_parameters())
    idx = torch.randint(0, 40, (2, 12))
    assert not torch.equal(model.train()(idx), model(idx))  # dropout draws in training


# ---- the runner's step: shard x accumulation x clipping ----------------------------------------


def _steps(ctx, shard: str) -> dict:
    from distlib.runner.training.step import build_step

    out = {}
    for clip in (0.0, 0.05):  # without clipping, and clipping every step
        cfg = load_config(None, [f"dist.shard={shard}", "train.grad_accum=2", f"train.clip_grad_norm={clip}",
                                 "train.precision=fp32", "train.compile=false", "train.cuda_graph=false"])  # fmt: skip
        for mode in ("reference", "step"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))
            opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
            step = build_step(cfg, ctx, model, opt, 8, loss_fn=F.cross_entropy) if mode == "step" else None
            losses = []
            g = torch.Generator().manual_seed(5)
            for _ in range(3):
                x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)  # the global batch
                mine = slice(8 * ctx.rank, 8 * ctx.rank + 8)
                if step is not None:
                    losses.append(float(step(x[mine], y[mine])))
                else:  # one process, the whole global batch at once
                    with torch.no_grad():
                        losses.append(float(F.cross_entropy(model(x[mine]), y[mine])))  # what this rank reports
                    F.cross_entropy(model(x), y).backward()
                    if clip:
                        nn.utils.clip_grad_norm_(model.parameters(), clip)
                    opt.step()
                    opt.zero_grad()
            out[(clip, mode)] = [p.detach().clone() for p in model.parameters()], losses
            if step is not None:
                step.close()
    return out


@pytest.mark.parametrize("shard", ["none", "optimizer"])
def test_the_step_with_accumulation_and_clipping_is_one_whole_batch_step(shard):
    """train.grad_accum=2, with and without train.clip_grad_norm, at two ranks, replicated and with
    the optimizer sharded: each rank's step returns the loss of its whole part of the batch (the
    mean of its micro-batches', not the last one's) and leaves the weights of one step over the
    whole global batch, clipped by the global norm (not by a rank's slice of it)."""
    for r in run_ranks(_steps, 2, shard):
        for clip in (0.0, 0.05):
            (want, want_losses), (got, got_losses) = r[(clip, "reference")], r[(clip, "step")]
            assert got_losses == pytest.approx(want_losses, rel=1e-5), clip
            for a, b in zip(want, got, strict=True):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"clip {clip}")
