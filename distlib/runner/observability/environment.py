"""The software and hardware a run ran on, for ``environment.json`` in the run's
directory: enough to tell later why two runs differ."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import socket
import subprocess
import sys
from typing import Any

import torch

from distlib.distributed import collectives
from distlib.distributed.process_group import Context


def _nccl_version() -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # a CPU-only build has no NCCL
        return None
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


def git_commit(path: str) -> dict[str, Any] | None:
    """The commit checked out at ``path`` and whether the tree has changes; None
    outside a git checkout or without git."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", path, *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def _rank_info(ctx: Context) -> dict[str, Any]:
    info: dict[str, Any] = {"rank": ctx.rank, "hostname": socket.gethostname(), "device": str(ctx.device)}
    if ctx.device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(ctx.device)
    return info


def _torchvision_version() -> str | None:
    """torchvision's version without importing it (seconds of start-up when the run does not need it)."""
    if "torchvision" in sys.modules:
        return sys.modules["torchvision"].__version__
    spec = importlib.util.find_spec("torchvision")  # finds the package without running it
    if spec is None:
        return None
    try:  # the file torchvision's __version__ comes from, with the build's local suffix (+cu130)
        with open(os.path.join(spec.submodule_search_locations[0], "version.py")) as f:
            return re.search(r"^__version__ = ['\"]([^'\"]+)", f.read(), re.M).group(1)
    except (OSError, TypeError, IndexError, AttributeError):
        return importlib.metadata.version("torchvision")


def bytecode_hint(source: str | None = None) -> str | None:
    """What to do when every process here compiles torch's Python sources again on import (Python
    may not write bytecode, and torch has none cached); None when its bytecode is cached or will be.
    ``source``: a module file of the installation (default torch's ``__init__.py``)."""
    source = source or torch.__file__
    if not sys.dont_write_bytecode:
        return None  # what is compiled is written: only a first run pays
    try:
        cached = importlib.util.cache_from_source(source)  # under sys.pycache_prefix when one is set
    except (NotImplementedError, ValueError):
        return None
    if os.path.exists(cached):
        return None
    site = os.path.dirname(os.path.dirname(os.path.abspath(source)))
    return (
        "Python may not write bytecode here (PYTHONDONTWRITEBYTECODE) and torch has none cached, so every "
        "process compiles torch's sources again on import (3 s more per process on an H200 machine; "
        "docs/startup.md). Keep a cache: export PYTHONPYCACHEPREFIX=$HOME/.cache/pycache and unset "
        f"PYTHONDONTWRITEBYTECODE, or compile once: python -m compileall -q {site}"
    )


def collect_environment(ctx: Context, repo_dir: str | None = None) -> dict[str, Any]:
    """Versions, GPUs, world size, git commit, and each rank's host and device.

    A collective (it gathers every rank's host and device): every rank must call
    it, in the same order. ``repo_dir`` is where to look for the git commit
    (default: the checkout that holds this distlib).
    """
    import distlib

    ranks = collectives.all_gather_object(_rank_info(ctx))
    repo_dir = repo_dir or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cuda = torch.cuda.is_available()
    tv_version = _torchvision_version()
    return {
        "distlib": distlib.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "torch": torch.__version__,
        "torchvision": tv_version,
        "cuda": torch.version.cuda,  # the CUDA torch was built with; None for a CPU build
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "cudnn_benchmark": torch.backends.cudnn.benchmark if cuda else None,  # autotuning, as this run set it
        "nccl": _nccl_version(),
        "gpu_count": torch.cuda.device_count() if cuda else 0,  # on this (the main rank's) node
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "world_size": ctx.world_size,
        "local_world_size": ctx.local_world_size,
        "nodes": len({r["hostname"] for r in ranks}),
        "backend": ctx.backend,
        "git": git_commit(repo_dir),
        "argv": sys.argv,
        "ranks": ranks,
    }


def environment_json(ctx: Context, repo_dir: str | None = None) -> str:
    """``collect_environment`` as indented JSON text. A collective, like it."""
    return json.dumps(collect_environment(ctx, repo_dir), indent=2) + "\n"
