"""Components named by import path: a user's own model and data set (examples/own_model) train
from a recipe through distributed_loader, and every mistake in naming them is a ConfigError
naming the recipe key, all reported at once, with "did you mean"."""

from __future__ import annotations

import json
import os

import pytest

from distlib.runner import components
from distlib.runner.config import ConfigError, load_config
from tests.conftest import ROOT, run_ranks

EXAMPLE = os.path.join(ROOT, "examples", "own_model", "recipe.yaml")


def problems(*overrides: str, recipe: str = EXAMPLE) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(recipe, list(overrides))
    return e.value.problems


def test_every_mistake_in_naming_a_component_is_reported_at_once_with_its_key():
    found = problems(
        "model.name=examples.own_model.spirals:MPL",  # attribute missing
        "data.args.arm=3",  # unknown keyword argument
        "loss.name=examples.own_model.nowhere:loss",  # module not found
    )
    assert len(found) == 3, found
    model, data, loss = sorted(found, key=lambda p: ["model", "data", "loss"].index(p.split(".")[0]))
    assert model.startswith("model.name:") and "has no attribute 'MPL'" in model and "did you mean 'MLP'?" in model
    assert data.startswith("data.args.arm:") and "did you mean 'arms'?" in data
    assert loss.startswith("loss.name:") and "module 'examples.own_model.nowhere' not found" in loss


def test_a_wrong_type_a_missing_argument_and_a_non_callable_are_config_errors():
    (wrong,) = problems("model.args.hidden=wide")
    assert wrong == "model.args.hidden: expected int, got 'wide'"
    (not_callable,) = problems("model.name=examples.own_model.spirals:math")
    assert not_callable.startswith("model.name:") and "not callable" in not_callable
    # a short name that is not registered, close to one that is
    (unknown,) = problems("model.name=small_cn", recipe=None)
    assert "unknown model 'small_cn'" in unknown and "did you mean 'small_cnn'?" in unknown


def needs_depth(num_classes: int, depth: int):  # a model factory with an argument the recipe must give
    raise AssertionError("never called at load time")


def test_a_missing_required_argument_names_the_key_to_add():
    (missing,) = problems("model.name=tests.runner.test_components:needs_depth", recipe=None)
    name = "tests.runner.test_components:needs_depth"
    assert missing == f"model.args: {name} needs the argument 'depth'; add model.args.depth"


def test_registered_names_resolve_to_the_built_in_components():
    from distlib.runner.models.gpt import gpt
    from distlib.runner.models.vision import small_cnn
    from distlib.runner.tasks.losses import cross_entropy

    assert components.resolve("model", "small_cnn") is small_cnn
    assert components.resolve("model", "gpt") is gpt
    assert components.resolve("loss", "cross_entropy") is cross_entropy
    assert components.resolve("model", "distlib.runner.models.vision:small_cnn") is small_cnn


def _train_example(ctx, out_dir: str) -> dict:
    import launch

    assert launch.main([EXAMPLE, f"run.out_dir={out_dir}", "run.progress=plain"]) == 0
    return ctx.rank


@pytest.mark.slow
def test_the_users_own_model_and_data_set_train_from_the_recipe_at_two_ranks(tmp_path):
    """The example's MLP learns its spirals (chance: 1/3) at two ranks, launched as torchrun
    would; each rank's steps cover half of the global batch."""
    out = tmp_path / "own"
    run_ranks(_train_example, 2, str(out), timeout=240)
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["epoch"] for r in rows] == list(range(1, 11))
    assert rows[-1]["world_size"] == 2
    assert rows[-1]["train_loss"] < 0.7 * rows[0]["train_loss"], rows
    assert rows[-1]["test_acc"] >= 0.6, rows[-1]
    for r in rows:  # ~2,500 training points, each rank its half: ~25 steps of 50 a rank (100 global)
        assert r["samples_per_s"] * r["epoch_s"] == pytest.approx(2500, rel=0.05), r
    with open(out / "config.yaml") as f:
        assert "examples.own_model.spirals:MLP" in f.read()
