"""The runner's entry imports what every run needs and nothing more (docs/startup.md, ``imports``): the
packages of optional features (transformers, torchao, plots, progress bars, trackers, images) and
torch's compiler are imported where a recipe uses them, each seconds of every rank's start-up."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

# seconds each on a GPU machine's first import (transformers pulls torchvision and torch._dynamo)
HEAVY = ("transformers", "torchao", "matplotlib", "rich", "tensorboard", "torch.utils.tensorboard", "wandb", "mlflow",
         "torchvision", "PIL", "datasets", "peft", "safetensors", "tokenizers", "torch._dynamo", "torch._inductor",
         "triton", "sympy", "torch.distributed.checkpoint", "torch.distributed.fsdp")  # fmt: skip

_PROBE = """
import importlib, json, sys
import torch, torch.distributed  # noqa: E401  (whatever torch imports itself is not the runner's doing)
before = set(sys.modules)
for m in {entries!r}:
    importlib.import_module(m)
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules and m not in before)))
"""


def test_the_runners_entry_imports_no_optional_package():
    entries = ["launch", "distlib.runner.cli", "distlib.runner.main", "distlib.runner.training.trainer",
               "distlib.runner.training.memory_plan", "distlib.runner.training.plan_cache"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(entries=entries, heavy=HEAVY)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [], "imported at start-up: " + proc.stdout
