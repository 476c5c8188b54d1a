"""Image classification, or any (input, class) data set: cross-entropy over the classes, test
accuracy (with test-time augmentation on the built-in images, whose data stays on the device)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

import distlib
from distlib.distributed.process_group import Context
from distlib.reliability.failures import shared_errors
from distlib.runner.config import Config, ConfigError
from distlib.runner.data.device_loader import DeviceLoader, normalize_stats
from distlib.runner.data.errors import DataError
from distlib.runner.data.images import load_image_set
from distlib.runner.observability.timeline import Timeline
from distlib.runner.tasks.evaluation import evaluate
from distlib.runner.tasks.task import Task, dataset_loaders


class ClassificationTask(Task):
    """(input, class) pairs; cross-entropy over the classes; test accuracy."""

    name = "classification"
    metrics = ("test_acc",)

    def __init__(self, cfg: Config, ctx: Context, per_rank: int, timeline: Timeline):
        super().__init__(cfg, ctx, per_rank, timeline)
        self.images = cfg.data.name == "image_folder"
        if self.images:
            self._build_images()
        else:
            self.loader, self.val_loader, self.train_size, self.eval_size = dataset_loaders(cfg, ctx, per_rank)
            self.timeline.mark("data")
            self.timeline.mark("loader")

    def _build_images(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        d = cfg.data
        kwargs = {"root": d.root, "download": d.download, "cache_dir": d.cache_dir, **d.args}  # args win
        with shared_errors(DataError):  # bad data: every rank stops with the same message
            if ctx.local_rank == 0:  # one decode per node; the others read the cache it leaves
                images = load_image_set(**kwargs)
        with shared_errors(DataError):
            if ctx.local_rank != 0:
                images = load_image_set(**{**kwargs, "download": False})
        self.timeline.mark("data")
        self.timeline.note(data_source=images.source, **{f"data_{k}": round(v, 3) for k, v in images.timings.items()})
        x_train, y_train = images.x_train, images.y_train
        if cfg.data.train_subset:
            x_train, y_train = x_train[: cfg.data.train_subset], y_train[: cfg.data.train_subset]
        if len(y_train) < cfg.train.batch_size:
            raise ConfigError([f"train.batch_size={cfg.train.batch_size} is more than the {len(y_train)} training "
                               "images (data.train_subset or the data set): not one step per epoch"])  # fmt: skip
        self.x_train, self.y_train = x_train, y_train
        mean, std = normalize_stats(x_train)
        device = ctx.device if cfg.data.on_device else torch.device("cpu")
        aug = cfg.data.augment
        self.loader = DeviceLoader(
            x_train, y_train, batch_size=self.per_rank, rank=ctx.rank, world_size=ctx.world_size,
            device=device, mean=mean, std=std, crop_pad=aug.crop_pad, flip=aug.flip,
            cutout_size=aug.cutout, seed=cfg.train.seed, channels_last=cfg.model.channels_last,
        )  # fmt: skip
        self.x_test, self.y_test = images.x_test.to(device), images.y_test.to(device)
        self.train_size, self.eval_size = len(y_train), len(self.y_test)
        self.timeline.mark("loader")

    def model_inputs(self) -> dict[str, Any]:
        return {"num_classes": self.cfg.model.num_classes, "width": self.cfg.model.width}

    def warm_up_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        n, device = self.per_rank, self.ctx.device
        if self.images:
            return self.loader.prepare(self.x_train[:n].to(device)), self.y_train[:n].to(device)
        x, y = next(iter(self.loader.loader))
        return x.to(device), y.to(device)

    def evaluate(self, model: nn.Module, autocast: contextlib.AbstractContextManager, final: bool) -> dict[str, Any]:
        t = self.cfg.train
        if self.images:
            acc = evaluate(model, self.x_test, self.y_test, self.loader, self.ctx, autocast, tta=t.tta and final,
                           translate=t.tta_translate)  # fmt: skip
            return {"test_acc": round(acc, 5)}
        if self.val_loader is None:
            return {}
        counts = torch.zeros(2, device=self.ctx.device, dtype=torch.float64)  # correct, seen
        model.eval()
        with torch.no_grad():
            for x, y in self.val_loader:
                x, y = x.to(self.ctx.device), y.to(self.ctx.device)
                with autocast:
                    counts[0] += (model(x).argmax(-1) == y).sum()
                counts[1] += y.numel()
        model.train()
        distlib.all_reduce(counts)
        return {"test_acc": round(counts[0].item() / max(1.0, counts[1].item()), 5)}

    def rates(self, samples_per_s: float, model: nn.Module, trained_frac: float = 1.0) -> dict[str, Any]:
        return {"images_per_s": round(samples_per_s, 1)}
