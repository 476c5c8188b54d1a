"""A run that runs out of GPU memory (runner/training/out_of_memory.py): one line naming the step,
what the memory plan said and what would fit, exit 2 on every rank, no traceback; and the plan's
margin, which refuses at the start a step that only fits without it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from distlib.runner.config import load_config
from distlib.runner.training.memory_plan import GIB, plan
from distlib.runner.training.out_of_memory import out_of_memory, tried_bytes
from tests.conftest import ROOT

MIB = 2**20


@pytest.fixture(scope="module")
def demo_plan():
    """The GPT demo's plan at 2 ranks, replicated, with and without checkpointing, no margin: 13.9 MiB
    at the peak, 7.9 MiB with checkpointing."""
    cfg = load_config("recipes/gpt_demo.yaml", ["run.memory_margin_gib=0", "run.memory_margin_fraction=0"])
    return cfg, plan(cfg, 2, shards=("none",), checkpointing=("none", "full"), batches=False)


def test_a_step_within_the_margin_of_the_device_is_refused_with_what_would_fit(demo_plan):
    cfg, bare = demo_plan
    peak = bare.peak()
    gpu = int(peak / 0.9)  # the step fits the device, not with a fifth of it kept
    cfg = load_config("recipes/gpt_demo.yaml", ["run.memory_margin_gib=0", "run.memory_margin_fraction=0.2"])
    result = plan(cfg, 2, gpu_bytes=gpu, shards=("none",), checkpointing=("none", "full"), batches=False)
    assert result.peak() == peak < gpu and result.margin == int(0.2 * gpu)
    assert result.fits() is False
    verdict = result.verdict()
    assert f"does not fit the device's {gpu / MIB:.1f} MiB less a {0.2 * gpu / MIB:.1f} MiB margin " \
        "(run.memory_margin_gib, run.memory_margin_fraction); dist.shard=none with " \
        "train.activation_checkpointing=full would (7.9 MiB)" in verdict, verdict  # fmt: skip
    # a fixed margin alone, in GiB: a device one GiB larger than the step still refuses it
    cfg = load_config("recipes/gpt_demo.yaml", ["run.memory_margin_fraction=0"])
    assert cfg.run.memory_margin_gib == 1.0
    edge = plan(cfg, 2, gpu_bytes=peak + GIB - 1, shards=("none",), checkpointing=("none",), batches=False)
    assert edge.fits() is False and plan(cfg, 2, gpu_bytes=peak + GIB, shards=("none",), checkpointing=("none",),
                                         batches=False).fits()  # fmt: skip


def test_out_of_memory_names_the_step_the_plan_and_a_setting_that_would_fit(demo_plan):
    """The plan said the step fits (no margin); the step asked for 2 MiB more than the device had: the
    plan's advice with the margin this run showed it needs, the checkpointed step (7.9 MiB)."""
    _, bare = demo_plan
    plan_ = type(bare)(**{**bare.__dict__, "gpu_bytes": bare.peak() + MIB})
    assert plan_.fits()
    e = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of ...")
    assert tried_bytes(e) == 2 * MIB
    error = out_of_memory(e, where="at step 12", rank=1, device=torch.device("cpu"), plan=plan_)
    assert str(error) == (
        "out of GPU memory at step 12 on rank 1; the memory plan said 13.9 MiB with a 0.0 MiB margin; "
        "dist.shard=none with train.activation_checkpointing=full would (7.9 MiB); or a margin of at least "
        "3.0 MiB (run.memory_margin_gib) so the plan refuses what cannot fit"
    )
    # no plan (a CPU run, run.memory_plan=off): the plan's command says what fits
    error = out_of_memory(e, where="in the warm-up", rank=0, device=torch.device("cpu"), plan=None)
    assert str(error).startswith("out of GPU memory in the warm-up on rank 0; python -m distlib.runner.plan ")


def test_out_of_memory_says_how_much_was_fragmentation_and_how_much_lay_outside_torch(demo_plan, monkeypatch):
    """torch's own figures of the failure (its message), in the one line: the allocator's reserve that
    no tensor used, with the setting that gives it back where it is a GiB or more, and the memory
    outside the allocator."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    _, bare = demo_plan
    e = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 3.91 GiB. GPU 0 has a total capacity of 79.18 GiB of which "
        "1.02 GiB is free. Including non-PyTorch memory, this process has 78.15 GiB memory in use. Of the "
        "allocated memory 74.89 GiB is allocated by PyTorch, and 2.50 GiB is reserved by PyTorch but "
        "unallocated. If reserved but unallocated memory is large try setting ..."
    )
    said = str(out_of_memory(e, where="at step 3", rank=2, device=torch.device("cpu"), plan=None))
    assert said.startswith(
        "out of GPU memory at step 3 on rank 2; of the rest, 2.50 GiB was reserved by torch's allocator but "
        "not in use (fragmentation: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True gives it back) and "
        "778.2 MiB was outside it (CUDA context, NCCL, cuBLAS); python -m distlib.runner.plan "
    ), said
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # already set: no advice
    said = str(out_of_memory(e, where="at step 3", rank=2, device=torch.device("cpu"), plan=None))
    assert "2.50 GiB was reserved by torch's allocator but not in use and 778.2 MiB" in said, said
    small = torch.OutOfMemoryError(str(e).replace("2.50 GiB is reserved", "20.00 MiB is reserved"))
    said = str(out_of_memory(small, where="at step 3", rank=2, device=torch.device("cpu"), plan=None))
    assert "20.0 MiB was reserved by torch's allocator but not in use and" in said, said
    # a message without the figures (another torch, another allocator): nothing made up
    bare_e = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
    said = str(out_of_memory(bare_e, where="at step 3", rank=2, device=torch.device("cpu"), plan=None))
    assert "reserved" not in said and "outside" not in said


@pytest.mark.slow
def test_a_step_that_runs_out_of_memory_on_one_rank_ends_every_rank_with_one_line_and_exit_2(tmp_path):
    """Rank 1's third step raises torch.OutOfMemoryError (a model by import path, on the CPU): rank 1 says
    where in one line, rank 0 (waiting in the step's all_reduce) says the same after it; both exit 2; no
    traceback from either."""
    out_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "launch.py",
           "recipes/gpt_demo.yaml", "model.name=tests.runner.out_of_memory_model:gpt_out_of_memory",
           "train.max_steps=8", f"run.out_dir={out_dir}", "run.curves=off"]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    out = r.stdout + r.stderr
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    said = "out of GPU memory at step 3 on rank 1; python -m distlib.runner.plan RECIPE --nproc N shows what fits"
    assert sorted(errors) == sorted([f"error: {said} (train.activation_checkpointing, dist.shard, a smaller "
                                     "train.batch_size, more ranks)", f"error: (on rank 1) {said} "
                                     "(train.activation_checkpointing, dist.shard, a smaller train.batch_size, "
                                     "more ranks)"]), out  # fmt: skip
    assert out.count("exitcode  : 2") == 2 or ("exitcode  : 2" in out and "Sending process" in out), out
    workers = out.split(" failed (exitcode: ")[0]  # what follows is torchrun's own summary (and traceback)
    assert "Traceback" not in workers and "OutOfMemoryError" not in out, out
