"""What the loop evaluates between optimizer steps, each part on its own schedule: the validation loss (at
step 0, every `eval_interval` steps and at the last step), the downstream evals (`DownstreamEvals.due`: with
validation or every `eval_tasks_every` steps) and the samples (`Sampler.due`: every `sample_every` steps).
Their time falls between steps, which MetricsWindow never counts as training (utils/observe/metrics.py)."""
from __future__ import annotations

from utils.evals.validation import run_eval


class Evaluator:
    def __init__(self, every: int, model, core, val_batches, evals, sampler, accelerator, log):
        """`model` is the wrapped model (validation runs it on every rank), `core` the unwrapped one that the
        downstream evals and the sampler drive."""
        self.every, self.model, self.core, self.val_batches = every, model, core, val_batches
        self.evals, self.sampler, self.accelerator, self.log = evals, sampler, accelerator, log

    def at_start(self, state, bar) -> None:
        """Step 0 of a fresh run (a resumed one has its curves already): where the curves start."""
        if state.step:
            return
        bar.set_description_str("setup: eval")
        run_eval(self.model, self.val_batches, self.accelerator, state, self.log)
        if self.evals.due(state.step):
            self.evals.run(self.core, state.step, state.tokens)

    def run_if_due(self, state, last: bool) -> None:
        """After optimizer step `state.step` (`last`: the run's last step, when validation always runs)."""
        if state.step % self.every == 0 or last:
            run_eval(self.model, self.val_batches, self.accelerator, state, self.log, final=last)
        if self.evals.due(state.step):
            self.evals.run(self.core, state.step, state.tokens)
        if self.sampler.due(state.step):
            self.sampler.sample(self.core, state.step, state.tokens)
