#!/usr/bin/env python
"""Pretrain GPT-NeoX with a hand-written loop over HuggingFace Accelerate.

`main()` settles the config and catches the errors a user fixes; `train()` assembles the run (each part
one call) and then runs the loop, every step of it visible: accumulate, backward, on the sync step clip /
optimizer step / schedule / zero, then log, eval and checkpoint when due. The parts live in utils/ (see
docs/ARCHITECTURE.md): the parallelism seam (utils/parallel.py) builds and wraps the model, the data package
(utils/data/build.py) the loader, the Checkpointer (utils/checkpoint/checkpointer.py) saves and restores every
stateful thing, the spike guard (utils/spike_guard.py) judges each step before its update, and TrainState, the
metrics window, the stop signal and the output folder are small objects beside them.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

PROCESS_STARTED = time.perf_counter()  # time to first step counts from here
REPO_ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO_ROOT))

from configs.settle import settle_config  # noqa: E402
from configs.training_config import (MIXED_PRECISION_MODES, PRESETS, RESUME_FORMS, describe_fields,  # noqa: E402
                                     precision_name, to_yaml)
from utils import layout  # noqa: E402
from utils.console import progress_bar, survive_lost_console  # noqa: E402
from utils.errors import UserError  # noqa: E402
from utils.run_status import RunStatus, rank_zero  # noqa: E402
from utils.signals import StoppedInSetup, catch_early, watch_supervisor  # noqa: E402


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


@dataclass(frozen=True)
class Run:
    """What every setup step of a run shares, made once in train(): its config, command line, processes,
    parallelism strategy, output folder and log."""
    cfg: Any
    args: argparse.Namespace
    accelerator: Any
    parallel: Any
    output_dir: Path
    log: Any


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
    finally:  # on every exit path: a gloo/NCCL group left alive can crash or hang the interpreter's exit
        dist = sys.modules.get("torch.distributed")  # none to close unless train() got as far as importing torch
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def train(cfg, profile, args) -> int:
    # The engine's imports wait for train() on purpose: `--help`, `--print-config` and a config error answer
    # without loading torch, and a stop signal during these imports is already caught (main's catch_early).
    import torch

    from utils.checkpoint.checkpointer import CheckpointPolicy, Checkpointer, find_checkpoint, remote_checkpoint_root
    from utils.checkpoint.format import checkpoint_name
    from utils.checkpoint.run_record import RunRecord
    from utils.data.build import build_data, description_dir
    from utils.debug import BatchTrace
    from utils.distributed import main_process_only
    from utils.evals.runner import DownstreamEvals
    from utils.evals.validation import run_eval
    from utils.export import export_final_model, finished_run
    from utils.metrics import MetricsWindow, RunLogger, closing_summary, peak_flops
    from utils.model.preflight import preflight
    from utils.model.spec import resolve_model_spec
    from utils.optim import schedule_from_config
    from utils.parallel import make_parallelism
    from utils.run_dir import default_output_dir, lock_output_dir, refuse_another_run, shared_output_dir
    from utils.sampling import Sampler
    from utils.signals import StopSignal
    from utils.spike_guard import SpikeGuard
    from utils.state import RngState, TrainState

    output_dir = Path(args.output_dir or default_output_dir(cfg, REPO_ROOT)).resolve()
    accelerator = make_accelerator(cfg, output_dir / layout.LOGS)
    device, world = accelerator.device, accelerator.num_processes
    parallel = make_parallelism(cfg, accelerator)
    stop = StopSignal(distributed=world > 1)
    RngState.seed(cfg.seed + accelerator.process_index)
    lock = lock_output_dir(output_dir, accelerator)
    if not args.resume:
        main_process_only(accelerator, lambda: refuse_another_run(output_dir, args.output_dir is None))
    log = RunLogger(output_dir / layout.LOGS, is_main=accelerator.is_main_process)
    run = Run(cfg, args, accelerator, parallel, output_dir, log)
    remote_root = remote_checkpoint_root(cfg)
    node_uploads = parallel.sharded and not shared_output_dir(output_dir, accelerator, remote_root, log)
    resume_path = (find_checkpoint(args.resume, accelerator, output_dir / layout.CHECKPOINTS, remote_root, log)
                   if args.resume else None)
    finished = resume_path and finished_run(resume_path, cfg, output_dir, accelerator, log)
    if finished:  # nothing to train: no preflight, no export unless final_model/ is missing
        log.close()
        lock.release()
        RunStatus(0, step=cfg.max_steps, checkpoint=str(resume_path), final_model=str(finished)).write()
        return 0
    spec, seq_len, init_weights = resolve_model_spec(cfg, log)
    loader, val_batches = build_data(cfg, seq_len, spec.vocab_size, accelerator, log)
    evals = DownstreamEvals(cfg, spec, accelerator, log, parallel.sharded)  # eval_tasks, read before the model build
    stop.end_setup_if_asked("data index")
    model, optimizer, scheduler = build_training(run, spec, init_weights if resume_path is None else None)
    core = accelerator.unwrap_model(model)
    state = TrainState()
    guard = SpikeGuard(cfg, accelerator, log)
    states = {"model": model, "optimizer": optimizer, "train": state, "scheduler": scheduler, "data": loader,
              "spike_guard": guard}
    if accelerator.scaler is not None:
        states["scaler"] = accelerator.scaler
    global_batch = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world
    tokens_per_step = global_batch * seq_len
    window = MetricsWindow(accelerator, tokens_per_step, core.flops_per_token(seq_len), peak_flops(device),
                           precision_name(cfg.mixed_precision), process_started=PROCESS_STARTED)
    ckpt = Checkpointer(accelerator, states,
                        CheckpointPolicy.from_config(cfg, output_dir / layout.CHECKPOINTS, remote_root, node_uploads),
                        RunRecord(world, parallel.name, global_batch, seq_len, cfg.to_dict(), spec.to_dict(),
                                  loader.fingerprint(), cfg.max_steps),
                        lambda: checkpoint_name(loader.epoch, state.step, loader.files_consumed()), log,
                        sharded=parallel.sharded)
    if resume_path is not None:
        ckpt.restore(resume_path)
    stop.end_setup_if_asked("model build")
    params = list(model.parameters())  # walked once, not by every clip
    max_grad_norm = cfg.max_grad_norm or math.inf  # 0: no clipping; the norm is still measured and logged
    log.start_trackers(accelerator, cfg.effective_run_name, cfg.to_dict(), state.step if resume_path else None)
    describe_run(run, profile, spec, core, loader, len(val_batches), state, remote_root)
    lr_at = schedule_from_config(cfg)
    sampler = Sampler(cfg.sample_every, cfg.sample_prompts, cfg.sample_max_new_tokens, description_dir(cfg), seq_len, cfg.seed,
                      accelerator, log, sharded=parallel.sharded)
    grad_norm = torch.zeros((), device=device)
    trace = BatchTrace.if_asked(output_dir, accelerator)
    bar = progress_bar(cfg.max_steps, state.step, accelerator.is_main_process)
    exit_code, stopped_by, last_checkpoint, export_dir = 0, None, None, None
    try:
        bar.set_description_str("setup: preflight (compiles the blocks)" if cfg.compile_model else "setup: preflight")
        preflight(model, val_batches, cfg, accelerator, log, stop)
        stop.end_setup_if_asked("preflight")
        if state.step == 0:
            bar.set_description_str("setup: eval")
            run_eval(model, val_batches, accelerator, state, log)
            if evals.due(state.step):
                evals.run(core, state.step, state.tokens)
        bar.set_description_str("train")
        window.restart(state.step + 1)
        data_iter = iter(loader)
        while state.step < cfg.max_steps:
            step_loss = torch.zeros((), device=device)
            for _ in range(cfg.gradient_accumulation_steps):
                t0 = time.perf_counter()
                input_ids = next(data_iter).to(device, non_blocking=True)
                window.data_wait_s += time.perf_counter() - t0
                if trace:
                    trace.record(state.step + 1, input_ids)
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
            window.add(step_loss, skipped=not applied)
            bar.update(1)
            if guard.rollback_due and guard.roll_back(ckpt, loader, state):  # the newest checkpoint, data since skipped
                window.restart(state.step + 1)
                bar.n = state.step
                continue

            if state.step % cfg.logging_steps == 0 or state.step == cfg.max_steps:
                guard.review()  # warn: this window's steps
                row = window.row(state.step, state.tokens, lr_at(state.step), grad_norm) | loader.source_tokens()
                state.best_loss = min(state.best_loss, row["loss"])
                log_step(run, row, state, window, bar)
            if state.step % cfg.eval_interval == 0 or state.step == cfg.max_steps:
                window.exclude(run_eval(model, val_batches, accelerator, state, log))
            if evals.due(state.step):
                window.exclude(evals.run(core, state.step, state.tokens))
            if sampler.due(state.step):
                window.exclude(sampler.sample(core, state.step, state.tokens))
            planned_stop = state.step == cfg.stop_at_step
            t0 = time.perf_counter()  # a source that fetches ahead: its next step's files, or the one that failed
            failed = None if planned_stop or state.step == cfg.max_steps else loader.unavailable(
                cfg.gradient_accumulation_steps)
            window.data_wait_s += time.perf_counter() - t0
            stopping = stop.agreed(failed)
            if stopping or planned_stop or state.step == cfg.max_steps or ckpt.due(state.step):
                window.checked_losses()  # a non-finite loss stops the run before anything is saved
                guard.review()  # warn: the saved guard has seen every step before the checkpoint
                last_checkpoint, blocked_s = ckpt.save(state.step)
                window.exclude(blocked_s)
            if stopping or planned_stop:
                stopped_by = stop.reason if stopping else "stop_at_step"
                exit_code = int(stop.failed)
                ckpt.wait()
                log.info(f"Stopped by {stopped_by} after step {state.step}: checkpoint {last_checkpoint}")
                break
        bar.close()
        ckpt.wait()
        if stopped_by is None:
            export_dir, in_sync = export_final_model(model, spec, cfg, state, output_dir, parallel, log)
            exit_code = 0 if in_sync else 1
        log.info(closing_summary(output_dir / layout.LOGS / layout.METRICS, step=state.step, tokens=state.tokens,
                                 session_s=time.perf_counter() - PROCESS_STARTED, window=window,
                                 checkpoint=last_checkpoint, final_model=export_dir, spikes=guard.summary()))
    finally:
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


# ------------------------------------------------------------------------------------------------- setup

def make_accelerator(cfg, log_dir: Path):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    from utils.host_memory import keep_freed_host_memory
    from utils.trackers import make_trackers

    if cfg.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise UserError("mixed_precision=fp16 needs a CUDA GPU; use --mixed-precision bf16 or no on the CPU")
    accelerator = Accelerator(
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        # fp8: torchao's float8 Linear layers (utils/model/fp8.py) inside bf16 autocast; accelerate's own
        # fp8 backends are not used
        mixed_precision="bf16" if cfg.mixed_precision == "fp8" else cfg.mixed_precision,
        log_with=make_trackers(cfg.report_to, cfg.effective_run_name, log_dir),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.process_group_timeout_s)),
                         DistributedDataParallelKwargs(gradient_as_bucket_view=True)],
    )
    if accelerator.distributed_type.name == "FSDP":
        raise UserError("accelerate was launched with its own FSDP flags; launch plainly (start_training.sh "
                        "--strategy fsdp, or --set strategy=fsdp): the engine shards the model itself")
    if accelerator.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    elif accelerator.device.type == "cpu":
        keep_freed_host_memory()
    return accelerator


def build_training(run: Run, spec, init_weights):
    """Model (from `init_weights` when given, built and wrapped by the parallelism seam), AdamW and the LR
    schedule. The scheduler is deliberately never prepared (see utils/optim.py)."""
    from utils.data.build import end_of_document
    from utils.optim import build_optimizer, build_scheduler

    eos = end_of_document(run.cfg) if run.cfg.attention == "document" else None
    model = run.parallel.build_model(spec, init_weights, run.log, eos)
    optimizer = build_optimizer(model, run.cfg, fused=run.parallel.device.type == "cuda")
    scheduler = build_scheduler(optimizer, run.cfg)
    model, optimizer = run.parallel.prepare(model, optimizer)
    return model, optimizer, scheduler


def describe_run(run: Run, profile, spec, core, loader, eval_batches: int, state, remote_root: str | None) -> None:
    from configs.profiles import GB

    cfg, parallel, world, log = run.cfg, run.parallel, run.accelerator.num_processes, run.log
    global_batch = loader.global_batch * cfg.gradient_accumulation_steps
    log.info(f"Training {cfg.preset} ({cfg.effective_run_name}): model {spec.name} "
             f"({core.parameter_counts()[0] / 1e6:.1f}M params), {world} process(es) on {parallel.device.type}, "
             f"{precision_name(cfg.mixed_precision)} precision, compile={'on' if cfg.compile_model else 'off'}")
    weights = parallel.state_bytes(core)
    moments = 2 * weights // (2 if cfg.optimizer_state_dtype == "bf16" else 1)
    log.info(f"  strategy {parallel.name}, world size {world}: per-rank state {(2 * weights + moments) / GB:.2f} GB "
             f"(parameters {weights} bytes, as many in gradients, {moments / GB:.2f} GB AdamW moments)")
    log.info(f"  batch {cfg.per_device_train_batch_size} x accumulation {cfg.gradient_accumulation_steps} x {world} "
             f"= {global_batch} sequences of {loader.dataset.seq_len} tokens per step; {loader.num_samples:,} train "
             f"sequences, {eval_batches} eval batches per rank; steps {state.step} -> {cfg.max_steps}")
    for line in loader.describe(cfg.max_steps - state.step, global_batch):
        log.info(line)
    if profile is not None:
        log.info(f"  memory profile {profile.name}: micro-batch {cfg.per_device_train_batch_size}, activation "
                 f"checkpointing {parallel.activation_checkpointing}, AdamW moments in {cfg.optimizer_state_dtype}")
    if remote_root:
        log.info(f"  checkpoints upload to {remote_root}/ ({'background' if cfg.background_upload else 'synchronous'})")
    else:
        log.info("  no gcs_bucket configured: checkpoints stay local, nothing is uploaded")


# --------------------------------------------------------------------------------------- loop helpers

def log_step(run: Run, row: dict, state, window, bar) -> None:
    from utils.metrics import format_step_line

    run.log.write_row(row)
    bar.clear()
    run.log.info(format_step_line(row, state.best_loss))
    if "first_step_s" in row:
        run.log.info(f"  time to first step: {row['first_step_s']:.1f} s from the process start (imports, data "
                     f"index, model build, compile)")
    if window.per_device and state.step % (run.cfg.logging_steps * 10) == 0:
        run.log.info("  per-GPU memory (GiB used/peak, util%): " + "; ".join(
            f"{s['device']} {s['mem_gb']:.1f}/{s['peak_mem_gb']:.1f} {s['gpu_util']}" for s in window.per_device))
    bar.refresh()


if __name__ == "__main__":
    sys.exit(main())
