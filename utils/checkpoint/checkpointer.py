"""The Checkpointer: everything a run does with checkpoints, in one object beside the training loop.

It finds the checkpoint to resume from (`find`), restores every stateful component from it after checking
that it fits this run (`restore`), saves them (`save`: the finite check, then only the device-to-host copy
blocks the loop; writing, retention and upload run in threads), and at the end reports what is where
(`close`). Stateful components are anything with `state_dict()` / `load_state_dict()`: the optimizer, the
LR scheduler, the grad scaler, the data loader's cursor; the model's weights go to `model.safetensors`
(HF names), `TrainState` into `trainer_state.json`, and each rank's RNG state into `rng.pt`.

Only rank 0 writes, retains and uploads; every rank takes part in the collective steps (RNG gather,
finite check), so `save` must be called on all ranks.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

import torch

from utils import files
from utils.checkpoint.format import (CheckpointError, CheckpointPayload, HostBuffers, NoCheckpointFound,
                                     apply_retention, read_checkpoint, snapshot_to_cpu)
from utils.checkpoint.resume import resolve_resume
from utils.checkpoint.upload import BackgroundUploader
from utils.checkpoint.writer import AsyncCheckpointWriter
from utils.errors import DiskFullError, UserError, main_process_first
from utils.state import RngState, TrainState
from utils.storage import make_client

# The model record and run facts a checkpoint must share with the run that resumes it.
_MUST_MATCH = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "padded_vocab_size")


class NonFiniteWeights(UserError):
    pass


class Checkpointer:
    def __init__(self, accelerator, root: Path, remote_root: str | None, *, keep: int, log,
                 background_upload: bool = True, upload_timeout_s: float = 600.0,
                 client_factory: Callable = make_client, extra_files: dict[str, Path] | None = None):
        self.accelerator = accelerator
        self.root, self.remote_root, self.keep, self.log = Path(root), remote_root, keep, log
        self.upload_timeout_s = upload_timeout_s
        self.client_factory = client_factory
        self.extra_files = dict(extra_files or {})  # resolved at each save: e.g. tokenizer.json made after setup
        self.is_main = accelerator.is_main_process
        self.writer = AsyncCheckpointWriter() if self.is_main else None
        self.uploader = (BackgroundUploader(client_factory, synchronous=not background_upload, log=log.info)
                         if remote_root and self.is_main else None)
        if self.uploader:
            self.uploader.check(remote_root)  # a mistyped bucket is one line now, not at the first upload
        self.buffers = HostBuffers()
        self.last: Path | None = None  # the newest checkpoint this run saved
        self.last_bytes = 0  # its size on disk, for the free-space check before the next one

    # ------------------------------------------------------------------------------------------ resume

    def find(self, resume: str) -> Path | None:
        """`--resume` -> a verified local checkpoint, downloaded from GCS if need be (rank 0 first; the
        others then find it locally). `auto`: the newest complete one, or None for a fresh start."""
        try:
            return main_process_first(self.accelerator, lambda: resolve_resume(
                "latest" if resume == "auto" else resume, self.root, self.remote_root,
                client_factory=self.client_factory, log=self.log.info))
        except NoCheckpointFound as exc:
            if resume != "auto":
                raise UserError(f"--resume {resume}: {exc}") from None
            self.log.info(f"--resume auto: {str(exc).split(';')[0]}; starting a fresh run")
            return None
        except UserError as exc:
            raise UserError(f"--resume {resume}: {exc}") from None

    def restore(self, path: Path, model: torch.nn.Module, stateful: dict, state: TrainState, run: dict) -> None:
        """Loads everything saved at `path` into this run's objects, after checking it fits (`run` holds
        this run's record: model, seq_len, data fingerprint, max_steps, world_size, global batch)."""
        payload = read_checkpoint(path, verify=False)  # find() verified it
        saved = payload.trainer_state
        _check_fits(path, saved, run)
        try:
            self.accelerator.unwrap_model(model).load_state_dict(payload.model_state)
        except RuntimeError as exc:
            raise CheckpointError(f"checkpoint {path}: its weights do not fit this model "
                                  f"({str(exc).splitlines()[0]})") from None
        for key, obj in stateful.items():
            if payload.objects.get(key) is None:
                continue  # e.g. no grad scaler was saved (bf16/fp32) or none is used now
            try:
                obj.load_state_dict(payload.objects[key])
            except (ValueError, KeyError, RuntimeError) as exc:
                raise CheckpointError(f"checkpoint {path}: cannot restore its {key} state: {exc}") from None
        rank, saved_rngs = self.accelerator.process_index, payload.objects["rng"]
        if rank < len(saved_rngs):
            RngState.load_state_dict(saved_rngs[rank])
        else:
            RngState.seed(run["config"]["seed"] + 1_000_003 * saved["step"] + rank)
        state.load_state_dict(saved)
        self.log.info(f"Resumed from {path} at step {state.step} ({state.tokens:,} tokens)")
        if saved["world_size"] != run["world_size"]:
            self.log.info(f"  checkpoint written by {saved['world_size']} processes, now {run['world_size']}: "
                          f"ranks below {min(run['world_size'], saved['world_size'])} restore their saved RNG, "
                          f"others seed theirs from (seed, step, rank); the data cursor is global, so no sample "
                          f"is skipped or repeated")
        old_global = saved.get("global_batch_sequences")
        if old_global and old_global != run["global_batch_sequences"]:
            self.log.warning(f"  global batch changes from {old_global} to {run['global_batch_sequences']} "
                             f"sequences per step; the LR schedule is per optimizer step and is not rescaled")

    # -------------------------------------------------------------------------------------------- save

    def save(self, name: str, model: torch.nn.Module, stateful: dict, state: TrainState, run: dict,
             window) -> tuple[Path, float]:
        """Checks nothing non-finite would be saved (every rank), then snapshots and hands the write to
        the writer thread (rank 0). Returns the checkpoint's path and how long the loop was blocked."""
        started = time.perf_counter()
        window.checked_losses()
        params = list(model.parameters())
        finite = torch.stack([torch.isfinite(p).all() for p in params]).all().float()
        if self.accelerator.reduce(finite, reduction="sum").item() != self.accelerator.num_processes:
            raise NonFiniteWeights(f"non-finite weights after step {state.step}; no checkpoint was written for "
                                   f"it. Lower learning_rate, or resume from the last checkpoint")
        rngs = _gather([RngState.state_dict()], self.accelerator)
        path = self.root / name
        if not self.is_main:
            return path, time.perf_counter() - started
        self.writer.wait()  # at most one write in flight (raising its error); the buffers are free again
        self._check_free_space(path)
        copy_started = time.perf_counter()
        unwrapped = self.accelerator.unwrap_model(model)
        snapshot = snapshot_to_cpu({"model": unwrapped.state_dict(),
                                    "objects": {k: v.state_dict() for k, v in stateful.items()}}, self.buffers)
        copy_s = time.perf_counter() - copy_started
        trainer_state = state.state_dict() | {k: v for k, v in run.items() if k != "max_steps"} | {
            "versions": {"torch": torch.__version__, "python": sys.version.split()[0]}}
        payload = CheckpointPayload(snapshot["model"], snapshot["objects"] | {"rng": rngs}, trainer_state)
        present = {k: v for k, v in self.extra_files.items() if Path(v).is_file()}
        self.writer.save(self.root, name, payload, on_done=self._after_write, extra_files=present)
        blocked_s = time.perf_counter() - started
        self.log.write_row({"step": state.step, "checkpoint": name, "blocked_s": blocked_s, "copy_s": copy_s})
        self.log.info(f"Checkpoint {name}: loop blocked {blocked_s:.3f} s (device->host copy {copy_s:.3f} s); "
                      f"writing{' and uploading' if self.uploader else ''} in the background")
        return path, blocked_s

    def wait(self) -> Path | None:
        """Blocks until the last save is on disk (rank 0); raises its error."""
        return self.writer.wait() if self.writer else None

    def _check_free_space(self, path: Path) -> None:
        """Warns before a save that would not fit: the previous checkpoint's size against the free space."""
        if not self.last_bytes:
            return
        free = files.free_bytes(self.root)
        if free < 1.1 * self.last_bytes:
            self.log.warning(f"warning: {free / 1e9:.2f} GB free on {files.mount_point(self.root)}, and a "
                             f"checkpoint takes about {self.last_bytes / 1e9:.2f} GB: {path.name} may not fit; free "
                             f"space or lower save_total_limit")

    def _after_write(self, path: Path) -> None:  # the writer thread, rank 0
        self.last = path
        self.last_bytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        protect = {path} | (self.uploader.protected() if self.uploader else set())
        apply_retention(self.root, self.keep, protect=protect, log=self.log.info)
        if self.uploader:
            self.uploader.submit(path, f"{self.remote_root}/{path.name}")

    # ------------------------------------------------------------------------------------------- close

    def close(self) -> int:
        """Waits for the last write and (at most upload_timeout_s) for uploads; says what is where.
        Returns 1 when the newest checkpoint failed to write or did not reach GCS, else 0."""
        if not self.is_main:
            return 0
        code = 0
        try:
            self.writer.wait()
        except DiskFullError as exc:
            self.log.error(f"error: {exc}")
            code = 1
        except CheckpointError as exc:
            self.log.error(f"error: checkpoint write failed: {exc}")
            code = 1
        if self.uploader is not None:
            report = self.uploader.close(timeout=self.upload_timeout_s)
            for line in report.summary():
                self.log.error(f"error: {line}")
            if report.failed:
                code = 1
            elif self.last is not None and report.succeeded:
                self.log.info(f"checkpoints are in {self.remote_root}/ (newest: {self.last.name})")
        return code


def _gather(obj: list, accelerator) -> list:
    if accelerator.num_processes == 1:
        return obj
    from accelerate.utils import gather_object

    return gather_object(obj)


def _check_fits(path: Path, saved: dict, run: dict) -> None:
    """One clear line for a checkpoint that cannot continue this run."""
    old, new = saved.get("model") or {}, run["model"]
    diff = [f"{k} {old.get(k)} vs {new.get(k)}" for k in _MUST_MATCH if k in old and old.get(k) != new.get(k)]
    if diff:
        raise CheckpointError(f"checkpoint {path} was written for model '{old.get('name')}' but this run builds "
                              f"'{new.get('name')}' ({', '.join(diff)}); resume with --set model={old.get('name')} "
                              f"or start a fresh run in another --output-dir")
    if saved.get("seq_len") not in (None, run["seq_len"]):
        raise CheckpointError(f"checkpoint {path} was trained with seq_len={saved['seq_len']} but this run has "
                              f"seq_len={run['seq_len']}; resume with --set seq_len={saved['seq_len']} or start a "
                              f"fresh run in another --output-dir")
    if saved.get("data") and saved["data"] != run["data"]:
        raise CheckpointError(f"the data changed since checkpoint {path}: it was trained on {saved['data']} and "
                              f"this run reads {run['data']}; restore the same shards and max_files/val_files, or "
                              f"start a fresh run in another --output-dir")
    if saved["step"] > run["max_steps"]:
        raise CheckpointError(f"checkpoint {path} is at step {saved['step']}, and max_steps is {run['max_steps']}: "
                              f"nothing left to train; raise --max-steps to continue the run")
