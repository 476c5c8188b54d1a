"""One run of a recipe, start to exit code: the config, the memory plan, the process group, the trainer,
and the teardown whatever happened. The command around it is ``distlib.runner.cli``."""

from __future__ import annotations

import argparse

import distlib
from distlib.checkpoint.disk import is_disk_full
from distlib.reliability import stop
from distlib.runner.config import load_config
from distlib.runner.observability.throughput import gpus_per_process
from distlib.runner.observability.timeline import Timeline
from distlib.runner.training.memory_plan import MemoryRefused, check_before_launch
from distlib.runner.training.outcome import exit_code
from distlib.runner.training.trainer import Trainer

USAGE = """Train a recipe: ``torchrun --nproc-per-node=N -m distlib.runner RECIPE.yaml [a.b=value ...]``
(or ``distlib-train``, ``python -m distlib.runner``, ``python launch.py`` from a checkout).
Exits 0 done, 2 bad input (``error: ...``), 1 a collective failed or a bug, 130/143 stopped by SIGINT/SIGTERM.
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="distlib-train", description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("recipe", help="YAML recipe (only what differs from the defaults)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.epochs=5")
    return p.parse_args(argv)


def main(argv: list[str], timeline: Timeline | None = None) -> int:
    """Run the recipe ``argv`` names and return its exit code (see ``USAGE``); every failure that is not
    a bug is one ``error:`` line, and the process group is torn down whatever happened."""
    timeline = timeline or Timeline()  # it starts at the process start (the OS's): the imports count
    timeline.mark("imports")
    args = parse_args(argv)
    # SIGTERM/SIGINT: until training starts the first one interrupts (nothing to save yet), then the
    # trainer's StopSignal stops every rank at one step with a checkpoint; repeats are ignored throughout
    stop.catch(interrupt=True)
    cfg = trainer = failure = None
    try:
        cfg = load_config(args.recipe, args.overrides, launch=True)
        timeline.mark("config")
        plan = check_before_launch(cfg)  # before anything is allocated: a step that cannot fit the GPU stops here
        timeline.mark("memory_plan")
        gpus = gpus_per_process(cfg.dist.mode)
        ctx = distlib.init(cfg.dist.backend, cfg.dist.timeout_s, gpus_per_process=gpus)
        trainer = Trainer(cfg, ctx, timeline, memory_plan=plan)
        trainer.build()
        code = trainer.fit()
    except BaseException as e:
        # from here a signal is only recorded (said below by the exit code), never raised into the way out
        stop.catch(interrupt=False)
        # before the teardown (may exit); cfg None: the recipe is wrong, the same on every rank (as a
        # refused memory plan: every rank computed the same)
        before_start = cfg is None or isinstance(e, MemoryRefused)
        failure, code = e, exit_code(e, cfg.dist.timeout_s if cfg else 0.0, before_start=before_start)
        if code is None:
            raise
    finally:
        late = _teardown(trainer, failure)
        signum = stop.received()
        stop.release()
    if late is not None:  # the teardown's last writes (summary.json) found the disk full: said as any other
        late_code = exit_code(late, cfg.dist.timeout_s if cfg else 0.0)
        code = late_code if failure is None else code
    if code == 0 and signum:  # a stop signal during the teardown, once the run had ended: said by its code
        code = 128 + signum
    return code


def _teardown(trainer: Trainer | None, failure: BaseException | None) -> BaseException | None:
    """The trainer's teardown (or the process group's, when there is no trainer). Returns its error when
    it is a full disk (its last writes: summary.json, the trackers' files), for ``main`` to say in one
    line; any other error is raised."""
    try:
        if trainer is not None:
            trainer.close(failure)
        else:
            distlib.shutdown(barrier=False)
    except Exception as e:
        if not is_disk_full(e):
            raise
        return e
    return None
