"""The metrics interface: every sink implements ``MetricSink``, ``Metrics`` hands each row to the
sinks a recipe chose; W&B (offline, no network) and MLflow (a local store) are read back with their
own libraries' formats and compared with metrics.jsonl; a resumed run continues the same tracker
run; without matplotlib or torchvision an LM recipe still runs and an image recipe names the extra."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
import time

import pytest

from distlib.runner.config import ConfigError, load_config
from distlib.runner.observability.metrics import MLflowSink, WandbSink
from distlib.runner.observability.plots import CurvePlot
from distlib.runner.observability.progress import TrainingProgress
from distlib.runner.observability.run_dir import RunDir
from distlib.runner.observability.sink import Metrics, MetricSink, scalars
from distlib.runner.observability.tensorboard import TensorBoardLog
from tests.conftest import ROOT, run_ranks
from tests.runner.test_trainer import metrics

GPT_DEMO = os.path.join(ROOT, "recipes", "gpt_demo.yaml")
ROWS = [
    {"epoch": 1, "epoch_step": 4, "step": 4, "train_loss": 2.5, "lr": 0.1, "tokens_per_s": 10.0, "val_loss": None},
    {"epoch": 1, "step": 8, "train_loss": 2.25, "lr": 0.05, "val_loss": 2.75, "val_ppl": 15.6,
     "peak_mem_gib": [1.5, 1.25]},
]  # fmt: skip


class Recorder(MetricSink):
    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def log(self, row, step):
        self.calls.append((self.name, "log", step))

    def log_text(self, tag, text, step):
        self.calls.append((self.name, "text", tag))

    def training_done(self):
        self.calls.append((self.name, "done"))

    def close(self):
        self.calls.append((self.name, "close"))


def test_every_sink_is_a_metric_sink_and_metrics_calls_each_in_order():
    for sink in (RunDir, TrainingProgress, CurvePlot, TensorBoardLog, WandbSink, MLflowSink):
        assert issubclass(sink, MetricSink), sink
    calls: list = []
    m = Metrics([Recorder("a", calls), Recorder("b", calls)])
    m.log(ROWS[0], 4)
    m.log_text("sample", "hi", 4)
    m.training_done()
    m.close()
    assert calls == [("a", "log", 4), ("b", "log", 4), ("a", "text", "sample"), ("b", "text", "sample"),
                     ("a", "done"), ("b", "done"), ("a", "close"), ("b", "close")]  # fmt: skip


def test_a_rows_numbers_get_tracker_names_and_empty_values_are_skipped():
    assert scalars(ROWS[0]) == {"train/loss": 2.5, "train/lr": 0.1, "throughput/tokens_per_s": 10.0}
    assert scalars(ROWS[1]) == {"train/loss": 2.25, "train/lr": 0.05, "eval/loss": 2.75, "eval/perplexity": 15.6,
                                "memory/peak_gib_rank0": 1.5, "memory/peak_gib_rank1": 1.25}  # fmt: skip


def test_the_run_directory_and_the_progress_display_take_rows_as_sinks(tmp_path, capsys):
    run = RunDir(str(tmp_path), is_main=True)
    progress = TrainingProgress("plain", enabled=True)
    progress.start(epochs=1, steps_per_epoch=8, images_per_step=4, unit="tok")
    Metrics([run, progress]).log(ROWS[1], 8)
    assert run.read_metrics() == [ROWS[1]]
    progress.close()
    shown = capsys.readouterr()
    assert "2.25" in shown.out + shown.err  # the row's training loss, on the display


# ---- Weights & Biases ------------------------------------------------------------------------


def wandb_records(path: str) -> list:
    """The records of one W&B transaction log (``run-<id>.wandb``: a LevelDB-style log of
    ``wandb_internal_pb2.Record``s), up to the first one not yet written whole."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    data, pos, block, buf = open(path, "rb").read(), 7, 32768, b""  # 7: ":W&B", magic, version
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if pos + length > len(data):  # still being written
            break
        buf += data[pos : pos + length]
        pos += length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            try:
                record.ParseFromString(buf)
            except DecodeError:
                break
            out.append(record)
            buf = b""
    return out


def wandb_history(run_dir, runs: int) -> tuple[list[str], list[dict]]:
    """The run ids and logged rows (in step order) of every offline W&B run in ``run_dir``. W&B's
    writer (its wandb-core service) can finish a run's file after ``run.finish()`` has returned: this
    waits, up to 60 s, until ``runs`` files each hold their run's exit record."""
    deadline = time.monotonic() + 60
    while True:
        paths = sorted(glob.glob(os.path.join(str(run_dir), "wandb", "offline-run-*", "run-*.wandb")))
        logs = [wandb_records(path) for path in paths]
        finished = [any(r.WhichOneof("record_type") == "exit" for r in log) for log in logs]
        if (len(logs) >= runs and all(finished)) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    ids, rows = [], []
    for record in (r for log in logs for r in log):
        if record.WhichOneof("record_type") == "run":
            ids.append(record.run.run_id)
        elif record.WhichOneof("record_type") == "history":
            item = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            rows.append({k: v for k, v in item.items() if not k.startswith("_")})
    return ids, sorted(rows, key=lambda row: row.get("step", -1))


def test_wandb_offline_logs_each_rows_numbers_at_its_step_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(str(tmp_path), name="t", config={"train": {"lr": 0.1}}, project="p", mode="offline")
    sink.log(ROWS[0], 4)
    sink.log_text("sample", "text", 4)
    sink.close()
    again = WandbSink(str(tmp_path), name="t", config={"train": {"lr": 0.1}}, project="p", mode="offline")
    again.log(ROWS[1], 8)
    again.close()
    again.close()  # twice is fine
    ids, rows = wandb_history(tmp_path, runs=2)
    assert len(ids) == 2 and ids[0] == ids[1] == open(tmp_path / "wandb_run_id").read().strip()
    assert rows == [{"step": 4, **scalars(ROWS[0])}, {"step": 8, **scalars(ROWS[1])}]


# ---- MLflow -----------------------------------------------------------------------------------


def test_mlflow_logs_params_and_metrics_in_a_local_store_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    config = {"train": {"lr": 0.1, "epochs": 2}, "model": {"name": "gpt", "args": {}}}
    sink = MLflowSink(str(tmp_path), name="t", config=config, experiment="e")
    sink.log(ROWS[0], 4)
    sink.close()  # stopped: the run is marked killed, its id kept
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run_id = open(tmp_path / "mlflow_run_id").read().strip()
    assert client.get_run(run_id).info.status == "KILLED"
    again = MLflowSink(str(tmp_path), name="t", config=config, experiment="e")
    assert again.run_id == run_id
    again.log(ROWS[1], 8)
    again.log_text("sample", "text", 8)
    again.training_done()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "t"
    assert run.data.params == {"train.lr": "0.1", "train.epochs": "2", "model.name": "gpt", "model.args": "{}"}
    history = {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in run.data.metrics}
    assert history["train/loss"] == [(4, 2.5), (8, 2.25)]
    assert history["eval/loss"] == [(8, 2.75)] and history["memory/peak_gib_rank1"] == [(8, 1.25)]
    assert [a.path for a in client.list_artifacts(run_id)] == ["sample_step8.txt"]
    assert os.listdir(elsewhere) == []  # nothing outside the run directory


# ---- the runner ------------------------------------------------------------------------------

SMALL = ["train.epochs=2", "data.train_subset=64", "model.args.n_layer=1", "model.args.n_embd=32",
         "model.args.n_head=2", "train.batch_size=8", "train.sample_tokens=10", "run.progress=plain"]  # fmt: skip


def _train_with_trackers(ctx, out_dir: str) -> None:
    import launch

    args = [GPT_DEMO, *SMALL, "run.wandb=true", "run.wandb.mode=offline", "run.mlflow=true", "run.curves=off",
            f"run.out_dir={out_dir}"]  # fmt: skip
    assert launch.main(args) == 0


@pytest.mark.slow
def test_a_run_logs_its_rows_to_wandb_and_mlflow_from_rank_0(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    run_ranks(_train_with_trackers, 2, str(out), timeout=300)
    rows = metrics(out)
    ids, logged = wandb_history(out, runs=1)
    assert len(ids) == 1  # rank 0's run only
    assert logged == [{"step": r["step"], **scalars(r)} for r in rows]
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    run_id = open(out / "mlflow_run_id").read().strip()
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == [
        (r["step"], r["train_loss"]) for r in rows
    ]
    assert client.get_run(run_id).data.params["run.out_dir"] == str(out)
    assert not (out / "curves.png").exists()


def test_tracker_sections_switch_on_with_a_boolean_and_report_unknown_keys_at_once():
    cfg = load_config(GPT_DEMO, ["run.wandb=true", "run.mlflow.experiment=x", "run.curves=false"])
    assert cfg.run.wandb.enabled and not cfg.run.mlflow.enabled and cfg.run.mlflow.experiment == "x"
    assert cfg.run.curves == "off"
    assert not load_config(GPT_DEMO, ["run.wandb.mode=offline"]).run.wandb.enabled  # enabled switches it on
    with pytest.raises(ConfigError) as e:
        load_config(GPT_DEMO, ["run.wandb.projekt=a", "run.mlflow=3", "run.wandb.mode=sometimes"])
    assert len(e.value.problems) == 3
    assert "did you mean 'project'" in e.value.problems[0]


def test_a_tracker_whose_package_is_missing_is_refused_naming_its_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    missing = {"wandb", "mlflow", "matplotlib", "tensorboard"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))
    with pytest.raises(ConfigError) as e:
        load_config(GPT_DEMO, ["run.wandb=true", "run.mlflow=true", "run.curves=on", "run.tensorboard=true"])
    text = "\n".join(e.value.problems)
    for extra in ("wandb", "mlflow", "plots", "tensorboard"):
        assert f"pip install 'distlib[{extra}]'" in text, text
    load_config(GPT_DEMO, [])  # curves: auto, not refused without matplotlib


# Runs in a fresh interpreter with the image and plotting packages made unimportable, as for a
# language-model user who installed the runner without them.
_WITHOUT = """
import sys
for n in ("torchvision", "matplotlib", "PIL"):
    sys.modules[n] = None
from distlib.runner.config import ConfigError, load_config
import distlib.runner.training.trainer  # the whole training path imports
cfg = load_config({gpt!r}, [])
try:
    load_config({demo!r}, [])
except ConfigError as e:
    print("\\n".join(e.problems))
"""


def test_a_language_model_recipe_needs_neither_torchvision_nor_matplotlib():
    code = _WITHOUT.format(gpt=GPT_DEMO, demo=os.path.join(ROOT, "recipes", "demo.yaml"))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "data.name=image_folder needs the images extra" in out.stdout
    assert "pip install 'distlib[images]'" in out.stdout


def _train_without_matplotlib(ctx, out_dir: str) -> None:
    import importlib.util

    import launch

    real = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: None if name == "matplotlib" else real(name, *a)
    try:
        assert launch.main([GPT_DEMO, *SMALL, "train.epochs=1", f"run.out_dir={out_dir}"]) == 0
    finally:
        importlib.util.find_spec = real


def test_without_matplotlib_the_run_trains_and_one_line_names_the_plots_extra(tmp_path, capfd):
    run_ranks(_train_without_matplotlib, 1, str(tmp_path / "run"), timeout=180)
    err = capfd.readouterr().err
    assert err.count("pip install 'distlib[plots]'") == 1, err
    assert not (tmp_path / "run" / "curves.png").exists()
