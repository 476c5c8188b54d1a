"""The recipe runner's training, in stages: build, step, epoch, evaluate, checkpoint, close.

    trainer = Trainer(cfg, ctx)       # after distlib.init
    try:
        trainer.build()               # data, model, step, optimizer, schedule, EMA, run dir; warm-up; resume
        code = trainer.fit()          # 0, or 128 + the signal's number when SIGTERM/SIGINT stopped it
    finally:
        trainer.close(error)          # the one teardown, for success and every failure

What it trains for (data, loss, evaluation, metrics) is the ``Task``'s business
(runner/tasks/task.py): image classification or causal language modelling, chosen by ``build_task``.
Where the run stands (epochs done, steps into the next, its clocks, this rank's loss sum)
is a ``TrainState``, saved in every checkpoint, so a resumed run continues bit for bit.
How gradients are synced is the ``TrainStep``'s business (runner/training/step.py), the order in which
the model and its step are made build_order.py's, and the checkpoint format the ``RunCheckpoints``'
(runner/training/checkpoints.py): nothing here depends on ``dist.mode``, and ``dist.shard`` only where
a fully sharded model must run its forward passes on every rank (``finish_task``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import distlib
from distlib.checkpoint.state import fingerprint
from distlib.distributed.process_group import Context
from distlib.reliability.failures import abort, describe
from distlib.reliability.stop import StopSignal
from distlib.reliability.watchdog import Watchdog
from distlib.runner.config import Config, ConfigError, dump_yaml
from distlib.runner.models.parameters import count_params, count_trainable
from distlib.runner.observability.environment import bytecode_hint, environment_json
from distlib.runner.observability.metrics import Metrics, build_metrics
from distlib.runner.observability.profiling import StepProfiler
from distlib.runner.observability.progress import TrainingProgress, run_rates
from distlib.runner.observability.run_dir import RunDir
from distlib.runner.observability.throughput import peak_memory_gib
from distlib.runner.observability.timeline import Timeline
from distlib.runner.tasks import Task, build_task
from distlib.runner.tasks.batch import Inputs, to_device
from distlib.runner.training import build_order
from distlib.runner.training.budget import Budget
from distlib.runner.training.checkpoints import build_checkpoints
from distlib.runner.training.compilation import load_compiler
from distlib.runner.training.disk_room import checkpoint_bytes, warn_if_no_room
from distlib.runner.training.memory_plan import MemoryPlan
from distlib.runner.training.optimizer_step import OptimizerSpec, autocast_dtype, optimizer_spec
from distlib.runner.training.out_of_memory import every_mode, out_of_memory
from distlib.runner.training.schedule import WarmupLinear, ema_decay, retarget, warmup_linear
from distlib.runner.training.step import TrainStep, build_step

# may change on a resume: they do not change what the weights are, or (the budget: train.epochs,
# train.max_steps) the resumed run recomputes its schedule over the new total and says so
_RESUME_FREE = {
    "train.eval_every", "train.tta", "train.tta_translate", "train.cuda_graph", "train.prewarm_steps",
    "train.prewarm_eval", "train.cudnn_benchmark", "train.compile", "train.peak_tflops", "train.sample_tokens",
    "train.epochs", "train.max_steps", "train.eval_every_steps",
    "train.activation_checkpointing", "train.compile_backend", "model.block_class",
    "train.fp8_recipe", "train.fp8_layers", "loss.chunks", "loss.chunks_when_needed",
}  # fmt: skip


def resume_settings(cfg: Config) -> dict:
    """The settings a checkpoint is valid for: model, optimizer and schedule, data order and augmentation.
    train.precision=fp8 counts as bf16: its weights and optimizer state are bf16 training's (fp32, the
    float8 casts are made afresh at every step), so either resumes from the other's checkpoint."""
    sections = ("model", "loss", "train")
    flat = {f"{sec}.{k}": v for sec in sections for k, v in dataclasses.asdict(getattr(cfg, sec)).items()}
    flat |= {f"data.augment.{k}": v for k, v in dataclasses.asdict(cfg.data.augment).items()}
    flat |= {"data.train_subset": cfg.data.train_subset, "data.name": cfg.data.name, "data.args": cfg.data.args}
    if flat["train.precision"] == "fp8":
        flat["train.precision"] = "bf16"
    return {k: v for k, v in flat.items() if k not in _RESUME_FREE}


@dataclass
class TrainState:
    """Where the run stands; saved in checkpoints as "train_state".

    The clocks are rank 0's (``state_dict``); ``loss_sum`` is each rank's own
    (``rank_state_dict``: the checkpoint keeps one per rank).
    """

    epoch: int = 0  # epochs completed
    step: int = 0  # steps done in epoch + 1
    train_s: float = 0.0  # the training clock: the steps of every epoch, and the final evaluation
    elapsed_s: float = 0.0  # since the first step, evaluations and checkpoints included
    epoch_s: float = 0.0  # spent in epoch + 1 so far (non-zero only when stopped inside it)
    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(()))  # this rank's, over epoch + 1 so far
    trained_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(()))  # trained targets, every rank's, so far

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "train_s": self.train_s, "elapsed_s": self.elapsed_s,
                "epoch_s": self.epoch_s}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self.train_s, self.elapsed_s, self.epoch_s = state["train_s"], state["elapsed_s"], state["epoch_s"]

    def rank_state_dict(self) -> dict[str, Any]:
        return {"loss_sum": self.loss_sum, "trained_sum": self.trained_sum}

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_sum = state["loss_sum"].to(self.loss_sum.device)
        if "trained_sum" in state:  # a checkpoint written before it was kept: the row's fraction starts again
            self.trained_sum = state["trained_sum"].to(self.loss_sum.device)


class Trainer:
    """Trains ``cfg`` on this rank. ``build``, ``fit`` and the stages they run are collectives:
    every rank must call them, in the same order. ``close`` is the one teardown."""

    def __init__(self, cfg: Config, ctx: Context, timeline: Timeline | None = None,
                 memory_plan: MemoryPlan | None = None):  # fmt: skip
        """``memory_plan``: the plan made at the start (``check_before_launch``), which a step that runs out
        of memory names (runner/training/out_of_memory.py)."""
        self.cfg, self.ctx = cfg, ctx
        self.memory_plan = memory_plan
        self.timeline = timeline or Timeline()
        self.timeline.mark("init")  # the process group (NCCL: CUDA context and communicator)
        self.finished_rows: list[dict[str, Any]] | None = None  # metrics.jsonl once training completed
        self.log = distlib.get_logger()
        if ctx.is_main and (hint := bytecode_hint()):
            self.log.warning(hint)
        # where each step adds its loss, and its trained targets
        self.state = TrainState(loss_sum=torch.zeros((), device=ctx.device),
                                trained_sum=torch.zeros((), device=ctx.device))  # fmt: skip
        self.progress = TrainingProgress(cfg.run.progress, enabled=ctx.is_main)  # rank 0 only
        p = cfg.profile
        self.profiler = StepProfiler(os.path.join(cfg.run.out_dir, "profile"), ctx.rank, ctx.device,
                                     enabled=p.enabled, wait=p.wait, warmup=p.warmup, active=p.active)  # fmt: skip
        self.step_fn: TrainStep | None = None
        self._final_save_t0: float | None = None  # when the final checkpoint's save began
        self._in_step = False  # inside train_step: where running out of memory is "at step N"
        self.task: Task | None = None
        self.metrics: Metrics | None = None  # the sinks of the metrics rows, built at the resume
        self.stop: StopSignal | None = None
        # a rank that stops running (SIGSTOP, frozen host) is killed soon after its peers time out
        self.watchdog = Watchdog(cfg.dist.timeout_s, ctx.rank) if ctx.world_size > 1 else None

    # ---- build ---------------------------------------------------------------------------

    def build(self) -> None:
        """Task (its data), model, training step, optimizer, schedule, EMA and run directory; then
        the warm-up (on a GPU) and the resume from the newest checkpoint in run.out_dir."""
        cfg, ctx, t = self.cfg, self.ctx, self.cfg.train
        if t.batch_size % (ctx.world_size * t.grad_accum):
            raise ConfigError([f"train.batch_size={t.batch_size} must divide evenly over "
                               f"{ctx.world_size} ranks x train.grad_accum={t.grad_accum}"])  # fmt: skip
        self.per_rank = t.batch_size // ctx.world_size
        if ctx.device.type == "cuda":
            torch.backends.cudnn.benchmark = t.cudnn_benchmark
        self.task = build_task(cfg, ctx, self.per_rank, self.timeline)  # its data loaded
        self.loader = self.task.loader
        if load_compiler(cfg):
            self.timeline.mark("compiler")  # inductor's imports, before the model's build
        torch.manual_seed(t.seed)  # after the data: a first decode draws from the global generator
        # the model, then its step: stages 1 to 5 and 6 to 10 of runner/training/build_order.py
        self.model = model = self.build_model()
        # weight averaging: evaluate an EMA of the weights (and BN buffers) when train.ema > 0; the
        # step updates it after the optimizer, inside the CUDA graph when there is one
        self.ema: distlib.EMA | None = None
        self.step_fn = build_step(cfg, ctx, model, self.build_optimizer(model), self.per_rank,
                                  post_step=(lambda: self.ema.update()) if t.ema > 0 else None,
                                  loss_fn=self.task.loss_fn(model))  # fmt: skip
        self.optimizer = self.step_fn.optimizer  # built by the step: sharded with dist.shard=optimizer
        if t.ema > 0:  # the weights the step broadcast, where the optimizer keeps them
            self.ema = distlib.EMA(model, ema_decay(t.ema, 0))
            self.step_fn.modules.append(self.ema.module)  # the warm-up puts the average back too
        self.timeline.mark("model")  # model, optimizer, gradient sync, graph set-up
        self.budget = Budget.of(cfg, len(self.loader))
        self.scheduler = warmup_linear(self.optimizer, self.budget.total_steps, t.warmup_frac, t.schedule,
                                       t.min_lr_frac)  # fmt: skip
        dtype = autocast_dtype(t.precision, ctx.device)  # evaluation runs in the training's precision
        self.autocast = torch.autocast(ctx.device.type, dtype=dtype, enabled=dtype is not None)
        self.run = RunDir(cfg.run.out_dir, ctx.is_main)
        self.run.write_text("config.yaml", dump_yaml(cfg))
        if ctx.is_main and callable(save_files := getattr(model, "save_files", None)):
            save_files(self.run.path)  # what builds the model again (its config): the export needs no more
        self.run.write_text("environment.json", environment_json(ctx))  # a collective: every rank calls it
        self.log.info(
            "%s (%s): %d params (%d trained), %d train / %d evaluation samples, global batch %d over %d rank(s), "
            "%d steps/epoch",
            cfg.model.name, self.task.name, count_params(model), count_trainable(model), self.task.train_size,
            self.task.eval_size,
            t.batch_size, ctx.world_size, len(self.loader),
        )  # fmt: skip
        self.log.info("budget: %s", self.budget.describe())
        self.timeline.mark("run_dir")  # config.yaml, environment.json
        if ctx.device.type == "cuda":
            with self.out_of_memory_said("in the warm-up"):
                self.warm_up()
            self.timeline.mark("warmup_eval")  # the first evaluation (its cuDNN autotuning)
        self.resume()
        # Compiling leaves many Python objects (graphs, guards, generated code): a full pass of the
        # collector over them, due whenever enough new objects piled up (FSDP2 makes many a step),
        # pauses the training step it falls in. Collect once now and keep what survives out of later
        # passes (torchtitan turns automatic collection off for the same reason).
        gc.collect()
        gc.freeze()
        self.timeline.mark("resume")

    def build_model(self) -> torch.nn.Module:
        """The model of model.name with model.args (and what the task provides, when it takes it), on
        this rank's device, under the random stream seeded with train.seed: the one place a model is
        made. Built, its frozen parameters cast, float8's layers, then sharded (dist.shard=full) or laid
        out channels_last, and its pretrained weights loaded: stages 1 to 5 of runner/training/build_order.py,
        where the order of the whole build is written."""
        return build_order.build_model(self.cfg, self.ctx.device, self.task.model_inputs())

    def build_optimizer(self, model: torch.nn.Module) -> OptimizerSpec:
        """train.optimizer over the model's parameters (``optimizer_spec``)."""
        return optimizer_spec(self.cfg.train, model, self.ctx.device, offload=self.cfg.dist.offload)

    def warm_up(self) -> None:
        """cuDNN autotuning, lazy set-up and graph capture, outside the training clock; the
        weights and optimizer state are then put back as they were."""
        x, y = self.task.warm_up_batch()
        self.step_fn.warm_up(x, y, steps=self.cfg.train.prewarm_steps)
        torch.cuda.synchronize()
        self.timeline.mark("warmup")  # training steps: cuDNN autotuning, lazy set-up, graph capture
        if self.cfg.train.prewarm_eval:  # else the first evaluation compiles (its time holds it)
            self.task.warm_up_evaluate(self.model, self.autocast)  # the final evaluation's kernels (tta) too
            torch.cuda.synchronize()

    def resume(self) -> None:
        """Continue from the newest checkpoint in run.out_dir (a restart under torchrun
        --max-restarts); after the warm-up, which resets the optimizer state: the state is
        copied into its tensors."""
        cfg = self.cfg
        self.objects = {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                        **({"ema": self.ema} if self.ema is not None else {}), "train_state": self.state}  # fmt: skip
        if self.step_fn.update.scaler is not None:  # fp16: a resumed run carries on with the same loss scale
            self.objects["scaler"] = self.step_fn.update.scaler
        self.checkpoints = build_checkpoints(
            os.path.join(self.run.path, "checkpoints"), self.objects, shard=cfg.dist.shard,
            fingerprint=fingerprint(self.model, steps_per_epoch=len(self.loader), **resume_settings(cfg)),
            keep=cfg.run.keep_checkpoints, timeout_s=cfg.dist.timeout_s, staging=cfg.run.checkpoint_staging,
        )  # fmt: skip
        self.checkpoints.resume(enabled=cfg.run.resume)  # whether it is complete: the budget's to say
        if self.ctx.is_main and cfg.run.final_checkpoint != "none":
            t = cfg.train
            need = checkpoint_bytes(self.model, t.optimizer, momentum=t.momentum, ema=self.ema is not None,
                                    weights_only=cfg.run.final_checkpoint == "weights" and not (
                                        cfg.run.checkpoint_every or cfg.run.checkpoint_every_steps))  # fmt: skip
            warn_if_no_room(self.run.path, need)
        self.step_fn.weights_changed()  # loaded in place: what the step derives from them is computed again
        self.resume_budget()
        self.loader.set_epoch(self.state.epoch)
        self.run.start_metrics(self.state.epoch, step=self.global_step)
        # rows from here on are new (metrics.jsonl was trimmed to the checkpoint's step)
        self.metrics = build_metrics(cfg, self.run, self.progress, is_main=self.ctx.is_main,
                                     first_step=self.global_step + 1)  # fmt: skip

    def resume_budget(self) -> None:
        """After a resume: the schedule of this run's budget in place of the checkpoint's (a resume may
        change train.epochs and train.max_steps), and whether anything is left to train."""
        t, step = self.cfg.train, self.global_step
        if retarget(self.scheduler, WarmupLinear(self.budget.total_steps, t.warmup_frac, t.schedule, t.min_lr_frac)):
            if self.ctx.is_main:
                self.log.warning("the budget changed since the checkpoint: now %s; the learning-rate schedule "
                                 "is recomputed over it, continuing from step %d", self.budget.describe(),
                                 step)  # fmt: skip
        if step and self.budget.done(step) and self.ctx.is_main:
            self.log.warning("the checkpoint is at step %d, the end of the budget (%s): this run is complete, "
                             "nothing to do (raise train.epochs or train.max_steps to train on, or set "
                             "run.resume=false or another run.out_dir to train again)", step,
                             self.budget.describe())  # fmt: skip

    @property
    def global_step(self) -> int:
        """Optimizer steps done since the run's start, over every epoch (resumes included)."""
        return self.state.epoch * len(self.loader) + self.state.step

    # ---- train ---------------------------------------------------------------------------

    def fit(self) -> int:
        """Train from ``state`` to the end of the budget (runner/training/budget.py). Returns 0, or the exit code
        of the signal (SIGTERM/SIGINT) that stopped every rank at one step, after saving a checkpoint there."""
        s, t = self.state, self.cfg.train
        self._t_start = time.perf_counter() - s.elapsed_s
        self.stop = StopSignal(timeout_s=self.cfg.dist.timeout_s)
        by_epochs = self.budget.total_steps == t.epochs * len(self.loader)  # else no "/N" after the epoch shown
        self.progress.start(epochs=t.epochs if by_epochs else 0, steps_per_epoch=len(self.loader),
                            images_per_step=t.batch_size * self.task.per_sample, start_epoch=s.epoch + 1,
                            start_step=s.step, unit=self.task.unit,
                            total_steps=self.budget.total_steps)  # fmt: skip
        self.profiler.start()
        self.timeline.training_started()
        self.task.train_metrics(collect=False)  # what the warm-up's steps added
        with self.out_of_memory_said(None):
            while not self.budget.done(self.global_step):
                if not self.train_epoch():
                    return self.stop.exit_code
            self.finish_task()
        self.timeline.mark("sample")  # what the task shows at the end: a language model's generated sample
        self.checkpoints.finish()  # the final checkpoint, written meanwhile: committed after the last row
        self.timeline.mark("checkpoint")  # what is left of its write after the evaluation and the sample
        if self._final_save_t0 is not None:
            # and its phases (the copies to the host, the writes, the fsync, the commit: checkpoints.py)
            self.timeline.note(final_checkpoint_s=round(time.perf_counter() - self._final_save_t0, 3),
                               final_checkpoint_phases=self.checkpoints.phases)  # fmt: skip
        self.finished_rows = self.run.read_metrics()  # the summary is printed after the teardown
        self.metrics.training_done()  # curves.png appears shortly after the exit; trackers' runs finished
        self.timeline.mark("plot")
        if self.stop.agree():  # a stop signal after the last check: the run is done, its end saved
            if self.ctx.is_main:
                self.log.warning("%s received during the run's last stage: the run is complete and its final "
                                 "checkpoint saved in %s", self.stop.name, self.checkpoints.directory)  # fmt: skip
            return self.stop.exit_code
        return 0

    @contextlib.contextmanager
    def out_of_memory_said(self, where: str | None) -> Iterator[None]:
        """Out of GPU memory inside: ``OutOfMemory``, one line saying ``where`` (None: "at step N" when in
        a step, else after the last one: an evaluation, a checkpoint's staging), with what the plan said
        and what would fit, in place of torch's traceback."""
        try:
            yield
        except torch.OutOfMemoryError as e:
            if where is None:
                where = (f"at step {self.global_step + 1}" if self._in_step else
                         f"after step {self.global_step} (an evaluation, a checkpoint's staging)")  # fmt: skip
            plan = every_mode(self.cfg, self.memory_plan) if self.memory_plan is not None else None
            raise out_of_memory(e, where=where, rank=self.ctx.rank, device=self.ctx.device, plan=plan) from None

    def train_step(self, x: Inputs, y: torch.Tensor) -> None:
        """One optimizer step (the EMA's update included), the schedule. ``x``: a tensor, or a mapping
        of tensors (the model called with ``model(**x)``)."""
        device = self.ctx.device
        if self.ema is not None:
            self.ema.set_decay(ema_decay(self.cfg.train.ema, self.global_step))
        self._in_step = True
        loss = self.step_fn(to_device(x, device), y.to(device, non_blocking=True))
        self._in_step = False
        self.state.loss_sum += loss
        self.state.trained_sum += self.step_fn.trained
        self.state.step += 1
        self.scheduler.step()
        self.profiler.step()
        self.progress.step(loss)  # cheap: the loss is read only when the display redraws

    def train_epoch(self) -> bool:
        """Epoch ``state.epoch + 1`` from step ``state.step`` on, to its end or the budget's, with the
        evaluations, metrics rows and checkpoints the budget asks for on the way (``end_of_step``).
        False when a signal stopped it (a checkpoint of that step is saved)."""
        s, device, budget = self.state, self.ctx.device, self.budget
        epoch = s.epoch + 1
        if s.step == 0:
            s.epoch_s, s.loss_sum, s.trained_sum = 0.0, torch.zeros((), device=device), torch.zeros((), device=device)
        last = min(len(self.loader), budget.total_steps - s.epoch * len(self.loader))  # the budget may end it early
        t0 = time.perf_counter() - s.epoch_s
        # this epoch's order, however the last pass ended: cut short by the budget's islice, an
        # EpochLoader's pass never completes, so it would not advance its epoch itself
        self.loader.set_epoch(s.epoch)
        # a loader that can start mid-epoch does so without reading the steps before (a token file)
        start = getattr(self.loader, "iter_from", None)
        batches = start(s.step) if start else itertools.islice(self.loader, s.step, None)
        for x, y in itertools.islice(batches, last - s.step):
            if self.stop.check():
                s.epoch_s = time.perf_counter() - t0
                self.save_checkpoint()
                if self.ctx.is_main:
                    self.log.warning("stopped by %s at epoch %d step %d; checkpoint saved in %s: run the same "
                                     "command to continue", self.stop.name, epoch, s.step,
                                     self.checkpoints.directory)  # fmt: skip
                return False
            self.train_step(x, y)
            self.checkpoints.commit_if_written()  # a background save, once every rank has written it
            if budget.stops_at(self.global_step):
                self.stop_clock(t0)
                self.end_of_step()
                t0 = time.perf_counter() - s.epoch_s  # evaluations and checkpoints are off the epoch's clock
        return True

    def stop_clock(self, t0: float) -> None:
        """The epoch's clock (started at ``t0``) up to the last step, which has finished on the device."""
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize()
        epoch_s = time.perf_counter() - t0
        self.timeline.add("train", epoch_s - self.state.epoch_s)  # this process's share
        self.state.epoch_s = epoch_s

    def end_of_step(self) -> None:
        """What the budget asks for after this step: the evaluation (the final one after the budget's
        last step), the metrics row (at an evaluation and at an epoch's end), the checkpoint. The final
        checkpoint is written in the background while the final evaluation and the task's sample run
        (they change nothing it saves) and committed by ``fit`` after them: the run's last row is
        logged before its checkpoint exists (a crash in between rewrites the row, never skips it)."""
        s, t, budget = self.state, self.cfg.train, self.budget
        step, steps, epoch_s = self.global_step, s.step, s.epoch_s  # global; this epoch's
        epoch, final, ends_epoch = s.epoch + 1, budget.done(step), s.step == len(self.loader)
        evaluates = budget.evaluates(step)
        logs = ends_epoch or evaluates
        train_loss = distlib.all_reduce(s.loss_sum.clone(), op="mean").item() / steps if logs else 0.0
        trained_frac = s.trained_sum.item() / (steps * t.batch_size * self.task.per_sample) if logs else 1.0
        train_metrics = self.task.train_metrics() if logs else {}
        if ends_epoch:
            s.epoch, s.step, s.train_s, s.epoch_s = epoch, 0, s.train_s + s.epoch_s, 0.0
        final_save = final and budget.checkpoints(step) and self.cfg.run.final_checkpoint != "none"
        if final_save:
            self.sync_buffers()  # what the final evaluation sees is what the checkpoint holds
            if self.cfg.run.final_checkpoint == "weights":
                self.save_weights()
            else:
                self.save_checkpoint(final=True)
        results = self.evaluate(final=final, synced=final_save) if evaluates else dict.fromkeys(self.task.metrics)
        row = None
        if logs:
            samples_per_s = steps * t.batch_size / epoch_s
            row = {
                "epoch": epoch,  # the epoch this row is in: its end, or ``epoch_step`` steps into it
                **({} if ends_epoch else {"epoch_step": steps}),
                "step": step,
                **self.task.seen(step * t.batch_size),
                "train_loss": round(train_loss, 5),  # the mean over this epoch's steps so far
                **train_metrics,  # a mixture of experts' aux_loss: the mean since the last row
                **results,
                **self.task.rates(samples_per_s, self.model, trained_frac=trained_frac),
                "samples_per_s": round(samples_per_s, 1),
                "epoch_s": round(epoch_s, 3),
                "train_s": round(s.train_s + s.epoch_s, 3),  # the final evaluation's included
                "elapsed_s": round(time.perf_counter() - self._t_start, 3),
                "lr": self.optimizer.param_groups[0]["lr"],
                "world_size": self.ctx.world_size,
            }
            if (memory := peak_memory_gib(self.ctx.device)) is not None:  # a collective, on a GPU
                row["peak_mem_gib"] = memory
            self.metrics.log(row, step)  # before the checkpoint: a crash in between rewrites the row, never skips it
        if budget.checkpoints(step) and not final:
            self.save_checkpoint(background=True)
        if final:
            self.timeline.mark("metrics")  # the last metrics row, shown and logged

    def sync_buffers(self) -> None:
        """Every rank's buffers averaged (a collective): each rank's BatchNorm statistics follow its own
        batches, so that every rank evaluates, and a checkpoint holds, the same model whatever the world size."""
        self.step_fn.sync_buffers()
        distlib.sync_buffers(self.ema.module if self.ema is not None else self.model)

    def evaluate(self, final: bool = False, synced: bool = False) -> dict[str, Any]:
        """The task's metrics (test accuracy; validation loss and perplexity) of the evaluated
        model (the EMA when there is one), with every rank's buffers averaged first (unless
        ``synced``: just done). ``final``: with test-time augmentation, on the training clock."""
        t_eval = time.perf_counter()
        if not synced:
            self.sync_buffers()
        model = self.ema.module if self.ema is not None else self.model
        results = self.task.evaluate(model, self.autocast, final=final)
        eval_s = time.perf_counter() - t_eval
        self.timeline.add("eval", eval_s)
        if final:  # airbench's clock: training from the first step through the final evaluation
            self.state.train_s += eval_s
            self.timeline.training_finished()
        return results

    def finish_task(self) -> None:
        """What the task shows once training is done (a generated sample), on the main rank: in
        the log, summary.json and TensorBoard."""
        if not self.ctx.is_main and self.cfg.dist.shard != "full":
            return
        model = self.ema.module if self.ema is not None else self.model
        extra = self.task.finish(model, self.autocast)  # sharded: every rank runs the forward passes
        if not self.ctx.is_main:
            return
        if extra.get("sample"):
            self.log.info("sample from the final model:\n%s", extra["sample"])
            self.metrics.log_text("sample", extra["sample"], step=self.global_step)
        rows = self.run.read_metrics()
        last = rows[-1] if rows else {}
        final = {k: v for k, v in last.items() if k in self.task.metrics}
        # the figures the summary on screen shows: the rates over the run, the last row's MFU and memory
        figures = {**run_rates(rows), **{k: last[k] for k in ("mfu", "peak_mem_gib") if last.get(k) is not None},
                   **self.task.model_figures(model)}  # fmt: skip
        self.timeline.note(task=self.task.name, **{f"final_{k}": v for k, v in final.items()}, **figures, **extra)

    def save_checkpoint(self, background: bool = False, final: bool = False) -> None:
        """A checkpoint of the models, optimizer, schedule and ``state`` (a collective). ``background``:
        asynchronous (runner/training/checkpoints.py), training continues while it is written. ``final``: the
        run's last, written in the background from the tensors themselves (no step follows it to change
        them, and no copy is made), committed by ``fit``."""
        s = self.state
        s.elapsed_s = time.perf_counter() - self._t_start
        if final:
            self._final_save_t0 = time.perf_counter()
        self.checkpoints.save(epoch=s.epoch, step=s.step, global_step=self.global_step,
                              async_=background or final, in_place=final)  # fmt: skip
        if background and self.cfg.train.cuda_graph:  # the captured optimizer step runs no step pre-hook
            self.checkpoints.wait_staged()

    def save_weights(self) -> None:
        """The model alone (and its weight average), into ``<run>/weights/step<global step>/``
        (run.final_checkpoint=weights; ``RunCheckpoints.save_weights``). A collective."""
        self.checkpoints.save_weights(os.path.join(self.run.path, "weights"), global_step=self.global_step)

    # ---- teardown ------------------------------------------------------------------------

    def close(self, error: BaseException | None = None) -> None:
        """Tear down whatever was built, after success or any failure (``error``). A collective
        failed or Ctrl-C: leave the process group at once (``abort``: the peers may be gone).
        Any other error: no final barrier (a peer that did not fail alike would never arrive)."""
        # what build() froze can be collected again: shutdown's collection must reach the cycles that
        # still hold a process group (FSDP2's modules), and a process may train again
        gc.unfreeze()
        if error is not None:
            if isinstance(error, KeyboardInterrupt) or describe(error, rank=self.ctx.rank,
                                                                timeout_s=self.cfg.dist.timeout_s):  # fmt: skip
                abort()
            else:
                distlib.shutdown(barrier=False)
        self.profiler.close()
        self.progress.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.stop is not None:  # its handlers stay until the process ends: launch.py's (stop.catch)
            self.stop.close(wait=error is None)
        if self.step_fn is not None:
            self.step_fn.close()
        if self.watchdog is not None:
            self.watchdog.close()
        # the final barrier after success; after a failure, nothing left to do: no barrier, and a save in
        # flight is not committed (a commit needs every rank), with a warning, not an error
        distlib.shutdown(barrier=error is None)
        if self.finished_rows is not None:
            self.timeline.mark("shutdown")
            summary = self.timeline.finish()  # the last stamp the process can make; interpreter exit follows
            if self.ctx.is_main:
                self.timeline.write(os.path.join(self.run.path, "summary.json"))
            self.progress.finish(self.finished_rows, summary)
