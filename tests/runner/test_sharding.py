"""dist.shard in the runner: the model is built with the same weights (and leaves the same random
state) in every mode at world size 1, 2 and 3; the GPT demo and the image demo's BatchNorm CNN train
to the same losses, step by step, replicated, with optimizer sharding and with full sharding, at
one, two and three gloo ranks (AdamW and SGD, clipped or not, with accumulation); a run
stopped mid-epoch resumes exactly at the same and at another world size in every mode (its step
position, data order and each rank's loss sum included); a checkpoint of one dist.shard is not
taken for another's, one-file checkpoints are refused by name, and so is a checkpoint directory
that not every rank sees; the combinations that cannot work are ConfigErrors naming the key and the fix.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch

import distlib
from distlib.checkpoint.checkpointer import CheckpointError, fingerprint
from distlib.runner.config import ConfigError, load_config
from distlib.runner.training.trainer import Trainer
from tests.conftest import ROOT, run_ranks
from tests.runner.conftest import checkpoints, step_name
from tests.runner.test_e2e import launch
from tests.runner.test_trainer import built, metrics

DEMO = os.path.join(ROOT, "recipes", "gpt_demo.yaml")
SHAKESPEARE = os.path.join(ROOT, "recipes", "gpt_shakespeare.yaml")
# 2 epochs of 8 steps of 8 sequences of 64 bytes; a one-block GPT 32 wide
TINY = ["train.epochs=2", "data.train_subset=64", "model.args.n_layer=1", "model.args.n_embd=32",
        "model.args.n_head=2", "train.batch_size=8", "train.warmup_frac=0.25", "train.sample_tokens=0",
        "run.progress=plain", "run.checkpoint_every=1"]  # fmt: skip
STEPS = 16


# ---- the combinations that cannot work, refused when the recipe is loaded ----------------------
@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["dist.shard=optimizer", "dist.mode=fallback"], ["dist.shard=optimizer", "dist.mode=process_per_gpu"]),
        (["dist.shard=full", "dist.mode=fallback"], ["dist.shard=full", "dist.mode=process_per_gpu"]),
        (["dist.shard=optimizer", "train.precision=fp16"], ["train.precision=fp16", "train.precision=bf16"]),
        (["dist.shard=full", "train.cuda_graph=true"], ["no CUDA-graph support", "train.cuda_graph=false"]),
        (["dist.shard=full", "train.compile=model"], ["dist.shard=full", "train.compile=blocks"]),
        (["dist.shard=full", "train.ema=0.9"], ["train.ema", "train.ema=0"]),
        (["dist.shard=full", "dist.compress=bf16"], ["dist.compress=bf16", "dist.compress=none"]),
        (["dist.shard=zero3"], ["dist.shard", "'optimizer'"]),
    ],
)
def test_a_sharding_that_cannot_work_is_a_config_error_naming_the_key_and_the_fix(overrides, names):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, overrides)
    assert len(e.value.problems) == 1, e.value.problems
    for name in names:
        assert name in e.value.problems[0], e.value.problems[0]


@pytest.mark.parametrize("recipe", ["gpt_demo", "gpt_shakespeare", "demo", "cifar"])
@pytest.mark.parametrize("shard", ["none", "optimizer", "full"])
def test_every_recipe_takes_every_shard_mode(recipe, shard):
    """With the overrides an error asks for (the CIFAR recipes capture their step: full sharding
    needs train.cuda_graph=false; the Shakespeare GPT's train.compile=true compiles per block, in
    every mode); optimizer sharding runs inside the CUDA-graph step."""
    extra = ["train.cuda_graph=false"] if shard == "full" else ["train.cuda_graph=true"]
    cfg = load_config(os.path.join(ROOT, "recipes", f"{recipe}.yaml"), [f"dist.shard={shard}", *extra])
    assert cfg.dist.shard == shard


def test_the_gpt_recipes_say_their_shard_mode():
    for recipe in (DEMO, SHAKESPEARE):
        with open(recipe) as f:
            assert "  shard: none  #" in f.read(), recipe


# ---- the same losses in every mode -------------------------------------------------------------
def _losses(ctx, shard: str, out_dir: str, *extra: str) -> tuple[list[float], dict, list[dict]]:
    """This rank's loss at every step of the tiny GPT demo with ``dist.shard=shard``, the initial
    weights (whole) and the metrics rows."""
    # a sample from the final model too: with full sharding every rank runs its forward passes
    cfg = load_config(DEMO, [*TINY, f"dist.shard={shard}", f"run.out_dir={out_dir}", "train.sample_tokens=4", *extra])
    losses = []
    with built(cfg, ctx) as trainer:
        initial = _whole(trainer.model)
        trainer.step_fn = Recorded(trainer.step_fn, losses)
        assert trainer.fit() == 0
    if ctx.is_main:
        with open(os.path.join(out_dir, "summary.json")) as f:
            assert len(json.load(f)["sample"]) > 32
    return losses, initial, metrics(out_dir) if ctx.is_main else []


class Recorded:
    """The trainer's step, recording this rank's loss at every step."""

    def __init__(self, step, losses: list[float]):
        self.step, self.losses = step, losses

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.step(x, y)
        self.losses.append(loss.item())
        return loss

    def __getattr__(self, name: str):
        return getattr(self.step, name)


def _whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight whole (a sharded model's DTensors gathered), on the CPU."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = v.detach().cpu().clone()
    return out


def _run(world_size: int, shard: str, out_dir: str, *extra: str) -> list:
    if world_size == 1:
        return [_losses(distlib.init("gloo"), shard, out_dir, *extra)]
    return run_ranks(_losses, world_size, shard, out_dir, *extra, timeout=180)


SGD = ["train.optimizer=sgd", "train.lr=0.3", "train.momentum=0.9"]  # Nesterov, weight decay on the matrices


@pytest.mark.parametrize(("world_size", "optimizer"), [(1, []), (2, SGD)], ids=["1-adamw", "2-sgd"])
def test_sharded_training_has_the_losses_of_replicated_training(tmp_path, world_size, optimizer, world_size_1):
    """Each rank's loss at each of the 16 steps, and the epochs' rows, equal in the three modes,
    with AdamW and with SGD (Nesterov momentum; both with weight decay on the matrices only, the
    global norm clipped to 1), from the same initial weights (each mode builds its own: the same
    seed gives the same weights). Tolerance: 1e-5 relative; the modes sum the same gradients in
    other orders (reduce-scatter, FSDP2's padded shards), which moves the losses by a few 1e-7."""
    ref = _run(world_size, "none", str(tmp_path / "none"), *optimizer)
    for shard in ("optimizer", "full"):
        got = _run(world_size, shard, str(tmp_path / shard), *optimizer)
        for r in range(world_size):
            assert len(got[r][0]) == STEPS
            assert got[r][0] == pytest.approx(ref[r][0], rel=1e-5), (shard, r)
            for k, w in ref[r][1].items():
                torch.testing.assert_close(got[r][1][k], w, rtol=0, atol=0, msg=f"{shard}: initial {k}")
        rows, want = got[0][2], ref[0][2]
        assert [row["train_loss"] for row in rows] == pytest.approx([row["train_loss"] for row in want], rel=1e-5)
        assert [row["val_loss"] for row in rows] == pytest.approx([row["val_loss"] for row in want], rel=1e-5)
        assert all(row["world_size"] == world_size for row in rows)
    assert ref[0][0][-1] < ref[0][0][0] - 0.3  # it learns


# ---- the same training in every mode, at 2 and 3 ranks: the GPT and a model with BatchNorm --------
IMAGE_DEMO = os.path.join(ROOT, "recipes", "demo.yaml")
# one epoch of 8 optimizer steps of 12 samples: 12 divides over 2 and 3 ranks, and each rank's part
# into 2 micro-batches; blocks (the GPT's two) and parameters split unevenly over 3 ranks (FSDP2 pads)
SMALL_GPT = ["train.epochs=1", "data.train_subset=96", "model.args.n_layer=2", "model.args.n_embd=24",
             "model.args.n_head=2", "train.batch_size=12", "train.warmup_frac=0.25", "train.sample_tokens=0",
             "run.progress=plain"]  # fmt: skip
SMALL_CNN = ["train.epochs=1", "data.train_subset=96", "model.width=8", "train.batch_size=12", "run.progress=plain"]
CLIP = ["train.clip_grad_norm=0.25"]  # below the gradients' norm: every step is clipped
MODE_CASES = {
    # each model with each optimizer, with and without clipping, with accumulation, at 2 and 3 ranks
    "gpt-adamw-clip-2ranks": (2, DEMO, [*SMALL_GPT, *CLIP]),
    "gpt-sgd-accum-3ranks": (3, DEMO, [*SMALL_GPT, *SGD, "train.clip_grad_norm=0", "train.grad_accum=2"]),
    "cnn-sgd-clip-accum-2ranks": (2, IMAGE_DEMO, [*SMALL_CNN, *CLIP, "train.grad_accum=2"]),
    "cnn-adamw-3ranks": (3, IMAGE_DEMO, [*SMALL_CNN, "train.optimizer=adamw", "train.lr=3e-3"]),
}


def _trained(ctx, recipe: str, overrides: list[str]) -> tuple[list[float], dict, list[dict]]:
    """This rank's loss at every optimizer step of one run, its initial weights (whole) and the
    metrics rows (rank 0)."""
    cfg = load_config(recipe, overrides)
    losses: list[float] = []
    with built(cfg, ctx) as trainer:
        initial = _whole(trainer.model)
        trainer.step_fn = Recorded(trainer.step_fn, losses)
        assert trainer.fit() == 0
    return losses, initial, metrics(cfg.run.out_dir) if ctx.is_main else []


def test_a_fully_sharded_model_evaluates_a_validation_split_the_ranks_share_unevenly(tmp_path):
    """61 validation windows over 2 ranks, 6 a batch: 31 windows (6 batches) and 30 (5). A fully sharded
    forward is a collective, so the shorter rank runs a sixth batch that counts for nothing: the
    evaluation ends, with replicated training's validation losses."""
    args = [*SMALL_GPT, "data.args.val_frac=0.00495", "train.eval_every=1"]
    rows = {}
    for shard in ("none", "full"):
        out = str(tmp_path / shard)
        rows[shard] = run_ranks(_trained, 2, DEMO, [*args, f"dist.shard={shard}", f"run.out_dir={out}"],
                                timeout=180)[0][2]  # fmt: skip
    assert [r["val_loss"] for r in rows["full"]] == pytest.approx([r["val_loss"] for r in rows["none"]], rel=1e-5)


@pytest.mark.parametrize("case", list(MODE_CASES))
def test_every_shard_mode_trains_alike_step_by_step(tmp_path, case):
    """dist.shard=none, optimizer and full: the same initial weights, each rank's loss at every
    step of the epoch within 1e-5 relative, the same epoch row (training loss, and the evaluation:
    validation loss, or the test accuracy, which the BatchNorm statistics decide)."""
    world_size, recipe, overrides = MODE_CASES[case]
    runs = {}
    for shard in ("none", "optimizer", "full"):
        args = [*overrides, f"dist.shard={shard}", f"run.out_dir={tmp_path / shard}"]
        runs[shard] = run_ranks(_trained, world_size, recipe, args, timeout=180)
    ref = runs["none"]
    steps = len(ref[0][0])
    assert steps == 8, steps
    for shard in ("optimizer", "full"):
        for r in range(world_size):
            losses, initial, _ = runs[shard][r]
            assert losses == pytest.approx(ref[r][0], rel=1e-5), (shard, r)
            for k, w in ref[r][1].items():
                torch.testing.assert_close(initial[k], w, rtol=0, atol=0, msg=f"{shard}: initial {k}")
        (row,), (want,) = runs[shard][0][2], ref[0][2]
        assert ("val_loss" in want) != ("test_acc" in want), want  # the GPT's evaluation, or the CNN's
        for key in {"train_loss", "val_loss", "test_acc", "lr"} & want.keys():
            assert row[key] == pytest.approx(want[key], rel=1e-5), (shard, key)
        assert row["world_size"] == world_size
    assert ref[0][0][-1] < ref[0][0][0]  # it learns


def _built_models(ctx, recipe: str, overrides: list[str]) -> dict[str, tuple[dict, torch.Tensor]]:
    """Per shard mode: the model ``Trainer.build_model`` makes (whole weights) and the global random
    state after it, from train.seed as the trainer seeds it."""
    from distlib.runner.tasks import build_task

    cfg = load_config(recipe, overrides)
    trainer = Trainer(cfg, ctx)
    out = {}
    try:
        trainer.task = build_task(cfg, ctx, cfg.train.batch_size // ctx.world_size, trainer.timeline)
        for shard in ("none", "optimizer", "full"):
            cfg.dist.shard = shard
            torch.manual_seed(cfg.train.seed)
            model = trainer.build_model()
            out[shard] = (_whole(model), torch.get_rng_state())
            del model
    finally:
        trainer.close()
    return out


OWN_MODEL = os.path.join(ROOT, "examples", "own_model", "recipe.yaml")  # a model named by import path


@pytest.mark.parametrize(
    ("recipe", "small"),
    [(DEMO, SMALL_GPT), (IMAGE_DEMO, SMALL_CNN), (OWN_MODEL, ["data.args.n=240", "model.args.hidden=16"])],
    ids=["gpt", "cnn", "own-model"],
)
def test_the_runner_builds_the_same_weights_in_every_mode_at_every_world_size(tmp_path, recipe, small, world_size_1):
    """Trainer.build_model at world size 1, 2 and 3 in each dist.shard mode, for built-in models and
    one named by import path: every weight and buffer of the model equal to the world-size-1
    replicated build's (full sharding's gathered), and the random state after it the same, so that
    what draws from it next (dropout, augmentation) does too."""
    overrides = [*small, f"run.out_dir={tmp_path}"]
    ref = None
    for world_size in (1, 2, 3):
        if world_size == 1:
            got = [_built_models(distlib.init("gloo"), recipe, overrides)]
        else:
            got = run_ranks(_built_models, world_size, recipe, overrides, timeout=180)
        ref = ref or got[0]["none"]
        for r, by_mode in enumerate(got):
            for shard, (weights, rng) in by_mode.items():
                assert weights.keys() == ref[0].keys()
                for k, w in ref[0].items():
                    torch.testing.assert_close(weights[k], w, rtol=0, atol=0, msg=f"{world_size} {shard} {r}: {k}")
                assert torch.equal(rng, ref[1]), f"random state after the build: world {world_size} {shard} rank {r}"


# ---- stopped and resumed: at the same and at another world size ---------------------------------
STOP_AFTER = 11  # epoch 2, step 3


def _stopped(ctx, shard: str, out_dir: str) -> int:
    """The run, stopped by SIGTERM after STOP_AFTER steps (a checkpoint of that step is saved)."""
    cfg = load_config(DEMO, [*TINY, f"dist.shard={shard}", f"run.out_dir={out_dir}"])
    step, steps = Trainer.train_step, []

    def signalled(self, x, y):
        step(self, x, y)
        steps.append(1)
        if len(steps) == STOP_AFTER:
            os.kill(os.getpid(), signal.SIGTERM)

    Trainer.train_step = signalled
    try:
        with built(cfg, ctx) as trainer:
            return trainer.fit()
    finally:
        Trainer.train_step = step


@pytest.mark.parametrize("shard", ["none", "optimizer", "full"])
def test_a_run_stopped_mid_epoch_resumes_exactly_at_the_same_and_another_world_size(tmp_path, shard, world_size_1):
    """The losses after the resume equal the uninterrupted run's (at one rank: the mean of the two
    ranks' losses, the loss of the whole global batch), and so does the epoch's training loss,
    which sums each rank's losses from before the stop (kept per rank in the checkpoint)."""
    ref = run_ranks(_losses, 2, shard, str(tmp_path / "ref"), timeout=180)
    out = tmp_path / "out"
    assert run_ranks(_stopped, 2, shard, str(out), timeout=180) == [128 + signal.SIGTERM] * 2
    saved = sorted(os.listdir(out / "checkpoints"))
    assert saved[0] == "step000000008" and len(saved) == 2  # epoch 1's, and the stop's
    stop = int(saved[1].removeprefix("step"))  # every rank stops at the same step, the signal's or the next
    assert STOP_AFTER <= stop < 16
    again = tmp_path / "again"
    shutil.copytree(out, again)

    same = run_ranks(_losses, 2, shard, str(out), timeout=180)  # 2 -> 2
    for r in range(2):
        assert same[r][0] == pytest.approx(ref[r][0][stop:], rel=1e-6), r
    assert [row["train_loss"] for row in same[0][2]] == pytest.approx([row["train_loss"] for row in ref[0][2]],
                                                                      rel=1e-6)  # fmt: skip

    one = _run(1, shard, str(again))  # 2 -> 1
    mean = [(a + b) / 2 for a, b in zip(ref[0][0], ref[1][0])]
    assert one[0][0] == pytest.approx(mean[stop:], rel=1e-5)
    rows = one[0][2]
    assert [row["train_loss"] for row in rows] == pytest.approx([row["train_loss"] for row in ref[0][2]], rel=1e-5)
    assert [row["val_loss"] for row in rows] == pytest.approx([row["val_loss"] for row in ref[0][2]], rel=1e-5)
    assert rows[-1]["world_size"] == 1


# ---- a checkpoint is resumed by the dist.shard that saved it ---------------------------------------
def _train(out_dir, *overrides: str) -> None:
    cfg = load_config(DEMO, [*TINY, "train.epochs=1", f"run.out_dir={out_dir}", *overrides])
    with built(cfg, distlib.init("gloo")) as trainer:
        assert trainer.fit() == 0


@pytest.mark.parametrize(("saved", "resumed"), [("none", "optimizer"), ("optimizer", "none"), ("optimizer", "full")])
def test_a_checkpoint_is_resumed_only_with_the_dist_shard_that_saved_it(tmp_path, world_size_1, saved, resumed):
    _train(tmp_path, f"dist.shard={saved}")
    with pytest.raises(CheckpointError, match="run.resume=false|another run.out_dir") as e:
        _train(tmp_path, f"dist.shard={resumed}")
    assert f"dist.shard: checkpoint has {saved!r}, this run has {resumed!r}" in str(e.value)
    _train(tmp_path, f"dist.shard={resumed}", "run.resume=false")  # deletes them and trains afresh
    assert os.listdir(tmp_path / "checkpoints") == [step_name(8)]


def test_one_file_checkpoints_are_refused_by_name_and_run_resume_false_deletes_them(tmp_path, world_size_1):
    """A run directory that holds distlib.Checkpointer's one-file checkpoints (which the runner no longer
    loads), beside a sharded one or not: the resume stops and says what they are and what to do."""
    _train(tmp_path)
    model = torch.nn.Linear(2, 2)
    one_file = distlib.Checkpointer(str(tmp_path / "checkpoints"))
    one_file.save({"model": model}, epoch=3, step=0, global_step=24, fingerprint=fingerprint(model))
    with pytest.raises(CheckpointError) as e:
        _train(tmp_path)
    said = str(e.value)
    assert "holds one-file checkpoints (epoch0003-step000000.pt)" in said and "distlib.Checkpointer" in said
    assert "run.resume=false" in said and "another run.out_dir" in said
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["epoch0003-step000000.pt", step_name(8)]  # untouched
    _train(tmp_path, "run.resume=false")
    assert os.listdir(tmp_path / "checkpoints") == [step_name(8)]  # both kinds deleted, then the new one saved


def _resume_in(ctx, directories: list[str]) -> str:
    from distlib.runner.training.checkpoints import build_checkpoints

    settings = {"settings": {}}
    ckpts = build_checkpoints(directories[ctx.rank], {"train_state": {}}, shard="none", fingerprint=settings, keep=1)
    with pytest.raises(CheckpointError) as e:
        ckpts.resume(enabled=True)
    return str(e.value)


def test_a_checkpoint_directory_that_not_every_rank_sees_is_refused(tmp_path):
    """Every rank writes its part of each checkpoint into the directory: a rank that does not see rank 0's
    (run.out_dir relative to another working directory, or not on a shared file system) stops the run."""
    directories = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
    said = run_ranks(_resume_in, 2, directories)
    assert said[0] == said[1]
    assert said[0].startswith(f"rank(s) 1 do not see the checkpoint directory of rank 0, {directories[0]}"), said
    assert "a file system every node shares" in said[0]
    assert os.listdir(directories[0]) == [] and not os.path.exists(directories[1])  # nothing left behind


# ---- GPUs ----------------------------------------------------------------------------------------------
@pytest.mark.gpus(1)
@pytest.mark.slow
@pytest.mark.parametrize("shard", ["none", "optimizer", "full"])
def test_the_gpt_demo_trains_on_one_gpu_in_each_shard_mode(tmp_path, shard):
    """World size 1 on a GPU is the same code path (a one-rank NCCL group for full sharding)."""
    out = tmp_path / shard
    launch([DEMO, f"run.out_dir={out}", "run.progress=plain", "train.precision=bf16", "train.epochs=2",
            f"dist.shard={shard}"], nproc=1, timeout=400)  # fmt: skip
    rows = metrics(out)
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] and rows[0]["val_loss"] < 3.5, rows


@pytest.mark.gpus(2)
@pytest.mark.slow
@pytest.mark.parametrize(
    ("shard", "overrides"),
    [
        ("none", []),
        ("optimizer", []),
        ("optimizer", ["train.cuda_graph=true"]),
        ("optimizer", ["train.compile=true"]),
        ("full", []),
    ],
    ids=["none", "optimizer", "optimizer-cuda_graph", "optimizer-compiled", "full"],
)
def test_the_gpt_demo_trains_on_two_gpus_in_each_shard_mode(tmp_path, shard, overrides):
    """bf16 (autocast; FSDP2's bf16 weights with fp32 reduce-scatters for full sharding), fused
    AdamW (capturable inside the captured sharded step), compile_for_sync with the sharded
    optimizer; the loss falls alike in every mode, and the last epoch, trained again at one GPU from
    the checkpoint before it (2 -> 1), ends at the same validation loss within bf16's noise."""
    out = tmp_path / "gpt"
    args = [DEMO, f"run.out_dir={out}", "run.progress=plain", "train.precision=bf16", f"dist.shard={shard}",
            "run.checkpoint_every=1", *overrides]  # fmt: skip
    launch(args, nproc=2, timeout=400)
    rows = metrics(out)
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] - 0.15 and rows[0]["val_loss"] < 3.0, rows
    assert all(len(row["peak_mem_gib"]) == 2 for row in rows)
    # the last checkpoint's epoch trained again at one GPU from the one before: 2 -> 1
    shutil.rmtree(out / "checkpoints" / checkpoints(out)[-1])
    launch(args, nproc=1, timeout=400)
    again = metrics(out)
    assert again[-1]["world_size"] == 1
    assert again[-1]["val_loss"] == pytest.approx(rows[-1]["val_loss"], abs=0.05), (rows, again)
