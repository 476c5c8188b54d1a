"""What a run trains for. The trainer sees only ``Task``; ``build_task`` alone picks it from
``train.task`` (runner/config.py: ``task_of``):

- ``classification`` (tasks/classification.py): images or any (input, class) data set;
- ``causal_lm`` (tasks/causal_lm.py): token sequences.
"""

from __future__ import annotations

from distlib.distributed.process_group import Context
from distlib.runner.config import Config, task_of
from distlib.runner.observability.timeline import Timeline
from distlib.runner.tasks.causal_lm import CausalLMTask
from distlib.runner.tasks.classification import ClassificationTask
from distlib.runner.tasks.task import Task

TASKS: dict[str, type[Task]] = {"classification": ClassificationTask, "causal_lm": CausalLMTask}


def build_task(cfg: Config, ctx: Context, per_rank: int, timeline: Timeline) -> Task:
    """The task of ``cfg`` (train.task, "auto" resolved by the data set and model), its data
    loaded. A collective (a bad data set stops every rank with the same message)."""
    return TASKS[task_of(cfg)](cfg, ctx, per_rank, timeline)


__all__ = ["TASKS", "Task", "build_task"]
