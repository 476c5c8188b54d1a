"""The Trainer in one process: its steps are a plain torch loop with the recipe's optimizer,
schedule, loss and data (checked against torch's own SGD, LinearLR and CrossEntropyLoss), its
evaluations what a hand computation gives; a resumed run's display starts at the epoch it
resumes, it ends with the rows and weights of an uninterrupted run, and its position is a
TrainState saved in the checkpoint (clocks once, the loss sum per rank). At two ranks, the
evaluation averages the ranks' BatchNorm statistics first."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import shutil
import signal
from collections.abc import Iterator

import pytest
import torch
from rich.console import Console
from torch import nn

import distlib
from distlib.reliability.stop import Interrupted
from distlib.runner.config import load_config
from distlib.runner.data.device_loader import DeviceLoader
from distlib.runner.data.images import load_image_set
from distlib.runner.models.vision import small_cnn
from distlib.runner.training.trainer import Trainer
from tests.conftest import ROOT, run_ranks
from tests.runner.conftest import checkpoints, saved, step_name

SMALL = ["train.epochs=2", "data.train_subset=256", "model.width=4", "run.checkpoint_every=1", "run.progress=plain"]
DEMO = os.path.join(ROOT, "recipes", "demo.yaml")


def metrics(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def trajectory(rows: list[dict]) -> list[tuple]:
    """What must be bit-for-bit equal between runs (timings are not)."""
    return [(r["epoch"], r["train_loss"], r["test_acc"], r["lr"]) for r in rows]


@contextlib.contextmanager
def built(cfg, ctx: distlib.Context) -> Iterator[Trainer]:
    """A built Trainer, closed afterwards and told of any failure, as launch.py does."""
    trainer = Trainer(cfg, ctx)
    failure = None
    try:
        trainer.build()
        yield trainer
    except BaseException as e:
        failure = e
        raise
    finally:
        trainer.close(failure)


def train(out_dir: str, fit: bool = True) -> tuple[Trainer, list[str]]:
    """One world-size-1 run with a plain line at every step (``fit=False``: build and resume
    only); returns the trainer and its lines."""
    cfg = load_config(os.path.join(ROOT, "recipes", "demo.yaml"), [*SMALL, f"run.out_dir={out_dir}"])
    with built(cfg, distlib.init("gloo")) as trainer:
        trainer.progress.console = Console(file=io.StringIO(), force_terminal=False)
        trainer.progress.refresh_s = trainer.progress.plain_every_s = 0.0
        assert not fit or trainer.fit() == 0
    return trainer, trainer.progress.console.file.getvalue().splitlines()


def test_a_resumed_run_shows_the_epochs_it_trains(tmp_path, world_size_1):
    out = tmp_path / "out"
    first, _ = train(str(out))
    steps = len(first.loader)
    rows = metrics(out)
    shutil.rmtree(out / "checkpoints" / step_name(2 * steps))  # as if it had died in epoch 2

    resumed, lines = train(str(out))
    assert resumed.progress.total_steps == resumed.progress.done == steps  # epoch 2 only
    step_lines = [line for line in lines if " step " in line.split("  ")[0]]
    assert len(step_lines) == steps, lines
    assert all(line.startswith("epoch 2/2 step ") for line in step_lines), step_lines
    assert step_lines[0].startswith("epoch 2/2 step 1/")
    # epoch 2's row is written again, once, and is what the first run wrote: the same data order
    # (the loader is at epoch 2), the same weights and schedule
    again = metrics(out)
    assert [r["epoch"] for r in again] == [1, 2] and again[0] == rows[0], again
    assert trajectory(again) == trajectory(rows)


def test_the_train_state_is_saved_typed_and_restored(tmp_path, world_size_1):
    out = tmp_path / "out"
    first, _ = train(str(out))
    steps = len(first.loader)
    payload = saved(out, steps)  # epoch 1's
    state = payload["train_state"]
    assert set(state) == {"epoch", "step", "train_s", "elapsed_s", "epoch_s"} and state["epoch"] == 1
    assert 0 < state["train_s"] <= state["elapsed_s"]
    assert set(payload["ranks"][0]["states"]["train_state"]) == {"loss_sum", "trained_sum"}  # per rank
    assert set(payload) == {"model", "optimizer", "scheduler", "train_state", "ranks"}  # nothing on the side

    shutil.rmtree(out / "checkpoints" / step_name(2 * steps))
    resumed, _ = train(str(out), fit=False)
    assert resumed.state.state_dict() == state  # the clocks continue from where they were


def test_the_final_checkpoint_is_written_during_the_final_evaluation_and_committed_after_the_last_row(
    tmp_path, world_size_1
):
    """The final save starts before the final evaluation and reads the tensors in place while it runs;
    the checkpoint appears only after the run's last row is logged, and holds the trained weights."""
    out = tmp_path / "out"
    cfg = load_config(DEMO, [*SMALL, "run.checkpoint_every=0", f"run.out_dir={out}"])
    seen: dict[str, bool] = {}
    with built(cfg, distlib.init("gloo")) as trainer:
        steps = 2 * len(trainer.loader)
        evaluate, log_metrics = trainer.task.evaluate, trainer.run.log_metrics

        def evaluating(model, autocast, final):
            if final:
                seen["in_flight"] = trainer.checkpoints.checkpointer._pending is not None
            return evaluate(model, autocast, final)

        def logging(row):
            seen[f"committed_at_row_{row['step']}"] = step_name(steps) in checkpoints(out)
            log_metrics(row)

        trainer.task.evaluate, trainer.run.log_metrics = evaluating, logging
        assert trainer.fit() == 0
        weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        summary = trainer.timeline.summary()
    assert seen["in_flight"] and seen[f"committed_at_row_{steps}"] is False, seen
    assert checkpoints(out) == [step_name(steps)]
    payload = saved(out, steps)
    assert payload["train_state"]["epoch"] == 2 and payload["train_state"]["step"] == 0
    assert weights.keys() == payload["model"].keys()
    for k, v in weights.items():
        assert torch.equal(payload["model"][k], v), k
    assert summary["final_checkpoint_s"] > 0 and {"metrics", "sample", "checkpoint"} <= summary["stages"].keys()


def test_the_warm_up_runs_the_first_and_the_last_evaluation_batch_not_the_whole_split(tmp_path, world_size_1):
    """What the final evaluation's kernels need (each batch shape), not a pass over a validation split
    that may be as large as the training's."""
    gpt = os.path.join(ROOT, "recipes", "gpt_demo.yaml")
    cfg = load_config(gpt, ["data.train_subset=64", "model.args.n_layer=1", "model.args.n_embd=32",
                            "model.args.n_head=2", "train.batch_size=8", "data.args.val_frac=0.01",
                            f"run.out_dir={tmp_path / 'out'}"])  # fmt: skip
    with built(cfg, distlib.init("gloo")) as trainer:
        sizes: list[int] = []
        hook = trainer.model.register_forward_hook(lambda m, args, out: sizes.append(args[0].shape[0]))
        trainer.task.warm_up_evaluate(trainer.model, trainer.autocast)
        warm, sizes[:] = list(sizes), []
        trainer.task.evaluate(trainer.model, trainer.autocast, final=True)
        hook.remove()
    assert len(sizes) > 2 and sizes[-1] < sizes[0], sizes  # a partial last batch
    assert warm == [sizes[0], sizes[-1]], (warm, sizes)


@pytest.mark.parametrize("prewarm_eval", [True, False])
def test_the_warm_up_evaluates_unless_told_to_leave_it_to_the_first_evaluation(
    tmp_path, world_size_1, monkeypatch, prewarm_eval
):
    """train.prewarm_eval=false: the warm-up runs its training steps and no evaluation (the first
    evaluation compiles instead), and still puts the weights back; true: one evaluation too."""
    gpt = os.path.join(ROOT, "recipes", "gpt_demo.yaml")
    cfg = load_config(gpt, ["data.train_subset=64", "model.args.n_layer=1", "model.args.n_embd=32",
                            "model.args.n_head=2", "train.batch_size=8", "train.prewarm_steps=3",
                            f"train.prewarm_eval={str(prewarm_eval).lower()}",
                            f"run.out_dir={tmp_path / 'out'}"])  # fmt: skip
    with built(cfg, distlib.init("gloo")) as trainer:  # on the CPU: no warm-up in the build
        calls: list[str] = []
        evaluate = trainer.task.warm_up_evaluate
        monkeypatch.setattr(trainer.task, "warm_up_evaluate", lambda *a: (calls.append("eval"), evaluate(*a)))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))  # the warm-up's, on a CPU
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.warm_up()
        after = trainer.model.state_dict()
    assert calls == (["sync", "eval", "sync"] if prewarm_eval else ["sync"]), calls
    assert all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.gpus(1)
def test_a_step_taken_after_the_build_outside_an_epoch_keeps_its_loss_on_the_gpu(tmp_path, world_size_1):
    """``train_step`` right after ``build``, as the benchmarks time it: the loss it adds to the train
    state is on the GPU, and so is the sum it adds it to (it was on the host until the first epoch)."""
    cfg = load_config(DEMO, [*SMALL, f"run.out_dir={tmp_path / 'out'}"])
    with built(cfg, distlib.init()) as trainer:
        assert trainer.ctx.device.type == "cuda"
        x, y = trainer.task.warm_up_batch()
        trainer.train_step(x, y)
        trainer.train_step(x, y)
        assert trainer.state.step == 2 and trainer.state.loss_sum.device == trainer.ctx.device
        assert torch.isfinite(trainer.state.loss_sum) and trainer.state.loss_sum > 0


def test_training_starts_with_the_build_s_objects_out_of_the_collector(tmp_path, world_size_1, capsys):
    """What build() left (a compile's graphs and code) is collected once and frozen, so the collector's
    full passes during training do not walk it; the teardown unfreezes it before the process group
    goes, so that the group held by a fully sharded model's cycles is found and released."""
    gpt = os.path.join(ROOT, "recipes", "gpt_demo.yaml")
    cfg = load_config(gpt, ["train.epochs=1", "data.train_subset=64", "train.sample_tokens=0", "dist.shard=full",
                            "run.progress=plain", f"run.out_dir={tmp_path / 'out'}"])  # fmt: skip
    assert gc.get_freeze_count() == 0
    with built(cfg, distlib.init("gloo")) as trainer:
        frozen = gc.get_freeze_count()
        assert trainer.fit() == 0
    assert frozen > 0 and gc.get_freeze_count() == 0
    assert "still referenced after shutdown" not in capsys.readouterr().err


def _launch(tmp_path) -> int:
    import launch

    return launch.main([os.path.join(ROOT, "recipes", "demo.yaml"), *SMALL, f"run.out_dir={tmp_path / 'out'}"])


@pytest.mark.parametrize(
    "raised, code, said",
    [
        (ValueError("a bug of ours"), None, None),  # not hidden as bad input: its traceback, exit 1
        (RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer"), 1, "error: rank 0 lost the conn"),
        # the recipe's dist.timeout_s (the demo's default: 300) is the one the message names
        (RuntimeError("[gloo] Timed out waiting 300000ms"), 1, "after 300 s (dist.timeout_s)"),
        (KeyboardInterrupt(), 130, "error: interrupted"),
        (Interrupted(signal.SIGTERM), 143, "error: interrupted by SIGTERM"),  # a stop before training started
    ],
)
def test_launch_maps_the_outcome_to_one_exit_code_and_tears_down(
    tmp_path, world_size_1, monkeypatch, capsys, raised, code, said
):
    closed = []
    monkeypatch.setattr(Trainer, "build", lambda self: (_ for _ in ()).throw(raised))
    monkeypatch.setattr(Trainer, "close", lambda self, error=None: closed.append(error))
    if code is None:
        with pytest.raises(type(raised)):
            _launch(tmp_path)
    else:
        assert _launch(tmp_path) == code
        err = capsys.readouterr().err
        assert err.count("error: ") == 1 and said in err, err
    assert closed == [raised]  # the one teardown, told what happened


def test_a_stop_signal_during_a_failed_starts_way_out_is_said_by_the_exit_code_not_raised(
    tmp_path, world_size_1, monkeypatch, capsys
):
    """A signal whose handler runs while the run handles its error (a store call that failed because
    the job is stopping: the handler runs once the call returns) ends the run with one line and 128 +
    the signal; it does not cut the way out short with a KeyboardInterrupt."""
    from distlib.runner.training import outcome

    closed = []
    lost = RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer")
    monkeypatch.setattr(Trainer, "build", lambda self: (_ for _ in ()).throw(lost))
    monkeypatch.setattr(Trainer, "close", lambda self, error=None: closed.append(error))
    # the peers' words are read while the error is handled: the signal lands there; no store answers,
    # and it was torchrun's
    monkeypatch.setattr(outcome, "peer_reports", lambda: (os.kill(os.getpid(), signal.SIGTERM), {})[1])
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    try:
        assert _launch(tmp_path) == 143
    except KeyboardInterrupt as e:  # caught here: it would end the whole test session
        pytest.fail(f"the signal was raised into the way out: {e!r}")
    err = capsys.readouterr().err
    assert err.count("error: ") == 1 and "error: interrupted by SIGTERM" in err, err
    assert closed == [lost]


def test_the_error_line_names_the_rank_that_says_it(monkeypatch, capsys):
    from types import SimpleNamespace

    from distlib.runner.training import outcome

    monkeypatch.setattr(outcome, "context", lambda: SimpleNamespace(rank=3))
    assert outcome.exit_code(RuntimeError("[gloo] Connection reset by peer"), timeout_s=60.0) == 1
    assert capsys.readouterr().err.startswith("error: rank 3 lost the connection to another rank in a collective")


@pytest.mark.parametrize(
    "reports, signalled, code, said",
    [
        ({1: None}, 0, 1, "rank 3 lost the connection to rank 1 in a collective: rank 1 ended without a word (killed"),
        ({1: {"code": 1, "message": "ValueError: a bug (its traceback is in its output)"}}, 0, 1,
         "to rank 1 in a collective: rank 1 failed: ValueError: a bug"),
        ({1: {"code": 2, "message": "x.bin: token id 600 ..."}}, 0, 2, "(on rank 1) x.bin: token id 600 ..."),
        ({1: {"code": 143, "message": "interrupted by SIGTERM"}, 2: None}, 0, 143,
         "(on rank 1) interrupted by SIGTERM"),
        ({1: {"code": 1, "message": "rank 1 lost the connection to rank 2 in all_reduce: ..."}, 2: None}, 0, 1,
         "lost the connection to rank 2 in a collective: rank 2 ended without a word"),
        ({}, 0, 1, "rank 3 lost the connection to another rank"),  # no store to ask
        # this rank was signalled and the store is gone: the job is stopping (torchrun, signalled again,
        # ended and took its store along)
        ({}, signal.SIGTERM, 143, "error: interrupted by SIGTERM"),
        # with the store there a signal excuses no lost peer (torchrun's SIGTERM after a worker died)
        ({1: None, 2: {"code": 1, "message": "rank 2 lost the connection to rank 1 in all_reduce: ..."}},
         signal.SIGTERM, 1, "lost the connection to rank 1 in a collective: rank 1 ended without a word"),
        ({1: None, 2: {"code": 2, "message": "x.bin: token id 600 ..."}}, signal.SIGINT, 2, "(on rank 2) x.bin"),
    ],
)  # fmt: skip
def test_a_rank_that_lost_a_peer_says_what_the_peer_said_or_names_it(
    monkeypatch, capsys, reports, signalled, code, said
):
    """The peers' words in the store (``failures.report``): an error or a stop of its own is said again with
    its code; a rank that left none, or failed with a bug, is named; another survivor is not. A rank that
    received a stop signal and finds torchrun's store gone was stopped: 128 + the signal."""
    from types import SimpleNamespace

    from distlib.runner.training import outcome

    sent = []
    monkeypatch.setattr(outcome, "context", lambda: SimpleNamespace(rank=3))
    monkeypatch.setattr(outcome, "peer_reports", lambda: reports)
    monkeypatch.setattr(outcome, "report", lambda c, m: sent.append((c, m)))
    monkeypatch.setattr(outcome.stop, "received", lambda: signalled)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torchrun's agent hosts the store
    assert outcome.exit_code(RuntimeError("[gloo] Connection reset by peer"), timeout_s=60.0) == code
    err = capsys.readouterr().err
    assert err.startswith("error: ") and said in err, err
    assert sent[-1] == (code, err.removeprefix("error: ").strip())  # its own word, for the others


def test_where_rank_0_hosted_the_store_its_loss_after_a_signal_is_still_a_lost_peer(monkeypatch, capsys):
    """srun or mpirun (no torchrun agent): the store was rank 0's, so finding it gone means rank 0 is
    gone, whatever signal this rank got (Slurm signals the survivors of a failed step)."""
    from types import SimpleNamespace

    from distlib.runner.training import outcome

    monkeypatch.setattr(outcome, "context", lambda: SimpleNamespace(rank=2))
    monkeypatch.setattr(outcome, "peer_reports", lambda: {})
    monkeypatch.setattr(outcome, "report", lambda c, m: None)
    monkeypatch.setattr(outcome.stop, "received", lambda: signal.SIGTERM)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert outcome.exit_code(RuntimeError("[gloo] Connection reset by peer"), timeout_s=60.0) == 1
    assert capsys.readouterr().err.startswith("error: rank 2 lost the connection to another rank")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torchrun's: gone with torchrun
    assert outcome.exit_code(RuntimeError("[gloo] Connection reset by peer"), timeout_s=60.0) == 143
    assert capsys.readouterr().err == "error: interrupted by SIGTERM\n"


def _one_rank_lost(ctx, lost: int) -> tuple[int, str] | None:
    """Rank ``lost`` leaves the group without a word (as one killed); the others' all_reduce fails:
    each one's exit code and error line (``outcome.exit_code``), as the launcher prints it."""
    import torch.distributed as dist

    from distlib.reliability.failures import abort
    from distlib.runner.training import outcome

    dist.barrier()
    if ctx.rank == lost:
        dist.destroy_process_group()
        return None
    err = io.StringIO()
    try:
        for _ in range(1000):
            dist.all_reduce(torch.ones(4))
        raise AssertionError("no collective failed")
    except RuntimeError as e:
        with contextlib.redirect_stderr(err):
            code = outcome.exit_code(e, timeout_s=30.0)
    abort()
    return code, err.getvalue()


def test_three_ranks_one_lost_each_survivor_names_that_one_and_not_the_other_survivor():
    """3 gloo ranks, rank 1 gone without a word: ranks 0 and 2 each exit 1 with one line naming rank 1
    alone; at 2 ranks "the other rank" and "the lost rank" are one, here a survivor that named the
    other survivor (its word not yet in the store) would show."""
    results = run_ranks(_one_rank_lost, 3, 1, timeout=120, init_timeout_s=30)
    assert results[1] is None
    for rank in (0, 2):
        code, err = results[rank]
        assert code == 1 and err.count("\n") == 1, err
        assert err.startswith(f"error: rank {rank} lost the connection to rank 1 in "), err
        assert "rank 1 ended without a word" in err and f"rank {2 - rank}" not in err, err


def _errors_at_once(ctx, lines: int) -> None:
    """This rank's error line, ``lines`` times, at the moment the other ranks say theirs, on stderr as
    PYTHONUNBUFFERED leaves it (each write straight to the file the ranks share)."""
    import sys

    import torch.distributed as dist

    from distlib.errors import DistlibError
    from distlib.runner.training import outcome

    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    outcome.report = lambda code, message: None  # the store's round trip: no part of the printing
    dist.barrier()
    for i in range(lines):
        assert outcome.exit_code(DistlibError(f"data.root: rank {ctx.rank} found bad input {i:04d}"), 30.0) == 2


def test_error_lines_of_ranks_failing_at_once_stay_whole(capfd, monkeypatch):
    """3 ranks print their error lines at once into one file: every line is one rank's whole line (the
    newline written with it, not apart, where another rank's line could come in between), and so is a
    configuration error of several lines."""
    import re

    from distlib.runner.config import ConfigError
    from distlib.runner.training import outcome

    capfd.readouterr()
    run_ranks(_errors_at_once, 3, 300, timeout=120)
    said = [line for line in capfd.readouterr().err.splitlines() if "found bad input" in line]
    broken = [s for s in said if not re.fullmatch(r"error: data\.root: rank [0-2] found bad input \d{4}", s)]
    assert len(said) == 900 and not broken, broken[:5]

    class Writes:  # each write() of one error
        def write(self, text: str) -> None:
            writes.append(text)

        def flush(self) -> None:
            pass

    writes: list[str] = []
    monkeypatch.setattr("sys.stderr", Writes())
    outcome.exit_code(ConfigError(["train.lr: expected float", "train.epochs: must be > 0"]), 0.0)
    assert writes == ["error: invalid configuration:\n  - train.lr: expected float\n  - train.epochs: must be > 0\n"]


def test_a_checkpoint_must_match_every_key_but_the_documented_free_ones():
    """docs/reliability.md: the model, the loss, train.* (except eval_every, tta, tta_translate,
    cuda_graph, prewarm_steps, prewarm_eval, cudnn_benchmark, compile, compile_backend, activation_checkpointing,
    peak_tflops, sample_tokens, fp8_recipe, fp8_layers, model.block_class, loss.chunks and
    loss.chunks_when_needed (the same loss and gradients), and the budget: epochs, max_steps,
    eval_every_steps), data.name, data.args, data.augment.* and data.train_subset
    must match the checkpoint."""
    import dataclasses

    from distlib.runner.config import Config
    from distlib.runner.training.trainer import resume_settings

    cfg = Config()
    free = {"eval_every", "tta", "tta_translate", "cuda_graph", "prewarm_steps", "prewarm_eval", "cudnn_benchmark",
            "compile", "peak_tflops", "sample_tokens", "epochs", "max_steps", "eval_every_steps", "compile_backend",
            "activation_checkpointing", "fp8_recipe", "fp8_layers"}  # fmt: skip
    expected = {f"model.{f.name}" for f in dataclasses.fields(cfg.model) if f.name != "block_class"}
    loss_free = ("chunks", "chunks_when_needed")
    expected |= {f"loss.{f.name}" for f in dataclasses.fields(cfg.loss) if f.name not in loss_free}
    expected |= {"data.name", "data.args"}
    expected |= {f"train.{f.name}" for f in dataclasses.fields(cfg.train) if f.name not in free}
    expected |= {f"data.augment.{f.name}" for f in dataclasses.fields(cfg.data.augment)} | {"data.train_subset"}
    assert set(resume_settings(cfg)) == expected


# ---- the training itself, against torch's own pieces ------------------------------------------

# 8 steps an epoch, 24 in all: a 6-step warm-up; weight decay and label smoothing large enough to
# tell apart where they act; the last epoch is evaluated though 3 is no multiple of eval_every
RECIPE = ["train.epochs=3", "data.train_subset=1024", "train.batch_size=128", "model.width=4", "train.seed=3",
          "train.warmup_frac=0.25", "train.weight_decay=0.05", "train.label_smoothing=0.2", "train.eval_every=2",
          "run.progress=plain"]  # fmt: skip


class StepSpy:
    """The trainer's step, recording the learning rate of every parameter group and the batch
    each step gets, and the weight average (train.ema) after it."""

    def __init__(self, trainer: Trainer):
        self.step, self.optimizer, self.seen = trainer.step_fn, trainer.optimizer, []
        self.ema, self.averages = trainer.ema, []

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen.append(([g["lr"] for g in self.optimizer.param_groups], x.clone(), y.clone()))
        loss = self.step(x, y)
        self.averages.append({k: v.clone() for k, v in self.ema.module.state_dict().items()})
        return loss

    def __getattr__(self, name: str):
        return getattr(self.step, name)


def test_training_is_a_plain_torch_loop_with_the_recipes_settings(tmp_path, world_size_1):
    # train.ema: the evaluations see the weight average; checkpoints every 2 epochs and at the end
    cfg = load_config(DEMO, [*RECIPE, "train.ema=0.9", "run.checkpoint_every=2", f"run.out_dir={tmp_path / 'out'}"])
    with built(cfg, distlib.init("gloo")) as trainer:
        start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.step_fn = spy = StepSpy(trainer)
        trainer.progress.console = Console(file=io.StringIO(), force_terminal=False)
        assert trainer.fit() == 0
    rows = metrics(tmp_path / "out")
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert checkpoints(tmp_path / "out") == [step_name(16), step_name(24)]  # epoch 2's and 3's, of 8 steps

    # the data: the first 1,024 training images (3 classes), normalized with their own per-channel statistics,
    # in the order and with the augmentation that train.seed gives
    images = load_image_set(os.path.join(ROOT, cfg.data.root))
    x_train, y_train = images.x_train[:1024], images.y_train[:1024]
    pixels = x_train.double() / 255
    mean, std = pixels.mean(dim=(0, 2, 3)), pixels.std(dim=(0, 2, 3))
    torch.testing.assert_close(trainer.loader.mean.flatten().double(), mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(trainer.loader.std.flatten().double(), std, rtol=1e-5, atol=1e-6)
    loader = DeviceLoader(x_train, y_train, batch_size=128, mean=mean.float(), std=std.float(), crop_pad=4,
                          flip="random", seed=3)  # fmt: skip
    expected = [batch for _epoch in range(3) for batch in loader]
    assert len(spy.seen) == len(expected) == 24
    for (_, x, y), (x_ref, y_ref) in zip(spy.seen, expected):
        assert torch.equal(y, y_ref)
        torch.testing.assert_close(x, x_ref)

    # one process, torch's pieces: SGD with Nesterov momentum, weight decay on the conv and linear
    # weights only, linear warm-up then linear decay to 0 (LinearLR twice), smoothed cross-entropy
    model = small_cnn(10, 4)
    model.load_state_dict(start)
    decay = [m.weight for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    rest = [p for p in model.parameters() if all(p is not q for q in decay)]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0}],
                          lr=0.2, momentum=0.9, nesterov=True)  # fmt: skip
    schedule = torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, 1 / 6, 1.0, total_iters=5),
              torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.0, total_iters=18)], milestones=[6],
    )  # fmt: skip
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.2)
    # the weight average after each optimizer step k (from 0): decay min(0.9, (1 + k) / (10 + k)),
    # over the float tensors of the state (BatchNorm's counter is copied)
    average = {k: v.clone() for k, v in start.items()}
    losses, lrs_after = [], []
    for k, (lrs, x, y) in enumerate(spy.seen):
        assert lrs == pytest.approx([opt.param_groups[0]["lr"]] * 2, rel=1e-9), k
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
        losses.append(loss.item())
        lrs_after.append(opt.param_groups[0]["lr"])
        decay = min(0.9, (1 + k) / (10 + k))
        for name, w in model.state_dict().items():
            average[name] = decay * average[name] + (1 - decay) * w if w.is_floating_point() else w.clone()
            torch.testing.assert_close(spy.averages[k][name], average[name], msg=f"step {k}: {name}")
    assert lrs_after[-1] == 0.0  # decayed to zero at the last step
    for name, a in trainer.model.state_dict().items():
        torch.testing.assert_close(a, model.state_dict()[name], msg=name)
    for row in rows:  # the row's loss is the epoch's mean step loss, its lr the rate after the epoch
        e = row["epoch"]
        assert row["train_loss"] == pytest.approx(sum(losses[8 * (e - 1) : 8 * e]) / 8, abs=2e-5), (row, losses)
        assert row["lr"] == pytest.approx(lrs_after[8 * e - 1], rel=1e-9, abs=1e-12), row

    # evaluated every 2 epochs and after the last, the weight average: the mean over the 1,000 test
    # images, without augmentation, of argmax(logits(x)), and in the final evaluation of
    # argmax(logits(x) + logits(flip(x))) (tta)
    assert rows[0]["test_acc"] is None
    x = (images.x_test.float() / 255 - trainer.loader.mean) / trainer.loader.std
    after_epoch_2 = small_cnn(10, 4)
    after_epoch_2.load_state_dict(spy.averages[15])
    for row, net, views in ((rows[1], after_epoch_2, [x]), (rows[2], trainer.ema.module, [x, x.flip(3)])):
        with torch.no_grad():
            logits = sum(net.eval()(v) for v in views)
        assert row["test_acc"] == round((logits.argmax(1) == images.y_test).double().mean().item(), 5), row


def _launch_run(out_dir, *overrides: str) -> int:
    import launch

    return launch.main([DEMO, *RECIPE, "run.checkpoint_every=1", f"run.out_dir={out_dir}", *overrides])


def test_a_run_stopped_by_sigterm_mid_epoch_exits_143_and_resumes_to_the_same_rows_and_weights(
    tmp_path, world_size_1, monkeypatch
):
    assert _launch_run(tmp_path / "ref") == 0
    reference = metrics(tmp_path / "ref")

    step, steps = Trainer.train_step, []

    def signalled_after_11_steps(self, x, y):
        step(self, x, y)
        steps.append(1)
        if len(steps) == 11:  # epoch 2, step 3: the stop comes at the next step's check
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(Trainer, "train_step", signalled_after_11_steps)
    out = tmp_path / "out"
    assert _launch_run(out) == 128 + signal.SIGTERM
    assert checkpoints(out) == [step_name(8), step_name(11)]  # epoch 1's, and the stop's at epoch 2 step 3
    assert trajectory(metrics(out)) == trajectory(reference[:1])
    monkeypatch.undo()

    assert _launch_run(out) == 0  # the same command continues at epoch 2, step 3
    assert trajectory(metrics(out)) == trajectory(reference)
    a, b = (saved(d, 24)["model"] for d in (tmp_path / "ref", out))  # the final checkpoint's
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- the evaluation at two ranks -----------------------------------------------------------------


def _evaluate_with_each_ranks_own_statistics(ctx, out_dir: str) -> tuple[float, list[torch.Tensor]]:
    cfg = load_config(DEMO, [*SMALL, f"run.out_dir={out_dir}"])
    with built(cfg, ctx) as trainer:
        norms = [m for m in trainer.model.modules() if isinstance(m, nn.BatchNorm2d)]
        with torch.no_grad():  # statistics as two ranks' different batches would leave them
            for i, bn in enumerate(norms):
                bn.running_mean.fill_(0.1 * i + ctx.rank)
                bn.running_var.fill_(1.0 + 2 * ctx.rank)
        acc = trainer.evaluate()
        return acc, [torch.cat([bn.running_mean, bn.running_var]) for bn in norms]


def test_evaluate_averages_the_ranks_batchnorm_statistics_first(tmp_path):
    """Every rank evaluates (and saves) one model: the mean of the ranks' BatchNorm statistics."""
    (acc0, stats0), (acc1, stats1) = run_ranks(_evaluate_with_each_ranks_own_statistics, 2, str(tmp_path / "out"))
    assert acc0 == acc1
    assert len(stats0) == 3
    for i, (s0, s1) in enumerate(zip(stats0, stats1, strict=True)):
        half = s0.numel() // 2
        assert torch.equal(s0, s1)
        torch.testing.assert_close(s0[:half], torch.full((half,), 0.1 * i + 0.5))
        torch.testing.assert_close(s0[half:], torch.full((half,), 2.0))
