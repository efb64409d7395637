#!/usr/bin/env python
"""Pretrain GPT-NeoX with a hand-written loop over HuggingFace Accelerate.

Reads top to bottom: arguments -> config -> accelerator -> data -> model and optimizer -> resume ->
prepare/compile -> the loop (accumulate, backward, on sync: clip, step, schedule, zero) -> log, eval,
checkpoint -> drain uploads -> export. Everything else is one call away in utils/.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
import zlib
from datetime import timedelta
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO_ROOT))

from configs import ConfigError, get_model_spec, get_training_config, parse_overrides  # noqa: E402


class UserError(RuntimeError):
    """A problem the user fixes (bad input, missing data, non-finite loss): one line, non-zero exit."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Pretrain GPT-NeoX (see README.md).")
    p.add_argument("--config", required=True, help="preset: demo | test | production")
    p.add_argument("--max-steps", type=int, help="optimizer steps to train to (overrides the preset)")
    p.add_argument("--output-dir", default=str(REPO_ROOT), help="where checkpoints/ and logs/ go (default: repo root)")
    p.add_argument("--data-dir", help="local shard directory (overrides the preset's data_dir)")
    p.add_argument("--resume", help="auto (the newest checkpoint if there is one, else a fresh start) | latest | "
                                    "a checkpoint name | a local path | a gs:// URL")
    p.add_argument("--mixed-precision", choices=("bf16", "fp16", "no"))
    p.add_argument("--no-background-upload", action="store_true", help="upload checkpoints synchronously")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any training-config field (repeatable)")
    return p.parse_args(argv)


def load_config(args):
    overrides = parse_overrides(args.set)
    if args.max_steps is not None:
        overrides["max_steps"] = args.max_steps
    if args.data_dir is not None:
        overrides["data_dir"] = args.data_dir
    if args.mixed_precision is not None:
        overrides["mixed_precision"] = args.mixed_precision
    if args.no_background_upload:
        overrides["background_upload"] = False
    return get_training_config(args.config, overrides)


class StopSignal:
    """SIGTERM/SIGINT set a flag; the loop stops after the current optimizer step. With several processes
    the flag is all-reduced over a CPU (gloo) group, so every rank stops at the same step and the check
    never synchronises the GPU. A second SIGINT interrupts at once."""

    def __init__(self, distributed: bool):
        import torch.distributed as dist

        self.requested = False
        self.signal_name = None
        self._group = dist.new_group(backend="gloo") if distributed else None
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def agreed(self) -> bool:
        if self._group is None:
            return self.requested
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())


def rng_state() -> dict:
    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def first_nonfinite(losses, first_step: int):
    """Step number of the first non-finite loss in a window of per-step losses, or None."""
    import torch

    bad = (~torch.isfinite(losses)).nonzero()
    return None if bad.numel() == 0 else first_step + int(bad[0])


def write_run_status(**fields) -> None:
    """Where the launcher asks for it (`NEOX_STATUS_FILE`), rank 0 leaves a JSON record of how the run
    ended (exit code, what stopped it, the last checkpoint), so the launcher's last line can name it."""
    path = os.environ.get("NEOX_STATUS_FILE")
    if not path or os.environ.get("RANK", "0") != "0":
        return
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(fields, f)
        os.replace(tmp, path)
    except OSError:
        pass  # the status record is a courtesy to the launcher; the run's own output says the same


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        write_run_status(exit_code=2, error=str(exc))
        return 2
    try:
        return train(cfg, args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        write_run_status(exit_code=2, error=str(exc))
        return 2
    finally:  # on every exit path: a gloo/NCCL group left alive can crash or hang the interpreter's exit
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def train(cfg, args) -> int:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs, gather_object
    from tqdm import tqdm

    from utils.checkpoint.writer import AsyncCheckpointWriter
    from utils.checkpoint.resume import resolve_resume
    from utils.checkpoint.format import (CheckpointError, CheckpointPayload, NoCheckpointFound, apply_retention,
                                         checkpoint_name, read_checkpoint, snapshot_to_cpu)
    from utils.data.dataset import TokenSequenceDataset
    from utils.data.index import DataDirError, ShardIndex
    from utils.data.loader import ResumableLoader, build_eval_batches
    from utils.data.shards import ShardError
    from utils.data.demo import DemoDataError, build_demo_data
    from utils.data.demo import is_built as is_demo_build
    from utils.metrics import RunLogger, format_step_line, local_device_stats, mfu, peak_flops
    from utils.model import build_model, count_parameters, flops_per_token, preflight_problem
    from utils.optim import build_optimizer, build_scheduler, schedule_from_config
    from configs.profiles import resolve_profile
    from utils.storage import CredentialsError, StorageError, make_client
    from utils.checkpoint.upload import BackgroundUploader

    # ---------------------------------------------------------------- accelerator, seeds, logging
    if cfg.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise UserError("mixed_precision=fp16 needs a CUDA GPU; use --mixed-precision bf16 or no on the CPU")
    accelerator = Accelerator(
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        mixed_precision=cfg.mixed_precision,
        kwargs_handlers=[
            InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.process_group_timeout_s)),
            DistributedDataParallelKwargs(gradient_as_bucket_view=True),
        ],
    )
    if accelerator.distributed_type.name == "FSDP":
        raise UserError("--strategy fsdp is not supported yet: checkpoints are saved from the unwrapped module, "
                        "which FSDP shards; use --strategy ddp (the 1.2B model fits one GPU with a profile)")
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    is_main = accelerator.is_main_process
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    seed_everything(cfg.seed + rank)

    device_gib = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None
    try:
        cfg, profile = resolve_profile(cfg, device.type, device_gib)
    except ConfigError as exc:
        raise UserError(str(exc)) from None

    output_dir = Path(args.output_dir).resolve()
    ckpt_root = output_dir / "checkpoints"
    spec = get_model_spec(cfg.model)
    seq_len = cfg.effective_seq_len()
    run = cfg.effective_run_name
    remote_prefix = "/".join(part for part in (cfg.gcs_prefix.strip("/"), "checkpoints", run) if part)
    remote_root = f"gs://{cfg.gcs_bucket}/{remote_prefix}" if cfg.gcs_bucket else None

    # ---------------------------------------------------------------- resume: find the checkpoint first
    resume_path, payload = None, None
    if args.resume:
        try:
            with accelerator.main_process_first():  # rank 0 resolves (and downloads) first
                resume_path = resolve_resume(
                    "latest" if args.resume == "auto" else args.resume, ckpt_root, remote_root,
                    client_factory=make_client if remote_root or args.resume.startswith("gs://") else None,
                    log=print if is_main else (lambda *_: None))
            payload = read_checkpoint(resume_path, verify=False)  # resolve_resume verified it
        except NoCheckpointFound as exc:
            if args.resume != "auto":
                raise UserError(f"--resume {args.resume}: {exc}") from None
            if is_main:
                print(f"--resume auto: {str(exc).split(';')[0]}; starting a fresh run")
        except (CheckpointError, StorageError, CredentialsError) as exc:
            raise UserError(f"--resume {args.resume}: {exc}") from None
    resume_step = payload.trainer_state["step"] if payload else None
    log = RunLogger(output_dir / "logs", is_main=is_main, resume_step=resume_step)

    # ---------------------------------------------------------------- data
    data_dir = Path(cfg.data_dir).expanduser().resolve()
    try:
        with accelerator.main_process_first():  # rank 0 builds demo data and the validation cache first
            # Build into an empty folder; re-check an existing demo build (it refuses another vocab or
            # seq_len); a folder of the user's own shards is used as it is.
            if cfg.demo_data and (is_demo_build(data_dir) or not any(data_dir.rglob("*.npz"))):
                build_demo_data(data_dir, vocab_size=spec.vocab_size, seq_len=seq_len, log=log.info)
            index = ShardIndex.build(data_dir, seq_len=seq_len, vocab_size=spec.vocab_size,
                                     max_files=cfg.max_files, log=log.info if is_main else (lambda *_: None))
        train_index, val_index = index.split(cfg.val_files)
    except (DataDirError, ShardError, DemoDataError) as exc:
        raise UserError(str(exc)) from None
    train_set, val_set = TokenSequenceDataset(train_index), TokenSequenceDataset(val_index)
    loader = ResumableLoader(train_set, cfg.per_device_train_batch_size, rank=rank, world_size=world,
                             seed=cfg.seed, num_workers=cfg.dataloader_num_workers,
                             prefetch_factor=cfg.prefetch_factor, pin_memory=device.type == "cuda")
    val_batches = (build_eval_batches(val_set, cfg.per_device_train_batch_size, rank, world, cfg.eval_batches)
                   if len(val_set) else [])

    # ---------------------------------------------------------------- model, optimizer, schedule
    model = build_model(spec, seed=cfg.seed, gradient_checkpointing=cfg.gradient_checkpointing)
    if payload is not None:
        model.lm.load_state_dict(payload.model_state)
    n_params, n_matmul = count_parameters(model)
    optimizer = build_optimizer(model, cfg, fused=device.type == "cuda")
    scheduler = build_scheduler(optimizer, cfg)  # deliberately not prepared: see utils/optim.py
    lr_schedule = schedule_from_config(cfg)

    # ---------------------------------------------------------------- prepare, compile
    model, optimizer = accelerator.prepare(model, optimizer)
    # AcceleratedOptimizer adds only the fp16 loss-scaler path to step/zero_grad, yet looks up an optional
    # package (importlib find_spec, twice) and a signature on every call. The loop calls them on sync steps
    # only, so without a scaler it drives the torch optimizer itself.
    step_optimizer = optimizer if accelerator.scaler is not None else optimizer.optimizer
    params = list(model.parameters())  # walked once, not by every clip
    if cfg.compile_model:
        model = torch.compile(model)
    stop = StopSignal(distributed=world > 1)

    step, tokens, best_loss = 0, 0, float("inf")
    if payload is not None:
        state = payload.trainer_state
        optimizer.load_state_dict(payload.objects["optimizer"])
        scheduler.load_state_dict(payload.objects["scheduler"])
        if accelerator.scaler is not None and payload.objects.get("scaler"):
            accelerator.scaler.load_state_dict(payload.objects["scaler"])
        loader.load_state_dict(payload.objects["data"])
        saved_rng = payload.objects["rng"]
        if rank < len(saved_rng):
            set_rng_state(saved_rng[rank])
        else:
            seed_everything(cfg.seed + 1_000_003 * state["step"] + rank)
        step, tokens, best_loss = state["step"], state["tokens"], state.get("best_loss", float("inf"))
        log.info(f"Resumed from {resume_path} at step {step} (epoch {loader.epoch}, {tokens:,} tokens)")
        if state["world_size"] != world:
            log.info(f"  checkpoint written by {state['world_size']} processes, now {world}: ranks below "
                     f"{min(world, state['world_size'])} restore their saved RNG, others seed theirs from "
                     f"(seed, step, rank); the data cursor is global, so no sample is skipped or repeated")
        old_global = state.get("global_batch_sequences")
        new_global = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world
        if old_global and old_global != new_global:
            log.warning(f"  global batch changes from {old_global} to {new_global} sequences per step; "
                        f"the LR schedule is per optimizer step and is not rescaled")
        del payload

    # ---------------------------------------------------------------- what the run does
    global_batch = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world
    tokens_per_step = global_batch * seq_len
    fpt = flops_per_token(spec, seq_len, n_matmul)
    peak = peak_flops(device)
    log.info(f"Training {cfg.preset} ({run}): model {spec.name} ({n_params / 1e6:.1f}M params), "
             f"{world} process(es) on {device.type}, {cfg.mixed_precision} precision, "
             f"compile={'on' if cfg.compile_model else 'off'}")
    log.info(f"  batch {cfg.per_device_train_batch_size} x accumulation {cfg.gradient_accumulation_steps} x "
             f"{world} = {global_batch} sequences of {seq_len} tokens per step; "
             f"{len(train_set):,} train / {len(val_set):,} val sequences in {len(train_index.shards)}/"
             f"{len(val_index.shards)} files; steps {step} -> {cfg.max_steps}")
    if profile is not None:
        log.info(f"  memory profile {profile.name}" + (f" (auto, {device_gib:.0f} GiB device)" if device_gib else "")
                 + f": micro-batch {cfg.per_device_train_batch_size}, activation checkpointing "
                 f"{'on' if cfg.gradient_checkpointing else 'off'}, AdamW moments in {cfg.optimizer_state_dtype}")
    if remote_root:
        log.info(f"  checkpoints upload to {remote_root}/ ({'background' if cfg.background_upload else 'synchronous'})")
    else:
        log.info("  no gcs_bucket configured: checkpoints stay local, nothing is uploaded")

    writer = AsyncCheckpointWriter()
    uploader = (BackgroundUploader(make_client, synchronous=not cfg.background_upload, log=log.info)
                if remote_root and is_main else None)

    def after_write(path: Path) -> None:  # runs in the writer thread, rank 0 only
        protect = {path} | (uploader.in_flight() if uploader else set())
        apply_retention(ckpt_root, cfg.save_total_limit, protect=protect, log=log.info)
        if uploader:
            uploader.submit(path, f"{remote_root}/{path.name}")

    def evaluate() -> float | None:
        if not val_batches:
            return None
        model.eval()
        total = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for batch in val_batches:
                total[0] += model(batch.to(device, non_blocking=True)).double()
                total[1] += 1
        model.train()
        total = accelerator.reduce(total, reduction="sum")
        return (total[0] / total[1]).item()

    def window_losses_checked():
        """Per-step losses since the last log, averaged over ranks (one host sync); stops the run at the
        first non-finite one, on every rank alike."""
        losses = accelerator.reduce(torch.stack(window_losses), reduction="mean").float().cpu()
        bad = first_nonfinite(losses, window_start)
        if bad is not None:
            raise UserError(f"non-finite loss at step {bad} ({cfg.mixed_precision} precision); no checkpoint "
                            f"was written for it. Lower learning_rate, or resume from the last checkpoint "
                            f"with --mixed-precision no")
        return losses

    def check_finite_before_save() -> None:
        """Nothing non-finite is ever checkpointed: the losses since the last log and every weight."""
        if window_losses:
            window_losses_checked()
        finite = torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all()
        if not bool(accelerator.reduce(finite.float(), reduction="sum") == world):
            raise UserError(f"non-finite weights after step {step}; no checkpoint was written for it. Lower "
                            f"learning_rate, or resume from the last checkpoint")

    def save_checkpoint() -> Path:
        """Blocks only for the device -> host copy; writing, retention and upload run in threads."""
        started = time.perf_counter()
        name = checkpoint_name(loader.epoch, step, train_index.files_consumed(loader.position))
        rngs = gather_object([rng_state()]) if world > 1 else [rng_state()]
        if is_main:
            writer.wait()  # at most one write in flight: a slow disk shows here as blocked time
            unwrapped = accelerator.unwrap_model(model)
            copy_started = time.perf_counter()
            snapshot = snapshot_to_cpu({
                "model": unwrapped.lm.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
            })
            trainer_state = {
                "step": step, "epoch": loader.epoch, "tokens": tokens, "best_loss": best_loss,
                "world_size": world, "global_batch_sequences": global_batch, "seq_len": seq_len,
                "config": cfg.to_dict(), "model": spec.to_dict(), "data": train_index.fingerprint(),
                "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
            }
            objects = {k: snapshot[k] for k in ("optimizer", "scheduler", "scaler")}
            objects |= {"rng": rngs, "data": loader.state_dict()}
            tokenizer = data_dir / "tokenizer.json"
            copy_s = time.perf_counter() - copy_started
            writer.save(ckpt_root, name, CheckpointPayload(snapshot["model"], objects, trainer_state),
                        on_done=after_write, extra_files={"tokenizer.json": tokenizer} if tokenizer.exists() else None)
            blocked_s = time.perf_counter() - started
            log.write_row({"step": step, "checkpoint": name, "blocked_s": blocked_s, "copy_s": copy_s})
            log.info(f"Checkpoint {name}: loop blocked {blocked_s:.3f} s (device->host copy {copy_s:.3f} s); "
                     f"writing{' and uploading' if uploader else ''} in the background")
        return ckpt_root / name

    # ---------------------------------------------------------------- the loop
    exit_code, stopped_by, last_checkpoint, export_dir = 0, None, None, None
    window_losses, window_start = [], step + 1
    window_data_wait, window_t0 = 0.0, time.perf_counter()
    grad_norm = torch.zeros((), device=device)
    trace = os.environ.get("NEOX_TRACE_BATCHES") == "1"
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not is_main, desc="train", unit="step",
               dynamic_ncols=True, mininterval=1.0 if sys.stderr.isatty() else 30.0)
    try:
        if cfg.preflight_steps and val_batches:
            checks = [b.to(device) for b in val_batches[:cfg.preflight_steps]]
            problem = preflight_problem(model, checks)
            failed = accelerator.reduce(torch.tensor(float(problem is not None), device=device), reduction="sum")
            if failed.item():
                others = [m for m in ("bf16", "no") if m != cfg.mixed_precision]
                raise UserError(f"preflight: {problem or 'another rank saw a non-finite loss or gradient'} in "
                                f"{cfg.mixed_precision} precision before training; try --mixed-precision "
                                f"{' or '.join(others)}")
            log.info(f"Preflight: {len(checks)} forward/backward pass(es) in {cfg.mixed_precision} precision "
                     f"gave a finite loss and gradients")
        if step == 0:
            val = evaluate()
            if val is not None:
                log.info(f"Step 0: val_loss={val:.4f}")
                log.write_row({"step": 0, "tokens": 0, "val_loss": val})
        window_t0 = time.perf_counter()
        data_iter = iter(loader)
        while step < cfg.max_steps:
            step_loss = torch.zeros((), device=device)
            for _ in range(cfg.gradient_accumulation_steps):
                t0 = time.perf_counter()
                input_ids = next(data_iter).to(device, non_blocking=True)
                window_data_wait += time.perf_counter() - t0
                if trace:
                    rows = [zlib.crc32(r.numpy().tobytes()) for r in input_ids.cpu()]
                    traced = gather_object([rows]) if world > 1 else [rows]
                    if is_main:
                        with open(output_dir / "logs" / "batch_trace.jsonl", "a") as f:
                            f.write(json.dumps({"step": step + 1, "ranks": traced}) + "\n")
                with accelerator.accumulate(model):
                    loss = model(input_ids)
                    accelerator.backward(loss)
                    step_loss += loss.detach() / cfg.gradient_accumulation_steps
                    if accelerator.sync_gradients:
                        grad_norm = accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
                        step_optimizer.step()
                        scheduler.step()
                        step_optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens += tokens_per_step
            window_losses.append(step_loss)
            bar.update(1)

            if step % cfg.logging_steps == 0 or step == cfg.max_steps:
                losses = window_losses_checked()
                elapsed = time.perf_counter() - window_t0
                n = len(window_losses)
                loss_value = float(losses.mean())
                best_loss = min(best_loss, loss_value)
                tps = n * tokens_per_step / elapsed
                row = {"step": step, "tokens": tokens, "loss": loss_value, "lr": lr_schedule(step),
                       "grad_norm": float(grad_norm),  # the same on every rank: taken after the all-reduce
                       "tokens_per_sec": tps, "mfu": mfu(tps, fpt, peak, world),
                       "steps_per_sec": n / elapsed, "data_wait_frac": window_data_wait / elapsed}
                stats = local_device_stats(device)
                if device.type == "cuda":
                    all_stats = gather_object([stats]) if world > 1 else [stats]
                    row["mem_gb"] = max(s["mem_gb"] for s in all_stats)
                    row["peak_mem_gb"] = max(s["peak_mem_gb"] for s in all_stats)
                    utils_ = [s["gpu_util"] for s in all_stats if s["gpu_util"] is not None]
                    row["gpu_util"] = sum(utils_) / len(utils_) if utils_ else None
                    if is_main and step % (cfg.logging_steps * 10) == 0:
                        log.info("  per-GPU memory (GiB used/peak, util%): " + "; ".join(
                            f"{s['device']} {s['mem_gb']:.1f}/{s['peak_mem_gb']:.1f} {s['gpu_util']}" for s in all_stats))
                else:
                    row["host_peak_rss_gb"] = stats["host_peak_rss_gb"]
                log.write_row(row)
                if is_main:
                    bar.clear()
                    log.info(format_step_line(row, best_loss))
                    bar.refresh()
                window_losses, window_start = [], step + 1
                window_data_wait, window_t0 = 0.0, time.perf_counter()

            if step % cfg.eval_interval == 0 or step == cfg.max_steps:
                val = evaluate()
                if val is not None:
                    log.info(f"Step {step}: val_loss={val:.4f}")
                    log.write_row({"step": step, "tokens": tokens, "val_loss": val})

            stopping = stop.agreed()
            planned_stop = step == cfg.stop_at_step
            if step % cfg.save_steps == 0 or step == cfg.max_steps or stopping or planned_stop:
                check_finite_before_save()
                path = last_checkpoint = save_checkpoint()
                if stopping or planned_stop:
                    stopped_by = (stop.signal_name or "a signal on another rank") if stopping else "stop_at_step"
                    writer.wait()
                    log.info(f"Stopped by {stopped_by} after step {step}: checkpoint {path}")
                    break
        bar.close()
        writer.wait()

        # ------------------------------------------------------------ end of run: consistency, export
        if stopped_by is None:
            sums = torch.stack([p.detach().double().sum() for p in accelerator.unwrap_model(model).parameters()]).sum()
            all_sums = accelerator.gather(sums.reshape(1)).tolist()
            in_sync = all(s == all_sums[0] for s in all_sums)
            if not in_sync:
                log.error(f"weights differ between ranks after training: {all_sums}")
                exit_code = 1
            if is_main:
                export_dir = output_dir / "final_model"
                accelerator.unwrap_model(model).lm.save_pretrained(export_dir, safe_serialization=True)
                tokenizer = data_dir / "tokenizer.json"
                if tokenizer.exists():
                    (export_dir / "tokenizer.json").write_bytes(tokenizer.read_bytes())
                log.write_row({"step": step, "tokens": tokens, "weights_in_sync": in_sync,
                               "weight_sums": all_sums, "final": True})
                log.info(f"Done: {step} steps, {tokens:,} tokens. Model exported to {export_dir}")
    except CheckpointError as exc:
        log.error(f"error: {exc}")
        exit_code = 1
    finally:
        bar.close()
        try:
            writer.wait()
        except CheckpointError as exc:
            log.error(f"error: checkpoint write failed: {exc}")
            exit_code = 1
        if uploader is not None:
            report = uploader.close(timeout=cfg.process_group_timeout_s)
            for url, why in report.failed:
                log.error(f"error: upload of {url} failed: {why}; the local copy is kept")
            if report.failed:
                exit_code = 1
        log.close()
        accelerator.end_training()
        if is_main:
            write_run_status(exit_code=exit_code, stopped_by=stopped_by, step=step,
                             checkpoint=str(last_checkpoint) if last_checkpoint else None,
                             final_model=str(export_dir) if export_dir else None)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
