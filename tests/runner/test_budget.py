"""Budgets in steps: train.max_steps ends a run as a last epoch does (the final evaluation, a metrics
row, the final checkpoint), mid-epoch too; train.eval_every_steps and run.checkpoint_every_steps
evaluate and checkpoint inside epochs; every row carries the global step and the tokens seen;
the schedule spans the real total; a resume from a step checkpoint ends bit for bit as an
uninterrupted run, a resume may extend the budget (the schedule recomputed, said in the log), and
any other change of settings is refused. The tiny GPT demo, at 1 and 2 gloo ranks."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from distlib.runner.training.budget import Budget
from tests.conftest import ROOT, run_ranks
from tests.runner.conftest import checkpoints, saved, step_name
from tests.runner.test_trainer import metrics

DEMO = os.path.join(ROOT, "recipes", "gpt_demo.yaml")
# 64 windows of 64 bytes, 8 a step: 8 steps an epoch at any world size; lr 3e-3, cosine to 0.1 of it; a
# validation set of 62 windows
TINY = ["data.train_subset=64", "model.args.n_layer=1", "model.args.n_embd=32", "model.args.n_head=2",
        "train.batch_size=8", "train.warmup_frac=0.25", "train.sample_tokens=0", "run.progress=plain",
        "run.keep_checkpoints=10", "data.args.val_frac=0.005"]  # fmt: skip
SPE, BATCH, BLOCK, LR = 8, 8, 64, 3e-3


def _launch(ctx, out_dir: str, overrides: list[str]) -> int:
    import launch

    return launch.main([DEMO, *TINY, f"run.out_dir={out_dir}", *overrides])


def launch_ranks(world: int, out_dir, *overrides: str) -> int:
    codes = run_ranks(_launch, world, str(out_dir), list(overrides), timeout=180)
    assert len(set(codes)) == 1, codes
    return codes[0]


def lr_after(step: int, total: int) -> float:
    """The rate after ``step`` optimizer steps of a run of ``total``: the recipe's cosine, by hand."""
    warmup = int(0.25 * total)
    if step < warmup:
        return LR * (step + 1) / warmup
    left = max(0.0, (total - step) / (total - warmup))
    return LR * (0.1 + 0.9 * 0.5 * (1 - math.cos(math.pi * left)))


def trajectory(rows: list[dict]) -> list[tuple]:
    return [(r["epoch"], r.get("epoch_step"), r["step"], r["train_loss"], r["val_loss"], r["lr"]) for r in rows]


def test_the_budget_is_the_first_of_its_limits_and_names_its_stops():
    b = Budget(steps_per_epoch=8, epochs=3, max_steps=11, eval_every=2, eval_every_steps=5, checkpoint_every=1,
               checkpoint_every_steps=0)  # fmt: skip
    assert b.total_steps == 11 and not b.done(10) and b.done(11)
    assert [s for s in range(1, 12) if b.evaluates(s)] == [5, 10, 11]  # epoch 2 would end at 16
    assert [s for s in range(1, 12) if b.checkpoints(s)] == [8, 11]
    assert [s for s in range(1, 12) if b.stops_at(s)] == [5, 8, 10, 11]
    assert Budget(8, epochs=3, max_steps=0).total_steps == 24 and Budget(8, epochs=0, max_steps=30).total_steps == 30
    assert Budget(8, epochs=2, max_steps=30).total_steps == 16  # the epochs come first
    assert [s for s in range(1, 17) if Budget(8, epochs=2, eval_every=0).evaluates(s)] == [16]  # the last only
    assert "train.max_steps" in Budget(8, 0, 30).describe() and "train.epochs=2" in Budget(8, 2, 30).describe()
    with pytest.raises(ValueError):
        _ = Budget(8, 0, 0).total_steps


@pytest.mark.parametrize("world", [1, 2])
def test_max_steps_ends_mid_epoch_with_the_final_evaluation_a_row_and_the_final_checkpoint(tmp_path, world):
    out = tmp_path / "out"
    assert launch_ranks(world, out, "train.epochs=3", "train.max_steps=11", "train.sample_tokens=8") == 0
    rows = metrics(out)
    # epoch 1's end (evaluated: eval_every=1), then the budget's end 3 steps into epoch 2
    assert [(r["epoch"], r.get("epoch_step"), r["step"]) for r in rows] == [(1, None, 8), (2, 3, 11)], rows
    last = rows[-1]
    assert last["val_loss"] is not None and last["world_size"] == world
    assert [r["tokens"] for r in rows] == [8 * BATCH * BLOCK, 11 * BATCH * BLOCK]
    # the schedule spans the 11 steps: the cosine has reached its floor at the last one
    assert last["lr"] == pytest.approx(lr_after(11, 11), rel=1e-6) and last["lr"] == pytest.approx(0.1 * LR)
    assert rows[0]["lr"] == pytest.approx(lr_after(8, 11), rel=1e-6)
    # the final checkpoint: 1 epoch done, 3 steps into the next; the final evaluation's figures in summary.json
    assert checkpoints(out) == [step_name(11)]  # run.checkpoint_every=0: the final one only
    with open(out / "summary.json") as f:
        summary = json.load(f)
    assert summary["final_val_loss"] == last["val_loss"] and summary["sample"]
    assert "checkpoint" in summary["stages"] and summary["teardown_s"] is not None

    # the same command again: the budget is spent, nothing is trained
    before = (out / "metrics.jsonl").read_text()
    assert launch_ranks(world, out, "train.epochs=3", "train.max_steps=11") == 0
    assert (out / "metrics.jsonl").read_text() == before


def test_evaluations_and_checkpoints_every_n_steps_across_epochs(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    assert launch_ranks(2, out, "train.epochs=2", "train.eval_every=0", "train.eval_every_steps=5",
                        "run.checkpoint_every_steps=6", "run.tensorboard=true") == 0  # fmt: skip
    rows = metrics(out)
    # a row at each evaluation (steps 5, 10, 15 and the last) and at each epoch's end (8: not evaluated)
    assert [r["step"] for r in rows] == [5, 8, 10, 15, 16], rows
    assert [r["val_loss"] is None for r in rows] == [False, True, False, False, False]
    assert [(r["epoch"], r.get("epoch_step")) for r in rows] == [(1, 5), (1, None), (2, 2), (2, 7), (2, None)]
    # checkpoints at steps 6 and 12 (inside epochs) and at the end
    assert checkpoints(out) == [step_name(6), step_name(12), step_name(16)]
    # TensorBoard's x-axis is the global step
    acc = EventAccumulator(str(out))
    acc.Reload()
    assert [s.step for s in acc.Scalars("train/loss")] == [5, 8, 10, 15, 16]
    assert [s.step for s in acc.Scalars("eval/loss")] == [5, 10, 15, 16]


@pytest.mark.parametrize("world", [1, 2])
def test_a_resume_from_a_step_checkpoint_ends_bit_for_bit_as_the_uninterrupted_run(tmp_path, world):
    run = ["train.epochs=2", "train.eval_every_steps=3", "run.checkpoint_every_steps=5"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert launch_ranks(world, ref, *run) == 0
    shutil.copytree(ref, out)
    for name in checkpoints(out):  # as if it had died after step 5's checkpoint, in epoch 1
        if name != step_name(5):
            shutil.rmtree(out / "checkpoints" / name)
    assert launch_ranks(world, out, *run) == 0
    assert trajectory(metrics(out)) == trajectory(metrics(ref))
    assert [r["step"] for r in metrics(out)] == [3, 6, 8, 9, 12, 15, 16]
    a, b = saved(ref, 16)["model"], saved(out, 16)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "first, then, reached, new_rows",
    [(["train.max_steps=6"], ["train.max_steps=12"], 6, [8, 12]),  # ended 6 steps into epoch 1
     (["train.epochs=1"], ["train.epochs=2", "train.eval_every_steps=12"], 8, [12, 16])],  # ended with epoch 1
    ids=["max_steps", "epochs"],
)  # fmt: skip
def test_a_resume_may_extend_the_budget_and_continues_from_the_step_reached(tmp_path, capfd, first, then, reached,
                                                                           new_rows):  # fmt: skip
    out = tmp_path / "out"
    assert launch_ranks(2, out, "train.epochs=3", *first) == 0
    before = metrics(out)
    assert [r["step"] for r in before] == [reached]
    capfd.readouterr()
    assert launch_ranks(2, out, "train.epochs=3", *then) == 0
    err = capfd.readouterr().err
    assert "the learning-rate schedule is recomputed" in err and f"continuing from step {reached}" in err, err
    rows = metrics(out)
    assert rows[:1] == before  # what the first run wrote stays
    assert [r["step"] for r in rows[1:]] == new_rows and rows[-1]["val_loss"] is not None
    # the steps after the resume run at the rates of the new total, to the cosine's floor at its end
    total = new_rows[-1]
    for r in rows[1:]:
        assert r["lr"] == pytest.approx(lr_after(r["step"], total), rel=1e-6), r
    assert rows[-1]["lr"] == pytest.approx(0.1 * LR)


def test_a_resume_that_changes_anything_but_the_budget_is_refused(tmp_path, capfd):
    out = tmp_path / "out"
    assert launch_ranks(1, out, "train.max_steps=6") == 0
    capfd.readouterr()
    assert launch_ranks(1, out, "train.max_steps=12", "train.lr=1e-3") == 2
    err = capfd.readouterr().err
    assert "train.lr: checkpoint has 0.003, this run has 0.001" in err, err
    assert "max_steps" not in err.split("is from another model or settings")[-1], err
    assert [r["step"] for r in metrics(out)] == [6]
