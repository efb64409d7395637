"""Learning-rate schedules: one registry, the only place a schedule is defined.

`SCHEDULES` maps each `lr_schedule` name to the LR after warmup as a function of the step; the config's
choices are its keys (configs/training_config.py imports them: this module imports nothing of the project,
so configs may). `DECAY_SHAPES` does the same for `decay_shape`. `lr_at` adds the warmup every schedule
shares. Adding a schedule is one function and one entry here.

Each schedule takes (step, Schedule) and returns the LR for optimizer step `step` (1-based) once the
warmup is over; past `max_steps` every decaying schedule stays at `peak * min_lr_ratio`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from utils.settings import Settings

DECAY_SHAPES: dict[str, Callable[[float], float]] = {  # progress in [0, 1] -> share of (peak - min) left
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    "sqrt": lambda progress: 1.0 - math.sqrt(progress),
}


@dataclass(frozen=True)
class Schedule:
    peak_lr: float
    warmup_steps: int
    max_steps: int
    min_lr_ratio: float
    decay_steps: int = 0  # wsd: the decay's length
    decay_shape: str = "linear"  # wsd: one of DECAY_SHAPES

    @property
    def min_lr(self) -> float:
        return self.peak_lr * self.min_lr_ratio

    def decayed(self, start: int, step: int, shape: Callable[[float], float]) -> float:
        """From the peak at `start` to the minimum at `max_steps`, along `shape`."""
        progress = min(1.0, (step - start) / max(1, self.max_steps - start))
        return self.min_lr + (self.peak_lr - self.min_lr) * shape(progress)


def _cosine(step: int, s: Schedule) -> float:
    return s.decayed(s.warmup_steps, step, DECAY_SHAPES["cosine"])


def _linear(step: int, s: Schedule) -> float:
    return s.decayed(s.warmup_steps, step, DECAY_SHAPES["linear"])


def _constant(step: int, s: Schedule) -> float:
    return s.peak_lr


def _wsd(step: int, s: Schedule) -> float:
    """Warmup-stable-decay: the peak until `max_steps - decay_steps` (never before the warmup ends), then
    `decay_shape` down to the minimum at `max_steps`."""
    decay_start = max(s.warmup_steps, s.max_steps - s.decay_steps)
    return s.peak_lr if step <= decay_start else s.decayed(decay_start, step, DECAY_SHAPES[s.decay_shape])


SCHEDULES: dict[str, Callable[[int, Schedule], float]] = {
    "cosine": _cosine, "wsd": _wsd, "linear": _linear, "constant": _constant}


def lr_at(step: int, *, peak_lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float,
          schedule: str = "cosine", decay_steps: int = 0, decay_shape: str = "linear") -> float:
    """Learning rate used by optimizer step `step` (1-based: step 1 is the first update): linear warmup from
    peak/warmup to peak over `warmup_steps`, then the named schedule."""
    if step <= warmup_steps:
        return peak_lr * step / max(1, warmup_steps)
    return SCHEDULES[schedule](step, Schedule(peak_lr, warmup_steps, max_steps, min_lr_ratio, decay_steps,
                                              decay_shape))


@dataclass(frozen=True)
class ScheduleSettings(Settings):
    """A run's schedule: `lr(step)` is the learning rate of optimizer step `step`."""

    learning_rate: float
    warmup_steps: int
    max_steps: int
    min_lr_ratio: float
    lr_schedule: str
    decay_steps: int
    decay_fraction: float
    decay_shape: str

    @property
    def wsd_decay_steps(self) -> int:
        """The WSD decay's length: `decay_steps`, or `decay_fraction` of `max_steps` when that is 0."""
        return self.decay_steps or round(self.decay_fraction * self.max_steps)

    def lr(self, step: int) -> float:
        return lr_at(step, peak_lr=self.learning_rate, warmup_steps=self.warmup_steps, max_steps=self.max_steps,
                     min_lr_ratio=self.min_lr_ratio, schedule=self.lr_schedule, decay_steps=self.wsd_decay_steps,
                     decay_shape=self.decay_shape)
