"""Train a recipe: ``torchrun --nproc-per-node=N launch.py RECIPE.yaml [a.b=value ...]``
(or ``python launch.py ...`` for one process).

config -> init -> build -> train -> teardown.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch
import torch.nn.functional as F

import distlib
from distlib.config import ConfigError, dump_yaml, load_config
from distlib.data import DataError, load_image_set
from distlib.device_loader import DeviceLoader, eval_shards, normalize_stats
from distlib.models import build_model, count_params, param_groups
from distlib.run_dir import RunDir
from distlib.schedule import warmup_linear


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="YAML recipe (only what differs from the defaults)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.epochs=5")
    return p.parse_args(argv)


@torch.no_grad()
def evaluate(model, x_test, y_test, loader, ctx, autocast, tta: bool) -> float:
    """Exact test accuracy: each test sample is counted once, whatever the world size."""
    model.eval()
    correct = torch.zeros((), device=ctx.device, dtype=torch.float64)
    for xb, yb in eval_shards(x_test, y_test, ctx.rank, ctx.world_size, batch_size=1000):
        x = loader.prepare(xb)
        with autocast:
            logits = model(x).float()
            if tta:
                logits += model(x.flip(3)).float()
        correct += (logits.argmax(1) == yb).sum()
    distlib.all_reduce(correct)
    model.train()
    return correct.item() / y_test.numel()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        ctx = distlib.init(cfg.dist.backend, cfg.dist.timeout_s)
    except distlib.EnvError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log = distlib.get_logger()
    try:
        # ---- build -------------------------------------------------------------------
        if cfg.train.batch_size % (ctx.world_size * cfg.train.grad_accum):
            raise ValueError(
                f"train.batch_size={cfg.train.batch_size} must divide evenly over "
                f"{ctx.world_size} ranks x train.grad_accum={cfg.train.grad_accum}"
            )
        per_rank = cfg.train.batch_size // ctx.world_size
        torch.manual_seed(cfg.train.seed)
        if ctx.device.type == "cuda":
            torch.backends.cudnn.benchmark = True
        if ctx.local_rank == 0:  # one decode per node; the others read the cache it leaves
            images = load_image_set(cfg.data.root, download=cfg.data.download, cache_dir=cfg.data.cache_dir)
        distlib.barrier()
        if ctx.local_rank != 0:
            images = load_image_set(cfg.data.root, download=False, cache_dir=cfg.data.cache_dir)
        x_train, y_train = images.x_train, images.y_train
        if cfg.data.train_subset:
            x_train, y_train = x_train[: cfg.data.train_subset], y_train[: cfg.data.train_subset]
        mean, std = normalize_stats(x_train)
        data_device = ctx.device if cfg.data.on_device else torch.device("cpu")
        aug = cfg.data.augment
        loader = DeviceLoader(
            x_train, y_train, batch_size=per_rank, rank=ctx.rank, world_size=ctx.world_size,
            device=data_device, mean=mean, std=std, crop_pad=aug.crop_pad, flip=aug.flip,
            cutout_size=aug.cutout, seed=cfg.train.seed, channels_last=cfg.model.channels_last,
        )  # fmt: skip
        x_test, y_test = images.x_test.to(data_device), images.y_test.to(data_device)

        model = build_model(cfg.model.name, cfg.model.num_classes, cfg.model.width).to(ctx.device)
        if cfg.model.channels_last:
            model = model.to(memory_format=torch.channels_last)
        sync = distlib.GradSync(model, bucket_mb=cfg.dist.bucket_mb)
        opt = torch.optim.SGD(
            param_groups(model, cfg.train.weight_decay), lr=cfg.train.lr,
            momentum=cfg.train.momentum, nesterov=cfg.train.nesterov,
        )  # fmt: skip
        sched = warmup_linear(opt, cfg.train.epochs * len(loader), cfg.train.warmup_frac)
        use_bf16 = cfg.train.precision == "bf16" and ctx.device.type == "cuda"
        autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=use_bf16)
        run = RunDir(cfg.run.out_dir, ctx.is_main)
        run.write_text("config.yaml", dump_yaml(cfg))
        run.start_metrics(0)
        log.info(
            "%s: %d params, %d train / %d test images, global batch %d over %d rank(s), %d steps/epoch",
            cfg.model.name, count_params(model), len(y_train), len(y_test), cfg.train.batch_size,
            ctx.world_size, len(loader),
        )  # fmt: skip

        # ---- train -------------------------------------------------------------------
        micro = per_rank // cfg.train.grad_accum
        train_s = 0.0
        t_start = time.perf_counter()
        for epoch in range(1, cfg.train.epochs + 1):
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), device=ctx.device)
            for x, y in loader:
                x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                for k in range(cfg.train.grad_accum):
                    last = k == cfg.train.grad_accum - 1
                    with contextlib.nullcontext() if last else sync.no_sync():
                        with autocast:
                            logits = model(x[k * micro : (k + 1) * micro])
                            loss = F.cross_entropy(
                                logits.float(), y[k * micro : (k + 1) * micro],
                                label_smoothing=cfg.train.label_smoothing,
                            )  # fmt: skip
                        (loss / cfg.train.grad_accum).backward()
                        sync.wait()
                    loss_sum += loss.detach() / cfg.train.grad_accum
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            epoch_s = time.perf_counter() - t0
            train_s += epoch_s
            last_epoch = epoch == cfg.train.epochs
            acc = float("nan")
            if last_epoch or epoch % cfg.train.eval_every == 0:
                acc = evaluate(model, x_test, y_test, loader, ctx, autocast, tta=cfg.train.tta and last_epoch)
            train_loss = distlib.all_reduce(loss_sum, op="mean").item() / len(loader)
            row = {
                "epoch": epoch,
                "train_loss": round(train_loss, 5),
                "test_acc": None if acc != acc else round(acc, 5),
                "images_per_s": round(len(loader) * cfg.train.batch_size / epoch_s, 1),
                "epoch_s": round(epoch_s, 3),
                "train_s": round(train_s, 3),
                "elapsed_s": round(time.perf_counter() - t_start, 3),
                "lr": opt.param_groups[0]["lr"],
                "world_size": ctx.world_size,
            }
            run.log_metrics(row)
            log.info(
                "epoch %d/%d loss %.4f acc %s  %.0f img/s  %.1fs",
                epoch, cfg.train.epochs, train_loss, "-" if acc != acc else f"{acc:.4f}",
                row["images_per_s"], row["elapsed_s"],
            )  # fmt: skip
        return 0
    except (DataError, ValueError) as e:
        log.error("%s", e)
        distlib.shutdown(barrier=False)  # a peer that did not fail the same way would never arrive
        return 2
    finally:
        distlib.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
