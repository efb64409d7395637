"""The loss-spike guard: `spike_guard = off | warn | skip | rollback` (default warn).

The statistic. The guard keeps the loss and the gradient norm of the last `spike_window` steps that were not
spikes. Once it holds that many (none is judged before: early training moves too fast for a short history to
describe it), a step is a spike when its loss is more than `spike_threshold` standard deviations (sample
standard deviation) above the window's mean loss, or its gradient norm as many of theirs above their mean.
A spread smaller than MIN_SPREAD of its mean counts as that much: a quiet stretch of the gradient norm can
be so even (0.04 around 0.70 in the demo) that an ordinary rise after the warmup would count as a spike,
so the norm must rise at least 6 x 15% = 90% above its mean (the loss, whose spread is rarely that small,
at least 6%).
The loss is the step's mean over its micro-batches and over the ranks, the norm the global one before
clipping: every rank sees the same two numbers and takes the same decision. Spikes never enter the window,
so a run of them does not raise the bar they are measured against. (OLMo-core's skip-step optimizer tests
the same two numbers the same way, over every recent step; its defaults, 128 steps and 6 deviations, are
ours.) Both numbers matter: a batch the model finds
absurd moves the gradient norm by an order of magnitude where a barely trained model's loss hardly moves,
and a model already damaged shows it in the loss.

What each mode does with a spike:
  off       nothing; nothing is measured.
  warn      a warning line and a metrics row; the step's update is applied as always.
  skip      also: the step's update is not applied. No optimizer step: the weights, AdamW's moments and its
            step count stay bitwise what they were. The batch counts as read (the data cursor moves on), and
            the step counter and the LR schedule advance: a skip never shifts the schedule, the LR at step k
            is lr_at(k) whatever was skipped, and max_steps still ends it. The step's training row counts it
            in `skipped_steps` and leaves its loss out of the window's mean.
  rollback  as skip, and once `spike_patience` spikes fall within the last `spike_window` steps, every rank
            restores the run's newest checkpoint (its weights, optimizer, schedule, RNG, step and this guard's
            window) and the data cursor is moved forward to where the spike's step left it: the sequences
            read since that checkpoint are skipped, never trained on again. The global stream positions
            skipped are recorded in this guard's state, which every later checkpoint carries (and a resume
            restores). The newest checkpoint rather than an older one: no newer checkpoint is then left for
            `--resume latest` to take (locally or in GCS), no checkpoint name is written twice, and none of
            the spikes' own updates is in it (they were skipped). A run whose spikes come back after
            `spike_max_rollbacks` rollbacks to one checkpoint stops in one line (lower the learning rate);
            one with no checkpoint yet says so and goes on skipping.
In every mode but skip and rollback a non-finite loss is not a spike: the run stops at the next check of
the losses, before anything is saved, as without a guard. Under skip and rollback a non-finite loss or
gradient norm is a spike (from the first step, full window or not), skipped like any other.
Under skip and rollback, `spike_window` spikes in a row (a window of steps all skipped, as after weights blown
up at step 1: every later loss is NaN) stop the run in one line: it is learning nothing. (Independently, a
validation loss at the last step that is not finite stops the run before the export: utils/evals/validation.py.)

The cost, and why warn is the default. Deciding before the update needs the step's loss on the host: skip
and rollback make one all-reduce of the two numbers and one device-to-host copy per step, between the
backward and the optimizer step. On a GPU that blocks the host until the backward has finished, so the
optimizer step and the next forward cannot be queued ahead of the device: it idles while the host launches
them (their launch time, not yet measured on a GPU, next to a step of hundreds of milliseconds for the 1.2B
model); the guard's own host work is about 70 us a step (measured on a CPU). warn asks nothing per step:
each step's two numbers stay on the device and are judged at logging steps and before each checkpoint
(`review`), where the loop syncs with the device anyway, so a warning may come up to logging_steps after
its step. A device-side skip (OLMo-core scales AdamW's update by a 0/1 factor computed on the device) avoids
the sync but needs an AdamW of its own in place of torch's fused one, and must keep a non-finite gradient
out of the moments by hand (0 x inf is nan); this engine keeps torch's optimizers and pays the sync only
when asked to skip.

Every spike is a `warning: spike at step N: ...` line and a metrics.jsonl row with `spike/loss`,
`spike/grad_norm`, their limits and `spike/action` (warn | skip); a rollback is a line and a row with
`spike/action: rollback`, `spike/to_step`, `spike/checkpoint`, `spike/skipped_from`, `spike/skipped_to`
and `spike/skipped_sequences` (TensorBoard: the numbers under `spike/`).
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np
import torch

from dataclasses import dataclass

from utils.errors import UserError
from utils.settings import Settings


MIN_SPREAD = np.array([0.01, 0.15])  # of the mean: the least spread (loss, gradient norm) a window is taken to have


class SpikesPersist(UserError):
    pass


@dataclass(frozen=True)
class SpikeGuardSettings(Settings):
    spike_guard: str
    spike_window: int
    spike_threshold: float
    spike_patience: int
    spike_max_rollbacks: int


class SpikeGuard:
    """Judges each optimizer step (see the module docstring); `state_dict` / `load_state_dict` carry its
    window, its count of recent spikes and its record of rollbacks through checkpoints."""

    def __init__(self, settings: SpikeGuardSettings, accelerator, log):
        self.mode = settings.spike_guard
        self.window, self.threshold = settings.spike_window, settings.spike_threshold
        self.patience, self.max_rollbacks = settings.spike_patience, settings.spike_max_rollbacks
        self.accelerator, self.log = accelerator, log
        self.recent: deque[tuple[float, float]] = deque(maxlen=self.window)  # (loss, grad norm), spikes left out
        self.spike_steps: list[int] = []  # rollback: the spikes within the window, counted against spike_patience
        self.rollbacks: list[dict] = []  # each: the spike's step, the checkpoint restored, the positions skipped
        self.spikes = self.skipped = 0  # over the whole run
        self.skipped_in_a_row = 0  # skip, rollback: spike_window of them and the run is learning nothing: it stops
        self.rollback_due = False
        self._pending: list[tuple[int, torch.Tensor]] = []  # warn: (step, [loss, grad norm] on the device)

    # ------------------------------------------------------------------------------------------ judging

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Whether step `step`'s update is to be applied. Every rank calls it once per optimizer step, after
        clipping and before the optimizer step: skip and rollback judge the step now (one host sync), warn
        keeps its numbers on the device for `review`, off does nothing."""
        if self.mode == "off":
            return True
        values = torch.stack([loss.detach().float(), grad_norm.detach().float()])
        if self.mode == "warn":
            self._pending.append((step, values))
            return True
        step_loss, norm = self.accelerator.reduce(values, reduction="mean").tolist()
        if not self._judge(step, step_loss, norm):
            self.skipped_in_a_row = 0
            return True
        self.skipped += 1
        self.skipped_in_a_row += 1
        if self.skipped_in_a_row >= self.window:
            finite = math.isfinite(step_loss) and math.isfinite(norm)
            raise SpikesPersist(f"spike_guard={self.mode}: the last {self.skipped_in_a_row} steps (to step {step}, a "
                                f"whole spike_window) were all spikes and skipped (loss {step_loss:.4g}, grad norm "
                                f"{norm:.4g}{'' if finite else ': not finite'}): the run is learning nothing, so it "
                                f"stops and exports nothing; lower learning_rate and train again")
        if self.accelerator.scaler is not None:  # fp16: close the step the scaler unscaled for (no optimizer step)
            self.accelerator.scaler.update()
        if self.mode == "rollback":
            self.spike_steps = [s for s in self.spike_steps if s > step - self.window] + [step]
            self.rollback_due = len(self.spike_steps) >= self.patience
        return False

    def review(self) -> None:
        """warn: judges the steps since the last review, in one all-reduce and one host copy. The loop calls
        it at logging steps and before a save (the saved window must hold every step before it)."""
        if not self._pending:
            return
        steps = [step for step, _ in self._pending]
        values = self.accelerator.reduce(torch.stack([v for _, v in self._pending]), reduction="mean").tolist()
        self._pending.clear()
        for step, (step_loss, norm) in zip(steps, values):
            self._judge(step, step_loss, norm)

    def _judge(self, step: int, loss: float, norm: float) -> bool:
        """Whether the step is a spike; a spike is said, any other step joins the window."""
        if not (math.isfinite(loss) and math.isfinite(norm)):
            if self.mode == "warn":
                return False  # not a spike: the window's non-finite check stops the run, as without a guard
            self._report(step, loss, norm, None)
            return True
        if len(self.recent) < self.window:
            self.recent.append((loss, norm))
            return False
        history = np.array(self.recent)
        mean = history.mean(axis=0)
        limits = mean + self.threshold * np.maximum(history.std(axis=0, ddof=1), MIN_SPREAD * mean)
        if loss <= limits[0] and norm <= limits[1]:
            self.recent.append((loss, norm))
            return False
        self._report(step, loss, norm, (float(limits[0]), float(limits[1])))
        return True

    def _report(self, step: int, loss: float, norm: float, limits: tuple[float, float] | None) -> None:
        self.spikes += 1
        action = "warn" if self.mode == "warn" else "skip"
        self.log.write_row({"step": step, "spike/action": action, "spike/loss": loss, "spike/grad_norm": norm,
                            "spike/loss_limit": limits and limits[0], "spike/grad_norm_limit": limits and limits[1]})
        if not self.accelerator.is_main_process:
            return
        if limits is None:
            measured = f"loss {loss:.4f}, grad norm {norm:.4g}: not finite"
        else:
            measures = (("loss", loss, limits[0]), ("grad norm", norm, limits[1]))
            over = [f"{name} {value:.4g} over its limit {limit:.4g}" for name, value, limit in measures
                    if value > limit]
            within = [f"{name} {value:.4g}, limit {limit:.4g}" for name, value, limit in measures if value <= limit]
            measured = (f"{' and '.join(over)} ({'; '.join(within + [''])}a limit is the mean of the last "
                        f"{self.window} steps + {self.threshold:g} standard deviations)")
        done = ("its update was applied (spike_guard=warn)" if action == "warn" else
                f"its update is skipped (spike_guard={self.mode})")
        self.log.warning(f"warning: spike at step {step}: {measured}; {done}")

    # ----------------------------------------------------------------------------------------- rollback

    def roll_back(self, ckpt, loader, state) -> bool:
        """rollback, once `rollback_due` (every rank): restores the run's newest checkpoint through `ckpt`, then
        moves `loader` forward to where the spike's step left it, and records the positions skipped. Returns
        whether it rolled back (not without a checkpoint)."""
        self.rollback_due = False
        spike_step, spikes = state.step, list(self.spike_steps)
        cursor = loader.state_dict()  # the stream just after the spike's step
        path = ckpt.newest()
        if path is None:
            self.spike_steps.clear()
            if self.accelerator.is_main_process:
                self.log.warning(f"warning: spike guard: {len(spikes)} spikes within {self.window} steps (steps "
                                 f"{', '.join(map(str, spikes))}) but no checkpoint to roll back to yet; they were "
                                 f"skipped and training goes on")
            return False
        earlier = sum(r["checkpoint"] == path.name for r in self.rollbacks)
        if earlier >= self.max_rollbacks:
            raise SpikesPersist(
                f"loss spikes came back after {earlier} rollback{'s' if earlier > 1 else ''} to checkpoint "
                f"{path.name}, each skipping the data read since (spike_max_rollbacks={self.max_rollbacks}); no "
                f"checkpoint was written since. Lower learning_rate (or raise spike_threshold) and resume with "
                f"--resume {path.name}")
        kept = (self.rollbacks, self.spikes, self.skipped)  # what happened: kept; the window: the checkpoint's
        ckpt.restore(path, action="Spike guard: rolled back to")
        self.rollbacks, self.spikes, self.skipped = kept
        self.spike_steps.clear()
        self.skipped_in_a_row = 0
        start = loader.position
        end = start + loader.skip_to(cursor)
        self.rollbacks.append({"step": spike_step, "checkpoint": path.name, "to_step": state.step,
                               "skipped": [start, end]})
        self.log.write_row({"step": spike_step, "spike/action": "rollback", "spike/to_step": state.step,
                            "spike/checkpoint": path.name, "spike/skipped_from": start, "spike/skipped_to": end,
                            "spike/skipped_sequences": end - start})
        if self.accelerator.is_main_process:
            self.log.warning(f"warning: spike guard: {len(spikes)} spikes within {self.window} steps (steps "
                             f"{', '.join(map(str, spikes))}): rolled back from step {spike_step} to {path.name}; "
                             f"the {end - start:,} sequences read since it (stream positions {start:,} to {end:,}) "
                             f"are skipped")
        return True

    # ------------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict:
        return {"recent": [list(v) for v in self.recent], "spike_steps": list(self.spike_steps),
                "rollbacks": [dict(r) for r in self.rollbacks], "spikes": self.spikes, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        """A window saved with another spike_window keeps its newest steps."""
        self.recent = deque((tuple(map(float, v)) for v in state["recent"]), maxlen=self.window)
        self.spike_steps = [int(s) for s in state["spike_steps"]]
        self.rollbacks = [dict(r) for r in state["rollbacks"]]
        self.spikes, self.skipped = int(state["spikes"]), int(state["skipped"])
        self.rollback_due = False
        self._pending.clear()

    def summary(self) -> str | None:
        """The closing line: spikes, steps skipped, rollbacks; None when there was no spike."""
        if not self.spikes:
            return None
        back = "".join(f"; rolled back at step {r['step']} to {r['checkpoint']}, skipping stream positions "
                       f"{r['skipped'][0]:,} to {r['skipped'][1]:,}" for r in self.rollbacks)
        done = "their updates applied" if self.mode == "warn" else f"{self.skipped} steps skipped"
        return f"  spike guard ({self.mode}): {self.spikes} spikes, {done}{back}"
