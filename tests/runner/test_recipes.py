"""Every recipe in recipes/ validates (new recipes are picked up by the glob)."""

from __future__ import annotations

import glob
import os

import pytest

from distlib.runner.config import ConfigError, load_config
from tests.conftest import ROOT

RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")))


def test_there_are_recipes():
    names = {os.path.basename(r) for r in RECIPES}
    assert {"demo.yaml", "cifar.yaml"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_recipe_validates(recipe):
    """Every key and value checks; a recipe of a pretrained folder the user points it at (not in the
    repository) checks fully but for that folder, which is the one problem reported."""
    try:
        cfg = load_config(recipe)
    except ConfigError as e:
        pretrained = load_config(recipe, check_components=False).model.args.get("pretrained")
        if not pretrained or os.path.isdir(os.path.join(ROOT, pretrained)):
            raise
        assert len(e.problems) == 1 and e.problems[0].startswith("model.args.pretrained:"), e.problems
        cfg = load_config(recipe, check_components=False)
    assert cfg.run.name == os.path.splitext(os.path.basename(recipe))[0]


def test_demo_recipe_uses_the_committed_data():
    cfg = load_config(os.path.join(ROOT, "recipes", "demo.yaml"))
    root = os.path.join(ROOT, cfg.data.root)
    assert os.path.isdir(os.path.join(root, "train")) and os.path.isdir(os.path.join(root, "test"))
    assert cfg.model.name == "small_cnn"
