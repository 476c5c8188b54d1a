"""The memory plan at launch, made once: kept between runs and shared by the ranks of a machine.

A plan's verdict depends on the recipe's settings that shape the step, the world size, the GPU
(its name and memory) and the code (torch, transformers, torchao, distlib's sources, the model's
module), and on nothing a run changes: a resumed run or a rerun of the same recipe would make the
same plan again, seconds of start-up each time on every rank. So the plan is written under a key
of all of these (``plan_key``) to ``<compile cache>/memory_plan/<key>.json`` (the folder of
torch.compile's caches, ``run.compile_cache_dir``: the start-up caches in one place), and
``shared_plan`` reads it there before making one. Of the processes of one launch on one machine
(torchrun's ``LOCAL_RANK``), local rank 0 makes the plan and the others wait for its file, so a
cold start pays for one plan per machine, not one per GPU. Design: docs/memory_plan.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from distlib.runner.config import Config

# settings the plan never reads (where the run writes, how long it trains, its learning rate, what it
# logs): left out of the key, so that a rerun with another run.out_dir, data.root or train.epochs
# finds the plan. Every other setting is in the key (a new one included until it is listed here).
UNPLANNED = {
    "data": "root download cache_dir train_subset on_device augment".split(),
    "train": "epochs max_steps lr beta1 beta2 warmup_frac schedule min_lr_frac eval_every eval_every_steps tta "
    "tta_translate seed cudnn_benchmark peak_tflops sample_tokens".split(),
    "dist": "timeout_s comm_groups".split(),
    "run": "name out_dir checkpoint_every checkpoint_every_steps keep_checkpoints final_checkpoint resume progress "
    "curves memory_plan tensorboard wandb mlflow compile_cache_dir".split(),
    "profile": [f.name for f in dataclasses.fields(Config().profile)],
}
VERSIONED = ("torch", "transformers", "torchao", "peft")  # the packages whose code the step may run
WAIT_S = 900.0  # how long the other local ranks wait for local rank 0's plan before making their own
CLAIM_S = 30.0  # how long they wait for local rank 0 to begin it (its imports and config come first)


def planned_settings(cfg: Config) -> dict[str, Any]:
    """``cfg`` as a mapping, without the settings the plan never reads (``UNPLANNED``)."""
    out = dataclasses.asdict(cfg)
    for section, names in UNPLANNED.items():
        for name in names:
            out[section].pop(name, None)
    return out


_SOURCES: dict[str, str] = {}


def _sources_hash(paths: list[str]) -> str:
    """A hash of the files' bytes (kept for the process: distlib's sources are read once)."""
    key = "\0".join(paths)
    if key not in _SOURCES:
        h = hashlib.sha256()
        for path in paths:
            h.update(path.encode())
            try:
                with open(path, "rb") as f:
                    h.update(f.read())
            except OSError:
                h.update(b"?")
        _SOURCES[key] = h.hexdigest()
    return _SOURCES[key]


def code_hash(cfg: Config) -> str:
    """distlib's Python sources and the model's module (a ``package.module:callable`` outside distlib):
    a plan made with other code is another plan (the version number does not change with an edit)."""
    import distlib

    root = os.path.dirname(os.path.abspath(distlib.__file__))
    paths = sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".py"))
    if ":" in cfg.model.name:  # a user's model: its module's source (its own imports are not followed)
        module = sys.modules.get(cfg.model.name.split(":", 1)[0])
        source = getattr(module, "__file__", None) if module is not None else None
        if source is None:
            try:
                from distlib.runner import components

                source = inspect.getsourcefile(components.resolve("model", cfg.model.name))
            except Exception:  # unresolvable: the config check says so; the key still names the model
                source = None
        if source and not os.path.abspath(source).startswith(root):
            paths.append(os.path.abspath(source))
    return _sources_hash(paths)


def cache_dir(cfg: Config) -> str:
    """Where the plans are kept: ``memory_plan/`` in torch.compile's cache folder (``run.compile_cache_dir``)."""
    from distlib.runner.training.compilation import compile_cache_dir

    return os.path.join(compile_cache_dir(cfg), "memory_plan")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


def plan_key(cfg: Config, world: int, gpu: str, gpu_bytes: int | None, on_gpu: bool, modes: dict[str, Any]) -> str:
    """The key of the plan of ``cfg`` at ``world`` ranks on the GPU named ``gpu`` of ``gpu_bytes`` (None:
    no fit asked), ``on_gpu`` (the warm-up's copy planned), ``modes`` (the shard and checkpointing modes
    measured): a hash of these, the settings the plan reads, the packages' versions and the code."""
    import torch

    parts = {
        "settings": planned_settings(cfg),
        "world": world,
        "gpu": gpu,
        "gpu_bytes": gpu_bytes,
        "on_gpu": on_gpu,
        "modes": {k: list(v) for k, v in modes.items()},
        "versions": {p: torch.__version__ if p == "torch" else _version(p) for p in VERSIONED},
        "python": sys.version.split()[0],
        "code": code_hash(cfg),
    }
    text = json.dumps(parts, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def launch_id() -> str:
    """The same for every process of one launch on one machine (their launcher's process, torchrun's
    run and restart), another for the next launch: a plan that is not kept is shared within a launch."""
    env = os.environ
    return ":".join((str(os.getppid()), env.get("TORCHELASTIC_RUN_ID", ""), env.get("TORCHELASTIC_RESTART_COUNT", "")))


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            entry = json.load(f)
    except (OSError, ValueError):  # none yet, or not one of ours
        return None
    return entry if isinstance(entry, dict) and "outcome" in entry else None


def _usable(entry: dict[str, Any] | None) -> bool:
    return entry is not None and (entry.get("keep") is True or entry.get("launch") == launch_id())


def _write(path: str, entry: dict[str, Any]) -> bool:
    """``entry`` to ``path`` whole or not at all (a reader never sees half of it); False where it cannot."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, path)
        return True
    except OSError:  # a read-only or full disk: the run goes on with its plan, the next one plans again
        try:
            os.remove(tmp)
        except OSError:
            pass
        return False


def shared_plan(
    directory: str,
    key: str,
    make: Callable[[], tuple[str, Any, bool]],
    *,
    local_rank: int | None = None,
    local_world: int | None = None,
) -> tuple[str, Any, str]:
    """``make()``'s outcome (``(outcome, result, keep)``, the first two JSON-able) for ``key``, made once: read from
    ``directory`` where an earlier run (or this launch's local rank 0) left it, else made here, by local
    rank 0 only (the other local ranks wait for its file while it says it is making it, then make their
    own), and
    written there; ``keep``: whether later launches may use it (a child process that died is this
    launch's outcome only). ``local_rank``, ``local_world``: torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE
    by default. Returns the outcome, the result and where it came from:
    "cache", "local rank 0" or "planned"."""
    path = os.path.join(directory, f"{key}.json")
    entry = _read(path)
    if _usable(entry):
        return entry["outcome"], entry["result"], "cache"
    try:
        os.makedirs(directory, exist_ok=True)
        writable = os.access(directory, os.W_OK)
    except OSError:
        writable = False
    claim = f"{path}.planning"  # local rank 0 is making the plan (its launch's id in it)
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if local_world is None else local_world
    if writable and local_rank != 0 and local_world > 1:
        entry = _wait_for(path, claim)
        if entry is not None:
            return entry["outcome"], entry["result"], "local rank 0"
    claimed = writable and _write_text(claim, launch_id())
    try:
        outcome, result, keep = make()
        if writable:
            entry = {"outcome": outcome, "result": result, "keep": keep, "launch": launch_id()}
            _write(path, entry)
    finally:
        if claimed:
            try:
                os.remove(claim)
            except OSError:
                pass
    return outcome, result, "planned"


def _write_text(path: str, text: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(text)
        return True
    except OSError:
        return False


def _wait_for(path: str, claim: str) -> dict[str, Any] | None:
    """Local rank 0's plan for this launch, once written; None where it does not come: local rank 0 did
    not claim it within ``CLAIM_S`` (another launcher's numbering), or gave up its claim without writing
    (a full disk), or ``WAIT_S`` passed."""
    start, seen = time.monotonic(), False
    while True:
        entry = _read(path)
        if _usable(entry):
            return entry
        try:
            with open(claim) as f:
                claimed = f.read() == launch_id()
        except OSError:
            claimed = False
        waited = time.monotonic() - start
        if not claimed and (seen or waited > CLAIM_S):  # done or never begun: its entry, if it wrote one
            entry = _read(path)
            return entry if _usable(entry) else None
        if waited > WAIT_S:
            return None
        seen = seen or claimed
        time.sleep(0.05)
