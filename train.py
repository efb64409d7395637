#!/usr/bin/env python
"""Pretrain GPT-NeoX with a hand-written loop over HuggingFace Accelerate.

`main()` settles the config and catches the errors a user fixes; `train()` assembles the run (each part
one call) and then runs the loop, every step of it visible: accumulate, backward, on the sync step clip /
optimizer step / schedule / zero; then, each deciding for itself whether it is due, the step line
(utils/run/report.py), the evaluations (utils/evals/evaluator.py) and the checkpoint (`Checkpointer.due`).
The parts live in utils/ (see docs/ARCHITECTURE.md): the parallelism seam (utils/parallel/strategies.py) builds and wraps
the model, the data package (utils/data/build.py) the loader, the Checkpointer (utils/checkpoint/checkpointer.py)
saves and restores every stateful thing, the spike guard (utils/training/spike_guard.py) judges each step before its
update, the metrics window (utils/observe/metrics.py) times the steps and nothing between them, and TrainState, the
stop signal and the output folder are small objects beside them. The engine's imports wait for train() on
purpose: `--help`, `--print-config` and a config error answer without loading torch, and a stop signal during
those imports is already caught (main's catch_early).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

PROCESS_STARTED = time.perf_counter()  # time to first step counts from here
REPO_ROOT = Path(__file__).resolve().parent

from configs.settle import settle_config
from configs.training_config import (MIXED_PRECISION_MODES, PRESETS, RESUME_FORMS, describe_fields,
                                     precision_name, to_yaml)
from utils import layout
from utils.io.console import progress_bar, survive_lost_console
from utils.errors import BackgroundFailure, UserError
from utils.runtime.run_status import RunStatus, rank_zero
from utils.runtime.signals import StoppedInSetup, catch_early, watch_supervisor


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Pretrain GPT-NeoX (see README.md).", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="training-config fields (--set KEY=VALUE, or KEY: VALUE in a --config file), with defaults:\n"
               + describe_fields())
    p.add_argument("--config", required=True, metavar="NAME|FILE",
                   help=f"a preset ({' | '.join(PRESETS)}: configs/presets/) or a .yaml/.json file of fields "
                        "(`base: PRESET` starts it from a preset)")
    p.add_argument("--max-steps", type=int, help="optimizer steps to train to (overrides the preset)")
    p.add_argument("--output-dir", help="where checkpoints/, logs/ and final_model/ go (default: runs/RUN_NAME/ in "
                                        "the repo, RUN_NAME being run_name or the preset's name)")
    p.add_argument("--data-dir", help="local shard directory (overrides the preset's data_dir)")
    p.add_argument("--resume", help=" | ".join(RESUME_FORMS) + " (auto: the newest checkpoint if there is one, "
                                    "else a fresh start)")
    p.add_argument("--mixed-precision", choices=MIXED_PRECISION_MODES)
    p.add_argument("--no-background-upload", action="store_true", help="upload checkpoints synchronously")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any training-config field (repeatable); the list is below")
    p.add_argument("--print-config", action="store_true", help="print the resolved config (after the memory "
                                                                "profile) as YAML and exit")
    return p.parse_args(argv)


def cli_aliases(args) -> dict:
    """The command-line flags that are shorthands for config fields."""
    return {"max_steps": args.max_steps, "data_dir": args.data_dir, "mixed_precision": args.mixed_precision,
            "background_upload": False if args.no_background_upload else None}


def main(argv=None) -> int:
    survive_lost_console()  # a console gone (`| tee` and Ctrl-C, a killed launcher) never stops the run
    catch_early()  # from the start: a stop signal during setup (imports, data index, build) ends it cleanly
    watch_supervisor()  # under the launcher: stop as on SIGTERM once it is gone
    args = parse_args(argv)
    try:
        cfg, profile = settle_config(args.config, args.set, cli_aliases(args))
        if args.print_config:
            print(to_yaml(cfg), end="")
            return 0
        return train(cfg, profile, args)
    except StoppedInSetup as exc:
        if rank_zero():
            print(f"Stopped: {exc}", flush=True)
        RunStatus(0, stopped_by=exc.reason).write()
        return 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        RunStatus(2, error=str(exc)).write()
        return 2
    except BackgroundFailure as exc:  # a background thread failed or died: its one line, exit 1
        print(f"error: {exc}", file=sys.stderr)
        RunStatus(1, error=str(exc)).write()
        return 1
    finally:  # on every exit path: a gloo/NCCL group left alive can crash or hang the interpreter's exit
        dist = sys.modules.get("torch.distributed")  # none to close unless train() got as far as importing torch
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def train(cfg, profile, args) -> int:
    import torch  # the engine's imports wait for train(): --help and a config error answer without torch

    from utils.parallel.accelerator import make_accelerator
    from utils.checkpoint.checkpointer import find_checkpoint, remote_checkpoint_root
    from utils.data.build import build_data, description_dir
    from utils.debug import BatchTrace
    from utils.evals.runner import DownstreamEvals
    from utils.run.export import finished_run
    from utils.observe.metrics import MetricsWindow, peak_flops
    from utils.model.fit import check_batch_fits
    from utils.model.lm_loss import set_z_loss
    from utils.model.spec import resolve_model_spec
    from utils.training.schedules import ScheduleSettings
    from utils.parallel.strategies import make_parallelism
    from utils.run.output_dir import default_output_dir, shared_output_dir
    from utils.run.report import StepReporter, describe_run
    from utils.runtime.signals import StopSignal
    from utils.training.spike_guard import SpikeGuard
    from utils.training.state import RngState, TrainState
    from utils.observe.watchdog import HangWatchdog, nccl_flight_recorder_env

    output_dir = Path(args.output_dir or default_output_dir(cfg, REPO_ROOT)).resolve()
    nccl_flight_recorder_env(output_dir / layout.LOGS)  # CUDA: before the process group exists
    accelerator = make_accelerator(cfg, output_dir / layout.LOGS)
    device, world = accelerator.device, accelerator.num_processes
    parallel = make_parallelism(cfg, accelerator)
    stop = StopSignal(distributed=world > 1)
    RngState.seed(cfg.seed + accelerator.process_index)
    lock, log = open_output_dir(output_dir, args, accelerator)
    remote_root = remote_checkpoint_root(cfg)
    node_uploads = parallel.sharded and not shared_output_dir(output_dir, accelerator, remote_root, log)
    resume_path = (find_checkpoint(args.resume, accelerator, output_dir / layout.CHECKPOINTS, remote_root, log)
                   if args.resume else None)
    described = description_dir(cfg)  # the data's dataset.json and tokenizer.json: vocabulary, evals, exports
    if resume_path and finished_run(resume_path, cfg, described, output_dir, accelerator, log, lock):
        return 0  # nothing to train: no preflight, no export unless final_model/ is missing
    spec, seq_len, init_weights = resolve_model_spec(cfg, described, log)
    check_batch_fits(cfg, spec, seq_len, device, world)
    loader, val_batches = build_data(cfg, seq_len, spec.vocab_size, accelerator, log)
    evals = DownstreamEvals(cfg, spec, described, accelerator, log, parallel.sharded)  # read before the model build
    stop.end_setup_if_asked("data index")
    model, optimizer, scheduler = build_training(parallel, cfg, spec, init_weights if resume_path is None else None, log)
    core = accelerator.unwrap_model(model)
    z_heads = set_z_loss(core, cfg.z_loss) if cfg.z_loss else []  # the z term: in the loss, logged as z_loss
    state, guard = TrainState(), SpikeGuard(cfg, accelerator, log)
    states = {"model": model, "optimizer": optimizer, "train": state, "scheduler": scheduler, "data": loader,
              "spike_guard": guard} | ({"scaler": accelerator.scaler} if accelerator.scaler is not None else {})
    tokens_per_step = loader.global_batch * cfg.gradient_accumulation_steps * seq_len  # every rank's
    window = MetricsWindow(accelerator, tokens_per_step, core.flops_per_token(seq_len), peak_flops(device),
                           precision_name(cfg.mixed_precision), PROCESS_STARTED, data_wait=lambda: loader.wait_s,
                           z_loss_heads=z_heads)
    ckpt = make_checkpointer(cfg, parallel, states, spec, seq_len, output_dir, remote_root, node_uploads, described,
                             log)
    if resume_path is not None:
        ckpt.restore(resume_path)
    stop.end_setup_if_asked("model build")
    params, max_grad_norm = list(model.parameters()), cfg.max_grad_norm or math.inf  # 0: not clipped, still logged
    log.start_trackers(accelerator, cfg.effective_run_name, cfg.to_dict(), state.step if resume_path else None)
    describe_run(cfg, parallel, log, profile, spec, core, loader, len(val_batches), state, remote_root)
    bar = progress_bar(cfg.max_steps, state.step, accelerator.is_main_process)
    reporter = StepReporter(cfg.logging_steps, log, window, ScheduleSettings.of(cfg).lr, loader, guard, bar)
    evaluator = make_evaluator(cfg, parallel, model, core, val_batches, evals, seq_len, described, log)
    grad_norm = torch.zeros((), device=device)
    trace = BatchTrace(output_dir, accelerator)  # NEOX_TRACE_BATCHES, NEOX_DEBUG_STEP_DELAY_S
    exit_code, stopped_by, last_checkpoint, export_dir = 0, None, None, None
    watchdog = HangWatchdog(cfg.hang_timeout_s, output_dir / layout.LOGS, accelerator.process_index, world)
    try:
        start_run(model, val_batches, cfg, accelerator, log, stop, evaluator, state, bar)
        window.restart(state.step + 1)
        data_iter = iter(loader)
        watchdog.start(state.step)  # from here, no progress for hang_timeout_s ends the run (utils/observe/watchdog.py)
        while state.step < cfg.max_steps:
            window.begin_step()  # the step's time, and the loader's waits, are what tokens/s and MFU count
            step_loss = torch.zeros((), device=device)
            for _ in range(cfg.gradient_accumulation_steps):
                input_ids = next(data_iter).to(device, non_blocking=True)
                trace.record(state.step + 1, input_ids)  # NEOX_TRACE_BATCHES=1 only
                with accelerator.accumulate(model):
                    loss = model(input_ids)
                    accelerator.backward(loss)
                    step_loss += loss.detach() / cfg.gradient_accumulation_steps
                    if accelerator.sync_gradients:
                        grad_norm = parallel.clip_grad_norm(params, max_grad_norm)
                        applied = guard.check(state.step + 1, step_loss, grad_norm)  # skip, rollback: a host sync
                        if applied:
                            optimizer.step()
                            parallel.after_optimizer_step(model)
                        scheduler.step()  # a skipped step too: the LR at step k is lr_at(k)
                        optimizer.zero_grad(set_to_none=True)
            state.advance(tokens_per_step)
            watchdog.beat(state.step)  # progress: for the hang watchdog and the launcher's restarts
            trace.after_step()
            window.add(step_loss, skipped=not applied)
            bar.update(1)
            if guard.rollback_due and guard.roll_back(ckpt, loader, state):  # the newest checkpoint, data since skipped
                window.restart(state.step + 1)
                bar.n = state.step
                continue
            last, planned_stop = state.step == cfg.max_steps, state.step == cfg.stop_at_step
            reporter.log_if_due(state, grad_norm, last)
            evaluator.run_if_due(state, last)
            # a source that fetches ahead: its next step's files, or the one that failed (then a checkpoint and stop)
            stopping = stop.agreed(None if last or planned_stop else loader.unavailable(cfg.gradient_accumulation_steps))
            if ckpt.due(state.step, last=last or planned_stop or stopping):
                window.checked_losses()  # a non-finite loss stops the run before anything is saved
                guard.review()  # warn: the saved guard has seen every step before the checkpoint
                last_checkpoint = ckpt.save(state.step)
            if stopping or planned_stop:
                stopped_by, exit_code = stop.reason if stopping else "stop_at_step", int(stop.failed)
                ckpt.wait()
                log.info(f"Stopped by {stopped_by} after step {state.step}: checkpoint {last_checkpoint}")
                break
        watchdog.stop()  # the loop is over: what follows (uploads, export) has its own limits
        export_dir, exit_code = end_run(model, spec, described, state, output_dir, parallel, log, bar, ckpt, window,
                                        guard, stopped_by, exit_code, last_checkpoint)
    finally:
        watchdog.stop()
        exit_code = close_run(exit_code, stopped_by, state, last_checkpoint, export_dir, bar, loader, ckpt, log, lock)
    return exit_code


def start_run(model, val_batches, cfg, accelerator, log, stop, evaluator, state, bar) -> None:
    """Before the first step: the preflight (a compile happens here), then a fresh run's step-0 evaluation."""
    from utils.model.preflight import preflight

    bar.set_description_str("setup: preflight (compiles the blocks)" if cfg.compile_model else "setup: preflight")
    preflight(model, val_batches, cfg, accelerator, log, stop)
    stop.end_setup_if_asked("preflight")
    evaluator.at_start(state, bar)  # a fresh run's step 0: where the curves start
    bar.set_description_str("train")


def end_run(model, spec, described, state, output_dir, parallel, log, bar, ckpt, window, guard, stopped_by,
            exit_code: int, last_checkpoint):
    """After the loop: the checkpoint writer drained, final_model/ exported unless the run stopped early (every
    rank: the export checks the ranks agree), and the closing summary. Returns (export dir or None, exit code)."""
    from utils.run.export import export_final_model
    from utils.observe.metrics import closing_summary

    bar.close()
    ckpt.wait()
    export_dir = None
    if stopped_by is None:
        export_dir, in_sync = export_final_model(model, spec, described, state, output_dir, parallel, log)
        exit_code = 0 if in_sync else 1
    log.info(closing_summary(output_dir / layout.LOGS / layout.METRICS, step=state.step, tokens=state.tokens,
                             session_s=time.perf_counter() - PROCESS_STARTED, window=window,
                             checkpoint=last_checkpoint, final_model=export_dir, spikes=guard.summary()))
    return export_dir, exit_code


def close_run(exit_code: int, stopped_by, state, last_checkpoint, export_dir, bar, loader, ckpt, log, lock) -> int:
    """On every way out of the loop, an error's too: the loader's workers and fetchers, the checkpoint writer and
    uploads (whose failure makes the exit non-zero), the log and the lock; then the status record the launcher
    reads. Returns the run's exit status."""
    bar.close()
    loader.close()
    exit_code = max(exit_code, ckpt.close())
    log.close()
    lock.release()
    if sys.exc_info()[0] is not None:  # leaving on an error (main() says 2 for a UserError)
        exit_code = max(exit_code, 1)
    RunStatus(exit_code, stopped_by, state.step, str(last_checkpoint) if last_checkpoint else None,
              str(export_dir) if export_dir else None).write()
    return exit_code


def open_output_dir(output_dir: Path, args, accelerator):
    """The run's folder, locked (one live run per folder), refused when a fresh run would write over another
    run's files; and its logger. Returns (lock, log)."""
    from utils.runtime.distributed import main_process_only
    from utils.observe.metrics import RunLogger
    from utils.run.output_dir import lock_output_dir, refuse_another_run

    lock = lock_output_dir(output_dir, accelerator)
    if not args.resume:
        main_process_only(accelerator, lambda: refuse_another_run(output_dir, args.output_dir is None))
    return lock, RunLogger(output_dir / layout.LOGS, is_main=accelerator.is_main_process)


def make_checkpointer(cfg, parallel, states, spec, seq_len: int, output_dir: Path, remote_root, node_uploads: bool,
                      described: Path, log):
    """The Checkpointer of every stateful thing in `states`: the config's policy, the run's record (what a resume
    must match), the checkpoint's name from the data cursor and the step."""
    from utils.checkpoint.checkpointer import CheckpointPolicy, Checkpointer
    from utils.checkpoint.format import checkpoint_name
    from utils.checkpoint.run_record import RunRecord

    loader, state, world = states["data"], states["train"], parallel.accelerator.num_processes
    global_batch = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world
    return Checkpointer(parallel.accelerator, states,
                        CheckpointPolicy.from_config(cfg, output_dir / layout.CHECKPOINTS, remote_root, node_uploads,
                                                                 described),
                        RunRecord(world, parallel.name, global_batch, seq_len, cfg.to_dict(), spec.to_dict(),
                                  loader.fingerprint(), cfg.max_steps),
                        lambda: checkpoint_name(loader.epoch, state.step, loader.files_consumed()), log,
                        sharded=parallel.sharded)


def make_evaluator(cfg, parallel, model, core, val_batches, evals, seq_len: int, described: Path, log):
    """Validation, the downstream evals and the samples, each on its own schedule (utils/evals/evaluator.py)."""
    from utils.evals.evaluator import Evaluator
    from utils.evals.sampling import Sampler

    sampler = Sampler(cfg.sample_every, cfg.sample_prompts, cfg.sample_max_new_tokens, described, seq_len,
                      cfg.seed, parallel.accelerator, log, sharded=parallel.sharded)
    return Evaluator(cfg.eval_interval, model, core, val_batches, evals, sampler, parallel.accelerator, log)


def build_training(parallel, cfg, spec, init_weights, log):
    """Model (from `init_weights` when given, built and wrapped by the parallelism seam), AdamW and the LR
    schedule. The scheduler is deliberately never prepared (see utils/training/lr_scheduler.py)."""
    from utils.data.build import end_of_document
    from utils.training.lr_scheduler import build_scheduler
    from utils.training.optim import OptimizerSettings, build_optimizer
    from utils.training.schedules import ScheduleSettings

    eos = end_of_document(cfg, spec.vocab_size) if cfg.attention == "document" else None
    model = parallel.build_model(spec, init_weights, log, eos)
    optimizer = build_optimizer(model, OptimizerSettings.of(cfg), fused=parallel.device.type == "cuda")
    scheduler = build_scheduler(optimizer, ScheduleSettings.of(cfg))
    model, optimizer = parallel.prepare(model, optimizer)
    return model, optimizer, scheduler


if __name__ == "__main__":
    sys.exit(main())
