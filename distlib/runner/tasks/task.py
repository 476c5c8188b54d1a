"""What a run trains for, as the trainer sees it: ``Task``, the task's half of a run (its data and
loaders, loss, evaluation and metrics); and the loaders of a data set named by import path, which
every task shares (the library's ``distributed_loader``)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

import distlib
from distlib.distributed.process_group import Context
from distlib.reliability.failures import shared_errors
from distlib.runner import components
from distlib.runner.config import Config, ConfigError
from distlib.runner.data.errors import DataError
from distlib.runner.observability.timeline import Timeline
from distlib.runner.tasks.losses import StepLoss


class Task:
    """The task's half of a run. ``loader`` yields this rank's training batches ``(x, y)`` (its
    ``len()`` the steps of an epoch, ``set_epoch`` for a resume); the rest the trainer calls."""

    name: str
    loader: Any
    train_size: int  # training samples (images, sequences)
    eval_size: int
    metrics: tuple[str, ...] = ()  # the metrics.jsonl keys of an evaluation (None in a row without one)
    per_sample: int = 1  # units a sample counts in the rate shown (tokens of a sequence)
    unit: str = "img"  # of the rate shown

    def __init__(self, cfg: Config, ctx: Context, per_rank: int, timeline: Timeline):
        self.cfg, self.ctx, self.per_rank, self.timeline = cfg, ctx, per_rank, timeline

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments the model gets when it takes them and model.args does not set them."""
        return {}

    def loss_fn(self, model: nn.Module | None = None) -> StepLoss:
        """The loss of ``model``'s outputs: loss.name with loss.args (and train.label_smoothing if it
        takes it); its sum over the trained targets where it takes ``reduction`` (the step divides by
        the step's trained targets over every rank), else its mean (runner/tasks/losses.py)."""
        c = self.cfg.loss
        fn = components.resolve("loss", c.name)
        kwargs = {**components.accepted(fn, {"label_smoothing": self.cfg.train.label_smoothing}), **c.args}
        if components.accepted(fn, {"reduction": "sum"}) and "reduction" not in kwargs:
            return StepLoss.of(lambda outputs, targets, reduction="mean": fn(outputs, targets, reduction=reduction,
                                                                             **kwargs))  # fmt: skip
        return StepLoss.of(lambda outputs, targets: fn(outputs, targets, **kwargs))

    def train_metrics(self, collect: bool = True) -> dict[str, Any]:
        """What the loss reported besides itself (metrics.jsonl keys), averaged over the training steps
        since the last call and over the ranks, then started again; ``collect=False`` only starts
        again (no collective: the warm-up's steps left out)."""
        return {}

    def warm_up_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One training batch on the device, for the warm-up's steps."""
        raise NotImplementedError

    def evaluate(self, model: nn.Module, autocast: contextlib.AbstractContextManager, final: bool) -> dict[str, Any]:
        """The evaluation metrics (metrics.jsonl keys) of ``model``. A collective."""
        raise NotImplementedError

    def warm_up_evaluate(self, model: nn.Module, autocast: contextlib.AbstractContextManager) -> None:
        """Run what the final evaluation runs, so that its kernels are ready (compiled, autotuned) before
        the training clock starts; by default the final evaluation itself. A collective."""
        self.evaluate(model, autocast, final=True)

    def rates(self, samples_per_s: float, model: nn.Module, trained_frac: float = 1.0) -> dict[str, Any]:
        """Throughput fields of a metrics row, from the global samples per second; ``trained_frac``:
        the share of the targets trained (not ``IGNORED``) over the row's steps."""
        return {}

    def seen(self, samples: int) -> dict[str, Any]:
        """What a metrics row says has been trained on, from the samples of every step so far."""
        return {}

    def model_figures(self, model: nn.Module) -> dict[str, Any]:
        """What summary.json says of the model's cost (a language model: its training FLOPs per token)."""
        return {}

    def finish(self, model: nn.Module, autocast: contextlib.AbstractContextManager) -> dict[str, Any]:
        """Once training is done, on the main rank: what summary.json adds (and the log shows)."""
        return {}


def dataset_loaders(cfg: Config, ctx: Context, per_rank: int) -> tuple[Any, Any, int, int]:
    """A user's (train, validation) data sets through distributed_loader: training shuffled by
    train.seed, full batches only (every rank the same steps); validation each sample once."""
    with shared_errors(DataError):
        out = components.build("data", cfg.data.name, cfg.data.args,
                               provided={"root": cfg.data.root, "download": cfg.data.download,
                                         "cache_dir": cfg.data.cache_dir})  # fmt: skip
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise DataError(f"data.name={cfg.data.name!r} returned {type(out).__name__}: expected a pair "
                            "(train, validation) of torch.utils.data.Dataset")  # fmt: skip
    train, val = out
    if cfg.data.train_subset:
        train = torch.utils.data.Subset(train, range(min(cfg.data.train_subset, len(train))))
    pin = ctx.device.type == "cuda"
    loader = distlib.distributed_loader(train, per_rank, shuffle=True, seed=cfg.train.seed, drop_last=True,
                                        pin_memory=pin)  # fmt: skip
    if len(loader) == 0:
        raise ConfigError([f"train.batch_size={cfg.train.batch_size} is more than the {len(train)} training "
                           "samples (data.train_subset or the data set): not one step per epoch"])  # fmt: skip
    val_loader = distlib.distributed_loader(val, per_rank, exact=True, pin_memory=pin) if val is not None else None
    return loader, val_loader, len(train), len(val) if val is not None else 0
