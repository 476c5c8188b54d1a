"""End to end: launch.py under torchrun and as one process, what a run leaves in
run.out_dir, and exact evaluation whatever the world size."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from torch.utils.data import DistributedSampler, TensorDataset

import distlib
from distlib.runner.data.device_loader import DeviceLoader
from distlib.runner.data.images import load_image_set
from distlib.runner.models.vision import small_cnn
from tests.conftest import ROOT, free_port, run_ranks
from tests.runner.conftest import TORCHRUN_VARS, checkpoints, saved, step_name

DEMO = os.path.join(ROOT, "recipes", "demo.yaml")
METRIC_KEYS = {"epoch", "train_loss", "test_acc", "images_per_s", "elapsed_s", "world_size"}


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
def test_demo_recipe_reaches_30_percent_and_writes_config_and_metrics(tmp_path, cache_dir):
    """What `make demo` promises: the default demo, two processes under torchrun, well above chance
    (10%); its resolved config and one metrics row per epoch in run.out_dir; only rank 0 informs."""
    out = tmp_path / "demo"
    proc = launch([DEMO, "train.seed=5", f"run.out_dir={out}", f"data.cache_dir={cache_dir}"], nproc=2)
    config, rows = read_run(out)
    assert config["train"]["seed"] == 5 and config["run"]["out_dir"] == str(out)  # the overrides, resolved
    assert config["model"]["name"] == "small_cnn" and config["run"]["name"] == "demo"
    epochs = config["train"]["epochs"]
    check_rows(rows, epochs=epochs, world_size=2)
    # rank 0 prints information, rank 1 does not (the per-epoch lines are the progress display's,
    # on rank 0's stdout)
    assert f"epoch {epochs}/{epochs}" in proc.stdout and "[distlib rank 0] INFO initialized" in proc.stderr
    assert "[distlib rank 1] INFO" not in proc.stderr
    print(f"demo: test_acc {rows[-1]['test_acc']:.3f} after {rows[-1]['elapsed_s']:.1f} s of training")
    assert rows[-1]["test_acc"] >= 0.30, rows[-1]


# ---- two ranks against one process, on two torchrun "nodes" -----------------------------------

# augmentation off: both runs see the same images; 8 steps an epoch of a 128-image global batch
SAME = ["train.epochs=2", "data.train_subset=1024", "model.width=8", "data.augment.crop_pad=0",
        "data.augment.flip=none", "run.checkpoint_every=1", "dist.backend=gloo", "run.progress=plain",
        f"data.root={os.path.join(ROOT, 'data', 'cifar10-demo')}"]  # fmt: skip
README_METRICS = {"epoch", "step", "train_loss", "test_acc", "images_per_s", "samples_per_s", "epoch_s", "train_s",
                  "elapsed_s", "lr", "world_size"}  # fmt: skip


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, cache_dir):
    """Two torchrun agents of one rank each, each in its own working directory, writing to the
    run.out_dir ``shared/two``, on a file system both "nodes" see (every rank writes its part of each
    checkpoint there)."""
    base = tmp_path_factory.mktemp("two-nodes")
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env["OMP_NUM_THREADS"] = "1"
    port = free_port()
    procs = []
    for node in (0, 1):
        os.makedirs(base / f"node{node}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               os.path.join(ROOT, "launch.py"), DEMO, *SAME, f"run.out_dir={base / 'shared' / 'two'}",
               f"data.cache_dir={cache_dir}"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=base / f"node{node}", env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))  # fmt: skip
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-4000:]
    return base


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, cache_dir) -> tuple[subprocess.CompletedProcess, str]:
    """``python launch.py``: the same run as ``two_nodes`` in one process, which takes each global
    batch's two halves as micro-batches (train.grad_accum=2)."""
    out = str(tmp_path_factory.mktemp("one-process") / "one")
    proc = launch([DEMO, *SAME, "train.grad_accum=2", f"run.out_dir={out}", f"data.cache_dir={cache_dir}"], nproc=1)
    return proc, out


@pytest.mark.slow
def test_world_size_1_with_python(one_process):
    proc, out = one_process
    config, rows = read_run(out)
    check_rows(rows, epochs=2, world_size=1)
    assert config["train"]["grad_accum"] == 2 and config["train"]["epochs"] == 2  # the overrides, resolved
    assert "backend=none device=cpu" in proc.stderr  # one process: no process group


def test_two_ranks_equal_one_process_accumulating_the_same_global_batch(two_nodes, one_process):
    """Rank r takes the r-th half of each global batch, one process with train.grad_accum=2 takes
    the same halves as its micro-batches: the same arithmetic (BatchNorm included), so the losses
    agree to rounding in the first epoch (measured: 7e-6 relative); the rounding differences grow
    over the steps (4e-4 in the second epoch). Unsynchronized or summed gradients give 1e-2 and more."""
    _, two = read_run(two_nodes / "shared" / "two")
    _, acc = read_run(one_process[1])
    assert [r["world_size"] for r in two] == [2, 2] and [r["world_size"] for r in acc] == [1, 1]
    assert len(two) == len(acc) == 2
    assert two[0]["train_loss"] == pytest.approx(acc[0]["train_loss"], rel=1e-4), (two, acc)
    assert two[1]["train_loss"] == pytest.approx(acc[1]["train_loss"], rel=3e-3), (two, acc)
    assert [r["lr"] for r in two] == pytest.approx([r["lr"] for r in acc])


def _bytes_by_rank(step_dir) -> tuple[dict[int, int], dict[int, int]]:
    """The bytes of each rank's shard files (``__<rank>_<i>.distcp``), and of the tensors' records in them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    def rank(name: str) -> int:
        return int(name.removeprefix("__").split("_")[0])

    files: dict[int, int] = {}
    for f in step_dir.glob("__*_*.distcp"):
        files[rank(f.name)] = files.get(rank(f.name), 0) + f.stat().st_size
    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata()
    tensors: dict[int, int] = {}
    for index, where in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata):
            tensors[rank(where.relative_path)] = tensors.get(rank(where.relative_path), 0) + where.length
    return files, tensors


def test_rank_0_writes_the_run_directory_and_every_rank_its_part_of_each_checkpoint(two_nodes):
    out = two_nodes / "shared" / "two"
    assert {"config.yaml", "metrics.jsonl", "environment.json", "checkpoints"} <= set(os.listdir(out))
    assert sorted(os.listdir(out / "checkpoints")) == checkpoints(out) == [step_name(8), step_name(16)]
    for name in checkpoints(out):  # dist.shard=none: the replicated state written in parts, not by rank 0 alone
        files, tensors = _bytes_by_rank(out / "checkpoints" / name)
        assert sorted(files) == sorted(tensors) == [0, 1], name
        for rank in (0, 1):
            assert files[rank] >= 0.25 * sum(files.values()), (name, files)
            assert tensors[rank] >= 0.25 * sum(tensors.values()), (name, tensors)
    assert os.listdir(two_nodes / "node0") == os.listdir(two_nodes / "node1") == [], "nothing in the working dirs"


def test_metrics_rows_hold_the_readme_keys_with_epoch_and_training_time(two_nodes):
    _, rows = read_run(two_nodes / "shared" / "two")
    for r in rows:
        assert set(r) == README_METRICS, r
        assert 0 < r["epoch_s"] <= r["train_s"] <= r["elapsed_s"]
        assert r["images_per_s"] * r["epoch_s"] == pytest.approx(8 * 128, rel=0.1)  # the global batches, all ranks'
    first, last = rows
    assert first["train_s"] == pytest.approx(first["epoch_s"], abs=2e-3)  # training time adds up the epochs
    assert last["train_s"] >= first["train_s"] + last["epoch_s"] - 2e-3  # (and the final evaluation)


def test_the_final_accuracy_is_the_saved_models_on_every_test_image(two_nodes, cache_dir):
    """The last row's test_acc is that of the final checkpoint's model (the ranks' BatchNorm
    statistics averaged into it before the evaluation) on the 1,000 test images with their mirror
    images (train.tta), normalized with the training subset's statistics: by hand, on the shards
    the two ranks evaluated (the same batch shapes)."""
    out = two_nodes / "shared" / "two"
    _, rows = read_run(out)
    model = small_cnn(10, 8)
    model.load_state_dict(saved(out, 16)["model"])  # the final checkpoint's, epoch 2's end
    model.eval()
    images = load_image_set(os.path.join(ROOT, "data", "cifar10-demo"), cache_dir=cache_dir)
    pixels = images.x_train[:1024].float() / 255
    mean, std = pixels.mean(dim=(0, 2, 3)).view(1, 3, 1, 1), pixels.std(dim=(0, 2, 3)).view(1, 3, 1, 1)
    correct = 0
    with torch.no_grad():
        for rank in (0, 1):
            x = (images.x_test[rank::2].float() / 255 - mean) / std
            correct += int(((model(x) + model(x.flip(3))).argmax(1) == images.y_test[rank::2]).sum())
    assert rows[-1]["test_acc"] == round(correct / 1000, 5), (rows[-1], correct)


def test_a_resume_at_another_world_size_continues_with_a_warning(two_nodes, tmp_path, cache_dir):
    out = tmp_path / "resumed"
    shutil.copytree(two_nodes / "shared" / "two", out)
    _, two = read_run(out)
    shutil.rmtree(out / "checkpoints" / step_name(16))  # as if stopped after epoch 1
    proc = launch([DEMO, *SAME, f"run.out_dir={out}", f"data.cache_dir={cache_dir}"], nproc=1)
    assert "checkpoint written by 2 rank(s), this run has 1" in proc.stderr
    _, rows = read_run(out)
    assert [r["epoch"] for r in rows] == [1, 2] and rows[0] == two[0]
    assert rows[1]["world_size"] == 1
    # the same global batch from the same weights: BatchNorm sees 128 images instead of 2 x 64
    assert rows[1]["train_loss"] == pytest.approx(two[1]["train_loss"], rel=2e-2)
    assert rows[1]["lr"] == two[1]["lr"]


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
    from distlib.runner.tasks.evaluation import evaluate

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
    """One process per GPU (up to two): NCCL chosen by dist.backend=auto, a clean teardown;
    train.cudnn_benchmark reaches cuDNN."""
    nproc = min(2, torch.cuda.device_count())
    out = tmp_path / "demo-gpu"
    proc = launch(
        [DEMO, f"run.out_dir={out}", f"data.cache_dir={cache_dir}", "train.cudnn_benchmark=false"], nproc=nproc
    )
    config, rows = read_run(out)
    with open(out / "environment.json") as f:
        assert json.load(f)["cudnn_benchmark"] is False
    check_rows(rows, epochs=config["train"]["epochs"], world_size=nproc)
    expected_backend = "nccl" if nproc > 1 else "none"
    assert f"backend={expected_backend} device=cuda:0" in proc.stderr
    assert "still referenced after shutdown" not in proc.stderr
    assert rows[-1]["test_acc"] >= 0.30, rows[-1]


@pytest.mark.gpus(2)
@pytest.mark.slow
def test_fallback_mode_refuses_two_processes_on_a_gpu_node(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "launch.py", DEMO,
           "dist.mode=fallback", "train.epochs=1", f"run.out_dir={tmp_path / 'out'}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]  # torchrun: a worker failed (each exits 2)
    assert "start one per node (torchrun --nproc-per-node=1)" in proc.stderr
    assert "exitcode: 2" in proc.stderr
