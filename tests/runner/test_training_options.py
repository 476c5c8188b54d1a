"""Recipe keys that change what a run computes, seen through launch.py's outputs: train.ema,
train.tta_translate, train.compile, and dist.compress / dist.comm_groups reaching GradSync.

Each run is one process in this process (world size 1): a 512-image subset, a width-8 model,
two epochs, augmentation off, so that two runs differ only by the key under test.
"""

from __future__ import annotations

import inspect
import json
import math
import os

import pytest
import torch

import launch
from distlib.parallel.grad_sync import GradSync
from tests.conftest import ROOT
from tests.runner.conftest import saved

SMALL = [
    "train.epochs=2", "data.train_subset=512", "model.width=8",
    "data.augment.crop_pad=0", "data.augment.flip=none", "run.progress=plain",
]  # fmt: skip

pytestmark = pytest.mark.slow


def run(tmp_path, name: str, *overrides: str, recipe: str = "recipes/demo.yaml") -> list[dict]:
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert launch.main([recipe, *SMALL, f"run.out_dir={tmp_path / name}", *overrides]) == 0
    finally:
        os.chdir(cwd)
    with open(tmp_path / name / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return run(tmp_path_factory.mktemp("baseline"), "base")


def test_ema_evaluates_the_averaged_weights(tmp_path, baseline):
    ema = run(tmp_path, "ema", "train.ema=0.5")
    # the average does not touch training: the same losses, bit for bit
    assert [r["train_loss"] for r in ema] == [r["train_loss"] for r in baseline]
    # but evaluation sees other weights (and BatchNorm statistics)
    assert [r["test_acc"] for r in ema] != [r["test_acc"] for r in baseline], (ema, baseline)


def test_ema_decay_ramps_up_to_the_configured_decay():
    from distlib.runner.training.schedule import ema_decay

    ramp = [ema_decay(0.99, n) for n in range(2000)]
    assert ramp[0] == pytest.approx(0.1)  # the first update nearly copies the trained weights
    assert all(a <= b for a, b in zip(ramp, ramp[1:])) and ramp[-1] == 0.99
    assert ema_decay(0.5, 0) == pytest.approx(0.1) and ema_decay(0.5, 8) == 0.5


def test_tta_translate_changes_only_the_final_evaluation(tmp_path, baseline):
    shifted = run(tmp_path, "tta", "train.tta_translate=2")
    assert [r["train_loss"] for r in shifted] == [r["train_loss"] for r in baseline]
    assert shifted[0]["test_acc"] == baseline[0]["test_acc"]  # not the final evaluation: no TTA at all
    assert shifted[-1]["test_acc"] != baseline[-1]["test_acc"], "the shifted views must change the final accuracy"


def test_compile_trains_through_the_compiled_model(tmp_path, baseline, monkeypatch):
    import distlib

    graphs = []

    def fx_backend(gm, example_inputs):  # run dynamo's graph as it is: no inductor C++ build on the CPU
        graphs.append(gm)
        return gm.forward

    original = distlib.compile_for_sync
    monkeypatch.setattr(distlib, "compile_for_sync", lambda model, sync, **_: original(model, sync, backend=fx_backend))
    try:
        rows = run(tmp_path, "compiled", "train.compile=true", "train.compile_backend=aot_eager")  # the loss too
    finally:
        torch._dynamo.reset()
    assert graphs, "train.compile=true: the forward never went through the compiled model"
    # the same computation: the same losses up to the order of floating-point sums
    for a, b in zip(rows, baseline, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5), (rows, baseline)


def test_compress_and_comm_groups_from_a_recipe_reach_gradsync(tmp_path, monkeypatch):
    seen: list[dict] = []
    original = GradSync.__init__

    def spy(self, *args, **kwargs):
        bound = inspect.signature(original).bind(self, *args, **kwargs)
        bound.apply_defaults()
        seen.append(dict(bound.arguments))
        original(self, *args, **kwargs)

    monkeypatch.setattr(GradSync, "__init__", spy)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        (open(os.path.join(ROOT, "recipes", "demo.yaml")).read())
        + "dist:\n  compress: bf16\n  comm_groups: 3\n  bucket_mb: 2.5\n"
    )
    run(tmp_path, "recipe", "train.epochs=1", recipe=str(recipe))
    assert len(seen) == 1
    assert (seen[0]["compress"], seen[0]["comm_groups"], seen[0]["bucket_mb"]) == ("bf16", 3, 2.5)


def test_fp16_with_clipping_trains_and_checkpoints_the_loss_scale(tmp_path, baseline):
    rows = run(tmp_path, "fp16", "train.precision=fp16", "train.clip_grad_norm=1.0")
    losses = [r["train_loss"] for r in rows]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    assert losses != [r["train_loss"] for r in baseline]  # fp16 autocast and clipping did change the run
    scaler = saved(tmp_path / "fp16")["scaler"]  # the newest checkpoint's
    assert scaler["scale"] > 0 and scaler["_growth_tracker"] > 0, scaler  # steps were taken and counted
