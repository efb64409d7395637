"""The scheduler that applies the learning-rate schedules (utils/training/schedules.py: warmup, then cosine, the
default, warmup-stable-decay `wsd`, linear or constant).

The schedule is a plain function of the optimizer step (`ScheduleSettings.lr`), and the scheduler is never
passed to `accelerator.prepare`: a prepared scheduler steps once per process per call, which would make the LR
at step k depend on the number of processes. Here the loop steps it once per optimizer step, on every rank.
A resume applies *this* run's schedule at the restored step (StepSchedule keeps only the step): changed
schedule settings apply from there. WSD holds the peak until the last `decay_steps` before `max_steps`, so a
resume with a larger `max_steps` moves the decay later and extends the stable phase.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.optim.lr_scheduler import LRScheduler

from utils.training.schedules import ScheduleSettings


class StepSchedule(LRScheduler):
    """Sets every param group's LR to `schedule(step)` for the optimizer step about to run (step =
    last_epoch + 1): the function the log reads, so the logged LR is the LR applied. Its state is the step
    alone: a restore applies *this* run's schedule at the restored step, so a resume that changes
    learning_rate, the warmup, min_lr_ratio, the decay or max_steps follows the new schedule from there (the
    base LRs and the optimizer's LR saved in the checkpoint are not used)."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Callable[[int], float]):
        self.schedule = schedule
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [self.schedule(self.last_epoch + 1)] * len(self.optimizer.param_groups)

    def state_dict(self) -> dict:
        return {key: value for key, value in super().state_dict().items() if key != "schedule"}

    def load_state_dict(self, state_dict: dict) -> None:
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict.get("_step_count", self.last_epoch + 1))
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr


def build_scheduler(optimizer: torch.optim.Optimizer, settings: ScheduleSettings) -> StepSchedule:
    """After construction the optimizer holds lr(1); each `scheduler.step()` moves to the next step."""
    return StepSchedule(optimizer, settings.lr)
