"""The Trainer in one process: a resumed run's display starts at the epoch it resumes, and
its position is a TrainState saved in the checkpoint (clocks once, the loss sum per rank)."""

from __future__ import annotations

import io
import os

import pytest
import torch
from rich.console import Console

import distlib
from distlib.runner.config import load_config
from distlib.runner.trainer import Trainer
from tests.conftest import ROOT

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SMALL = ["train.epochs=2", "data.train_subset=256", "model.width=4", "run.checkpoint_every=1", "run.progress=plain"]


def train(out_dir: str, fit: bool = True) -> tuple[Trainer, list[str]]:
    """One world-size-1 run with a plain line at every step (``fit=False``: build and resume
    only); returns the trainer and its lines."""
    cfg = load_config(os.path.join(ROOT, "recipes", "demo.yaml"), [*SMALL, f"run.out_dir={out_dir}"])
    trainer = Trainer(cfg, distlib.init("gloo"))
    failure = None
    try:
        trainer.build()
        trainer.progress.console = Console(file=io.StringIO(), force_terminal=False)
        trainer.progress.refresh_s = trainer.progress.plain_every_s = 0.0
        assert not fit or trainer.fit() == 0
    except BaseException as e:
        failure = e
        raise
    finally:
        trainer.close(failure)
    return trainer, trainer.progress.console.file.getvalue().splitlines()


@pytest.fixture
def world_size_1(monkeypatch):
    for key in TORCHRUN_VARS:
        monkeypatch.delenv(key, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_resumed_run_shows_the_epochs_it_trains(tmp_path, world_size_1):
    out = tmp_path / "out"
    first, _ = train(str(out))
    steps = len(first.loader)
    os.unlink(out / "checkpoints" / "epoch0002-step000000.pt")  # as if it had died in epoch 2

    resumed, lines = train(str(out))
    assert resumed.progress.total_steps == resumed.progress.done == steps  # epoch 2 only
    step_lines = [line for line in lines if " step " in line.split("  ")[0]]
    assert len(step_lines) == steps, lines
    assert all(line.startswith("epoch 2/2 step ") for line in step_lines), step_lines
    assert step_lines[0].startswith("epoch 2/2 step 1/")


def test_the_train_state_is_saved_typed_and_restored(tmp_path, world_size_1):
    out = tmp_path / "out"
    first, _ = train(str(out))
    payload = torch.load(out / "checkpoints" / "epoch0001-step000000.pt", weights_only=True)
    saved = payload["state"]["train_state"]
    assert set(saved) == {"epoch", "step", "train_s", "elapsed_s", "epoch_s"} and saved["epoch"] == 1
    assert 0 < saved["train_s"] <= saved["elapsed_s"]
    assert set(payload["ranks"][0]["states"]["train_state"]) == {"loss_sum"}  # per rank
    assert payload["extra"] == {}  # no string-keyed values on the side

    os.unlink(out / "checkpoints" / "epoch0002-step000000.pt")
    resumed, _ = train(str(out), fit=False)
    assert resumed.state.state_dict() == saved  # the clocks continue from where they were


def _launch(tmp_path) -> int:
    import launch

    return launch.main([os.path.join(ROOT, "recipes", "demo.yaml"), *SMALL, f"run.out_dir={tmp_path / 'out'}"])


@pytest.mark.parametrize(
    "raised, code, said",
    [
        (ValueError("a bug of ours"), None, None),  # not hidden as bad input: its traceback, exit 1
        (RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer"), 1, "error: rank 0 lost the conn"),
        (KeyboardInterrupt(), 130, "error: interrupted"),
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
