"""How long a run trains, and at which steps it evaluates and checkpoints, in optimizer steps.

The run ends at whichever of ``train.epochs`` (x the steps of an epoch) and ``train.max_steps``
comes first; 0 switches either limit off (not both: the config refuses that). Steps are global
(counted over the epochs, from 1). The run's last step always evaluates, writes a metrics row and
checkpoints, mid-epoch too. Besides it, a step evaluates when it ends an epoch that
``train.eval_every`` names or is a multiple of ``train.eval_every_steps``, and checkpoints when it
ends an epoch that ``run.checkpoint_every`` names or is a multiple of ``run.checkpoint_every_steps``
(0 switches each off). A metrics row is written at the end of every epoch and at every
evaluation. Design: docs/training.md ("Budgets").
"""

from __future__ import annotations

from dataclasses import dataclass

from distlib.runner.config import Config


@dataclass(frozen=True)
class Budget:
    steps_per_epoch: int
    epochs: int = 0  # 0 = no limit
    max_steps: int = 0  # 0 = no limit
    eval_every: int = 1  # epochs; 0 = off
    eval_every_steps: int = 0
    checkpoint_every: int = 0  # epochs; 0 = off
    checkpoint_every_steps: int = 0

    @classmethod
    def of(cls, cfg: Config, steps_per_epoch: int) -> Budget:
        t, r = cfg.train, cfg.run
        return cls(steps_per_epoch, t.epochs, t.max_steps, t.eval_every, t.eval_every_steps, r.checkpoint_every,
                   r.checkpoint_every_steps)  # fmt: skip

    @property
    def total_steps(self) -> int:
        """The run's last step: the first of its limits."""
        limits = [n for n in (self.epochs * self.steps_per_epoch, self.max_steps) if n > 0]
        if not limits:
            raise ValueError("a budget needs train.epochs > 0 or train.max_steps > 0")
        return min(limits)

    def describe(self) -> str:
        """The budget in words, for the log: ``"150 steps (train.max_steps; 18.8 epochs of 8 steps)"``."""
        total, spe = self.total_steps, self.steps_per_epoch
        by_steps = self.max_steps > 0 and (self.epochs == 0 or self.max_steps < self.epochs * spe)
        why = "train.max_steps" if by_steps else f"train.epochs={self.epochs}"
        return f"{total} steps ({why}; {total / spe:g} epochs of {spe} steps)"

    def done(self, step: int) -> bool:
        """Whether the run has nothing left to train after global step ``step``."""
        return step >= self.total_steps

    def ends_epoch(self, step: int) -> bool:
        return step > 0 and step % self.steps_per_epoch == 0

    def evaluates(self, step: int) -> bool:
        """Whether global step ``step`` ends with an evaluation (and a metrics row)."""
        return step == self.total_steps or _every(step, self.eval_every_steps) or (
            self.ends_epoch(step) and _every(step // self.steps_per_epoch, self.eval_every))  # fmt: skip

    def checkpoints(self, step: int) -> bool:
        """Whether global step ``step`` ends with a checkpoint."""
        return step == self.total_steps or _every(step, self.checkpoint_every_steps) or (
            self.ends_epoch(step) and _every(step // self.steps_per_epoch, self.checkpoint_every))  # fmt: skip

    def stops_at(self, step: int) -> bool:
        """Whether the loop pauses after global step ``step``: an epoch's end, an evaluation, a checkpoint."""
        return self.ends_epoch(step) or self.evaluates(step) or self.checkpoints(step)


def _every(n: int, every: int) -> bool:
    return every > 0 and n > 0 and n % every == 0
