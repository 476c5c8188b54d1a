"""run.tensorboard: rank 0 writes event files under run.out_dir that TensorBoard's own reader
reads back as the run's metrics; without the package the key is a ConfigError naming the extra."""

from __future__ import annotations

import os
import shutil

import pytest

from distlib.runner import config
from distlib.runner.config import ConfigError, load_config
from tests.conftest import ROOT, run_ranks
from tests.runner.conftest import checkpoints
from tests.runner.test_trainer import metrics

DEMO = os.path.join(ROOT, "recipes", "gpt_demo.yaml")
SMALL = ["train.epochs=2", "data.train_subset=64", "model.args.n_layer=1", "model.args.n_embd=32",
         "model.args.n_head=2", "train.batch_size=8", "train.sample_tokens=10", "run.progress=plain",
         "run.tensorboard=true"]  # fmt: skip


def _train(ctx, out_dir: str) -> None:
    import launch

    assert launch.main([DEMO, *SMALL, f"run.out_dir={out_dir}"]) == 0


def test_event_files_hold_the_runs_metrics_written_by_rank_0_only(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    run_ranks(_train, 2, str(out), timeout=180)
    events = [f for f in os.listdir(out) if f.startswith("events.out.tfevents")]
    assert len(events) == 1, os.listdir(out)  # one writer: rank 0's
    acc = EventAccumulator(str(out))
    acc.Reload()
    rows = metrics(out)
    steps_per_epoch = 64 // 8
    for tag, key in (("train/loss", "train_loss"), ("train/lr", "lr"), ("eval/loss", "val_loss"),
                     ("eval/perplexity", "val_ppl"), ("throughput/tokens_per_s", "tokens_per_s"),
                     ("throughput/samples_per_s", "samples_per_s")):  # fmt: skip
        scalars = acc.Scalars(tag)
        assert [s.step for s in scalars] == [r["epoch"] * steps_per_epoch for r in rows], tag
        assert [s.value for s in scalars] == pytest.approx([r[key] for r in rows], rel=1e-6), tag
    assert "sample/text_summary" in acc.Tags()["tensors"]  # the generated text (add_text)


def _train_3_epochs(ctx, out_dir: str) -> None:
    import launch

    args = [DEMO, *SMALL, "train.epochs=3", "run.checkpoint_every=1", "run.keep_checkpoints=5", "train.sample_tokens=0"]
    assert launch.main([*args, f"run.out_dir={out_dir}"]) == 0


def test_a_resume_from_an_older_checkpoint_leaves_one_point_per_step(tmp_path):
    """Resumed from epoch 2's checkpoint after epoch 3 was logged: epoch 3 is trained again, and
    TensorBoard shows its new values once, not the old and the new at the same step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    run_ranks(_train_3_epochs, 1, str(out), timeout=180)
    ckpts = checkpoints(out)
    assert len(ckpts) == 3, ckpts
    shutil.rmtree(out / "checkpoints" / ckpts[-1])  # the newest (epoch 3) gone: the rerun resumes from epoch 2
    run_ranks(_train_3_epochs, 1, str(out), timeout=180)
    acc = EventAccumulator(str(out))
    acc.Reload()
    rows = metrics(out)
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    scalars = acc.Scalars("train/loss")
    assert [s.step for s in scalars] == [8, 16, 24]
    assert [s.value for s in scalars] == pytest.approx([r["train_loss"] for r in rows], rel=1e-6)


def test_without_the_package_the_key_names_the_extra_to_install(monkeypatch):
    real = config.importlib.util.find_spec
    monkeypatch.setattr(config.importlib.util, "find_spec", lambda name: None if name == "tensorboard" else real(name))
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, ["run.tensorboard=true"])
    (problem,) = e.value.problems
    assert problem.startswith("run.tensorboard=true") and "pip install 'distlib[tensorboard]'" in problem
    load_config(DEMO)  # the key off: no need for the package
