"""Recipe keys in the combinations the other tests leave at their defaults, where the right value
and the plausible wrong one differ: ``loss.args`` beside ``train.label_smoothing``, a component's
``args`` beside what the runner provides, ``train.seed`` reaching a user's data set's order."""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F

from distlib.runner import components
from distlib.runner.config import load_config
from distlib.runner.tasks import Task, _dataset_loaders

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
    loader, _, _, _ = _dataset_loaders(cfg, types.SimpleNamespace(device=torch.device("cpu")), 8)
    return [round(float(v), 6) for x, _ in loader for v in x[:, 0]]


def test_a_users_data_set_is_shuffled_by_train_seed():
    """The order of a user's data set follows ``train.seed`` (the same seed the same order, another
    seed another), as the image data's does."""
    a, b = _order(3), _order(3)
    assert a == b
    c = _order(4)
    assert len(c) == len(a) and c != a  # full batches of the same data, in another order
