"""The Trainer: a run assembled from its config, then the loop.

Construction is the one place (with configs/) that holds the run's whole config: each part gets its typed
settings (`XSettings.of(config)`), the observers are callbacks on one seam (utils/run/callbacks.py). The
loop keeps what only it can do: the data, forward, backward, clipping, the optimizer step, the stop vote;
everything else is a callback deciding for itself whether a hook concerns it.

    open      output folder and its lock, accelerator, parallelism, stop signal, resume choice
    build     model spec, data, downstream evals, model + optimizer + schedule, compile cache, state,
              checkpointer
    observe   trackers, the description, and the callbacks: batch trace, metrics window, progress bar, spike
              guard, step report, evaluation, hang watchdog, checkpoint policy
    fit       a resume's compiled code, preflight, on_start, the loop, on_stop, export, close

A StartupClock marks the end of each part up to the first step (the first metrics row's `start/<phase>_s`).
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from configs.training_config import precision_name
from utils import layout
from utils.run.callbacks import (
    BatchTracing,
    Callbacks,
    CheckpointPolicy,
    CompileCaching,
    Evaluation,
    ProgressBar,
    SpikeGuarding,
    StepProfiler,
    StepReport,
    StepTiming,
    WatchdogBeat,
)
from utils.runtime.run_status import PLANNED_STOP, RunStatus


@dataclass(frozen=True)
class RunOptions:
    """What the command line adds to the config: where the run's folder is, whether and from where it resumes,
    and when its process started (time to the first step counts from there)."""

    output_dir: Path
    resume: str | None = None
    output_dir_given: bool = True  # False: the default runs/RUN_NAME/ (a fresh run may not reuse another's)
    started: float | None = None  # time.perf_counter() at the process start
    explicit: frozenset | None = None  # the fields the command set (configs/settle.py); None: all of them


class Trainer:
    def __init__(self, config, profile, options: RunOptions):
        self.config, self.profile, self.options = config, profile, options
        self.output_dir = Path(options.output_dir).resolve()
        self.rewound = self.stopping = self.last = self.planned_stop = False
        self.stopped_by, self.exit_code, self.last_checkpoint, self.export_dir = None, 0, None, None
        self.step_loss = self.grad_norm = self.input_ids = None
        self.applied = True
        self.core_share, self.sharing = None, None  # utils/runtime/cpu_share.py, on a CPU run

    def run(self) -> int:
        """Trains the run to its end (or its stop); returns the exit status (docs/contracts.md)."""
        if self._open():
            return 0  # a finished run: nothing to train
        self._build()
        self._observe()
        return self._fit()

    # ------------------------------------------------------------------------------------- construction
    def _open(self) -> bool:
        """The output folder, the processes and the resume choice. True when the run already finished."""
        from utils.checkpoint.checkpointer import CheckpointSettings, find_checkpoint
        from utils.data.build import description_dir
        from utils.data.source import DataSettings
        from utils.observe.metrics import StartupClock
        from utils.observe.watchdog import nccl_flight_recorder_env
        from utils.parallel.accelerator import AcceleratorSettings, make_accelerator
        from utils.parallel.strategies import ParallelSettings, make_parallelism
        from utils.run.export import finished_run
        from utils.run.output_dir import shared_output_dir
        from utils.runtime.signals import StopSignal
        from utils.training.state import RngState

        self.startup = StartupClock(self.options.started)  # where the time to the first step goes
        self.startup.mark("imports")
        cfg, logs = self.config, self.output_dir / layout.LOGS
        nccl_flight_recorder_env(logs)  # CUDA: before the process group exists
        self.accelerator = make_accelerator(AcceleratorSettings.of(cfg), logs)
        self.device, self.world = self.accelerator.device, self.accelerator.num_processes
        self.parallel = make_parallelism(ParallelSettings.of(cfg), self.accelerator)
        self.stop = StopSignal(distributed=self.world > 1)
        RngState.seed(cfg.seed + self.accelerator.process_index)
        self.lock, self.log = self._lock_output_dir()
        self.checkpoint_settings = CheckpointSettings.of(cfg)
        self.remote_root = self.checkpoint_settings.remote_root
        self.node_uploads = self.parallel.sharded and not shared_output_dir(
            self.output_dir, self.accelerator, self.remote_root, self.log)
        self.resume_path = (find_checkpoint(self.options.resume, self.accelerator, self.output_dir / layout.CHECKPOINTS,
                                            self.remote_root, self.log) if self.options.resume else None)
        if self.resume_path is not None and self.options.explicit is not None:
            self.config = cfg = self._continued_recipe(cfg)
        if self.accelerator.is_main_process:  # once, with the values this run trains with
            for line in cfg.warnings():
                self.log.warning(line)
        self.data_settings = DataSettings.of(cfg)
        self.described = description_dir(self.data_settings)  # dataset.json, tokenizer.json: vocabulary, evals
        self.startup.mark("setup")
        return bool(self.resume_path and finished_run(self.resume_path, cfg.max_steps, self.described,
                                                      self.output_dir, self.accelerator, self.log, self.lock))

    def _continued_recipe(self, cfg):
        """The config with the resume checkpoint's recipe where the command did not set it (keep_recipe)."""
        from configs.training_config import keep_recipe
        from utils.checkpoint.format import TRAINER_STATE_FILE, read_trainer_state

        saved = read_trainer_state(self.resume_path).get("config", {})
        cfg, line = keep_recipe(cfg, saved, self.options.explicit, f"checkpoint {self.resume_path}: "
                                f"{TRAINER_STATE_FILE}'s config")
        if line:
            self.log.info(line)
        return cfg

    def _lock_output_dir(self):
        """The run's folder, locked (one live run per folder), refused when a fresh run would write over another
        run's files; and its logger."""
        from utils.observe.metrics import RunLogger
        from utils.run.output_dir import lock_output_dir, refuse_another_run
        from utils.runtime.distributed import main_process_only

        lock = lock_output_dir(self.output_dir, self.accelerator)
        if not self.options.resume:
            main_process_only(self.accelerator,
                              lambda: refuse_another_run(self.output_dir, not self.options.output_dir_given))
        return lock, RunLogger(self.output_dir / layout.LOGS, is_main=self.accelerator.is_main_process)

    def _build(self) -> None:
        """The architecture, the data, the model with its optimizer and schedule, and every stateful thing
        under the checkpointer (restored from the resume checkpoint)."""
        from utils.data.build import build_data
        from utils.evals.runner import DownstreamEvals, EvalSettings
        from utils.model.fit import FitSettings, check_batch_fits
        from utils.model.spec import ModelSettings, resolve_model_spec
        from utils.training.spike_guard import SpikeGuard, SpikeGuardSettings
        from utils.training.state import TrainState

        cfg = self.config
        self.spec, self.seq_len, init_weights = resolve_model_spec(ModelSettings.of(cfg), self.described, self.log)
        check_batch_fits(FitSettings.of(cfg), self.spec, self.seq_len, self.device, self.world)
        self.loader, self.val_batches = build_data(self.data_settings, self.seq_len, self.spec.vocab_size,
                                                   self.accelerator, self.log)
        self.eval_settings = EvalSettings.of(cfg)
        self.evals = DownstreamEvals(self.eval_settings, self.spec, self.described, self.accelerator, self.log,
                                     self.parallel.sharded)  # the tasks are read before the model is built
        self.stop.end_setup_if_asked("data index")
        self.startup.mark("data_index")
        self._build_model(init_weights if self.resume_path is None else None)
        self.compile_cache = self._make_compile_cache()
        self.state, self.guard = TrainState(), SpikeGuard(SpikeGuardSettings.of(cfg), self.accelerator, self.log)
        self.states = {"model": self.model, "optimizer": self.optimizer, "train": self.state,
                       "scheduler": self.scheduler, "data": self.loader, "spike_guard": self.guard}
        if self.accelerator.scaler is not None:
            self.states["scaler"] = self.accelerator.scaler
        self.tokens_per_step = self.loader.global_batch * cfg.gradient_accumulation_steps * self.seq_len
        self.checkpointer = self._make_checkpointer()
        self.startup.mark("model_build")
        if self.resume_path is not None:
            self.checkpointer.restore(self.resume_path)
            self.startup.mark("restore")
        self.stop.end_setup_if_asked("model build")

    def _build_model(self, init_weights: dict | None) -> None:
        """The model (from `init_weights` when given, built and wrapped by the parallelism seam), its optimizer
        and LR schedule. The scheduler is deliberately never prepared (see utils/training/lr_scheduler.py)."""
        from utils.data.build import end_of_document
        from utils.model.lm_loss import set_z_loss
        from utils.training.lr_scheduler import build_scheduler
        from utils.training.optim import OptimizerSettings, build_optimizer
        from utils.training.schedules import ScheduleSettings

        cfg = self.config
        eos = end_of_document(self.data_settings, self.spec.vocab_size) if cfg.attention == "document" else None
        model = self.parallel.build_model(self.spec, init_weights, self.log, eos)
        optimizer = build_optimizer(model, OptimizerSettings.of(cfg), fused=self.device.type == "cuda")
        self.schedule = ScheduleSettings.of(cfg)
        self.scheduler = build_scheduler(optimizer, self.schedule)
        self.model, self.optimizer = self.parallel.prepare(model, optimizer)
        self.core = self.accelerator.unwrap_model(self.model)
        self.z_heads = set_z_loss(self.core, cfg.z_loss) if cfg.z_loss else []  # logged as z_loss

    def _make_compile_cache(self):
        """The compiled code the run's checkpoints carry (utils/checkpoint/compile_cache.py), made for this
        torch, device, model and compile settings."""
        from utils.checkpoint.compile_cache import CompileCache, CompileCacheSettings, made_for

        settings = CompileCacheSettings.of(self.config)
        made = made_for(settings, self.spec.to_dict(), self.seq_len, self.device) if settings.compile_model else {}
        return CompileCache(settings, made, self.output_dir / layout.CHECKPOINTS, self.accelerator.is_main_process,
                            self.log, self.accelerator.process_index)

    def _make_checkpointer(self):
        """The Checkpointer of every stateful thing: the policy, the run's record (what a resume must match),
        each checkpoint's name from the data cursor and the step."""
        from utils.checkpoint.checkpointer import Checkpointer, CheckpointPolicy
        from utils.checkpoint.format import checkpoint_name
        from utils.checkpoint.run_record import RunRecord

        cfg, loader, state = self.config, self.loader, self.state
        global_batch = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * self.world
        policy = CheckpointPolicy.from_settings(self.checkpoint_settings, self.output_dir / layout.CHECKPOINTS,
                                                self.node_uploads, self.described,
                                                self.compile_cache.path if self.compile_cache.on else None)
        record = RunRecord(self.world, self.parallel.name, global_batch, self.seq_len, cfg.to_dict(),
                           self.spec.to_dict(), loader.fingerprint(), cfg.max_steps)
        return Checkpointer(self.accelerator, self.states, policy, record,
                            lambda: checkpoint_name(loader.epoch, state.step, loader.files_consumed()), self.log,
                            sharded=self.parallel.sharded)

    def _observe(self) -> None:
        """The trackers, the lines that describe the run, and the callbacks that observe the loop."""
        from utils.io.console import progress_bar
        from utils.observe.metrics import MetricsWindow, peak_flops
        from utils.run.report import ReportSettings, describe_run

        cfg = self.config
        if self.device.type == "cpu":  # its threads keep to fewer cores while other programs use them
            import torch

            from utils.runtime.cpu_share import CoreShare

            self.core_share, self.sharing = CoreShare.for_run(torch.get_num_threads(), self.log)
        self.log.start_trackers(self.accelerator, cfg.effective_run_name, cfg.to_dict(),
                                self.state.step if self.resume_path else None)
        describe_run(ReportSettings.of(cfg), self)
        self.window = MetricsWindow(self.accelerator, self.tokens_per_step, self.core.flops_per_token(self.seq_len),
                                    peak_flops(self.device), precision_name(cfg.mixed_precision), self.startup,
                                    data_wait=lambda: self.loader.wait_s, z_loss_heads=self.z_heads)
        self.bar = progress_bar(cfg.max_steps, self.state.step, self.accelerator.is_main_process)
        self.callbacks = Callbacks(self.observers())
        self.startup.mark("trackers")

    def observers(self) -> list:
        """The callbacks on the loop's seam, in the order each hook calls them (utils/run/callbacks.py)."""
        from utils.debug import BatchTrace, profiled_steps
        from utils.observe.watchdog import HangWatchdog
        from utils.run.report import StepReporter

        cfg = self.config
        reporter = StepReporter(cfg.logging_steps, self.log, self.window, self.schedule.lr, self.loader, self.guard,
                                self.bar)
        watchdog = HangWatchdog(cfg.hang_timeout_s, self.output_dir / layout.LOGS, self.accelerator.process_index,
                                self.world)
        logs, rank = self.output_dir / layout.LOGS, self.accelerator.process_index
        return [BatchTracing(BatchTrace(self.output_dir, self.accelerator)), StepTiming(self.window),
                ProgressBar(self.bar), SpikeGuarding(self.guard), StepReport(reporter),
                Evaluation(self._make_evaluator(), self.bar), WatchdogBeat(watchdog), CheckpointPolicy(),
                StepProfiler(profiled_steps(), logs, rank, self.log), CompileCaching(self.compile_cache)]

    def _make_evaluator(self):
        """Validation, the downstream evals and the samples, each on its own schedule."""
        from utils.evals.evaluator import Evaluator
        from utils.evals.sampling import Sampler, SampleSettings

        sampler = Sampler(SampleSettings.of(self.config), self.described, self.seq_len, self.accelerator, self.log,
                          sharded=self.parallel.sharded)
        return Evaluator(self.eval_settings.eval_interval, self.model, self.core, self.val_batches, self.evals,
                         sampler, self.accelerator, self.log)

    # ------------------------------------------------------------------------------------------ the run
    def _fit(self) -> int:
        try:
            self._start()
            self._loop()
            self.callbacks.call("on_stop", self)
            self._end()
        finally:
            self.callbacks.call("on_close", self)
            self._close()
        return self.exit_code

    def _start(self) -> None:
        """Before the first step: a resume's compiled code loaded, the preflight (the compile happens here), then
        the callbacks' on_start (a fresh run's step-0 evaluation, the watchdog armed)."""
        from utils.model.preflight import PreflightSettings, preflight

        # the parameters clipping sees, taken before any forward: FSDP2 leaves the root module's parameters
        # unsharded after a forward without a backward (the preflight's, the step-0 evaluation's), and a list
        # taken then holds tensors that never get a gradient (their norm left out of the clip)
        self.params = list(self.model.parameters())
        if self.resume_path is not None:
            self.compile_cache.load(self.resume_path)
            self.startup.mark("compile_cache")
        self.bar.set_description_str("setup: preflight (compiles the blocks)" if self.config.compile_model
                                     else "setup: preflight")
        preflight(self.model, self.val_batches, PreflightSettings.of(self.config), self.accelerator, self.log,
                  self.stop)
        self.stop.end_setup_if_asked("preflight")
        self.startup.mark("compile" if self.config.compile_model else "preflight")
        self.callbacks.call("on_start", self)
        self.startup.mark("evaluation")
        self.bar.set_description_str("train")

    def _loop(self) -> None:
        """Steps until max_steps or a stop: the step, its observers, the stop vote, the checkpoint policy."""
        import torch

        cfg, state = self.config, self.state
        self.max_grad_norm = cfg.max_grad_norm or math.inf  # 0: not clipped, still logged
        self.grad_norm = torch.zeros((), device=self.device)
        data = iter(self.loader)
        while state.step < cfg.max_steps:
            self.callbacks.call("pre_step", self)
            self.train_step(data)
            state.advance(self.tokens_per_step)
            self.last, self.planned_stop = state.step == cfg.max_steps, state.step == cfg.stop_at_step
            self.rewound = False
            self.callbacks.post_step(self)
            if self.rewound:
                continue
            # a source that fetches ahead: its next step's files, or the one that failed (then a checkpoint, stop)
            unavailable = None if self.last or self.planned_stop else self.loader.unavailable(
                cfg.gradient_accumulation_steps)
            self.stopping = self.stop.agreed(unavailable)
            self.callbacks.call("step_end", self)
            if self.stopping or self.planned_stop:
                self.stopped_by = self.stop.reason if self.stopping else PLANNED_STOP
                self.exit_code = int(self.stop.failed)
                with self.busy("the stop's checkpoint"):
                    self.checkpointer.wait()
                self.log.info(f"Stopped by {self.stopped_by} after step {state.step}: checkpoint "
                              f"{self.last_checkpoint}")
                break

    def train_step(self, data) -> None:
        """One optimizer step: the micro-batches' forward and backward, then on the sync step clipping, the
        update (unless a callback refuses it), the schedule and zeroed gradients."""
        import torch

        steps = self.config.gradient_accumulation_steps
        self.step_loss = torch.zeros((), device=self.device)
        for _ in range(steps):
            self.input_ids = next(data).to(self.device, non_blocking=True)
            self.callbacks.call("on_batch", self)
            with self.accelerator.accumulate(self.model):
                loss = self.model(self.input_ids)
                self.accelerator.backward(loss)
                self.step_loss += loss.detach() / steps
                if self.accelerator.sync_gradients:
                    self.grad_norm = self.parallel.clip_grad_norm(self.params, self.max_grad_norm)
                    self.applied = self.callbacks.approve_update(self)
                    if self.applied:
                        self.optimizer.step()
                        self.parallel.after_optimizer_step(self.model)
                    self.scheduler.step()  # a skipped step too: the LR at step k is lr(k)
                    self.optimizer.zero_grad(set_to_none=True)

    def rewind(self) -> None:
        """The run went back to an earlier step (its state restored by the caller): the callbacks hear of it."""
        self.rewound = True
        self.callbacks.call("on_rewind", self)

    def save(self) -> None:
        """A checkpoint now, with the callbacks' pre- and post-checkpoint hooks around it."""
        self.callbacks.call("pre_checkpoint", self)
        with self.busy("a checkpoint"):  # it may wait for the previous checkpoint's write
            self.last_checkpoint = self.checkpointer.save(self.state.step)
        self.callbacks.call("post_checkpoint", self)

    def busy(self, what: str):
        """`with run.busy(what):` around a part of the loop that is progress though no step ends (the
        callbacks' `busy`: the hang watchdog's clock stops meanwhile)."""
        return self.callbacks.busy(self, what)

    # ------------------------------------------------------------------------------------------ the end
    def _end(self) -> None:
        """After the loop: the checkpoint writer drained, final_model/ exported unless the run stopped early
        (every rank: the export checks the ranks agree), and the closing summary."""
        from utils.observe.metrics import closing_summary
        from utils.run.export import export_final_model

        self.checkpointer.wait()
        if self.stopped_by is None:
            self.export_dir, in_sync = export_final_model(self.model, self.spec, self.described, self.state,
                                                          self.output_dir, self.parallel, self.log)
            self.exit_code = 0 if in_sync else 1
        started = self.options.started if self.options.started is not None else time.perf_counter()
        self.log.info(closing_summary(self.output_dir / layout.LOGS / layout.METRICS, step=self.state.step,
                                      tokens=self.state.tokens, session_s=time.perf_counter() - started,
                                      window=self.window, checkpoint=self.last_checkpoint,
                                      final_model=self.export_dir, spikes=self.guard.summary()))

    def _close(self) -> None:
        """On every way out of the loop, an error's too: the loader's workers and fetchers, the checkpoint
        writer and uploads (whose failure makes the exit non-zero), the log and the lock; then the status record
        the launcher reads."""
        if self.core_share is not None:
            self.core_share.stop()
        self.loader.close()
        self.exit_code = max(self.exit_code, self.checkpointer.close())
        self.log.close()
        self.lock.release()
        if sys.exc_info()[0] is not None:  # leaving on an error (main() says 2 for a UserError)
            self.exit_code = max(self.exit_code, 1)
        RunStatus(self.exit_code, self.stopped_by, self.state.step,
                  str(self.last_checkpoint) if self.last_checkpoint else None,
                  str(self.export_dir) if self.export_dir else None).write()

