"""End to end on the CPU: resume after a killed worker, SIGTERM/SIGINT, a stalled rank,
two torchrun "nodes", and every bad input of the table in docs/reliability.md.

The torchrun runs train the demo's small CNN (width 8) on 2,048 images for 3
epochs: 16 steps an epoch on 2 gloo ranks on the CPU, also on a GPU machine
(bit-for-bit checks need the CPU). The GPU variants at the end run with NCCL.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import distlib
import launch
from distlib.reliability.watchdog import grace_s
from distlib.runner.data.images import load_image_set
from tests.conftest import ROOT, flip_a_tensor_byte, free_port
from tests.runner.conftest import checkpoints, saved, step_name

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
DEMO = [
    "recipes/demo.yaml",
    "train.epochs=3",
    "data.train_subset=2048",
    "model.width=8",
    "run.checkpoint_every=1",
    "train.ema=0.9",
]  # the weight average too must resume bit for bit
CPU = ["dist.backend=gloo"]  # gloo ranks use the CPU even where a GPU exists
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
STEPS = 16  # an epoch's: 2,048 images in global batches of 128
FINAL = 3 * STEPS  # the global step of the final checkpoint

pytestmark = pytest.mark.slow


# ---- helpers ------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def decoded_demo_data():
    """Decode the demo set once so that no run spends its collective timeout decoding it; one
    thread for the in-process runs, as for the workers (OMP_NUM_THREADS=1): CI's cores are busy."""
    load_image_set(os.path.join(ROOT, "data/cifar10-demo"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def no_job_outlives_its_test():
    yield
    while Job.running:
        job = Job.running.pop()
        if job.proc.poll() is None:  # a test failed before its job ended
            job.kill()


class Job:
    """A torchrun (or python) command running in the background, its output in a file."""

    running: list[Job] = []

    def __init__(self, cmd: list[str], log_path: str, env: dict[str, str] | None = None):
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env or ENV, stdout=self.log, stderr=subprocess.STDOUT)
        self.seen: set[int] = set()  # every worker (and watchdog) pid seen, to check none is left
        Job.running.append(self)

    def kill(self) -> None:
        """SIGKILL the job and everything below it (torchrun's workers live in their own sessions)."""
        for pid in [p for p, _ in descendants(self.proc.pid)] + [self.proc.pid]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.log.close()

    @property
    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def workers(self) -> dict[int, int]:
        """rank -> pid of the current workers (children of torchrun that have RANK set)."""
        out = {}
        tree = descendants(self.proc.pid)
        self.seen.update(p for p, _ in tree)
        for pid, parent in tree:
            if parent != self.proc.pid:
                continue  # a worker's own children (its watchdog) inherit RANK too
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            for e in env:
                if e.startswith(b"RANK="):
                    out[int(e[5:])] = pid
        return out


def descendants(root: int) -> list[tuple[int, int]]:
    """(pid, parent pid) of every process below ``root``."""
    children: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p))
    out, todo = [], [root]
    while todo:
        parent = todo.pop()
        for c in children.get(parent, []):
            out.append((c, parent))
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def torchrun(
    out_dir: str, *overrides: str, nproc: int = 2, extra: tuple[str, ...] = (), name: str = "run", device=CPU
) -> Job:
    cmd = TORCHRUN + ["--standalone", f"--nproc-per-node={nproc}", *extra, "launch.py", *DEMO, *device]
    cmd += [f"run.out_dir={out_dir}", *overrides]
    return Job(cmd, os.path.join(os.path.dirname(out_dir), f"{name}.log"))


def wait_for_file(path: str, job: Job, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        assert job.proc.poll() is None, f"the run ended before {path} appeared:\n{job.output[-3000:]}"
        assert time.monotonic() < end, f"{path} did not appear:\n{job.output[-3000:]}"
        job.workers()  # remember pids while they live
        time.sleep(0.02)
    job.workers()


def signal_while_training(job: Job, out_dir: str, sig: int, timeout: float = 120) -> None:
    """Send ``sig`` to the job once its training is seen running: the first epoch's metrics row
    is written. Callers train for enough epochs that the rest cannot end before the signal
    lands (the checks after it fail if it did: there would be no stop and no checkpoint of it)."""
    path = os.path.join(out_dir, "metrics.jsonl")
    end = time.monotonic() + timeout
    while not (os.path.exists(path) and metrics(out_dir)):
        assert job.proc.poll() is None, f"the run ended before its first epoch's row:\n{job.output[-3000:]}"
        assert time.monotonic() < end, f"no epoch finished in {timeout} s:\n{job.output[-3000:]}"
        job.workers()  # remember pids while they live
        time.sleep(0.02)
    job.workers()
    job.proc.send_signal(sig)


def stopped_at(job: Job, out_dir: str, sig_name: str, epochs: int) -> tuple[int, int]:
    """(epoch, step) where the signal stopped every rank; checks the message, said once by rank 0,
    that the stop came before the last epoch's end, and the checkpoint and metrics rows it left."""
    m = re.search(rf"stopped by {sig_name} at epoch (\d+) step (\d+); checkpoint saved", job.output)
    assert m, job.output[-3000:]
    assert job.output.count(f"stopped by {sig_name}") == 1  # said once, by rank 0
    epoch, step = int(m.group(1)), int(m.group(2))
    assert 2 <= epoch <= epochs, (epoch, step)
    assert step_name((epoch - 1) * STEPS + step) in checkpoints(out_dir)
    assert [r["epoch"] for r in metrics(out_dir)] == list(range(1, epoch))
    return epoch, step


def metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def trajectory(out_dir: str) -> list[tuple]:
    """What must be bit-for-bit equal between runs (timings are not)."""
    return [(r["epoch"], r["train_loss"], r["test_acc"], r["lr"]) for r in metrics(out_dir)]


def final_model(out_dir: str) -> dict[str, torch.Tensor]:
    return saved(out_dir, FINAL)["model"]


def assert_same_model(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def assert_nothing_left(job: Job) -> None:
    time.sleep(0.5)
    left = [p for p in job.seen if alive(p)]
    assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted 2-rank run on one node."""
    out = str(tmp_path_factory.mktemp("reference") / "out")
    job = torchrun(out, name="reference")
    assert job.wait() == 0, job.output[-3000:]
    return {"trajectory": trajectory(out), "model": final_model(out)}


# ---- resume, signals, stalls ---------------------------------------------------------------


def test_a_killed_worker_is_restarted_and_the_run_resumes_to_the_same_result(tmp_path, reference):
    out = str(tmp_path / "out")
    job = torchrun(out, extra=("--max-restarts=1",), name="killed")
    wait_for_file(os.path.join(out, "checkpoints", step_name(STEPS)), job)  # epoch 1's, committed
    os.kill(job.workers()[1], signal.SIGKILL)
    assert job.wait() == 0, job.output[-4000:]
    assert "rank 0 lost the connection to rank 1 in " in job.output and "rank 1 ended without a word" in job.output
    # (which failure torchrun's agent reports first, rank 1's SIGKILL or rank 0's exit, depends on
    # the machine's load: not asserted)
    assert f"resuming from {os.path.join(out, 'checkpoints', step_name(STEPS))}" in job.output
    epochs = [r["epoch"] for r in metrics(out)]
    assert epochs == [1, 2, 3]  # no epoch twice, none skipped
    assert trajectory(out) == reference["trajectory"]
    assert_same_model(final_model(out), reference["model"])
    assert_nothing_left(job)


def test_a_run_killed_while_a_background_save_is_written_resumes_from_the_previous_one(tmp_path, reference):
    """Background checkpoints every 6 steps; the third one's write is held (tests/runner/held_save_launch.py)
    once each rank has written part of its shard file, and the whole job is then killed with SIGKILL.
    The first two are committed, the third is a partial directory; the same command resumes from the
    second and ends as the uninterrupted run, bit for bit."""
    out, mark = str(tmp_path / "out"), str(tmp_path / "held")
    every = ("run.checkpoint_every=0", "run.checkpoint_every_steps=6")
    cmd = TORCHRUN + ["--standalone", "--nproc-per-node=2", "tests/runner/held_save_launch.py", *DEMO, *CPU,
                      f"run.out_dir={out}", *every]  # fmt: skip
    job = Job(cmd, str(tmp_path / "held.log"), env={**ENV, "HELD_SAVE_AFTER": "2", "HELD_SAVE_MARK": mark})
    for rank in (0, 1):
        wait_for_file(f"{mark}-{rank}", job)  # each rank inside its write of step 18's checkpoint
    job.kill()
    job.log.close()
    assert checkpoints(out) == [step_name(6), step_name(12)], os.listdir(os.path.join(out, "checkpoints"))
    partial = os.path.join(out, "checkpoints", f".partial-{step_name(18)}")
    files = os.listdir(partial)  # being written: each rank's shard files, no .metadata yet
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(files) and all(f.endswith(".distcp") for f in files), files
    assert_nothing_left(job)

    again = torchrun(out, *every, name="held-resumed")
    assert again.wait() == 0, again.output[-3000:]
    assert f"deleting {partial}, the partial directory of an interrupted save" in again.output
    assert f"resuming from {os.path.join(out, 'checkpoints', step_name(12))}: epoch 0, step 12" in again.output
    assert trajectory(out) == reference["trajectory"]
    assert_same_model(final_model(out), reference["model"])


def test_a_rank_lost_while_a_background_save_is_written_is_named_by_the_survivor_and_nothing_committed_is_lost(
    tmp_path, reference
):
    """Rank 1's write of the third background save is held, then rank 1 is killed: rank 0 (its own write and
    its training both lose rank 1) says so in one line naming rank 1, exits 1, without a traceback; the two
    committed checkpoints stay, and the rerun ends as the uninterrupted run."""
    out, mark = str(tmp_path / "out"), str(tmp_path / "held")
    every = ("run.checkpoint_every=0", "run.checkpoint_every_steps=6")
    cmd = TORCHRUN + ["--standalone", "--nproc-per-node=2", "tests/runner/held_save_launch.py", *DEMO, *CPU,
                      f"run.out_dir={out}", *every]  # fmt: skip
    env = {**ENV, "HELD_SAVE_AFTER": "2", "HELD_SAVE_MARK": mark, "HELD_SAVE_RANKS": "1"}
    job = Job(cmd, str(tmp_path / "lost.log"), env=env)
    wait_for_file(f"{mark}-1", job)
    os.kill(job.workers()[1], signal.SIGKILL)
    assert job.wait(timeout=120) == 1, job.output[-3000:]
    output = job.output
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 0 lost the connection to rank 1 in "), output[-3000:]
    assert "rank 1 ended without a word" in errors[0]
    assert not re.search(r'File ".*(distlib|launch\.py)', output), output[-3000:]  # no worker's traceback
    assert checkpoints(out) == [step_name(6), step_name(12)], os.listdir(os.path.join(out, "checkpoints"))
    assert_nothing_left(job)

    again = torchrun(out, *every, name="lost-resumed")
    assert again.wait() == 0, again.output[-3000:]
    assert f"resuming from {os.path.join(out, 'checkpoints', step_name(12))}: epoch 0, step 12" in again.output
    assert trajectory(out) == reference["trajectory"]
    assert_same_model(final_model(out), reference["model"])


def test_a_data_error_found_mid_run_by_one_rank_ends_every_rank_with_it(tmp_path):
    """Token ids beyond the model's vocabulary past the first 65,536 tokens (checked at the start): the rank
    whose batch holds one first finds it mid-run; every rank says it (the file, the token) and exits 2, as for
    an error found at the start, not "lost the connection" with 1."""
    from distlib.runner.data.token_files import HEADER_BYTES, write_token_file

    data = tmp_path / "tokens"
    shutil.copytree(os.path.join(ROOT, "data/shakespeare-demo/tokens"), data)
    train = str(data / "train_000000.bin")
    tokens = np.fromfile(train, dtype=np.uint16, offset=HEADER_BYTES).copy()
    tokens[[70_001, 100_003, 130_007, 160_009, 190_013, 220_019]] = 600  # vocabulary 512
    write_token_file(train, tokens, "uint16")
    cmd = TORCHRUN + ["--standalone", "--nproc-per-node=2", "launch.py", "recipes/gpt_tokens_demo.yaml", *CPU,
                      "train.epochs=1", f"data.root={data}", f"run.out_dir={tmp_path / 'out'}"]  # fmt: skip
    job = Job(cmd, str(tmp_path / "data_error.log"))
    assert job.wait() == 1, job.output[-3000:]
    output = job.output
    assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", output)) == {"2"}, output[-3000:]  # torchrun's summary
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and all(f"{train}: token id 600 (token " in e for e in errors), output[-3000:]
    assert "lost the connection" not in output and not re.search(r'File ".*(distlib|launch\.py)', output)
    assert_nothing_left(job)


def test_sigterm_stops_every_rank_at_one_step_with_a_checkpoint_and_the_rerun_ends_the_same(tmp_path, reference):
    out = str(tmp_path / "out")
    job = torchrun(out, name="sigterm")
    signal_while_training(job, out, signal.SIGTERM)  # to torchrun, which forwards it to every worker
    code = job.wait(timeout=60)
    assert code == 1, job.output[-3000:]  # torchrun reports a signal as a failure; a worker alone exits 143
    epoch, step = stopped_at(job, out, "SIGTERM", epochs=3)
    assert_nothing_left(job)

    again = torchrun(out, name="sigterm-resumed")
    assert again.wait() == 0, again.output[-3000:]
    assert f"epoch {epoch - 1}, step {step}" in again.output
    assert trajectory(out) == reference["trajectory"]  # bit-for-bit, from the middle of an epoch
    assert_same_model(final_model(out), reference["model"])


def test_a_stopped_rank_ends_the_job_within_the_timeout_and_is_named(tmp_path):
    out = str(tmp_path / "out")
    timeout = 10
    job = torchrun(out, f"dist.timeout_s={timeout}", name="sigstop")
    wait_for_file(os.path.join(out, "checkpoints", step_name(STEPS)), job)
    stalled = job.workers()[1]
    os.kill(stalled, signal.SIGSTOP)
    t0 = time.monotonic()
    code = job.wait(timeout=120)
    took = time.monotonic() - t0
    assert code == 1
    assert took < timeout + grace_s(timeout) + 8, f"took {took:.1f} s"  # 8 s: torchrun's teardown on a busy CI
    output = job.output
    # the collective is named when the traceback shows it (not for an asynchronous one's wait())
    assert re.search(r"rank 0 timed out waiting for the other ranks in [\w ]+ \(called from ", output), output[-3000:]
    assert f"after {timeout} s (dist.timeout_s)" in output
    assert f"[distlib watchdog] rank 1 (pid {stalled} on " in output and "state T (stopped)" in output
    assert_nothing_left(job)


# Stop signals as clusters deliver them: to every process of the job (Slurm's scancel, Kubernetes), or to
# torchrun (which forwards it), once or in copies, at a random moment: during the start, a step, a background
# save, the final evaluation and save, the teardown. Seeded; DISTLIB_SIGNAL_TRIALS=N runs N trials (each an
# interrupted run and its rerun, about a minute here), DISTLIB_SIGNAL_SEED another set of moments.
SIGNAL_SEED = int(os.environ.get("DISTLIB_SIGNAL_SEED", "0"))
EVERY_6 = ("run.checkpoint_every_steps=6",)  # background saves every 6 steps too: more moments inside a save


# (to every process, copies, moment) of the first trials: what schedulers do (every process, a copy from
# torchrun), in each stage; later trials draw all three
SCENARIOS = [(True, 2, "save"), (True, 1, "training"), (True, 3, "start"), (True, 2, "final save"), (False, 1, "save")]
SIGNAL_TRIALS = int(os.environ.get("DISTLIB_SIGNAL_TRIALS", str(len(SCENARIOS))))  # each scenario once by default


def signal_moment(job: Job, out_dir: str, rng: random.Random, kind: str) -> str:
    """Wait for a random moment of the run's stage ``kind``: a random time into its start (once the workers
    run), a random time into training (after its first committed checkpoint), or within 30 ms of a random
    background save's partial directory appearing, or the final save's (during the final evaluation).
    Returns the moment."""
    directory = os.path.join(out_dir, "checkpoints")
    if kind == "start":
        while len(job.workers()) < 2 and job.proc.poll() is None:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 8.0))
        return kind
    if kind == "training":
        wait_for_file(os.path.join(directory, step_name(6)), job)
        time.sleep(rng.uniform(0.0, 3.0))
        return kind
    step = FINAL if kind == "final save" else rng.choice(range(6, FINAL, 6))
    partial, committed = (os.path.join(directory, f"{p}{step_name(step)}") for p in (".partial-", ""))
    while not (os.path.exists(partial) or os.path.exists(committed)) and job.proc.poll() is None:
        time.sleep(0.002)  # a save of this demo takes tens of milliseconds
    time.sleep(rng.uniform(0.0, 0.03))
    return f"save of step {step}"


@pytest.mark.parametrize("trial", range(SIGNAL_TRIALS))
def test_stop_signals_at_random_moments_end_every_rank_with_a_checkpoint_and_the_rerun_is_bit_equal(
    tmp_path, reference, trial
):
    out = signal_trial(tmp_path, trial, CPU)
    assert trajectory(out) == reference["trajectory"]
    assert_same_model(final_model(out), reference["model"])


def signal_trial(tmp_path, trial: int, device: list[str]) -> str:
    """One trial: a run signalled at a random moment, its checks, and its rerun to the end (which must
    train every epoch once). Returns the run directory."""
    rng = random.Random(f"{SIGNAL_SEED}-{trial}")
    sig = signal.SIGTERM if trial == 0 else rng.choice([signal.SIGTERM, signal.SIGTERM, signal.SIGINT])
    if trial < len(SCENARIOS):
        to_all, copies, kind = SCENARIOS[trial]
    else:
        to_all, copies = rng.random() < 0.75, rng.choice([1, 2, 3])
        kind = rng.choice(["start", "training", "save", "save", "final save"])
    out = str(tmp_path / "out")
    job = torchrun(out, *EVERY_6, name="signalled", device=device)
    moment = signal_moment(job, out, rng, kind)
    sent = time.monotonic()
    for _ in range(copies):
        targets = [p for p, _ in descendants(job.proc.pid)] if to_all else []
        for pid in [job.proc.pid, *targets]:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        time.sleep(rng.uniform(0.0, 0.05))
    job.wait(timeout=120)
    took, output = time.monotonic() - sent, job.output
    what = f"trial {trial} (seed {SIGNAL_SEED}): {signal.Signals(sig).name} x{copies} to " \
           f"{'every process' if to_all else 'torchrun'} at {moment}, ended after {took:.1f} s"  # fmt: skip
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", output)]  # torchrun's failure summary
    assert set(codes) <= {128 + sig}, f"{what}: worker exit codes {codes}\n{output[-4000:]}"
    # a worker that hangs is SIGKILLed by torchrun 30 s after the signal: exit code -9 above
    assert took < 60, f"{what}: a hang\n{output[-4000:]}"
    ours = [line for line in output.splitlines() if re.search(r'File ".*(distlib|launch\.py)', line)]
    assert not ours and "lost the connection" not in output, f"{what}\n{output[-4000:]}"
    if m := re.search(rf"stopped by {signal.Signals(sig).name} at epoch (\d+) step (\d+); checkpoint saved", output):
        assert step_name((int(m.group(1)) - 1) * STEPS + int(m.group(2))) in checkpoints(out), what
    assert_nothing_left(job)

    again = torchrun(out, *EVERY_6, name="rerun", device=device)
    assert again.wait() == 0, f"{what}\n{again.output[-3000:]}"
    assert [r["epoch"] for r in metrics(out)] == [1, 2, 3], what  # no epoch twice, none skipped
    print(what)  # pytest -s or -rP shows the moments tried
    return out


def test_sigint_stops_a_single_process_run_with_a_checkpoint_and_exit_130(tmp_path):
    out = str(tmp_path / "out")
    job = Job([sys.executable, "launch.py", *DEMO, *CPU, f"run.out_dir={out}"], str(tmp_path / "sigint.log"))
    signal_while_training(job, out, signal.SIGINT)
    assert job.wait(timeout=60) == 130, job.output[-3000:]
    stopped_at(job, out, "SIGINT", epochs=3)


def test_two_nodes_give_the_same_result_as_one(tmp_path, reference):
    out = str(tmp_path / "out")
    port = free_port()
    jobs = [
        Job(
            TORCHRUN
            + [
                "--nnodes=2",
                f"--node-rank={n}",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=two-nodes",
                "launch.py",
                *DEMO,
                *CPU,
                f"run.out_dir={out}",
            ],
            str(tmp_path / f"node{n}.log"),
        )  # fmt: skip
        for n in (0, 1)
    ]
    for job in jobs:
        assert job.wait() == 0, job.output[-3000:]
    assert "world_size=2" in jobs[0].output + jobs[1].output
    assert trajectory(out) == reference["trajectory"]
    assert_same_model(final_model(out), reference["model"])


# ---- bad input ------------------------------------------------------------------------------


@pytest.fixture
def distlib_log():
    """What the distlib logger says during an in-process launch.main (it does not propagate)."""
    records: list[str] = []

    class ListHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = ListHandler()
    logger = logging.getLogger("distlib")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def run_launch(tmp_path, *overrides: str, recipe: str = "recipes/demo.yaml") -> int:
    """launch.main in this process (world size 1): fast, for errors found before training."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return launch.main([recipe, "train.epochs=1", "data.train_subset=256", "model.width=4",
                            f"run.out_dir={tmp_path / 'out'}", *overrides])  # fmt: skip
    finally:
        os.chdir(cwd)


def small_imagefolder(root, corrupt: str = "") -> str:
    """2 classes x 4 demo JPEGs in train/ and test/, one file replaced by ``corrupt`` bytes."""
    src = os.path.join(ROOT, "data/cifar10-demo/train")
    for split in ("train", "test"):
        for cls in ("cat", "dog"):
            os.makedirs(os.path.join(root, split, cls))
            for name in sorted(os.listdir(os.path.join(src, cls)))[:4]:
                shutil.copy(os.path.join(src, cls, name), os.path.join(root, split, cls, name))
    bad = os.path.join(root, "train", "dog", "0001.jpg")
    if corrupt == "truncated":
        data = open(bad, "rb").read()
        open(bad, "wb").write(data[: len(data) // 3])
    elif corrupt == "not_an_image":
        open(bad, "wb").write(b"this is not a JPEG")
    return bad


# The exit code of each situation in docs/reliability.md's table (rows found by the start of their first cell).
CASES = {
    "malformed YAML": 2,
    "unknown config key": 2,
    "wrong type": 2,
    "missing data": 2,
    "corrupt image": 2,
    "batch size does not divide": 2,
    "more processes than GPUs": 2,
    "port in use, rank 0 hosts the store": 2,
    "checkpoint of another model or config": 2,
    "one-file checkpoints": 2,
    "no readable checkpoint": 2,
    "corrupt newest checkpoint": 0,
}
# The codes the torchrun and signal tests above check, as docs/reliability.md's table words them.
RUNTIME = {
    "port in use, `torchrun --master-port": "1 (torchrun)",
    "a rank killed, under `torchrun --max-restarts": "0",
    "a stalled rank": "1 (torchrun)",
    "a rank lost while a background save": "1 (the survivor); torchrun exits 1",
    "a data error found mid-run": "2 (every rank); torchrun exits 1",
    "the disk full during a run": "2 (every rank); torchrun exits 1",  # test_disk_full.py
    "out of GPU memory in a step": "2 (every rank); torchrun exits 1",  # test_out_of_memory.py
    "SIGTERM or SIGINT before training": "143 / 130",  # test_trainer.py
    "SIGTERM": "143 (`python launch.py`); torchrun exits 1",  # 143: test_stop.py
    "SIGINT": "130 (`python launch.py`); torchrun exits 1",
}


def test_malformed_or_unknown_config(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    assert run_launch(tmp_path, recipe=str(bad)) == CASES["malformed YAML"]
    assert "malformed YAML" in capsys.readouterr().err
    assert run_launch(tmp_path, "train.epoch=3") == CASES["unknown config key"]
    assert "train.epoch: unknown key (valid keys here: epochs," in capsys.readouterr().err
    assert run_launch(tmp_path, "train.batch_size=big") == CASES["wrong type"]
    assert "train.batch_size: expected int, got 'big'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written


def test_missing_data(tmp_path, capsys):
    assert run_launch(tmp_path, f"data.root={tmp_path / 'nowhere'}") == CASES["missing data"]
    assert "error: no data set at data.root=" in capsys.readouterr().err


@pytest.mark.parametrize("corrupt", ["truncated", "not_an_image"])
def test_corrupt_image(tmp_path, corrupt, capsys):
    bad = small_imagefolder(str(tmp_path / "images"), corrupt)
    code = run_launch(tmp_path, f"data.root={tmp_path / 'images'}", f"data.cache_dir={tmp_path / 'cache'}")
    assert code == CASES["corrupt image"]
    err = capsys.readouterr().err
    assert f"error: {bad}: corrupt or unusable image: " in err, err


def test_batch_size_that_does_not_divide(tmp_path, capsys):
    assert run_launch(tmp_path, "train.batch_size=100", "train.grad_accum=3") == CASES["batch size does not divide"]
    assert "train.batch_size=100 must divide evenly over 1 ranks x train.grad_accum=3" in capsys.readouterr().err


def test_more_processes_than_gpus(tmp_path, monkeypatch, capsys):
    env = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    for k, v in {**env, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert run_launch(tmp_path) == CASES["more processes than GPUs"]
    assert "2 processes on this node but only 1 GPU(s) visible" in capsys.readouterr().err


def test_port_in_use(tmp_path, monkeypatch, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
        for k, v in {**env, "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(k, v)
        assert run_launch(tmp_path, "dist.backend=gloo") == CASES["port in use, rank 0 hosts the store"]
        assert f"MASTER_PORT={port} is already in use" in capsys.readouterr().err

        # torchrun itself binds --master-port before any worker runs: its own error, exit code 1
        monkeypatch.undo()
        t0 = time.monotonic()
        r = subprocess.run(TORCHRUN + ["--nproc-per-node=2", f"--master-port={port}", "launch.py", *DEMO],
                           cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert r.returncode == 1 and time.monotonic() - t0 < 60
        assert "EADDRINUSE" in r.stderr and f"port: {port}" in r.stderr


def test_checkpoint_of_another_model_or_config(tmp_path, capsys):
    assert run_launch(tmp_path) == 0
    capsys.readouterr()
    assert run_launch(tmp_path, "model.width=8", "train.lr=0.3") == CASES["checkpoint of another model or config"]
    text = capsys.readouterr().err
    assert "error: checkpoint " in text and "is from another model or settings" in text
    assert (
        "model.width: checkpoint has 4, this run has 8" in text
        and "train.lr: checkpoint has 0.2, this run has 0.3" in text
    )
    assert run_launch(tmp_path, "model.width=8", "train.lr=0.3", "run.resume=false") == 0  # start over


def test_one_file_checkpoints(tmp_path, capsys):
    """distlib.Checkpointer's format in the run's checkpoints directory: named, not loaded."""
    model = torch.nn.Linear(2, 2)
    directory = tmp_path / "out" / "checkpoints"
    distlib.Checkpointer(str(directory)).save({"model": model}, epoch=3, step=0, global_step=3, fingerprint={})
    assert run_launch(tmp_path) == CASES["one-file checkpoints"]
    err = capsys.readouterr().err
    assert f"error: {directory} holds one-file checkpoints (epoch0003-step000000.pt)" in err, err
    assert run_launch(tmp_path, "run.resume=false") == 0
    assert sorted(os.listdir(directory)) == checkpoints(tmp_path / "out")  # the one-file one deleted


def test_corrupt_checkpoints(tmp_path, distlib_log, capsys):
    """A checkpoint with a truncated shard file, or one whose bytes changed (the records' CRC-32s), is
    skipped for the previous one; none usable stops the resume."""
    first = ("train.epochs=2", "run.checkpoint_every=1")
    assert run_launch(tmp_path, *first) == 0
    directory = tmp_path / "out" / "checkpoints"
    older, newest = (directory / name for name in checkpoints(tmp_path / "out"))
    shard = newest / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    assert run_launch(tmp_path, *first) == CASES["corrupt newest checkpoint"]
    assert any(m.startswith("skipping checkpoint: ") and "has 1000 bytes" in m for m in distlib_log), distlib_log
    assert f"resuming from the older checkpoint {older}" in distlib_log
    assert [r["epoch"] for r in metrics(str(tmp_path / "out"))] == [1, 2]
    assert checkpoints(tmp_path / "out") == [older.name, newest.name]  # the damaged one saved again
    for step in (older, newest):
        flip_a_tensor_byte(str(step), "__0_0.distcp")  # the size the same, a record's CRC-32 not
    assert run_launch(tmp_path, *first) == CASES["no readable checkpoint"]
    err = capsys.readouterr().err
    assert "error: none of the 2 committed checkpoint(s) in" in err and "is usable" in err
    assert sum(m.startswith("skipping checkpoint: ") and "checksum mismatch" in m for m in distlib_log) == 2


def test_the_docs_table_matches_these_tests():
    text = open(os.path.join(ROOT, "docs", "reliability.md")).read()
    section = text.split("## What you see when something is wrong", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| Situation")]
    codes = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if cells[0].startswith("---"):
            continue
        codes[cells[0]] = cells[-1]
    expected = {**{k: str(v) for k, v in CASES.items()}, **RUNTIME}
    for case, code in expected.items():
        matching = [k for k in codes if k.lower() == case.lower()] or [
            k for k in codes if k.lower().startswith(case.lower())
        ]
        assert len(matching) == 1, f"docs/reliability.md's table has {len(matching)} rows for {case!r}"
        assert codes[matching[0]] == code, (case, codes[matching[0]])
    assert len(codes) == len(expected), f"rows no test checks: {set(codes) - set(expected)}"


# ---- the same on two GPUs with NCCL (skipped on CPU machines) ---------------------------------

NCCL = ["dist.backend=nccl"]


@pytest.mark.gpus(2)
def test_gpu_a_killed_worker_is_restarted_and_resumes(tmp_path):
    out = str(tmp_path / "out")
    job = torchrun(out, extra=("--max-restarts=1",), name="gpu-killed", device=NCCL)
    wait_for_file(os.path.join(out, "checkpoints", step_name(STEPS)), job)
    os.kill(job.workers()[1], signal.SIGKILL)
    assert job.wait() == 0, job.output[-4000:]
    assert "backend=nccl" in job.output and "resuming from" in job.output
    assert [r["epoch"] for r in metrics(out)] == [1, 2, 3]
    assert_nothing_left(job)


@pytest.mark.gpus(2)
def test_gpu_sigterm_saves_and_the_rerun_finishes(tmp_path):
    # an epoch of the demo takes well under 0.1 s on a GPU: 100 of them leave seconds of training
    # after the first epoch's row, where the signal is sent
    out, epochs = str(tmp_path / "out"), 100
    job = torchrun(out, f"train.epochs={epochs}", "run.checkpoint_every=0", name="gpu-sigterm", device=NCCL)
    signal_while_training(job, out, signal.SIGTERM)
    assert job.wait(timeout=60) == 1, job.output[-3000:]  # torchrun reports a signal as a failure
    epoch, step = stopped_at(job, out, "SIGTERM", epochs=epochs)
    assert_nothing_left(job)
    again = torchrun(out, f"train.epochs={epochs}", "run.checkpoint_every=0", name="gpu-sigterm-resumed", device=NCCL)
    assert again.wait() == 0, again.output[-3000:]
    assert f"epoch {epoch - 1}, step {step}" in again.output  # resumed from the checkpoint the signal left
    assert [r["epoch"] for r in metrics(out)] == list(range(1, epochs + 1))


@pytest.mark.gpus(2)
@pytest.mark.parametrize("trial", range(min(SIGNAL_TRIALS, len(SCENARIOS))))
def test_gpu_stop_signals_at_random_moments_end_every_rank_with_a_checkpoint(tmp_path, trial):
    """The CPU trials' scenarios on NCCL ranks (the rerun trains every epoch once; not compared bit for bit)."""
    signal_trial(tmp_path, trial, NCCL)


@pytest.mark.gpus(2)
def test_gpu_a_stopped_rank_ends_the_job_within_the_timeout(tmp_path):
    out = str(tmp_path / "out")
    timeout = 20
    job = torchrun(out, f"dist.timeout_s={timeout}", "train.epochs=30", name="gpu-sigstop", device=NCCL)
    wait_for_file(os.path.join(out, "checkpoints", step_name(STEPS)), job)
    stalled = job.workers()[1]
    os.kill(stalled, signal.SIGSTOP)
    t0 = time.monotonic()
    code = job.wait(timeout=180)
    took = time.monotonic() - t0
    assert code == 1 and took < timeout + grace_s(timeout) + 10, (code, took, job.output[-4000:])
    assert f"[distlib watchdog] rank 1 (pid {stalled} on " in job.output
    assert_nothing_left(job)
