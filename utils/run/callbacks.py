"""The Trainer's seam: one `Callback` base whose hooks the loop calls at fixed points, and the engine's own
observers on it, each deciding for itself whether a hook concerns it.

Hooks, in the order a step meets them (each gets the Trainer, `run`, and reads what it needs from it):
  on_start          after the preflight, before the first step (a fresh run's step-0 evaluation)
  pre_step          before a step's first micro-batch
  on_batch          each micro-batch, before its forward (`run.input_ids`)
  approve_update    after backward and clipping: False from any callback skips the optimizer update
  post_step         after the update (`run.step_loss`, `run.grad_norm`, `run.applied`, `run.state`); a
                    callback that rewinds the run (`run.rewind()`) ends this hook for the callbacks after it
  on_rewind         the run went back to an earlier step (a spike guard's rollback)
  step_end          after the stop vote (`run.stopping`): where the checkpoint policy decides
  busy(what)        a context around a part of the loop that is progress though no step ends (an evaluation,
                    a checkpoint's save, the stop's wait for its write, a rollback): `with run.busy(what):`
  pre_checkpoint    before a save; post_checkpoint after it (`run.last_checkpoint`)
  on_stop           the loop is over, for any reason, before the export
  on_close          every way out of the run, an error's too

Adding an observer is one Callback subclass and one line where the Trainer is built (utils/run/trainer.py
`observers`). The components themselves (MetricsWindow, HangWatchdog, SpikeGuard, Evaluator, ...) know nothing
of the Trainer; the adapters here hand each the values it takes.
"""
from __future__ import annotations

import contextlib


class Callback:
    """An observer of the training loop; every hook does nothing unless overridden."""

    def on_start(self, run) -> None: ...

    def pre_step(self, run) -> None: ...

    def on_batch(self, run) -> None: ...

    def approve_update(self, run) -> bool:
        return True

    def post_step(self, run) -> None: ...

    def on_rewind(self, run) -> None: ...

    def step_end(self, run) -> None: ...

    def busy(self, run, what: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def pre_checkpoint(self, run) -> None: ...

    def post_checkpoint(self, run) -> None: ...

    def on_stop(self, run) -> None: ...

    def on_close(self, run) -> None: ...


class Callbacks:
    """The callbacks of a run, called in the order they were given."""

    def __init__(self, callbacks: list[Callback]):
        self.callbacks = list(callbacks)

    def __iter__(self):
        return iter(self.callbacks)

    def call(self, hook: str, run) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(run)

    def approve_update(self, run) -> bool:
        """Every callback is asked (each may record the step); the update is applied when none refuses."""
        votes = [callback.approve_update(run) for callback in self.callbacks]
        return all(votes)

    def post_step(self, run) -> None:
        for callback in self.callbacks:
            callback.post_step(run)
            if run.rewound:
                return

    @contextlib.contextmanager
    def busy(self, run, what: str):
        """Every callback's context for a busy part of the loop, entered in order."""
        with contextlib.ExitStack() as stack:
            for callback in self.callbacks:
                stack.enter_context(callback.busy(run, what))
            yield


class WatchdogBeat(Callback):
    """The hang watchdog (utils/observe/watchdog.py): armed at the first step, a beat after each step, its
    clock stopped while the run is busy between steps (`busy`), off once the loop is over."""

    def __init__(self, watchdog):
        self.watchdog = watchdog

    def on_start(self, run) -> None:
        self.watchdog.start(run.state.step)

    def post_step(self, run) -> None:
        self.watchdog.beat(run.state.step)

    def on_rewind(self, run) -> None:
        self.watchdog.beat(run.state.step)

    def busy(self, run, what: str) -> contextlib.AbstractContextManager:
        return self.watchdog.busy(what)

    def on_stop(self, run) -> None:
        self.watchdog.stop()

    def on_close(self, run) -> None:
        self.watchdog.stop()


class BatchTracing(Callback):
    """utils/debug.py's BatchTrace: NEOX_TRACE_BATCHES records each micro-batch, NEOX_DEBUG_STEP_DELAY_S pauses
    after each step."""

    def __init__(self, trace):
        self.trace = trace

    def on_batch(self, run) -> None:
        self.trace.record(run.state.step + 1, run.input_ids)

    def post_step(self, run) -> None:
        self.trace.after_step(run.state.step)


class StepTiming(Callback):
    """The metrics window (utils/observe/metrics.py): a step's time from its start to its loss, and nothing
    between steps; before a checkpoint, a non-finite loss stops the run before anything is saved."""

    def __init__(self, window):
        self.window, self.started = window, False

    def pre_step(self, run) -> None:
        if not self.started:  # the first window starts with the first step: the preflight's and step 0's passes
            self.window.restart(run.state.step + 1)  # are not training
            self.started = True
        self.window.begin_step()

    def post_step(self, run) -> None:
        self.window.add(run.step_loss, run.grad_norm, skipped=not run.applied)

    def on_rewind(self, run) -> None:
        self.window.restart(run.state.step + 1)

    def pre_checkpoint(self, run) -> None:
        self.window.checked_losses()


class ProgressBar(Callback):
    """The console's progress bar: one tick a step, back with a rollback, closed when the loop ends."""

    def __init__(self, bar):
        self.bar = bar

    def post_step(self, run) -> None:
        self.bar.update(1)

    def on_rewind(self, run) -> None:
        self.bar.n = run.state.step

    def on_stop(self, run) -> None:
        self.bar.close()

    def on_close(self, run) -> None:
        self.bar.close()


class SpikeGuarding(Callback):
    """The loss-spike guard (utils/training/spike_guard.py): judges each step before its update (skip,
    rollback), rolls the run back to its newest checkpoint when due, reviews its window before a save."""

    def __init__(self, guard):
        self.guard = guard

    def approve_update(self, run) -> bool:
        return self.guard.check(run.state.step + 1, run.step_loss, run.grad_norm)  # skip, rollback: a host sync

    def post_step(self, run) -> None:
        if not self.guard.rollback_due:
            return
        with run.busy("a rollback"):
            rolled_back = self.guard.roll_back(run.checkpointer, run.loader, run.state)
        if rolled_back:
            run.rewind()  # the newest checkpoint restored, the data read since skipped

    def pre_checkpoint(self, run) -> None:
        self.guard.review()  # warn: the saved guard has seen every step before the checkpoint


class StepReport(Callback):
    """The step line and metrics row every `logging_steps` and at the last step (utils/run/report.py)."""

    def __init__(self, reporter):
        self.reporter = reporter

    def post_step(self, run) -> None:
        self.reporter.log_if_due(run.state, run.grad_norm, run.last)


class Evaluation(Callback):
    """Validation, the downstream evals and the samples (utils/evals/evaluator.py), each on its own schedule;
    a fresh run's step 0 at the start."""

    def __init__(self, evaluator, bar):
        self.evaluator, self.bar = evaluator, bar

    def on_start(self, run) -> None:
        self.evaluator.at_start(run.state, self.bar)

    def post_step(self, run) -> None:
        with run.busy("an evaluation"):
            self.evaluator.run_if_due(run.state, run.last)


class StepProfiler(Callback):
    """NEOX_PROFILE_STEPS=A-B (utils/debug.py): torch.profiler from the start of optimizer step A to the end of
    step B on every rank; then a Chrome trace per rank (logs/profile-rank{R}.json, chrome://tracing or
    Perfetto) and, in the log, the operators that took the most time over those steps."""

    def __init__(self, steps: tuple[int, int] | None, logs_dir, rank: int, log):
        self.steps, self.logs_dir, self.rank, self.log = steps, logs_dir, rank, log
        self.profiler = None

    def pre_step(self, run) -> None:
        if self.steps and self.profiler is None and run.state.step + 1 == self.steps[0]:
            import torch
            from torch.profiler import ProfilerActivity, profile

            cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            self.profiler = profile(activities=[ProfilerActivity.CPU, *cuda])
            self.profiler.__enter__()

    def post_step(self, run) -> None:
        if self.profiler is not None and run.state.step >= self.steps[1]:
            self._finish(run.state.step)

    def on_close(self, run) -> None:
        if self.profiler is not None:  # the run ended within the span: what was profiled is still written
            self._finish(run.state.step)

    def _finish(self, step: int) -> None:
        import torch

        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        path = self.logs_dir / f"profile-rank{self.rank}.json"
        profiler.export_chrome_trace(str(path))
        if self.rank == 0:
            key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            table = profiler.key_averages().table(sort_by=key, row_limit=12)
            self.log.info(f"profile of steps {self.steps[0]}-{step}: {path} (every rank: profile-rank*.json); the "
                          f"operators by {key}:\n{table}")


class CheckpointPolicy(Callback):
    """The checkpoint policy (utils/checkpoint/checkpointer.py `Checkpointer.due`): a save every `save_steps`,
    at the last step, at `stop_at_step` and whenever the run stops."""

    def step_end(self, run) -> None:
        if run.checkpointer.due(run.state.step, last=run.last or run.planned_stop or run.stopping):
            run.save()


class CompileCaching(Callback):
    """The run's compiled code beside its checkpoints (utils/checkpoint/compile_cache.py): written once the first
    step has compiled, refreshed before each checkpoint (an evaluation compiles more), which then carries it."""

    def __init__(self, cache):
        self.cache, self.written = cache, False

    def post_step(self, run) -> None:
        if not self.written:
            self.written = True
            self.cache.update()

    def pre_checkpoint(self, run) -> None:
        self.cache.update()
