"""Train a recipe: ``torchrun --nproc-per-node=N launch.py RECIPE.yaml [a.b=value ...]`` (or ``python launch.py``).
Exits 0 done, 2 bad input (``error: ...``), 1 a collective failed or a bug, 130/143 stopped by SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import sys

import torch

import distlib
from distlib.errors import DistlibError
from distlib.failures import describe
from distlib.process_group import context
from distlib.runner.config import load_config
from distlib.runner.trainer import Trainer


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="YAML recipe (only what differs from the defaults)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.epochs=5")
    return p.parse_args(argv)


def exit_code(e: BaseException, timeout_s: float) -> int | None:
    """Say in one line why the run ends and return its exit code; None for a bug (re-raise it)."""
    if isinstance(e, DistlibError):  # the input, environment, data or a checkpoint
        message, code = str(e), 2
    elif isinstance(e, KeyboardInterrupt):  # a second Ctrl-C, or one before training started
        message, code = "interrupted", 130
    elif (message := describe(e, rank=getattr(context(), "rank", 0), timeout_s=timeout_s)) is not None:
        code = 1  # a collective timed out or lost a peer
    else:  # a bug: its traceback says more than one line could
        return None
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cfg = trainer = failure = None
    try:
        cfg = load_config(args.recipe, args.overrides)
        gpus = max(1, torch.cuda.device_count()) if cfg.dist.mode == "fallback" else 1
        trainer = Trainer(cfg, distlib.init(cfg.dist.backend, cfg.dist.timeout_s, gpus_per_process=gpus))
        trainer.build()
        return trainer.fit()
    except BaseException as e:
        failure, code = e, exit_code(e, cfg.dist.timeout_s if cfg else 0.0)  # before the teardown (may exit)
        if code is None:
            raise
        return code
    finally:
        trainer.close(failure) if trainer is not None else distlib.shutdown(barrier=False)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
