"""End to end: launch.py under torchrun and as one process, what a run leaves in
run.out_dir, and exact evaluation whatever the world size."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from torch.utils.data import DistributedSampler, TensorDataset

import distlib
from distlib.runner.device_loader import DeviceLoader
from distlib.runner.models import small_cnn
from tests.conftest import ROOT, run_ranks

DEMO = os.path.join(ROOT, "recipes", "demo.yaml")
METRIC_KEYS = {"epoch", "train_loss", "test_acc", "images_per_s", "elapsed_s", "world_size"}
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    """One decode of the demo images for all the runs here, outside the user's ~/.cache."""
    return str(tmp_path_factory.mktemp("distlib-cache"))


def launch(args: list[str], nproc: int, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    if nproc == 1:
        cmd = [sys.executable, "launch.py", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd += ["launch.py", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    assert "terminate called" not in proc.stderr
    return proc


def read_run(out_dir) -> tuple[dict, list[dict]]:
    with open(os.path.join(out_dir, "config.yaml")) as f:
        config = yaml.safe_load(f)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return config, rows


def check_rows(rows: list[dict], epochs: int, world_size: int) -> None:
    assert [r["epoch"] for r in rows] == list(range(1, epochs + 1))  # one row per epoch
    for r in rows:
        assert METRIC_KEYS <= set(r), r
        assert r["world_size"] == world_size
        assert r["train_loss"] > 0 and r["images_per_s"] > 0
        assert 0.0 <= r["test_acc"] <= 1.0
    assert [r["elapsed_s"] for r in rows] == sorted(r["elapsed_s"] for r in rows)


@pytest.mark.slow
def test_torchrun_two_ranks_writes_config_and_metrics(tmp_path, cache_dir):
    out = tmp_path / "run"
    proc = launch([DEMO, "train.epochs=2", f"run.out_dir={out}", f"data.cache_dir={cache_dir}"], nproc=2)
    config, rows = read_run(out)
    assert config["train"]["epochs"] == 2 and config["run"]["out_dir"] == str(out)
    assert config["model"]["name"] == "small_cnn" and config["run"]["name"] == "demo"
    check_rows(rows, epochs=2, world_size=2)
    # rank 0 prints information, rank 1 does not
    # (the per-epoch lines are the progress display's, on rank 0's stdout)
    assert "epoch 2/2" in proc.stdout and "[distlib rank 0] INFO initialized" in proc.stderr
    assert "[distlib rank 1] INFO" not in proc.stderr


@pytest.mark.slow
def test_world_size_1_with_python(tmp_path, cache_dir):
    out = tmp_path / "run"
    launch([DEMO, "train.epochs=1", f"run.out_dir={out}", f"data.cache_dir={cache_dir}"], nproc=1)
    config, rows = read_run(out)
    check_rows(rows, epochs=1, world_size=1)
    assert config["dist"]["backend"] == "auto"


@pytest.mark.slow
def test_demo_recipe_reaches_30_percent(tmp_path, cache_dir):
    """What `make demo` promises: the default demo, two processes, well above chance (10%)."""
    out = tmp_path / "demo"
    launch([DEMO, f"run.out_dir={out}", f"data.cache_dir={cache_dir}"], nproc=2)
    config, rows = read_run(out)
    check_rows(rows, epochs=config["train"]["epochs"], world_size=2)
    print(f"demo: test_acc {rows[-1]['test_acc']:.3f} after {rows[-1]['elapsed_s']:.1f} s of training")
    assert rows[-1]["test_acc"] >= 0.30, rows[-1]


# ---- exact evaluation: the same accuracy for the same weights at world size 1, 2, 3 ----------

N_TEST = 103  # divides by neither 2 nor 3: a padded sampler would count some samples twice


def eval_fixture() -> tuple[torch.nn.Module, DeviceLoader, torch.Tensor, torch.Tensor]:
    """The same model weights and test set in every process (float64: no reduction-order noise)."""
    torch.manual_seed(0)
    model = small_cnn(10, 8).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (N_TEST, 3, 16, 16), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 10, (N_TEST,), generator=g)
    loader = DeviceLoader(x, y, batch_size=8, dtype=torch.float64)
    return model, loader, x, y


def _exact_eval(ctx):
    from distlib.runner.evaluation import evaluate

    model, loader, x, y = eval_fixture()
    acc = evaluate(model, x, y, loader, ctx, torch.autocast("cpu", enabled=False), tta=False)
    acc_tta = evaluate(model, x, y, loader, ctx, torch.autocast("cpu", enabled=False), tta=True)
    # distributed_loader(exact=True): the samples counted over the ranks
    ds = TensorDataset(torch.arange(N_TEST))
    n_exact = torch.tensor([sum(len(b) for (b,) in distlib.distributed_loader(ds, 10, exact=True))])
    n_padded = torch.tensor([len(DistributedSampler(ds, ctx.world_size, ctx.rank))])
    return acc, acc_tta, int(distlib.all_reduce(n_exact).item()), int(distlib.all_reduce(n_padded).item())


@pytest.mark.slow
def test_exact_evaluation_is_the_same_at_world_size_1_2_3(monkeypatch):
    model, loader, x, y = eval_fixture()
    with torch.no_grad():
        want = (model.eval()(loader.prepare(x)).argmax(1) == y).double().mean().item()
    for key in TORCHRUN_VARS:
        monkeypatch.delenv(key, raising=False)
    one = _exact_eval(distlib.init("gloo"))
    distlib.shutdown()
    two = run_ranks(_exact_eval, 2)
    three = run_ranks(_exact_eval, 3)
    assert one[0] == want
    for results in (two, three):
        for acc, acc_tta, n_exact, _ in results:
            assert (acc, acc_tta) == one[:2]  # bit for bit
            assert n_exact == N_TEST
    assert {r[3] for r in two} == {104} and {r[3] for r in three} == {105}  # what padding would have counted


@pytest.mark.gpus(1)
@pytest.mark.slow
def test_demo_on_gpus_with_nccl(tmp_path, cache_dir):
    """One process per GPU (up to two): NCCL chosen by dist.backend=auto, a clean teardown."""
    nproc = min(2, torch.cuda.device_count())
    out = tmp_path / "demo-gpu"
    proc = launch([DEMO, f"run.out_dir={out}", f"data.cache_dir={cache_dir}"], nproc=nproc)
    config, rows = read_run(out)
    check_rows(rows, epochs=config["train"]["epochs"], world_size=nproc)
    expected_backend = "nccl" if nproc > 1 else "none"
    assert f"backend={expected_backend} device=cuda:0" in proc.stderr
    assert "still referenced after shutdown" not in proc.stderr
    assert rows[-1]["test_acc"] >= 0.30, rows[-1]
