#!/usr/bin/env python
"""Pretrain GPT-NeoX with a hand-written loop over HuggingFace Accelerate.

`main()` settles the config and catches the errors a user fixes; `train()` is setup calls and then the
loop, every step of it visible: accumulate, backward, on the sync step clip / optimizer step / schedule /
zero, then log, eval and checkpoint when due. The stateful pieces it drives live beside it in utils/:
TrainState and RngState (utils/state.py), the Checkpointer (utils/checkpoint/checkpointer.py), the
metrics window and run logger (utils/metrics.py), the data loader (utils/data/), the stop signal
(utils/signals.py) and the output-dir lock (utils/lock.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

PROCESS_STARTED = time.perf_counter()  # time to first step counts from here
REPO_ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO_ROOT))

from configs.settle import settle_config  # noqa: E402
from configs.training_config import (MIXED_PRECISION_MODES, PRESETS, RESUME_FORMS, describe_fields,  # noqa: E402
                                     precision_name, to_yaml)
from utils.errors import UserError  # noqa: E402
from utils.signals import StoppedInSetup  # noqa: E402


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


def write_run_status(**fields) -> None:
    """Where the launcher asks for it (`NEOX_STATUS_FILE`), rank 0 leaves a JSON record of how the run
    ended (exit code, what stopped it, the last checkpoint), so the launcher's last line can name it."""
    path = os.environ.get("NEOX_STATUS_FILE")
    if not path or os.environ.get("RANK", "0") != "0":
        return
    try:
        from utils.files import write_text

        write_text(path, json.dumps(fields))
    except OSError:
        pass  # the status record is a courtesy to the launcher; the run's own output says the same


def default_output_dir(cfg) -> Path:
    """runs/<run name>/ in the repo: each run its own folder unless --output-dir says otherwise."""
    name = Path(cfg.effective_run_name).name  # a config file's path names its run by its file name
    return REPO_ROOT / "runs" / (name if name not in ("", ".", "..") else "run")


def main(argv=None) -> int:
    from utils.console import survive_lost_console
    from utils.signals import catch_early, watch_supervisor

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
        if os.environ.get("RANK", "0") == "0":
            print(f"Stopped: {exc}", flush=True)
        write_run_status(exit_code=0, stopped_by=exc.reason, step=None, checkpoint=None, final_model=None)
        return 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        write_run_status(exit_code=2, error=str(exc))
        return 2
    finally:  # on every exit path: a gloo/NCCL group left alive can crash or hang the interpreter's exit
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def train(cfg, profile, args) -> int:
    import torch

    from utils.checkpoint.checkpointer import CheckpointPolicy, Checkpointer, find_checkpoint
    from utils.checkpoint.run_record import RunRecord
    from utils.data.build import build_data
    from utils.debug import BatchTrace
    from utils.checkpoint.format import checkpoint_name
    from utils.distributed import main_process_only
    from utils.evals.runner import DownstreamEvals
    from utils.metrics import MetricsWindow, RunLogger, closing_summary, peak_flops
    from utils.optim import schedule_from_config
    from utils.parallel import make_parallelism
    from utils.sampling import Sampler
    from utils.signals import StopSignal
    from utils.state import RngState, TrainState

    output_dir = Path(args.output_dir or default_output_dir(cfg)).resolve()
    accelerator = make_accelerator(cfg, output_dir / "logs")
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    parallel = make_parallelism(cfg, accelerator)
    stop = StopSignal(distributed=world > 1)
    RngState.seed(cfg.seed + rank)
    lock = lock_output_dir(output_dir, accelerator)
    if not args.resume:
        main_process_only(accelerator, lambda: refuse_another_run(output_dir, args.output_dir is None))
    log = RunLogger(output_dir / "logs", is_main=accelerator.is_main_process)
    remote_root = remote_checkpoint_root(cfg)
    node_uploads = parallel.sharded and not shared_output_dir(output_dir, accelerator, remote_root, log)
    resume_path = (find_checkpoint(args.resume, accelerator, output_dir / "checkpoints", remote_root, log)
                   if args.resume else None)
    finished = resume_path and finished_run(resume_path, cfg, output_dir, accelerator, log)
    if finished:  # nothing to train: no preflight, no export unless final_model/ is missing
        log.close()
        lock.release()
        write_run_status(exit_code=0, stopped_by=None, step=cfg.max_steps, checkpoint=str(resume_path),
                         final_model=str(finished))
        return 0
    spec, seq_len, init_weights = resolve_model_spec(cfg, log)
    loader, val_batches = build_data(cfg, seq_len, spec.vocab_size, accelerator, log)
    evals = DownstreamEvals(cfg, spec, accelerator, log, parallel.sharded)  # eval_tasks, read before the model build
    stop.end_setup_if_asked("data index")
    model, optimizer, scheduler = build_training(cfg, spec, init_weights if resume_path is None else None,
                                                 parallel, log)
    core = accelerator.unwrap_model(model)
    state = TrainState()
    states = {"model": model, "optimizer": optimizer, "train": state, "scheduler": scheduler, "data": loader}
    if accelerator.scaler is not None:
        states["scaler"] = accelerator.scaler
    global_batch = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world
    run_record = RunRecord(world, parallel.name, global_batch, seq_len, cfg.to_dict(), spec.to_dict(),
                           loader.fingerprint(), cfg.max_steps)
    tokens_per_step = global_batch * seq_len
    window = MetricsWindow(accelerator, tokens_per_step, core.flops_per_token(seq_len), peak_flops(device),
                           precision_name(cfg.mixed_precision), process_started=PROCESS_STARTED)
    ckpt = Checkpointer(accelerator, states,
                        CheckpointPolicy.from_config(cfg, output_dir / "checkpoints", remote_root, node_uploads),
                        run_record, lambda: checkpoint_name(loader.epoch, state.step, loader.files_consumed()), log,
                        sharded=parallel.sharded)
    if resume_path is not None:
        ckpt.restore(resume_path)
    stop.end_setup_if_asked("model build")
    params = list(model.parameters())  # walked once, not by every clip
    max_grad_norm = cfg.max_grad_norm or math.inf  # 0: no clipping; the norm is still measured and logged
    log.start_trackers(accelerator, cfg.effective_run_name, cfg.to_dict(), state.step if resume_path else None)
    describe_run(cfg, profile, spec, core, parallel, global_batch, seq_len, loader, val_batches, state, remote_root,
                 accelerator, log)
    lr_at = schedule_from_config(cfg)
    sampler = Sampler(cfg.sample_every, cfg.sample_prompts, cfg.sample_max_new_tokens, cfg.data_dir, seq_len, cfg.seed,
                      accelerator, log, sharded=parallel.sharded)
    grad_norm = torch.zeros((), device=device)
    trace = BatchTrace.if_asked(output_dir, accelerator)
    bar = progress_bar(cfg, state, accelerator)
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
                        optimizer.step()
                        parallel.after_optimizer_step(model)
                        scheduler.step()
                        optimizer.zero_grad(set_to_none=True)
            state.advance(tokens_per_step)
            window.add(step_loss)
            bar.update(1)

            if state.step % cfg.logging_steps == 0 or state.step == cfg.max_steps:
                row = window.row(state.step, state.tokens, lr_at(state.step), grad_norm) | loader.source_tokens()
                state.best_loss = min(state.best_loss, row["loss"])
                log_step(row, state, window, cfg, bar, log)
            if state.step % cfg.eval_interval == 0 or state.step == cfg.max_steps:
                window.exclude(run_eval(model, val_batches, accelerator, state, log))
            if evals.due(state.step):
                window.exclude(evals.run(core, state.step, state.tokens))
            if sampler.due(state.step):
                window.exclude(sampler.sample(core, state.step, state.tokens))
            stopping = stop.agreed()
            planned_stop = state.step == cfg.stop_at_step
            if stopping or planned_stop or state.step == cfg.max_steps or ckpt.due(state.step):
                window.checked_losses()  # a non-finite loss stops the run before anything is saved
                last_checkpoint, blocked_s = ckpt.save(state.step)
                window.exclude(blocked_s)
            if stopping or planned_stop:
                stopped_by = stop.reason if stopping else "stop_at_step"
                ckpt.wait()
                log.info(f"Stopped by {stopped_by} after step {state.step}: checkpoint {last_checkpoint}")
                break
        bar.close()
        ckpt.wait()
        if stopped_by is None:
            export_dir, in_sync = finish(model, spec, cfg, state, output_dir, parallel, log)
            exit_code = 0 if in_sync else 1
        log.info(closing_summary(output_dir / "logs" / "metrics.jsonl", step=state.step, tokens=state.tokens,
                                 session_s=time.perf_counter() - PROCESS_STARTED, window=window,
                                 checkpoint=last_checkpoint, final_model=export_dir))
    finally:
        bar.close()
        loader.close()
        exit_code = max(exit_code, ckpt.close())
        log.close()
        lock.release()
        if sys.exc_info()[0] is not None:  # leaving on an error (main() says 2 for a UserError)
            exit_code = max(exit_code, 1)
        write_run_status(exit_code=exit_code, stopped_by=stopped_by, step=state.step,
                         checkpoint=str(last_checkpoint) if last_checkpoint else None,
                         final_model=str(export_dir) if export_dir else None)
    return exit_code


# ------------------------------------------------------------------------------------------------- setup

def make_accelerator(cfg, log_dir: Path):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    if cfg.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise UserError("mixed_precision=fp16 needs a CUDA GPU; use --mixed-precision bf16 or no on the CPU")
    accelerator = Accelerator(
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        # fp8: torchao's float8 Linear layers (utils/model/fp8.py) inside bf16 autocast; accelerate's own
        # fp8 backends are not used
        mixed_precision="bf16" if cfg.mixed_precision == "fp8" else cfg.mixed_precision,
        log_with=make_trackers(cfg, log_dir),
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
        from utils.host_memory import keep_freed_host_memory

        keep_freed_host_memory()
    return accelerator


def make_trackers(cfg, log_dir: Path) -> list:
    """accelerate's trackers for `report_to`; TensorBoard writes into logs/tensorboard/ as it always has."""
    from accelerate.tracking import MLflowTracker, WandBTracker

    from utils.metrics import tensorboard_tracker, usable_trackers

    made = {"tensorboard": lambda: tensorboard_tracker(log_dir),
            "wandb": lambda: WandBTracker(cfg.effective_run_name),
            "mlflow": lambda: MLflowTracker(cfg.effective_run_name, logging_dir=str(log_dir / "mlruns"))}
    quiet = os.environ.get("RANK", "0") != "0"  # every rank finds the same missing package: rank 0 says it
    return [made[name]() for name in usable_trackers(cfg.report_to, warn=(lambda msg: None) if quiet else None)]


def lock_output_dir(output_dir: Path, accelerator):
    """Rank 0 takes the output dir's lock; every rank learns the outcome, so all stop together if busy."""
    from utils.distributed import main_process_only
    from utils.lock import OutputDirLock

    lock = OutputDirLock(output_dir)
    main_process_only(accelerator, lambda: lock.acquire(log=print))
    return lock


def refuse_another_run(output_dir: Path, defaulted: bool) -> None:
    """A fresh run (no --resume) never writes into a folder that holds another run's files: any checkpoint
    (complete or not), final_model/, or rows in logs/metrics.jsonl (a run that trained but never saved).
    Its retention would delete those checkpoints, its export overwrite that model, its rows mix with those,
    so the summary, plot_run.py, generate.py and a later `--resume auto` could take either run's."""
    from utils.checkpoint.format import parse_checkpoint_name

    try:
        found = sorted((p.name for p in (output_dir / "checkpoints").iterdir() if parse_checkpoint_name(p.name)),
                       key=parse_checkpoint_name)
    except OSError:  # none, or unreadable (said where the run reads them)
        found = []
    metrics = output_dir / "logs" / "metrics.jsonl"
    held = ([f"{len(found)} checkpoint(s) (newest {found[-1]})"] if found else []) + \
        (["final_model/"] if (output_dir / "final_model").exists() else []) + \
        (["logs/metrics.jsonl"] if metrics.is_file() and metrics.stat().st_size else [])
    if held:
        elsewhere = ("--set run_name=NAME (its own folder runs/NAME/) or --output-dir DIR" if defaulted
                     else "a new --output-dir")
        raise UserError(f"{output_dir} holds another run's {', '.join(held)}, which a fresh run there would delete, "
                        f"overwrite or mix with its own; continue that run with --resume auto, or start this one "
                        f"elsewhere with {elsewhere}")


def remote_checkpoint_root(cfg) -> str | None:
    prefix = "/".join(p for p in (cfg.gcs_prefix.strip("/"), "checkpoints", cfg.effective_run_name) if p)
    return f"gs://{cfg.gcs_bucket}/{prefix}" if cfg.gcs_bucket else None


def resolve_model_spec(cfg, log):
    """(architecture, seq_len, weights to start from or None). The architecture is the `model` preset, or
    with `init_from` the HF model directory's own; a dataset.json in the data directory (prepare_data.py)
    sets the vocabulary to its tokenizer's."""
    from dataclasses import replace

    from configs import get_model_spec
    from configs.training_config import check_seq_len
    from utils.data.dataset_info import DatasetInfo

    weights = None
    if cfg.init_from:
        from utils.model.hf import check_weights, load_hf_pretrained

        spec, weights = load_hf_pretrained(cfg.init_from)
        check_weights(spec, weights, cfg.init_from)
        log.info(f"init_from {cfg.init_from}: architecture from its config.json (hidden {spec.hidden_size}, "
                 f"{spec.num_hidden_layers} layers, vocab {spec.vocab_size}); the model field ('{cfg.model}') is "
                 f"ignored; a fresh run starts from these weights with a new optimizer and schedule (with "
                 f"--resume, the checkpoint's weights, optimizer and schedule are restored instead)")
    else:
        spec = get_model_spec(cfg.model)
    info = DatasetInfo.load(Path(cfg.data_dir).expanduser())
    if info is not None and cfg.init_from:
        if info.vocab_size > spec.padded_vocab_size:
            raise UserError(f"{info.path}: its tokenizer has {info.vocab_size:,} ids but the init_from model "
                            f"{cfg.init_from} has {spec.padded_vocab_size:,} embedding rows; prepare the data with "
                            f"that model's tokenizer")
        # ids are checked against the tokenizer's size; the embedding keeps the model's own rows
        spec = replace(spec, vocab_size=info.vocab_size, pad_vocab_multiple=spec.padded_vocab_size)
    elif info is not None and info.vocab_size != spec.vocab_size:
        log.info(f"vocabulary from {info.path}: {info.vocab_size:,} token ids (model '{spec.name}' had "
                 f"{spec.vocab_size:,}); {replace(spec, vocab_size=info.vocab_size).padded_vocab_size:,} "
                 f"embedding rows")
        spec = replace(spec, vocab_size=info.vocab_size)
    check_seq_len(cfg.seq_len, spec)
    return spec, cfg.seq_len_for(spec), weights


def finished_run(resume_path: Path, cfg, output_dir: Path, accelerator, log) -> Path | None:
    """A checkpoint at `max_steps` is a finished run: says so and returns final_model/, exporting it from the
    checkpoint (rank 0) only when it is missing; None when there are steps left to train."""
    from utils.checkpoint.format import parse_checkpoint_name

    parsed = parse_checkpoint_name(Path(resume_path).name)
    step = parsed[1] if parsed else None
    if step != cfg.max_steps:
        return None
    final = output_dir / "final_model"
    if accelerator.is_main_process:
        if (final / "config.json").is_file():
            log.info(f"The run already finished: checkpoint {resume_path.name} is at max_steps={step}, and the model "
                     f"is in {final}; nothing to do (raise --max-steps to train further)")
        else:
            from utils.model.hf import export_hf, load_checkpoint_model

            spec, weights, _ = load_checkpoint_model(resume_path)
            data_dir = Path(cfg.data_dir).expanduser()
            has_tokenizer = (data_dir / "dataset.json").is_file() or (data_dir / "tokenizer.json").is_file()
            export_hf(weights, spec, final, tokenizer=data_dir if has_tokenizer else resume_path)
            log.info(f"The run already finished at step {step} ({resume_path.name}); final_model/ was missing: "
                     f"exported it to {final}")
    accelerator.wait_for_everyone()
    return final


def build_training(cfg, spec, init_weights, parallel, log):
    """Model (from `init_weights` when given, built and wrapped by the parallelism seam), AdamW and the LR
    schedule. The scheduler is deliberately never prepared (see utils/optim.py)."""
    from utils.optim import build_optimizer, build_scheduler

    model = parallel.build_model(spec, init_weights, log, document_eos(cfg) if cfg.attention == "document" else None)
    optimizer = build_optimizer(model, cfg, fused=parallel.device.type == "cuda")
    scheduler = build_scheduler(optimizer, cfg)
    model, optimizer = parallel.prepare(model, optimizer)
    return model, optimizer, scheduler


def document_eos(cfg) -> int:
    """attention=document: the id documents end with, from `eos_id` or the data."""
    from utils.data.dataset_info import end_of_document_id
    from utils.data.source import sources_from_config

    eos = cfg.eos_id if cfg.eos_id >= 0 else end_of_document_id(s.path for s in sources_from_config(cfg))
    if eos is None:
        raise UserError(f"attention=document needs the id documents end with, and {cfg.data_dir} has no dataset.json "
                        f"(prepare_data.py writes one): set it with --set eos_id=N")
    return eos


def shared_output_dir(output_dir: Path, accelerator, remote_root: str | None, log) -> bool:
    """Sharded checkpoints are written by every rank into one directory: across nodes it is complete in one
    place only on a shared filesystem, or in GCS. Rank 0 leaves a file in its output dir and every node
    looks for it in its own. False when some node cannot see it: with a bucket each node then uploads its
    own ranks' shards (utils/checkpoint/sharded.py); without one every rank stops in one line."""
    import secrets

    from accelerate.utils import broadcast_object_list, gather_object

    world = accelerator.num_processes
    if world == 1 or int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world:
        return True
    name = f".shared-fs-check-{secrets.token_hex(4)}" if accelerator.is_main_process else None
    if name is not None:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / name).write_text("")
    name = broadcast_object_list([name])[0]
    accelerator.wait_for_everyone()
    seen = (output_dir / name).exists()  # each node's own --output-dir: the same directory only if shared
    blind = [host for host, ok in gather_object([(os.uname().nodename, seen)]) if not ok]
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (output_dir / name).unlink(missing_ok=True)
    if not blind:
        return True
    nodes = ", ".join(sorted(set(blind)))
    if remote_root is None:
        raise UserError(f"strategy=fsdp on several nodes writes one checkpoint from every rank, but --output-dir "
                        f"{output_dir} is not shared: {nodes} cannot see it; put it on a shared filesystem (NFS, "
                        f"Lustre, GCS FUSE), set gcs_bucket (each node then uploads its own shards), or use "
                        f"strategy=ddp")
    log.info(f"  --output-dir is not shared ({nodes} cannot see rank 0's): each node writes its ranks' checkpoint "
             f"shards to its own disk and uploads them to {remote_root}/; a checkpoint is complete there once its "
             f"manifest is, and --resume downloads it on every node")
    return False


def describe_run(cfg, profile, spec, core, parallel, global_batch, seq_len, loader, val_batches, state, remote_root,
                 accelerator, log) -> None:
    from configs.profiles import GB

    world = accelerator.num_processes
    log.info(f"Training {cfg.preset} ({cfg.effective_run_name}): model {spec.name} "
             f"({core.parameter_counts()[0] / 1e6:.1f}M params), {world} process(es) on {accelerator.device.type}, "
             f"{precision_name(cfg.mixed_precision)} precision, compile={'on' if cfg.compile_model else 'off'}")
    weights = parallel.state_bytes(core)
    moments = 2 * weights // (2 if cfg.optimizer_state_dtype == "bf16" else 1)
    log.info(f"  strategy {parallel.name}, world size {world}: per-rank state {(2 * weights + moments) / GB:.2f} GB "
             f"(parameters {weights} bytes, as many in gradients, {moments / GB:.2f} GB AdamW moments)")
    log.info(f"  batch {cfg.per_device_train_batch_size} x accumulation {cfg.gradient_accumulation_steps} x {world} "
             f"= {global_batch} sequences of {seq_len} tokens per step; {loader.num_samples:,} train sequences, "
             f"{len(val_batches)} eval batches per rank; steps {state.step} -> {cfg.max_steps}")
    for line in loader.describe(cfg.max_steps - state.step, global_batch):
        log.info(line)
    if profile is not None:
        log.info(f"  memory profile {profile.name}: micro-batch {cfg.per_device_train_batch_size}, activation "
                 f"checkpointing {parallel.activation_checkpointing}, AdamW moments in "
                 f"{cfg.optimizer_state_dtype}")
    if remote_root:
        log.info(f"  checkpoints upload to {remote_root}/ ({'background' if cfg.background_upload else 'synchronous'})")
    else:
        log.info("  no gcs_bucket configured: checkpoints stay local, nothing is uploaded")


def progress_bar(cfg, state, accelerator):
    """A tqdm bar on an interactive terminal; none when output goes to a file (SLURM, nohup, CI), where
    the step lines already show progress and bar fragments would glue onto them."""
    from tqdm import tqdm

    interactive = sys.stderr.isatty()
    if not interactive:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    return tqdm(total=cfg.max_steps, initial=state.step, desc="train", unit="step", dynamic_ncols=True,
                disable=not (accelerator.is_main_process and interactive))


# --------------------------------------------------------------------------------------- loop helpers

def evaluate(model, batches, accelerator) -> float | None:
    """Mean loss over this rank's eval batches, averaged over ranks; None without a validation split."""
    import torch

    if not batches:
        return None
    model.eval()
    total = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    with torch.no_grad():
        for batch in batches:
            total[0] += model(batch.to(accelerator.device, non_blocking=True)).double()
            total[1] += 1
    model.train()
    total = accelerator.reduce(total, reduction="sum")
    return (total[0] / total[1]).item()


def run_eval(model, batches, accelerator, state, log) -> float:
    """Evaluates each source's batches (an EvalBatches), logs the row and the line; returns the seconds it
    took (kept out of tokens/s)."""
    started = time.perf_counter()
    losses = {name: evaluate(model, source_batches, accelerator) for name, source_batches in batches.by_source.items()}
    seconds = time.perf_counter() - started
    if losses:
        fields = batches.row(losses)  # val_loss (weight-averaged over sources) and val_loss/<name>
        log.info(f"Step {state.step}: " + ", ".join(f"{k}={v:.4f}" for k, v in fields.items()))
        log.write_row({"step": state.step, "tokens": state.tokens, **fields, "eval_s": seconds})
    return seconds


def log_step(row, state, window, cfg, bar, log) -> None:
    from utils.metrics import format_step_line

    log.write_row(row)
    bar.clear()
    log.info(format_step_line(row, state.best_loss))
    if "first_step_s" in row:
        log.info(f"  time to first step: {row['first_step_s']:.1f} s from the process start (imports, data index, "
                 f"model build, compile)")
    if window.per_device and state.step % (cfg.logging_steps * 10) == 0:
        log.info("  per-GPU memory (GiB used/peak, util%): " + "; ".join(
            f"{s['device']} {s['mem_gb']:.1f}/{s['peak_mem_gb']:.1f} {s['gpu_util']}" for s in window.per_device))
    bar.refresh()


def preflight(model, batches, cfg, accelerator, log, stop) -> None:
    """`preflight_steps` forward/backward passes in the run's precision before step 1: a loss or gradient
    that is not finite stops the run with the precision to try instead. A stop signal ends it between
    passes (in one process; ranks may hold different numbers of eval batches, so several check after it)."""
    import torch

    from utils.model import preflight_problem

    if not (cfg.preflight_steps and batches):
        return
    checks = [b.to(accelerator.device) for b in batches[:cfg.preflight_steps]]
    between = (lambda: stop.end_setup_if_asked("preflight")) if accelerator.num_processes == 1 else None
    problem = preflight_problem(model, checks, between)
    failed = accelerator.reduce(torch.tensor(float(problem is not None), device=accelerator.device), reduction="sum")
    precision = precision_name(cfg.mixed_precision)
    if failed.item():
        what = f"preflight: {problem or 'another rank saw a non-finite loss or gradient'} in {precision} precision"
        if cfg.mixed_precision == "no":  # no optimizer step has run: no setting of the schedule or AdamW is involved
            start = f"init_from {cfg.init_from}'s weights" if cfg.init_from else "the starting weights"
            raise UserError(f"{what} before any optimizer step: {start} or the data give it; check them")
        others = [m for m in ("bf16", "no") if m != cfg.mixed_precision]
        raise UserError(f"{what} before training; try --mixed-precision {' or '.join(others)}")
    log.info(f"Preflight: {len(checks)} forward/backward pass(es) in {precision} precision gave a finite loss and "
             f"gradients")


def finish(model, spec, cfg, state, output_dir: Path, parallel, log):
    """End of a completed run: check the ranks agree on the weights, export final_model/ (rank 0).
    Returns (export dir or None, weights in sync)."""
    from utils import files
    from utils.model.hf import export_hf

    weights = parallel.full_state_dict(model)  # collective; rank 0 gets it
    in_sync, all_sums = parallel.weights_in_sync(model)
    if not in_sync:
        log.error(f"weights differ between ranks after training: {all_sums}")
    if weights is None:
        return None, in_sync
    with files.write_guard(output_dir / "final_model", advice="the checkpoints are intact: export one with "
                           "scripts/export_hf.py CHECKPOINT_DIR OUT_DIR into a folder you may write"):
        export_dir = export_hf(weights, spec, output_dir / "final_model",
                               tokenizer=Path(cfg.data_dir).expanduser())  # its dataset.json names EOS
    log.write_row({"step": state.step, "tokens": state.tokens, "weights_in_sync": in_sync, "weight_sums": all_sums,
                   "final": True})
    log.info(f"Done: {state.step} steps, {state.tokens:,} tokens. Model exported to {export_dir}")
    return export_dir, in_sync


if __name__ == "__main__":
    sys.exit(main())
