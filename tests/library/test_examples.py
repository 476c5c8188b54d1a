"""examples/: each "before" script and its distlib port train on the CPU, and the
ports give the same model as the originals where the arithmetic is the same.

- ddp_tutorial: a hand-written DDP + DistributedSampler script and its port
  (distributed_loader, GradSync) see the same samples in the same order and
  average the same gradients, so two ranks of each end with the same weights.
- single_gpu: the port keeps the global batch whatever the world size, so one
  process and two processes end with the same weights (up to the order of
  floating-point sums).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

EPOCH_LINE = re.compile(r"epoch (\d+)/(\d+)  loss ([\d.]+)  acc ([\d.]+)")

pytestmark = pytest.mark.slow


def run_script(script: str, *args: str, nproc: int = 0) -> list[tuple[float, float]]:
    """Run an example (under torchrun when ``nproc``); returns (loss, acc) per epoch."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = (launcher if nproc else [sys.executable]) + [os.path.join(ROOT, "examples", script), *args]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    epochs = [(float(m[3]), float(m[4])) for m in EPOCH_LINE.finditer(p.stdout)]
    assert len(epochs) == 2, p.stdout  # printed by rank 0 only
    return epochs


def assert_trains(epochs: list[tuple[float, float]]) -> None:
    (loss1, _), (loss2, acc2) = epochs
    assert loss2 < 0.5 * loss1 and acc2 > 0.8, epochs


def max_diff(a: str, b: str) -> float:
    sa, sb = torch.load(a), torch.load(b)
    assert sa.keys() == sb.keys()
    return max((sa[k] - sb[k]).abs().max().item() for k in sa)


def test_single_gpu_before_and_after_train_and_the_port_gives_one_result_at_any_world_size(tmp_path):
    before = run_script("single_gpu/train.py", "--epochs=2")
    assert_trains(before)
    one = run_script("single_gpu/train_distlib.py", "--epochs=2", f"--save={tmp_path / 'one.pt'}")
    two = run_script("single_gpu/train_distlib.py", "--epochs=2", f"--save={tmp_path / 'two.pt'}", nproc=2)
    assert_trains(one)
    assert_trains(two)
    # same samples per step, gradients averaged over the ranks: only the order of
    # float sums differs (measured 1e-4 after 3 epochs; a wrong shard or a sum
    # instead of a mean gives differences of order 0.1)
    assert max_diff(tmp_path / "one.pt", tmp_path / "two.pt") < 2e-3
    for (l1, a1), (l2, a2) in zip(one, two):
        assert abs(l1 - l2) < 1e-3 and abs(a1 - a2) < 0.01


def test_ddp_tutorial_port_ends_with_the_same_weights_as_ddp(tmp_path):
    ddp = run_script("ddp_tutorial/train_ddp.py", "--epochs=2", f"--save={tmp_path / 'ddp.pt'}", nproc=2)
    port = run_script("ddp_tutorial/train_distlib.py", "--epochs=2", f"--save={tmp_path / 'distlib.pt'}", nproc=2)
    assert_trains(ddp)
    # DistributedSampler gives the same order, GradSync averages like DDP: on the
    # CPU with two ranks the weights come out bit for bit the same
    assert max_diff(tmp_path / "ddp.pt", tmp_path / "distlib.pt") <= 1e-6
    assert ddp == port


@pytest.mark.skipif(shutil.which("diff") is None, reason="needs diff")
def test_docs_show_the_real_diff():
    before, after = "examples/single_gpu/train.py", "examples/single_gpu/train_distlib.py"
    p = subprocess.run(["diff", "-u", "--label", before, "--label", after, before, after], cwd=ROOT,
                       capture_output=True, text=True)  # fmt: skip
    assert p.returncode == 1 and p.stdout  # 1: the files differ
    with open(os.path.join(ROOT, "docs", "examples.md")) as f:
        readme = f.read()
    marker = f"<!-- diff -u {before} {after} -->\n```diff\n"
    assert marker in readme, "docs/examples.md lost the marked diff block"
    shown = readme.split(marker, 1)[1].split("```\n", 1)[0]
    assert shown == p.stdout, "docs/examples.md's diff is stale: regenerate it with diff -u (see the marker)"
