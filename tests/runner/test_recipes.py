"""Every recipe in recipes/ validates (new recipes are picked up by the glob)."""

from __future__ import annotations

import glob
import os

import pytest

from distlib.runner.config import load_config
from tests.conftest import ROOT

RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")))


def test_there_are_recipes():
    names = {os.path.basename(r) for r in RECIPES}
    assert {"demo.yaml", "cifar.yaml"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_recipe_validates(recipe, tmp_path):
    overrides = []
    pretrained = load_config(recipe, check_components=False).model.args.get("pretrained")
    if pretrained and not os.path.isdir(os.path.join(ROOT, pretrained)):  # the user gives it: a tiny one here
        pytest.importorskip("transformers")
        from tests.runner.test_hf_causal_lm import save_tiny

        save_tiny(tmp_path / "pretrained")
        overrides = [f"model.args.pretrained={tmp_path / 'pretrained'}"]
    cfg = load_config(recipe, overrides)
    assert cfg.run.name == os.path.splitext(os.path.basename(recipe))[0]


def test_demo_recipe_uses_the_committed_data():
    cfg = load_config(os.path.join(ROOT, "recipes", "demo.yaml"))
    root = os.path.join(ROOT, cfg.data.root)
    assert os.path.isdir(os.path.join(root, "train")) and os.path.isdir(os.path.join(root, "test"))
    assert cfg.model.name == "small_cnn"
