"""An average of the weights over the end of a run, for the exported model: `tail` (the uniform mean of the
weights after each optimizer step from `start` on) or `ema` (an exponential moving average from `start` on).

`update(step)` follows each optimizer step; `applied()` puts the average into the parameters for as long as
its block runs (an evaluation, the export) and the trained weights back after it. benchmarks/bench_convergence.py
measures it (`--averages tail ema`); it becomes a setting of train.py only when those figures say it wins.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

AVERAGES = ("tail", "ema")


class WeightAverage:
    def __init__(self, params, kind: str, start: int, ema_decay: float = 0.99):
        self.params, self.kind, self.start, self.ema_decay = list(params), kind, start, ema_decay
        self.count, self.average = 0, None

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step `step`: steps after `start` enter the average."""
        if step <= self.start:
            return
        if self.average is None:
            self.average = [p.detach().clone() for p in self.params]
            self.count = 1
            return
        self.count += 1
        weight = 1.0 / self.count if self.kind == "tail" else 1.0 - self.ema_decay
        for avg, p in zip(self.average, self.params):
            avg.lerp_(p.detach(), weight)

    @contextmanager
    def applied(self):
        """The parameters hold the average inside the block (unchanged before any step entered it)."""
        if self.average is None:
            yield
            return
        with torch.no_grad():
            trained = [p.detach().clone() for p in self.params]
            for p, avg in zip(self.params, self.average):
                p.copy_(avg)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, t in zip(self.params, trained):
                    p.copy_(t)
