"""A run whose disk fills up: one ``error:`` line naming the directory, what was written, what it needs and
what is free; exit 2 on every rank, no traceback; the partial checkpoint removed, the committed ones intact,
and the run resumes from them elsewhere. The end-to-end runs write into a real small file system: a tmpfs
mounted in a mount namespace of the test's own (``unshare``; skipped where the machine does not allow it),
which disappears with the command."""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from distlib.checkpoint.disk import DiskFull
from distlib.runner.main import _teardown
from distlib.runner.observability.tensorboard import TensorBoardLog
from distlib.runner.training.outcome import exit_code
from tests.conftest import ROOT
from tests.runner.conftest import checkpoints

PY = shlex.quote(sys.executable)
GPT = ["recipes/gpt_demo.yaml", "run.curves=off"]


def _unshare_allowed() -> bool:
    probe = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"distlib-tmpfs-probe-{os.getpid()}")
    os.makedirs(probe, exist_ok=True)
    try:
        r = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {probe}"],
                           capture_output=True, timeout=30)  # fmt: skip
        return r.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        os.rmdir(probe)


needs_tmpfs = pytest.mark.skipif(not shutil.which("unshare") or not _unshare_allowed(),
                                 reason="no mount namespace with a tmpfs allowed here (unshare -rm)")  # fmt: skip


def on_a_small_disk(disk: str, kib: int, script: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the bash ``script`` from the repository's root with a tmpfs of ``kib`` KiB mounted at ``disk``,
    in a mount namespace of its own: the file system is gone when the script ends (copy out what is kept)."""
    os.makedirs(disk, exist_ok=True)
    body = f"mount -t tmpfs -o size={kib}k tmpfs {shlex.quote(disk)} || exit 99; {script}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    r = subprocess.run(["unshare", "-rm", "bash", "-c", body], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env=env)  # fmt: skip
    assert r.returncode != 99, r.stderr
    return r


def _errors(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error: ")]


def _workers(out: str) -> str:
    """The workers' output: what precedes torchrun's own failure report (its summary and traceback)."""
    return out.split(" failed (exitcode: ")[0]


@pytest.mark.slow
@needs_tmpfs
def test_a_periodic_save_on_a_full_disk_ends_in_one_line_and_the_run_resumes_elsewhere(tmp_path):
    """The GPT demo at 2 ranks, a checkpoint every 5 steps, on 3 MiB (one checkpoint is 1.7 MB): the save of
    step 10 finds the disk full. Each rank says the same one line and exits 2; no traceback; the partial
    directory is gone and step 5 is intact; copied to another disk, the run resumes from it and finishes.
    Its export into 64 KiB then ends in one line as well, leaving no file behind."""
    disk, kept = str(tmp_path / "disk"), str(tmp_path / "kept")
    run = f"{disk}/run"
    r = on_a_small_disk(disk, 3 * 1024, (
        f"{PY} -m torch.distributed.run --standalone --nproc-per-node=2 launch.py {' '.join(GPT)} "
        f"run.out_dir={run} run.checkpoint_every_steps=5; echo exit=$?; cp -a {run} {kept}"))  # fmt: skip
    out = r.stdout + r.stderr
    errors = _errors(out)
    assert 1 <= len(errors) <= 2 and len(set(errors)) == 1, out  # one a rank, the same (one, if torchrun ends
    # the other first: it exits 2 even so)
    assert errors[0].startswith(f"error: the disk is full: writing checkpoint step000000010 into {run}/checkpoints "
                                "needs about "), out  # fmt: skip
    assert "free there; the partial save is removed, the committed checkpoints (the newest step000000005) are " \
        "intact; free space on that disk, or write to another" in errors[0], out  # fmt: skip
    assert out.count("exitcode  : 2") == 2 and "exit=1" in out, out  # both workers 2; torchrun's own exit 1
    assert "Traceback" not in _workers(out) and "Exception in thread" not in out, out
    assert sorted(os.listdir(os.path.join(kept, "checkpoints"))) == ["step000000005"], out
    # resumed elsewhere: from step 5, to the end of a shorter budget
    resumed = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                              "launch.py", *GPT, f"run.out_dir={kept}", "run.checkpoint_every_steps=5",
                              "train.max_steps=12"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {kept}/checkpoints/step000000005" in resumed.stderr
    assert checkpoints(kept)[-1] == "step000000012"
    # the export of the finished run onto a disk too small for its model
    exported = f"{disk}/model"
    r = on_a_small_disk(disk, 64, f"{PY} -m distlib.runner.export {kept} {exported} --dtype fp32; echo exit=$?; "
                                  f"ls -a {exported}")  # fmt: skip
    out = r.stdout + r.stderr
    assert _errors(out) == [next(e for e in _errors(out))] and "exit=2" in out, out
    assert _errors(out)[0].startswith(f"error: the disk is full: writing model.safetensors into {exported} needs "
                                      "about "), out  # fmt: skip
    assert "Traceback" not in out and "model.safetensors" not in r.stdout.split("exit=2")[1], out


@pytest.mark.slow
@needs_tmpfs
@pytest.mark.parametrize(("final", "kib", "what"), [("full", 1024, "checkpoint step000000010"),
                                                    ("weights", 256, "checkpoint step000000010")])  # fmt: skip
def test_the_final_save_on_a_full_disk_is_warned_of_at_the_start_and_ends_in_one_line(tmp_path, final, kib, what):
    """One process, no checkpoint before the final one (full, or the weights alone): the start warns that the
    disk cannot hold one, the final save ends the run in one line, exit 2, nothing partial left; the metrics
    rows written before are whole."""
    disk = str(tmp_path / "disk")
    run = f"{disk}/run"
    where = f"{run}/checkpoints" if final == "full" else f"{run}/weights"
    r = on_a_small_disk(disk, kib, (
        f"{PY} launch.py {' '.join(GPT)} run.out_dir={run} train.max_steps=10 train.eval_every_steps=5 "
        f"run.final_checkpoint={final}; echo exit=$?; ls -a {where}; cat {run}/metrics.jsonl"))  # fmt: skip
    out = r.stdout + r.stderr
    assert f"WARNING {run} has " in out and "less than one checkpoint of this run needs (about " in out, out
    errors = _errors(out)
    assert len(errors) == 1 and errors[0].startswith(f"error: the disk is full: writing {what} into {where}"), out
    assert "exit=2" in out and "Traceback" not in out, out
    listing = r.stdout.split("exit=2")[1].split()
    assert listing[:2] == [".", ".."] and not any(n.startswith((".partial", "step")) for n in listing), out
    rows = [line for line in r.stdout.splitlines() if line.startswith("{")]
    # the weights are saved before the final evaluation's row, the full checkpoint beside that evaluation
    assert [json.loads(row)["step"] for row in rows] == ([5, 10] if final == "full" else [5]), out


# ---- the run directory's other writes --------------------------------------------------------------


def test_tensorboard_on_a_full_disk_raises_disk_full(tmp_path):
    log = TensorBoardLog(str(tmp_path), enabled=False)

    class Writer:
        def add_scalar(self, *args, **kwargs):
            pass

        def flush(self):  # the event writer's thread kept the error of its write for this call
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        close = flush

    log.writer = Writer()
    with pytest.raises(DiskFull, match=f"the disk is full: writing TensorBoard's event file into {tmp_path}"):
        log.log({"train_loss": 1.5}, step=4)
    log.writer = Writer()
    with pytest.raises(DiskFull):
        log.close()
    assert log.writer is None  # closed once, even so


def test_a_full_disk_in_the_teardown_is_said_in_one_line_with_exit_2(tmp_path, capfd):
    """summary.json, the run's last write, after its processes have left the group: main() says it as any
    other full disk (not a traceback)."""

    class Trainer:
        def close(self, failure):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "summary.json"))

    late = _teardown(Trainer(), None)
    assert isinstance(late, OSError)
    assert exit_code(late, 0.0) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"error: the disk is full: writing summary.json into {tmp_path}, ") and err.count("\n") == 1
    assert err.endswith(" free there; free space on that disk, or write to another\n"), err


def test_other_errors_of_the_teardown_stay_bugs():
    class Trainer:
        def close(self, failure):
            raise OSError(errno.EACCES, "Permission denied")

    with pytest.raises(OSError, match="Permission denied"):
        _teardown(Trainer(), None)
