"""Run options with values other than their defaults, reaching what they set: with the defaults
(3 checkpoints kept) a run too short to make more than three cannot tell an option that is
ignored from one that is followed."""

from __future__ import annotations

import distlib
from distlib.runner.config import load_config
from tests.runner.conftest import checkpoints, step_name
from tests.runner.test_trainer import DEMO, built


def test_keep_checkpoints_reaches_the_checkpointer(tmp_path, world_size_1):
    out = tmp_path / "out"
    cfg = load_config(DEMO, ["train.epochs=3", "data.train_subset=128", "model.width=4", "run.checkpoint_every=1",
                             "run.keep_checkpoints=2", "run.progress=plain", "train.tta=false",
                             f"run.out_dir={out}"])  # fmt: skip
    with built(cfg, distlib.init("gloo")) as trainer:
        assert trainer.fit() == 0
    # three saves (one an epoch), the newest two kept
    assert checkpoints(out) == [step_name(2), step_name(3)]  # one step an epoch
