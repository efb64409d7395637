"""The Checkpointer: everything a run does with checkpoints, in one object beside the training loop.

`find_checkpoint` turns `--resume` into a verified local checkpoint before the model is built (so
`init_from` knows whether its weights are wanted). The Checkpointer is then built once with

    states   every stateful thing of the run by name, each with `state_dict()` / `load_state_dict()`
             (torchtitan's shape): "model" and "optimizer" (saved by the checkpoint format, sharded under
             FSDP), "train" (TrainState: trainer_state.json) and any others (scheduler, data cursor, grad
             scaler: `<key>.pt`)
    policy   when and where (CheckpointPolicy: every, keep, the GCS folder, upload mode, extra files)
    run      this run's RunRecord, written with every checkpoint and checked against on resume
    name     a function naming the checkpoint for the current step

The loop decides when a save is due (`due(step)`, or a forced one: the last step, a stop signal) and checks
its losses first; `save(step)` then saves, `restore(path)` mirrors it, `close()` reports what is where.
`newest()` names the run's newest checkpoint on every rank (the spike guard's rollback restores it).

Saving: the finite check (every rank), then only the device-to-host copy blocks the loop; writing,
retention and upload run in threads. Unsharded (DDP): rank 0 writes the model (`model.safetensors`, HF
names) and every object (`<key>.pt`, the optimizer's among them). Sharded (FSDP): every rank writes its
own shards of model and optimizer into `dcp/` (utils/checkpoint/sharded.py), rank 0 the rest and, once
every rank's files are on disk, the manifest; then the directory is renamed into place (on
several nodes without a shared output dir, each node uploads its own shards to GCS first, and rank 0's copy
is partial: the checkpoint is complete in GCS once its manifest is). Each rank's RNG
state goes into `rng.pt`, `TrainState` and the run record into `trainer_state.json`. Extra files (the
data's tokenizer.json) are looked up when a checkpoint is written, so one made during the run is included.
Restoring reads model and optimizer by the format on disk (DCP's shards, or the full state), into a
model sharded or not, on any world size.

`save` and `restore` must be called on every rank (they hold collective steps); rank 0 alone writes the
non-sharded files, retains and uploads.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch

from utils import layout
from utils.checkpoint.format import (
    COMPILE_CACHE_FILE,
    SHARDED_DIR,
    CheckpointError,
    CheckpointPayload,
    HostBuffers,
    NoCheckpointFound,
    NodeUploadFailed,
    ShardedPart,
    apply_retention,
    read_checkpoint,
    snapshot_to_cpu,
)
from utils.checkpoint.resume import resolve_resume
from utils.checkpoint.run_record import RunRecord
from utils.checkpoint.upload import BackgroundUploader
from utils.checkpoint.writer import AsyncCheckpointWriter
from utils.data.tokenizer import FILE as TOKENIZER_FILE
from utils.errors import DiskFullError, UserError
from utils.io import files
from utils.io.storage import make_client
from utils.runtime.distributed import local_tensor, main_process_first, main_process_only
from utils.settings import Settings
from utils.training.state import RngState

# The model record and run facts a checkpoint must share with the run that resumes it.
_MUST_MATCH = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "padded_vocab_size")

# Settings a checkpoint records (trainer_state.json's config) whose effect a resume would otherwise take from the
# checkpoint's state (the scheduler's, the optimizer's param groups and moments) rather than from the config:
# each follows this run's config from the resumed step on, and a change is said in one line. The README
# ("Settings on resume") lists these and the refused ones.
FOLLOW_CONFIG_ON_RESUME = {
    **dict.fromkeys(("learning_rate", "warmup_steps", "min_lr_ratio", "lr_schedule", "decay_steps", "decay_fraction",
                     "decay_shape", "max_steps"), "the LR schedule"),
    **dict.fromkeys(("adam_beta1", "adam_beta2", "adam_eps", "weight_decay", "optimizer_state_dtype"), "AdamW"),
    **dict.fromkeys(("muon_momentum", "muon_scale", "cautious_weight_decay"), "Muon"), "z_loss": "the loss",
    "max_grad_norm": "gradient clipping",
}
# Settings a resume cannot change (it continues the checkpoint's data order and random generators): refused
# in one line, as are another model, seq_len or data (_check_fits).
KEEP_ON_RESUME = ("seed",)


class NonFiniteWeights(UserError):
    pass


def find_checkpoint(resume: str, accelerator, root: Path, remote_root: str | None, log,
                    client_factory: Callable = make_client) -> Path | None:
    """`--resume` -> a verified local checkpoint, downloaded from GCS if need be. `auto`: the newest complete
    one, or None for a fresh start. Rank 0 decides which checkpoint; every other rank then takes that one
    (found locally, or downloaded by the first process of its node when its disk is not rank 0's), so no
    rank can resume another step than rank 0's, whatever each one's disk holds or its GCS listing says."""
    from accelerate.utils import broadcast_object_list

    arg = "latest" if resume == "auto" else resume

    def resolve(which: str) -> Path:
        return resolve_resume(which, Path(root), remote_root, client_factory=client_factory, log=log.info)

    chosen = problem = None  # rank 0: ("found", name) or ("fresh", why)
    if accelerator.is_main_process:
        try:
            path = resolve(arg)
            chosen = ("found", path.name)
        except NoCheckpointFound as exc:
            if resume != "auto":
                problem = UserError(f"--resume {resume}: {exc}")
            else:
                chosen = ("fresh", str(exc).split(";")[0])
        except UserError as exc:
            problem = UserError(f"--resume {resume}: {exc}")
    if accelerator.num_processes > 1:
        chosen = broadcast_object_list([chosen])[0]
    if problem is not None:
        raise problem
    if chosen is None:
        raise SystemExit(2)  # rank 0 says why
    if chosen[0] == "fresh":
        log.info(f"--resume auto: {chosen[1]}; starting a fresh run")
        return None
    # a path or gs:// URL names one checkpoint for every rank; `latest` and names become rank 0's choice
    same = arg if arg.startswith("gs://") or Path(arg).is_dir() else chosen[1]
    try:
        return main_process_first(accelerator, lambda: path if accelerator.is_main_process else resolve(same))
    except UserError as exc:
        raise UserError(f"--resume {resume} (checkpoint {chosen[1]}, chosen by rank 0): {exc}") from None


MODEL, OPTIMIZER, TRAIN = "model", "optimizer", "train"  # the states the format itself saves


@dataclass(frozen=True)
class CheckpointSettings(Settings):
    save_steps: int
    save_total_limit: int
    gcs_bucket: str
    gcs_prefix: str
    effective_run_name: str  # names the run's folder in the bucket
    background_upload: bool
    upload_timeout_s: int

    @property
    def remote_root(self) -> str | None:
        """gs://BUCKET/PREFIX/checkpoints/RUN: where the run's checkpoints upload (None: no bucket)."""
        prefix = "/".join(p for p in (self.gcs_prefix.strip("/"), layout.CHECKPOINTS, self.effective_run_name) if p)
        return f"gs://{self.gcs_bucket}/{prefix}" if self.gcs_bucket else None


@dataclass(frozen=True)
class CheckpointPolicy:
    """When and where checkpoints go."""
    root: Path  # the local checkpoints folder
    every: int = 0  # optimizer steps between saves (save_steps); 0: only forced saves
    keep: int | None = 3  # local checkpoints kept, the newest (save_total_limit); None: all
    remote_root: str | None = None  # gs://.../checkpoints/RUN: uploads go there; None: local only
    background_upload: bool = True
    upload_timeout_s: float = 600.0  # at close, how long uploads still running may take
    node_uploads: bool = False  # FSDP on several nodes without a shared output dir: each node uploads its shards
    extra_files: Mapping[str, Path] = field(default_factory=dict)  # copied in when present at save time

    @classmethod
    def from_settings(cls, settings: CheckpointSettings, root: Path, node_uploads: bool = False,
                      described: Path | None = None, compile_cache: Path | None = None) -> "CheckpointPolicy":
        """`described`: the data's description folder, whose tokenizer.json each checkpoint carries;
        `compile_cache`: the run's compiled code (utils/checkpoint/compile_cache.py), carried too."""
        extra = {TOKENIZER_FILE: described / TOKENIZER_FILE} if described is not None else {}
        if compile_cache is not None:
            extra[COMPILE_CACHE_FILE] = Path(compile_cache)
        return cls(Path(root), settings.save_steps, settings.save_total_limit, settings.remote_root,
                   settings.background_upload, settings.upload_timeout_s, node_uploads, extra)


class Checkpointer:
    def __init__(self, accelerator, states: Mapping, policy: CheckpointPolicy, run: RunRecord,
                 name: Callable[[], str], log, sharded: bool = False, client_factory: Callable = make_client):
        self.accelerator, self.states, self.policy, self.run = accelerator, dict(states), policy, run
        self.name, self.log, self.sharded, self.client_factory = name, log, sharded, client_factory
        self.root, self.remote_root = Path(policy.root), policy.remote_root
        self.is_main = accelerator.is_main_process
        self.writer = AsyncCheckpointWriter() if self.is_main else None
        # several nodes without a shared output dir: each node uploads its own ranks' shards (sharded.py)
        self.node_uploads = sharded and policy.node_uploads and self.remote_root is not None
        self.uploader = (BackgroundUploader(client_factory, synchronous=not policy.background_upload, log=log.info,
                                            clean_superseded=self.node_uploads)
                         if self.remote_root and self.is_main else None)
        if self.remote_root:  # a mistyped bucket is one line now, on every rank, not at the first upload
            main_process_only(accelerator, lambda: self.uploader.check(self.remote_root))
        self.buffers = HostBuffers()
        self.shard_saver = None
        if sharded:
            from utils.checkpoint.sharded import NodeUploads, ShardedSaver

            nodes = (NodeUploads(uploader=accelerator.is_local_main_process and not self.is_main,
                                 remote_root=self.remote_root, client_factory=client_factory, log=log.warning)
                     if self.node_uploads else None)
            self.shard_saver = ShardedSaver(nodes)  # a gloo group of its own: created on every rank, in order
        self.incomplete: str | None = None  # the newest checkpoint, when a node's shards did not reach GCS
        self.last: Path | None = None  # the newest checkpoint this run saved
        self.restored: Path | None = None  # the checkpoint last restored (the one resumed from, or rolled back to)
        self.last_bytes = 0  # its size on disk, for the free-space check before the next one

    @property
    def model(self) -> torch.nn.Module:
        return self.states[MODEL]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.states[OPTIMIZER]

    def objects(self) -> dict:
        """The states saved as `<key>.pt`: all but the model and the train state, and the optimizer too
        unless it is sharded with the model."""
        skip = {MODEL, TRAIN} | ({OPTIMIZER} if self.sharded else set())
        return {k: v for k, v in self.states.items() if k not in skip}

    # ------------------------------------------------------------------------------------------ resume

    def restore(self, path: Path, action: str = "Resumed from") -> None:
        """Loads everything saved at `path` into the registered states, after checking it fits this run,
        whatever the strategy and world size that wrote it (every rank calls it). `action` starts the log line."""
        from utils.checkpoint.sharded import is_sharded, load_full, load_sharded

        payload = read_checkpoint(path, verify=False)  # find_checkpoint verified it
        step, saved = payload.trainer_state["step"], RunRecord.from_json(payload.trainer_state)
        _check_fits(path, saved, step, self.run)
        core = self.accelerator.unwrap_model(self.model)
        objects = dict(payload.objects)
        # the optimizer's hyperparameters are this run's config (the restore would put back the checkpoint's);
        # its LR is the scheduler's, set when the scheduler is restored
        own_settings = [{k: v for k, v in group.items() if k not in ("params", "lr")}
                        for group in self.optimizer.param_groups]
        try:  # by the format on disk, into this model whether it is sharded or not
            if is_sharded(path):
                load_sharded(core, self.optimizer, path)
            else:
                load_full(core, self.optimizer, payload.model_state, objects.pop(OPTIMIZER, None))
        except UserError:  # e.g. a sharded checkpoint refused as unsafe: its own message
            raise
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"checkpoint {path}: its weights or optimizer state do not fit this model "
                                  f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        self._check_optimizer_state(path, core)
        for key, obj in self.objects().items():
            if key == OPTIMIZER or objects.get(key) is None:
                continue  # the optimizer is loaded with the model; e.g. no grad scaler was saved or none is used now
            try:
                obj.load_state_dict(objects[key])
            except (ValueError, KeyError, RuntimeError) as exc:
                raise CheckpointError(f"checkpoint {path}: cannot restore its {key} state: {exc}") from None
        for group, own in zip(self.optimizer.param_groups, own_settings):
            group.update(own)
        rank, saved_rngs = self.accelerator.process_index, objects["rng"]
        if rank < len(saved_rngs):
            RngState.load_state_dict(saved_rngs[rank])
        else:
            RngState.seed(self.run.config["seed"] + 1_000_003 * step + rank)
        self.states[TRAIN].load_state_dict(payload.trainer_state)
        self.restored = Path(path)
        saved_strategy = "fsdp" if is_sharded(path) else "ddp"
        self.log.info(f"{action} {path} at step {step} ({self.states[TRAIN].tokens:,} tokens)")
        for line in _followed_changes(saved.config, self.run.config, step):
            self.log.info(line)
        if saved.world_size != self.run.world_size or saved_strategy != self.run.strategy:
            self.log.info(f"  checkpoint written by {saved.world_size} processes ({saved_strategy}), now "
                          f"{self.run.world_size} ({self.run.strategy}): model and optimizer state are "
                          f"resharded; ranks below {min(self.run.world_size, saved.world_size)} restore their "
                          f"saved RNG, others seed theirs from (seed, step, rank); the data cursor is global, so "
                          f"no sample is skipped or repeated")
        if self.node_uploads:  # other nodes keep no checkpoints: the copy downloaded for this resume goes
            self.accelerator.wait_for_everyone()  # once every rank of the node has read it
            if self.accelerator.is_local_main_process and not self.is_main and path.parent == self.root:
                files.remove_tree(path)
        old_global = saved.global_batch_sequences
        if old_global and old_global != self.run.global_batch_sequences and self.is_main:  # the same on every rank
            self.log.warning(f"  global batch changes from {old_global} to {self.run.global_batch_sequences} "
                             f"sequences per step; the LR schedule is per optimizer step and is not rescaled")

    def _check_optimizer_state(self, path: Path, core: torch.nn.Module) -> None:
        """The loaded optimizer state's steps and moments checked on every rank (each its own shards), the first
        problem raised on all of them: one line naming the checkpoint, not a non-finite loss at the next step."""
        from utils.training.optim import state_problem

        names: dict[int, str] = {}
        for name, p in core.state_dict(keep_vars=True).items():
            names.setdefault(id(p), name)
        problem = state_problem((names.get(id(p), "a parameter"), self.optimizer.state.get(p, {}))
                                for group in self.optimizer.param_groups for p in group["params"])
        problems = [found for found in _gather([problem], self.accelerator) if found]
        if problems:
            raise CheckpointError(f"checkpoint {path}: its optimizer state cannot be continued from: {problems[0]}; "
                                  f"resume from another checkpoint (--resume NAME) or start a fresh run")

    def newest(self) -> Path | None:
        """The run's newest checkpoint, once its write is done: the last one this run saved, else the one it
        resumed from; None when there is none. Rank 0 names it and every rank gets its own verified copy
        (from its disk, or downloaded for its node), as for `--resume` (every rank calls it)."""
        from accelerate.utils import broadcast_object_list

        self.wait()
        newest = self.last or self.restored
        # one in the checkpoints folder by its name (each node finds it there, or downloads it), another by its path
        arg = None if newest is None else newest.name if newest.parent == self.root else str(newest)
        if self.accelerator.num_processes > 1:
            arg = broadcast_object_list([arg])[0]
        if arg is None:
            return None
        return find_checkpoint(arg, self.accelerator, self.root, self.remote_root, self.log, self.client_factory)

    # -------------------------------------------------------------------------------------------- save

    def due(self, step: int, last: bool = False) -> bool:
        """Whether to save after `step`: every `save_steps` steps by the policy, and always when it is the
        run's `last` step of this session (the end, a planned stop, a stop signal or failure)."""
        return last or bool(self.policy.every) and step % self.policy.every == 0

    def save(self, step: int) -> Path:
        """Saves now (the loop asks when one is due, after checking its losses): checks nothing non-finite
        would be saved (every rank), snapshots and hands the write to the writer thread(s). Returns the
        checkpoint's path; how long the loop was blocked goes to the log and the checkpoint's metrics row."""
        started = time.perf_counter()
        finite = torch.stack([torch.isfinite(local_tensor(p)).all() for p in self.model.parameters()]).all().float()
        if self.accelerator.reduce(finite, reduction="sum").item() != self.accelerator.num_processes:
            raise NonFiniteWeights(f"non-finite weights after step {step}; no checkpoint was written for it. "
                                   f"Lower learning_rate, or resume from the last checkpoint")
        rngs = _gather([RngState.state_dict()], self.accelerator)
        name = self.name()
        path = self.root / name
        if self.is_main:
            self._wait_writer()  # at most one write in flight (raising its error); the buffers are free again
            self._check_free_space(path)
        copy_started = time.perf_counter()
        sharded = self._start_sharded(path) if self.sharded else None
        if not self.is_main:
            return path
        unwrapped = self.accelerator.unwrap_model(self.model)
        snapshot = snapshot_to_cpu({"model": None if self.sharded else unwrapped.state_dict(),
                                    "objects": {k: v.state_dict() for k, v in self.objects().items()}},
                                   self.buffers)
        copy_s = time.perf_counter() - copy_started
        trainer_state = self.states[TRAIN].state_dict() | self.run.to_json() | {
            "versions": {"torch": torch.__version__, "python": sys.version.split()[0]}}
        payload = CheckpointPayload(snapshot["model"], snapshot["objects"] | {"rng": rngs}, trainer_state)
        present = {k: v for k, v in self.policy.extra_files.items() if Path(v).is_file()}
        self.writer.save(self.root, name, payload, on_done=self._after_write, extra_files=present, sharded=sharded)
        blocked_s = time.perf_counter() - started
        self.log.write_row({"step": step, "checkpoint": name, "blocked_s": blocked_s, "copy_s": copy_s})
        self.log.info(f"Checkpoint {name}: loop blocked {blocked_s:.3f} s (device->host copy {copy_s:.3f} s); "
                      f"writing{' and uploading' if self.uploader else ''} in the background")
        return path

    def _start_sharded(self, path: Path) -> ShardedPart | None:
        """Every rank stages its shards and starts writing them into the temporary directory rank 0 names."""
        from accelerate.utils import broadcast_object_list

        self._wait_shards()  # this rank's previous shards are on disk (the writer may still finish it)
        tmp = files.temp_path(path).name if self.is_main else None
        if self.accelerator.num_processes > 1:
            tmp = broadcast_object_list([tmp])[0]  # a name: each node's own output dir holds it
        future = self.shard_saver.start(self.accelerator.unwrap_model(self.model), self.optimizer,
                                        self.root / tmp / SHARDED_DIR, path.name)
        if not self.is_main:
            return None
        if self.node_uploads:  # its result: the files the other nodes sent to GCS
            return ShardedPart(self.root / tmp, future.result, complete_at=f"{self.remote_root}/{path.name}")

        def shards_written() -> None:  # every rank's files are local (DCP's result, its metadata, is not needed)
            future.result()

        return ShardedPart(self.root / tmp, shards_written)

    def _wait_writer(self) -> Path | None:
        """Rank 0: waits for the last write. A checkpoint whose shards did not all reach GCS (several nodes
        without a shared output dir) is said and remembered, not raised: the run goes on, the next
        checkpoint tries again and the previous one is intact."""
        try:
            return self.writer.wait()
        except NodeUploadFailed as exc:
            self.incomplete = str(exc)
            self.log.error(f"error: {exc}; the previous checkpoint is intact, the next one tries again")
            return None

    def wait(self) -> Path | None:
        """Blocks until the last save is on disk (rank 0's files; every rank's shards); raises its error."""
        if self.shard_saver is not None:
            self._wait_shards()
        return self._wait_writer() if self.writer else None

    def _wait_shards(self) -> None:
        """This rank's shards of the last save are written, or their write failed: DCP fails it on every rank
        at once, and rank 0's writer, which waits for the same save, raises it in one line (a full disk as
        the DiskFullError the README promises). So rank 0 leaves it to its writer, and every other rank stops
        quietly (exit 2), at the same save as rank 0, instead of saying it again."""
        try:
            self.shard_saver.wait()
        except UserError:
            if not self.is_main:
                raise SystemExit(2) from None

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
        self.last, self.incomplete = path, None
        self.last_bytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        protect = {path} | (self.uploader.protected() if self.uploader else set())
        apply_retention(self.root, self.policy.keep, protect=protect, log=self.log.info)
        if self.uploader:
            self.uploader.submit(path, f"{self.remote_root}/{path.name}")

    # ------------------------------------------------------------------------------------------- close

    def close(self) -> int:
        """Waits for the last write and (at most upload_timeout_s) for uploads; says what is where.
        Returns 1 when the newest checkpoint failed to write or did not reach GCS, else 0."""
        code = 0
        if self.shard_saver is not None:
            try:
                self.shard_saver.wait()
            except UserError:  # rank 0's writer reports it, below
                code = 1
            except Exception as exc:  # noqa: BLE001 - rank 0's writer reports the failed checkpoint
                self.log.warning(f"warning: writing this rank's checkpoint shards failed: {exc}")
                code = 1
        if not self.is_main:
            return code
        try:
            self._wait_writer()
            if self.incomplete:
                code = 1
        except DiskFullError as exc:
            self.log.error(f"error: {exc}")
            code = 1
        except CheckpointError as exc:
            self.log.error(f"error: checkpoint write failed: {exc}")
            code = 1
        if self.uploader is not None:
            report = self.uploader.close(timeout=self.policy.upload_timeout_s)
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


def _check_fits(path: Path, saved: RunRecord, step: int, run: RunRecord) -> None:
    """One clear line for a checkpoint (`saved` at `step`) that cannot continue this run."""
    old, new = saved.model, run.model
    diff = [f"{k} {old.get(k)} vs {new.get(k)}" for k in _MUST_MATCH if k in old and old.get(k) != new.get(k)]
    if diff and old.get("name") == new.get("name"):  # e.g. the vocabulary, set by another dataset's tokenizer
        raise CheckpointError(f"checkpoint {path} was written for another shape of model '{new.get('name')}' "
                              f"({', '.join(diff)}: checkpoint vs this run); resume it with the data and settings "
                              f"it was trained with, or start a fresh run in another --output-dir")
    if diff:
        raise CheckpointError(f"checkpoint {path} was written for model '{old.get('name')}' but this run builds "
                              f"'{new.get('name')}' ({', '.join(diff)}); resume with --set model={old.get('name')} "
                              f"or start a fresh run in another --output-dir")
    for key in KEEP_ON_RESUME:
        if key in saved.config and saved.config[key] != run.config[key]:
            raise CheckpointError(f"checkpoint {path} was trained with {key}={saved.config[key]} but this run has "
                                  f"{key}={run.config[key]}: a resume continues the checkpoint's data order and "
                                  f"random generators; resume with --set {key}={saved.config[key]} or start a fresh "
                                  f"run in another --output-dir")
    old_opt, new_opt = saved.config["optimizer"], run.config["optimizer"]  # (an earlier engine's record: adamw)
    if old_opt != new_opt:
        raise CheckpointError(f"checkpoint {path} was trained with optimizer={old_opt} but this run has "
                              f"optimizer={new_opt}: its optimizer state does not carry over; resume with --set "
                              f"optimizer={old_opt} or start a fresh run in another --output-dir")
    if saved.seq_len not in (None, run.seq_len):
        raise CheckpointError(f"checkpoint {path} was trained with seq_len={saved.seq_len} but this run has "
                              f"seq_len={run.seq_len}; resume with --set seq_len={saved.seq_len} or start a "
                              f"fresh run in another --output-dir")
    if saved.data and saved.data != run.data:
        raise CheckpointError(f"the data changed since checkpoint {path}: it was trained on {saved.data} and "
                              f"this run reads {run.data}; restore the same shards and max_files/val_files, or "
                              f"start a fresh run in another --output-dir")
    if step > run.max_steps:
        raise CheckpointError(f"checkpoint {path} is at step {step}, and max_steps is {run.max_steps}: "
                              f"nothing left to train; raise --max-steps to continue the run")


def _followed_changes(old_config: dict, config: dict, step: int) -> list[str]:
    """One line per FOLLOW_CONFIG_ON_RESUME setting this run changes: what now follows the new value."""
    def shown(value) -> str:
        return f"{value:g}" if isinstance(value, float) else str(value)

    return [f"resume: {key} changed {shown(old_config[key])} -> {shown(config[key])}: {what} follows the new value "
            f"from step {step + 1}" for key, what in FOLLOW_CONFIG_ON_RESUME.items()
            if key in old_config and old_config[key] != config[key]]
