"""A run's metrics and where they go: ``build_metrics`` chooses the sinks a recipe asks for (each one a
``MetricSink``, ``sink.py``) and gathers them in one ``Metrics``; the trackers' sinks (W&B, MLflow) are here.

A row is what ``metrics.jsonl`` holds (``epoch``, ``step``, ``train_loss``, the evaluation's metrics,
the rates, ...), logged at the global optimizer step it ends on. The sinks:

- ``metrics.jsonl`` (always: a resumed run trims it to its checkpoint and the summary reads it back);
- the progress display (always; rank 0 alone prints);
- ``curves.png`` (``run.curves``: needs matplotlib, the ``distlib[plots]`` extra);
- TensorBoard event files (``run.tensorboard``, ``distlib[tensorboard]``);
- Weights & Biases (``run.wandb``, ``distlib[wandb]``; ``mode: offline`` writes its files into the
  run directory with no network, ``wandb sync`` uploads them later);
- MLflow (``run.mlflow``, ``distlib[mlflow]``; by default a local SQLite store in the run directory).

Only the main rank builds the sinks that write; the other ranks' ``Metrics`` holds none. The
optional packages are imported when their sink is built, and the recipe check refuses a sink whose
package is missing before anything starts, so nothing fails here once training has begun. Each
external tracker keeps its run id in the run directory, so a resumed run continues the same
tracker run instead of starting a new one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from distlib.runner.observability.sink import TAGS, Metrics, MetricSink, scalars

if TYPE_CHECKING:
    from distlib.runner.config import Config
    from distlib.runner.observability.progress import TrainingProgress
    from distlib.runner.observability.run_dir import RunDir


def _stored_id(path: str) -> str | None:
    """The tracker run id a previous process of this run left in ``path``."""
    try:
        with open(path) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def _store_id(path: str, run_id: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(run_id + "\n")
    os.replace(tmp, path)


class WandbSink(MetricSink):
    """Weights & Biases: one W&B run per distlib run (its id kept in ``<run>/wandb_run_id``), the
    resolved config as its config, each row's numbers against the global step.

    The rows are plotted against a ``step`` metric of their own rather than W&B's internal step,
    which must only grow: a run resumed from a checkpoint older than its last row logs those steps
    again."""

    ID_FILE = "wandb_run_id"

    def __init__(self, run_dir: str, *, name: str, config: Mapping[str, Any], project: str, entity: str = "",
                 group: str = "", mode: str = "auto"):  # fmt: skip
        import wandb

        id_path = os.path.join(run_dir, self.ID_FILE)
        self.run = wandb.init(
            project=project, entity=entity or None, group=group or None, name=name, id=_stored_id(id_path),
            resume="allow", dir=run_dir, config=dict(config), mode=None if mode == "auto" else mode,
        )  # fmt: skip
        _store_id(id_path, self.run.id)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, row: Mapping[str, Any], step: int) -> None:
        if self.run is not None:
            self.run.log({"step": step, **scalars(row)})

    def log_text(self, tag: str, text: str, step: int) -> None:
        if self.run is not None:
            self.run.summary[tag] = text

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _flat(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow parameters: dotted keys, values as text (the recipe's own spelling)."""
    out: dict[str, str] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = str(value)
    return out


class MLflowSink(MetricSink):
    """MLflow: one MLflow run per distlib run (its id kept in ``<run>/mlflow_run_id``), the resolved
    config as its parameters, each row's numbers at the global step. ``tracking_uri`` "" is a local
    store in the run directory: the SQLite file ``<run>/mlflow.db``, artifacts in ``<run>/mlartifacts``
    (MLflow's plain-folder store is in maintenance mode; ``mlflow ui --backend-store-uri
    sqlite:///<run>/mlflow.db`` shows it)."""

    ID_FILE = "mlflow_run_id"

    def __init__(self, run_dir: str, *, name: str, config: Mapping[str, Any], tracking_uri: str = "",
                 experiment: str = "distlib"):  # fmt: skip
        from mlflow.tracking import MlflowClient

        run_dir = os.path.abspath(run_dir)
        uri = tracking_uri or "sqlite:///" + os.path.join(run_dir, "mlflow.db")
        self.client = MlflowClient(tracking_uri=uri)
        id_path = os.path.join(run_dir, self.ID_FILE)
        self.run_id = _stored_id(id_path)
        if self.run_id is None:
            found = self.client.get_experiment_by_name(experiment)
            # a local store keeps the artifacts beside it (MLflow's default: ./mlruns of the working directory)
            artifacts = None if tracking_uri else "file:" + os.path.join(run_dir, "mlartifacts")
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment, artifacts)
            self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            params = _flat(config)
            for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
                batch = list(params.items())[start : start + 100]
                self.client.log_batch(self.run_id, params=[_param(k, v) for k, v in batch])
            _store_id(id_path, self.run_id)
        else:
            self.client.update_run(self.run_id, status="RUNNING")

    def log(self, row: Mapping[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        if self.run_id is None:
            return
        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in scalars(row).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def log_text(self, tag: str, text: str, step: int) -> None:
        if self.run_id is not None:
            self.client.log_text(self.run_id, text, f"{tag}_step{step}.txt")

    def training_done(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status="FINISHED")
            self.run_id = None

    def close(self) -> None:
        # not finished: stopped, failed or interrupted; a resume sets it running again
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status="KILLED")
            self.run_id = None


def _param(key: str, value: str) -> Any:
    from mlflow.entities import Param

    return Param(key, value[:6000])  # MLflow's limit on a parameter's value


def build_metrics(cfg: Config, run: RunDir, progress: TrainingProgress, *, is_main: bool,
                  first_step: int) -> Metrics:  # fmt: skip
    """The sinks ``cfg.run`` chooses, in the order they get a row: metrics.jsonl first (a crash right
    after still has the row on disk), the display, the curves, then the trackers. ``first_step``: the
    first global step this process logs (a resumed run's trackers drop or overwrite what came after
    the checkpoint). Only the main rank's sinks write."""
    import importlib.util

    from distlib.runner.config import to_dict
    from distlib.runner.observability.plots import CurvePlot
    from distlib.runner.observability.tensorboard import TensorBoardLog

    r = cfg.run
    sinks: list[MetricSink] = [run, progress]
    if not is_main:
        return Metrics(sinks)  # both write nothing on other ranks
    curves = r.curves == "on" or (r.curves == "auto" and importlib.util.find_spec("matplotlib") is not None)
    if r.curves == "auto" and not curves:
        from distlib.log import get_logger

        get_logger().warning("curves.png is not drawn: matplotlib is not installed (pip install 'distlib[plots]'; "
                             "run.curves=off says you know)")  # fmt: skip
    if curves:
        sinks.append(CurvePlot(os.path.join(run.path, "curves.png"), run.read_metrics(), title=r.name,
                               metrics_path=run.metrics_path))  # fmt: skip
    if r.tensorboard:
        # TensorBoard drops what an earlier run wrote from first_step on, or a resumed stretch would show twice
        sinks.append(TensorBoardLog(run.path, enabled=True, purge_step=first_step))
    if r.wandb.enabled:
        w = r.wandb
        sinks.append(WandbSink(run.path, name=r.name, config=to_dict(cfg), project=w.project,
                               entity=w.entity, group=w.group, mode=w.mode))  # fmt: skip
    if r.mlflow.enabled:
        m = r.mlflow
        sinks.append(MLflowSink(run.path, name=r.name, config=to_dict(cfg), tracking_uri=m.tracking_uri,
                                experiment=m.experiment))  # fmt: skip
    return Metrics(sinks)


__all__ = ["build_metrics", "TAGS", "MLflowSink", "MetricSink", "Metrics", "WandbSink", "scalars"]
