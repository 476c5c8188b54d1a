"""Train a recipe: ``torchrun --nproc-per-node=N launch.py RECIPE.yaml [a.b=value ...]``
(or ``python launch.py ...`` for one process).

config -> init -> build -> train -> teardown.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import distlib
from distlib.checkpoint import Checkpointer, CheckpointError, fingerprint
from distlib.comm_fallback import Replicas, node_devices
from distlib.cuda_graph import build_train_step
from distlib.failures import abort, describe, shared_errors
from distlib.runner.config import ConfigError, dump_yaml, load_config
from distlib.runner.data import DataError, load_image_set
from distlib.runner.device_loader import DeviceLoader, eval_shards, normalize_stats, shift
from distlib.runner.environment import environment_json
from distlib.runner.models import build_model, count_params, param_groups
from distlib.runner.plots import CurvePlot
from distlib.runner.profiling import StepProfiler
from distlib.runner.progress import TrainingProgress
from distlib.runner.run_dir import RunDir
from distlib.runner.schedule import warmup_linear
from distlib.runner.timeline import Timeline
from distlib.runner.warmup import warm_up
from distlib.stop import StopSignal
from distlib.watchdog import Watchdog


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="YAML recipe (only what differs from the defaults)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.epochs=5")
    return p.parse_args(argv)


def resume_settings(cfg) -> dict:
    """The settings a checkpoint is valid for: model, optimizer and schedule, data order and augmentation."""
    # may change on a resume: they do not change what the weights are
    free = {"train.eval_every", "train.tta", "train.tta_translate", "train.cuda_graph", "train.prewarm_steps"}
    flat = {f"{sec}.{k}": v for sec in ("model", "train") for k, v in dataclasses.asdict(getattr(cfg, sec)).items()}
    flat |= {f"data.augment.{k}": v for k, v in dataclasses.asdict(cfg.data.augment).items()}
    flat["data.train_subset"] = cfg.data.train_subset
    return {k: v for k, v in flat.items() if k not in free}


@torch.no_grad()
def evaluate(model, x_test, y_test, loader, ctx, autocast, tta: bool, translate: int = 0) -> float:
    """Exact test accuracy: each test sample is counted once, whatever the world size.

    ``tta``: average the logits of each image and its mirror image; ``translate`` > 0 adds
    the views shifted by that many pixels up-left and down-right (and their mirrors).
    """
    model.eval()
    correct = torch.zeros((), device=ctx.device, dtype=torch.float64)
    for xb, yb in eval_shards(x_test, y_test, ctx.rank, ctx.world_size, batch_size=1000):
        x = loader.prepare(xb)
        views = [x]
        if tta and translate:
            views += [shift(x, translate), shift(x, -translate)]
        with autocast:
            logits = sum(model(v).float() for v in views)
            if tta:
                logits += sum(model(v.flip(3)).float() for v in views)
        correct += (logits.argmax(1) == yb).sum()
    distlib.all_reduce(correct)
    model.train()
    return correct.item() / y_test.numel()


def main(argv: list[str], timeline: Timeline | None = None) -> int:
    timeline = timeline or Timeline()
    timeline.mark("imports")  # interpreter start and imports, from the process start
    args = parse_args(argv)
    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        gpus = max(1, torch.cuda.device_count()) if cfg.dist.mode == "fallback" else 1
        ctx = distlib.init(cfg.dist.backend, cfg.dist.timeout_s, gpus_per_process=gpus)
    except distlib.EnvError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    timeline.mark("init")  # config and process group (NCCL: CUDA context and communicator)
    log = distlib.get_logger()
    progress = TrainingProgress(cfg.run.progress, enabled=ctx.is_main)  # rank 0 only
    pc = cfg.profile
    prof = StepProfiler(
        os.path.join(cfg.run.out_dir, "profile"), ctx.rank, ctx.device,
        enabled=pc.enabled, wait=pc.wait, warmup=pc.warmup, active=pc.active,
    )  # fmt: skip
    # a rank that stops running (SIGSTOP, frozen host) is killed soon after its peers time out
    watchdog = Watchdog(cfg.dist.timeout_s, ctx.rank) if ctx.world_size > 1 else None
    stop = None
    finished_rows = None  # metrics.jsonl once training completed: the summary is printed after the teardown
    try:
        # ---- build -------------------------------------------------------------------
        if cfg.train.batch_size % (ctx.world_size * cfg.train.grad_accum):
            raise ValueError(
                f"train.batch_size={cfg.train.batch_size} must divide evenly over "
                f"{ctx.world_size} ranks x train.grad_accum={cfg.train.grad_accum}"
            )
        per_rank = cfg.train.batch_size // ctx.world_size
        if ctx.device.type == "cuda":
            torch.backends.cudnn.benchmark = True
        with shared_errors(DataError):  # bad data: every rank stops with the same message
            if ctx.local_rank == 0:  # one decode per node; the others read the cache it leaves
                images = load_image_set(
                    cfg.data.root, download=cfg.data.download, cache_dir=cfg.data.cache_dir, decode=cfg.data.decode
                )
        with shared_errors(DataError):
            if ctx.local_rank != 0:
                images = load_image_set(cfg.data.root, download=False, cache_dir=cfg.data.cache_dir)
        timeline.mark("data")
        timeline.note(data_source=images.source)
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

        timeline.mark("loader")
        torch.manual_seed(cfg.train.seed)  # after the data: a first decode draws from the global generator
        model = build_model(cfg.model.name, cfg.model.num_classes, cfg.model.width).to(ctx.device)
        if cfg.model.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if cfg.dist.mode == "fallback":  # one process drives every GPU of its node: distlib/comm_fallback.py
            devices = node_devices(ctx.device, ctx.local_world_size)
            replicas = Replicas(model, devices, bucket_mb=cfg.dist.bucket_mb, cuda_graph=cfg.train.cuda_graph)
            replicas.check_batch(per_rank, cfg.train.grad_accum)
            loss_fn = functools.partial(F.cross_entropy, label_smoothing=cfg.train.label_smoothing)
        else:
            sync = distlib.GradSync(
                model, bucket_mb=cfg.dist.bucket_mb, compress=cfg.dist.compress, comm_groups=cfg.dist.comm_groups
            )
        opt = torch.optim.SGD(
            param_groups(model, cfg.train.weight_decay), lr=cfg.train.lr,
            momentum=cfg.train.momentum, nesterov=cfg.train.nesterov,
            fused=True if cfg.train.cuda_graph and ctx.device.type == "cuda" else None,  # graphs need fused
        )  # fmt: skip
        # weight averaging: evaluate an EMA of the weights (and BN buffers) when train.ema > 0
        ema = (
            AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(cfg.train.ema), use_buffers=True)
            if cfg.train.ema > 0
            else None
        )
        sched = warmup_linear(opt, cfg.train.epochs * len(loader), cfg.train.warmup_frac)
        use_bf16 = cfg.train.precision == "bf16" and ctx.device.type == "cuda"
        autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=use_bf16)

        def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with autocast:
                return F.cross_entropy(model(x).float(), y, label_smoothing=cfg.train.label_smoothing)

        # train.cuda_graph: the whole step replayed as one CUDA graph (None: eager, with a warning why)
        graph_step = None
        if cfg.dist.mode != "fallback":  # (the fallback mode captures its own per-GPU graphs)
            graph_step = build_train_step(
                cfg.train.cuda_graph, model, opt, loss_of, sync, grad_accum=cfg.train.grad_accum
            )
        timeline.mark("model")  # model, gradient sync, optimizer, graph set-up
        run = RunDir(cfg.run.out_dir, ctx.is_main)
        run.write_text("config.yaml", dump_yaml(cfg))
        run.write_text("environment.json", environment_json(ctx))  # a collective: every rank calls it
        log.info(
            "%s: %d params, %d train / %d test images, global batch %d over %d rank(s), %d steps/epoch",
            cfg.model.name, count_params(model), len(y_train), len(y_test), cfg.train.batch_size,
            ctx.world_size, len(loader),
        )  # fmt: skip

        timeline.mark("run_dir")  # config.yaml, environment.json
        micro = per_rank // cfg.train.grad_accum

        def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            """One optimizer step on this rank's batch; returns its mean loss (not synced)."""
            if cfg.dist.mode == "fallback":  # split over the node's GPUs; root gets the averaged grads
                amp = torch.bfloat16 if use_bf16 else None
                loss = replicas.train_step(x, y, loss_fn, autocast_dtype=amp, grad_accum=cfg.train.grad_accum)
            elif graph_step is not None:  # forward, backward, all_reduce and SGD: one graph replay
                return graph_step(x, y)
            else:
                loss = torch.zeros((), device=ctx.device)
                for k in range(cfg.train.grad_accum):
                    last = k == cfg.train.grad_accum - 1
                    with contextlib.nullcontext() if last else sync.no_sync():
                        micro_loss = loss_of(x[k * micro : (k + 1) * micro], y[k * micro : (k + 1) * micro])
                        (micro_loss / cfg.train.grad_accum).backward()
                        sync.wait()
                    loss += micro_loss.detach() / cfg.train.grad_accum
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        if ctx.device.type == "cuda" and cfg.dist.mode != "fallback":
            # cuDNN autotuning, lazy set-up and graph capture happen here, outside the training
            # clock; the weights and optimizer state are then put back as they were
            xw, yw = loader.prepare(x_train[:per_rank].to(ctx.device)), y_train[:per_rank].to(ctx.device)
            warm_up(lambda: train_step(xw, yw), [model], opt, steps=cfg.train.prewarm_steps)
            evaluate(model, x_test, y_test, loader, ctx, autocast, cfg.train.tta, cfg.train.tta_translate)
            torch.cuda.synchronize()
        timeline.mark("warmup")  # cuDNN autotuning, graph capture, first evaluation

        # ---- resume from the newest checkpoint in out_dir (a restart under torchrun --max-restarts);
        # after the warm-up, which resets the optimizer state: the state is copied into its tensors
        ckpt = Checkpointer(os.path.join(run.path, "checkpoints"), keep=cfg.run.keep_checkpoints, is_main=ctx.is_main)
        state = {"model": model, "optimizer": opt, "scheduler": sched, **({"ema": ema} if ema is not None else {})}
        fprint = fingerprint(model, steps_per_epoch=len(loader), **resume_settings(cfg))
        resumed = ckpt.resume(state, fingerprint=fprint, enabled=cfg.run.resume, epochs=cfg.train.epochs)
        loader.set_epoch(resumed.epoch)
        run.start_metrics(resumed.epoch)
        curves = CurvePlot(
            os.path.join(run.path, "curves.png"), run.read_metrics(), title=cfg.run.name, enabled=ctx.is_main
        )

        # ---- train -------------------------------------------------------------------
        train_s = resumed.extra.get("train_s", 0.0)
        t_start = time.perf_counter() - resumed.extra.get("elapsed_s", 0.0)
        stop = StopSignal(timeout_s=cfg.dist.timeout_s)  # SIGTERM/SIGINT: every rank stops at one step boundary

        def save_checkpoint(epoch: int, step: int, loss_sum=None, epoch_s: float = 0.0) -> None:  # a collective
            extra = {"train_s": train_s, "elapsed_s": time.perf_counter() - t_start, "epoch_s": epoch_s}
            ckpt.save(state, epoch=epoch, step=step, global_step=epoch * len(loader) + step, fingerprint=fprint,
                      extra=extra, rank_extra={} if loss_sum is None else {"loss_sum": loss_sum})  # fmt: skip

        progress.start(epochs=cfg.train.epochs, steps_per_epoch=len(loader), images_per_step=cfg.train.batch_size)
        prof.start()
        timeline.mark("resume")
        timeline.training_started()
        for epoch in range(resumed.epoch + 1, cfg.train.epochs + 1):
            first = resumed.step if epoch == resumed.epoch + 1 else 0  # steps already done in this epoch
            t0 = time.perf_counter() - (resumed.extra.get("epoch_s", 0.0) if first else 0.0)
            loss_sum = resumed.rank_extra.get("loss_sum", torch.zeros(())) if first else torch.zeros(())
            loss_sum = loss_sum.to(ctx.device)
            for step, (x, y) in enumerate(itertools.islice(loader, first, None), first):
                if stop.check():
                    save_checkpoint(epoch - 1, step, loss_sum, epoch_s=time.perf_counter() - t0)
                    if ctx.is_main:
                        log.warning(
                            "stopped by %s at epoch %d step %d; checkpoint saved in %s: run the same command "
                            "to continue", stop.name, epoch, step, ckpt.directory,
                        )  # fmt: skip
                    return stop.exit_code
                loss = train_step(x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True))
                loss_sum += loss
                sched.step()
                if ema is not None:
                    ema.update_parameters(model)
                prof.step()
                progress.step(loss)  # cheap: the loss is read only when the display redraws
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            epoch_s = time.perf_counter() - t0
            train_s += epoch_s
            timeline.add("train", epoch_s)
            last_epoch = epoch == cfg.train.epochs
            acc = float("nan")
            if last_epoch or epoch % cfg.train.eval_every == 0:
                t_eval = time.perf_counter()
                if cfg.dist.mode == "fallback":
                    replicas.sync_buffers()  # BatchNorm statistics averaged over every GPU into the root
                eval_model = ema.module if ema is not None else model
                # each rank's BatchNorm statistics follow its own batches: average them, so that
                # every rank evaluates the same model and the accuracy does not depend on the world size
                distlib.sync_buffers(eval_model)
                acc = evaluate(
                    eval_model, x_test, y_test, loader, ctx, autocast,
                    tta=cfg.train.tta and last_epoch, translate=cfg.train.tta_translate,
                )  # fmt: skip
                eval_s = time.perf_counter() - t_eval
                timeline.add("eval", eval_s)
                if last_epoch:  # airbench's clock: training from the first step through the final evaluation
                    train_s += eval_s
                    timeline.training_finished()
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
            run.log_metrics(row)  # before the checkpoint: a crash in between rewrites the row, never skips it
            if last_epoch or (cfg.run.checkpoint_every and epoch % cfg.run.checkpoint_every == 0):
                save_checkpoint(epoch, 0)
                if last_epoch:
                    timeline.mark("checkpoint")  # metrics row and final checkpoint
            progress.epoch_end(row)
            curves.add(row)
        finished_rows = run.read_metrics()
        curves.write_detached(run.metrics_path)  # curves.png appears shortly after the exit
        stop.close()
        timeline.mark("plot")
        return 0
    except (DataError, ValueError, CheckpointError) as e:
        log.error("%s", e)
        distlib.shutdown(barrier=False)  # a peer that did not fail the same way would never arrive
        return 2
    except RuntimeError as e:  # a collective timed out or lost a peer: say so, and leave without the barrier
        message = describe(e, rank=ctx.rank, timeout_s=cfg.dist.timeout_s)
        if message is None:
            raise
        log.error("%s", message)
        abort()
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C, or one before training started
        log.warning("interrupted")
        abort()
        return 130
    finally:
        prof.close()
        progress.close()
        if stop is not None:
            stop.restore_handlers()
        if watchdog is not None:
            watchdog.close()
        distlib.shutdown()
        if finished_rows is not None:
            timeline.mark("shutdown")
            summary = timeline.finish()  # the last stamp the process can make; interpreter exit follows
            if ctx.is_main:
                timeline.write(os.path.join(run.path, "summary.json"))
            progress.finish(finished_rows, summary)


def fast_exit(code: int) -> None:
    """Exit without the interpreter's finalization, which takes seconds once torch is imported
    (module teardown, not work of ours). Only after a clean return of ``main``: the process
    group is destroyed, every file we wrote is closed, the device idle; output is flushed here."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    fast_exit(main(sys.argv[1:]))
