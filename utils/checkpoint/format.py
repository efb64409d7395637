"""The local checkpoint format: atomic directories with a crc32c manifest, verification, reading, retention.

A checkpoint is a directory `checkpoint-epoch{E}-step{S}-files{F}/` holding

    model.safetensors     the unwrapped model state (HF parameter names)            } unsharded (DDP)
    <key>.pt              one torch.save file per stateful object (optimizer, scheduler, rng, cursor ...)
    dcp/                  instead of model.safetensors and optimizer.pt under FSDP: every rank's shards of
                          model and optimizer (utils/checkpoint/sharded.py)
    trainer_state.json    step, epoch, tokens, world size, config, versions
    <extra files>         copied in as given (e.g. tokenizer.json, compile_cache.safetensors)
    manifest.json         written last: size and crc32c of every other file

A file in READ_VERIFIED (the compiled code, utils/checkpoint/compile_cache.py) is checked against its manifest
entry by its reader when it reads it, not by `verify_checkpoint`: a damaged one costs only what it would have
saved (a compile), never the checkpoint.

Every name the manifest holds (`files`, `objects`) stays inside the checkpoint: a relative path, no `..`,
no symlink out; an object is one of the listed files.

On several nodes without a shared filesystem, rank 0's copy holds only its node's shards: the manifest
lists the other nodes' files too, marked `remote` (they went to GCS from their nodes), and names the GCS
copy, which alone is complete (`complete_at`). Such a local copy is partial: resume downloads the whole one.

It is written under a temporary name (utils/io/files.py) and renamed into place only after every file, the
manifest included, is on disk. So a directory with a checkpoint's name is complete unless something outside this
module damaged it, and `verify_checkpoint` catches that too. Uploads send the manifest last, so a remote
checkpoint without one is an incomplete upload.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file as load_safetensors
from safetensors.torch import save_file as save_safetensors

from utils.debug import checkpoint_write_delay_s
from utils.errors import UserError
from utils.io import files
from utils.io.storage import file_crc32c

MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
TRAINER_STATE_FILE = "trainer_state.json"
SHARDED_DIR = "dcp"  # FSDP: every rank's shards of model and optimizer (utils/checkpoint/sharded.py)
COMPILE_CACHE_FILE = "compile_cache.safetensors"  # the run's compiled code (utils/checkpoint/compile_cache.py)
READ_VERIFIED = frozenset({COMPILE_CACHE_FILE})  # optional files their reader verifies (the module docstring)
FORMAT_VERSION = 1

_NAME_RE = re.compile(r"checkpoint-epoch(\d+)-step(\d+)-files(\d+)")
_OBJECT_KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, incomplete or corrupt, or could not be written; the message names it."""


class NodeUploadFailed(CheckpointError):
    """A node's shards of a checkpoint did not reach GCS: that checkpoint is complete nowhere. (Here, not in
    sharded.py, so that a run that never shards does not import torch.distributed.checkpoint to catch it.)"""


class PartialCheckpoint(CheckpointError):
    """This node's copy of a checkpoint written on several nodes without a shared filesystem: the other
    nodes' shards are only in GCS."""


class NoCheckpointFound(CheckpointError):
    """`--resume latest` found no complete checkpoint, locally or remotely (`auto` starts fresh then)."""


def checkpoint_name(epoch: int, step: int, files: int) -> str:
    """The one place the checkpoint directory name format lives."""
    for label, value in (("epoch", epoch), ("step", step), ("files", files)):
        if int(value) != value or value < 0:
            raise ValueError(f"checkpoint {label} must be a non-negative integer, got {value!r}")
    return f"checkpoint-epoch{int(epoch)}-step{int(step)}-files{int(files)}"


def parse_checkpoint_name(name: str) -> tuple[int, int, int] | None:
    """(epoch, step, files) for a checkpoint directory name, None for anything else."""
    m = _NAME_RE.fullmatch(name)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


@dataclass
class CheckpointPayload:
    model_state: dict[str, torch.Tensor] | None  # None: sharded, in dcp/
    objects: dict[str, Any]
    trainer_state: dict


@dataclass
class ShardedPart:
    """A sharded save under way: every rank writes its shards into `tmp` (the checkpoint's temporary
    directory); `wait()` returns once all of them are on disk (or, on several nodes without a shared
    filesystem, in GCS at `complete_at`: it then returns the other nodes' files' manifest entries), or raises."""
    tmp: Path
    wait: Any
    complete_at: str | None = None


# ---------------------------------------------------------------------------------------------- snapshot

class HostBuffers:
    """Host memory for checkpoint snapshots, kept from one checkpoint to the next.

    Allocating and page-locking 17 GB of host memory (a 1.2B model with its AdamW state) is what made the
    first checkpoint's device-to-host copy take 11.9 s on an H100 (1.4 GB/s); copying into buffers that are
    already pinned runs at PCIe speed. So each tensor's buffer is kept under its place in the state
    (e.g. ("objects", "optimizer", "state", 3, "exp_avg")) and reused while shape and dtype match. CPU
    sources get plain (unpinned) reused buffers. A buffer is overwritten only by the next snapshot, which
    the Checkpointer takes only after the previous write has finished reading it."""

    def __init__(self):
        self._pool: dict[tuple, torch.Tensor] = {}
        self.reused_bytes = self.allocated_bytes = 0

    def take(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        buf = self._pool.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            pin = like.device.type == "cuda"
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
            self._pool[key] = buf
            self.allocated_bytes += buf.numel() * buf.element_size()
        else:
            self.reused_bytes += buf.numel() * buf.element_size()
        return buf


def snapshot_to_cpu(obj, buffers: HostBuffers | None = None):
    """A CPU copy of nested dicts/lists/tuples/dataclasses (a CheckpointPayload) of tensors, so training
    may keep mutating the originals.

    Tensors are copied into `buffers` (reused across calls; see HostBuffers) or fresh ones; CUDA copies are
    non_blocking, then one synchronize per device. Numpy arrays are copied; other leaves are returned as
    they are (they are immutable in the states we save: numbers, strings, None)."""
    devices: set[torch.device] = set()
    out = _snapshot(obj, devices, buffers, ())
    for device in devices:
        torch.cuda.synchronize(device)
    return out


def _snapshot(obj, devices: set, buffers: HostBuffers | None, key: tuple):
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.device.type not in ("cpu", "cuda"):
            return t.to("cpu", copy=True)
        if buffers is not None:
            buf = buffers.take(key, t)
        else:
            buf = torch.empty_like(t, device="cpu", pin_memory=t.device.type == "cuda")
        if t.device.type == "cuda":
            buf.copy_(t, non_blocking=True)
            devices.add(t.device)
        else:
            buf.copy_(t)
        return buf
    if isinstance(obj, dict):
        items = {k: _snapshot(v, devices, buffers, key + (k,)) for k, v in obj.items()}
        if type(obj) is dict:
            return items
        try:
            return type(obj)(items)
        except TypeError:
            return items
    if isinstance(obj, list):
        return [_snapshot(v, devices, buffers, key + (i,)) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        items = [_snapshot(v, devices, buffers, key + (i,)) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _snapshot(getattr(obj, f.name), devices, buffers, key + (f.name,))
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def non_cpu_tensor(obj) -> str | None:
    if isinstance(obj, torch.Tensor):
        return None if obj.device.type == "cpu" else str(obj.device)
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for v in values:
        found = non_cpu_tensor(v)
        if found:
            return found
    return None


# ------------------------------------------------------------------------------------------------ writing

def _model_tensors(model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors with no shared storage, as safetensors requires."""
    out, seen = {}, set()
    for key, t in model_state.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"model_state['{key}'] is a {type(t).__name__}, not a tensor")
        t = t.detach().contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
        elif ptr is not None:
            seen.add(ptr)
        out[key] = t
    return out


def build_manifest(directory: Path, name: str, objects: list[str], remote: dict | None = None,
                   complete_at: str | None = None) -> dict:
    """Size and crc32c of every file in `directory`, and `remote`: entries for files other nodes sent to
    `complete_at` (GCS)."""
    listed = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel != MANIFEST:
            listed[rel] = {"size": path.stat().st_size, "crc32c": file_crc32c(path)}
    manifest = {"format_version": FORMAT_VERSION, "name": name, "created_unix": time.time(),
                "objects": objects, "files": dict(sorted((listed | (remote or {})).items()))}
    if remote:
        manifest["complete_at"] = complete_at
    return manifest


def write_checkpoint(root, name: str, payload: CheckpointPayload,
                     extra_files: dict[str, Path] | None = None, sharded: ShardedPart | None = None) -> Path:
    """Writes `root/name` atomically (see the module docstring) and returns its path.

    Safe to run on a background thread while training continues, provided `payload` is a snapshot that
    nobody mutates (see `snapshot_to_cpu`). Re-saving an existing name replaces it: the old directory is
    renamed aside, the new one renamed in, then the old one deleted. With `sharded`, the ranks' shards are
    being written into its temporary directory: this waits for them before the manifest."""
    root = Path(root)
    if parse_checkpoint_name(name) is None:
        raise CheckpointError(f"'{name}' is not a checkpoint name; build it with checkpoint_name()")
    final = root / name
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create checkpoint directory {root}: {e}") from e
    needed = sum(t.numel() * t.element_size() for t in (payload.model_state or {}).values()
                 if isinstance(t, torch.Tensor))
    try:
        with files.disk_full_guard(final, needed or None), \
                files.atomic_directory(final, tmp=sharded.tmp if sharded else None) as tmp:
            _write_contents(tmp, name, payload, extra_files, sharded)
        return final
    except UserError:  # CheckpointError, DiskFullError
        raise
    except Exception as e:
        raise CheckpointError(f"writing checkpoint {final} failed: {type(e).__name__}: {e}") from e


def _write_contents(tmp: Path, name: str, payload: CheckpointPayload, extra_files: dict[str, Path] | None,
                    sharded: ShardedPart | None) -> None:
    if payload.model_state is not None:
        save_safetensors(_model_tensors(payload.model_state), str(tmp / MODEL_FILE), metadata={"format": "pt"})
        files.set_default_mode(tmp / MODEL_FILE)
        files.fsync_file(tmp / MODEL_FILE)

    for key, obj in payload.objects.items():
        if not _OBJECT_KEY_RE.fullmatch(key):
            raise CheckpointError(f"object key '{key}' cannot be a file name; use letters, digits, _ . -")
        with open(tmp / f"{key}.pt", "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())

    with open(tmp / TRAINER_STATE_FILE, "w") as f:
        json.dump(payload.trainer_state, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())

    for rel, src in (extra_files or {}).items():
        dest = tmp / rel
        if dest.exists() or rel == MANIFEST or Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CheckpointError(f"extra file name '{rel}' is not allowed (clashes or leaves the checkpoint)")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        files.fsync_file(dest)

    delay = checkpoint_write_delay_s()  # fault injection for the preemption tests: a slow disk
    if delay:
        time.sleep(delay)
    remote = None
    if sharded is not None:
        remote = sharded.wait()  # every rank's shards are on disk (or in GCS) before the manifest lists them
        for path in tmp.rglob("*"):
            if path.is_file():
                files.set_default_mode(path)
    manifest = build_manifest(tmp, name, sorted(payload.objects), remote, sharded.complete_at if sharded else None)
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


# -------------------------------------------------------------------------------------------- verifying

def _read_manifest(path: Path) -> dict:
    manifest_path = path / MANIFEST
    try:
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
        present = manifest_path.is_file()
    except OSError as e:  # e.g. a directory this user may not enter (chmod 000, another user's)
        raise CheckpointError(f"checkpoint {path}: cannot open it ({e.strerror}); check its permissions"
                              f"{files.owner_of(path)}") from None
    if not present:
        raise CheckpointError(
            f"checkpoint {path} has no {MANIFEST}: it is incomplete (an interrupted write, copy or upload); "
            "resume from another checkpoint or delete it")
    try:
        manifest = json.loads(manifest_path.read_text())
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: cannot read {MANIFEST} ({e}); check its permissions") from e
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({str(e)[:200]}); the checkpoint is "
                              f"corrupt") from None
    check_manifest(path, manifest)
    listed, version = manifest["files"], manifest["format_version"]
    if version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {version}; this code reads up to "
                              f"{FORMAT_VERSION}: update the code")
    for rel in listed:
        if not files.inside(path, rel):
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} lists '{rel}', outside the checkpoint (an absolute "
                                  f"path, '..' or a symlink out); refused: delete it or resume from another")
    objects = manifest.get("objects", [])
    if not isinstance(objects, list):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST}'s 'objects' is not a list; the checkpoint is corrupt")
    for key in objects:
        if not (isinstance(key, str) and _OBJECT_KEY_RE.fullmatch(key) and f"{key}.pt" in listed):
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} names object {key!r} in 'objects', which is not a "
                                  f"file it lists; refused: delete the checkpoint or resume from another")
    return manifest


def check_manifest(path: Path, manifest) -> None:
    """manifest.json's fields (a checkpoint may come from a bucket, or be crafted) before anything uses them:
    an object; format_version a positive integer; files an object whose entries are {size: a non-negative
    integer, crc32c: a string} (and `remote`: a boolean); objects a list; name and complete_at strings.
    Containment of the paths it lists is _read_manifest's. CheckpointError naming the file and field."""
    where = f"checkpoint {path}: {MANIFEST}"

    def bad(field: str, value, want: str):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise CheckpointError(f"{where}: {field} is {shown}, not {want}; the checkpoint is corrupt or crafted: "
                              f"resume from another one")

    if not isinstance(manifest, dict):
        bad("the file", type(manifest).__name__, "an object")
    version = manifest.get("format_version")
    if type(version) is not int or version < 1:
        bad("format_version", version, "a positive integer")
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        bad("files", listed if listed is None else type(listed).__name__, "an object of file entries")
    for rel, entry in listed.items():
        if not rel:
            bad("files", rel, "a file name")
        if not isinstance(entry, dict):
            bad(f"files[{rel!r}]", entry, "an object {size, crc32c}")
        size, crc = entry.get("size"), entry.get("crc32c")
        if type(size) is not int or size < 0:
            bad(f"files[{rel!r}].size", size, "a non-negative integer")
        if not isinstance(crc, str):
            bad(f"files[{rel!r}].crc32c", crc, "a string")
        if "remote" in entry and not isinstance(entry["remote"], bool):
            bad(f"files[{rel!r}].remote", entry["remote"], "true or false")
    if "objects" in manifest and not isinstance(manifest["objects"], list):
        bad("objects", manifest["objects"], "a list")
    for field in ("name", "complete_at"):
        if manifest.get(field) is not None and not isinstance(manifest[field], str):
            bad(field, manifest[field], "a string")


def verify_checkpoint(path) -> dict:
    """Checks every file the manifest lists (size, then crc32c) but those their reader verifies (READ_VERIFIED),
    and returns the manifest."""
    path = Path(path)
    manifest = _read_manifest(path)
    for rel, expected in manifest["files"].items():
        if rel in READ_VERIFIED:
            continue
        file = path / rel
        if not isinstance(expected, dict) or not {"size", "crc32c"} <= expected.keys():
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} entry for {rel} is malformed; "
                                  "the checkpoint is corrupt")
        if file.exists() and not file.is_file():  # a FIFO or a device is never read (a FIFO would wait for good)
            raise CheckpointError(f"checkpoint {path}: {rel} is not a regular file; the checkpoint is corrupt or "
                                  f"crafted: resume from another one")
        if not file.is_file():
            if expected.get("remote"):
                raise PartialCheckpoint(f"checkpoint {path} holds only this node's shards: it was written by "
                                        f"several nodes without a shared output dir, and the whole checkpoint is at "
                                        f"{manifest.get('complete_at')} (--resume latest downloads it)")
            raise CheckpointError(f"checkpoint {path}: file {rel} is missing; the checkpoint is corrupt")
        size = file.stat().st_size
        if size != expected["size"]:
            raise CheckpointError(f"checkpoint {path}: file {rel} has {size} bytes, the manifest says "
                                  f"{expected['size']}; the checkpoint is corrupt")
        try:
            crc = file_crc32c(file)
        except OSError as e:
            raise CheckpointError(f"checkpoint {path}: cannot read {rel} ({e}); check its permissions") from e
        if crc != expected["crc32c"]:
            raise CheckpointError(f"checkpoint {path}: file {rel} has crc32c {crc}, the manifest says "
                                  f"{expected['crc32c']}; the checkpoint is corrupt")
    return manifest


def _looks_complete(path: Path) -> bool:
    """Cheap completeness check for retention: manifest readable and every size matches (no crc32c); the
    files other nodes sent to GCS (`remote`) may be absent."""
    try:
        manifest = _read_manifest(path)
        return all((path / rel).stat().st_size == f["size"] if (path / rel).is_file() else f.get("remote", False)
                   for rel, f in manifest["files"].items() if rel not in READ_VERIFIED)
    except (CheckpointError, OSError):
        return False


# ------------------------------------------------------------------------------------- listing, retention

def _sort_key(path: Path):
    return (parse_checkpoint_name(path.name)[1], path.name)


def list_checkpoints(root) -> list[Path]:
    """Directories under root named like a checkpoint (temp dirs excluded), oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if parse_checkpoint_name(p.name) and p.is_dir()]
    return sorted(found, key=_sort_key)


def find_latest_local(root, log=print) -> Path | None:
    """The newest checkpoint under root that verifies; broken ones are skipped with a log line each."""
    for path in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            log(f"skipping checkpoint {path.name}: {e}")
    return None



def apply_retention(root, keep: int | None, protect=frozenset(), log=print) -> list[Path]:
    """Deletes complete checkpoints older than the newest `keep` (at least 1 is always kept; None keeps
    all), except those in `protect` (e.g. still uploading), and temp dirs left by dead processes. Returns
    what it deleted. Directories named like a checkpoint but incomplete are left alone and not counted."""
    root = Path(root)
    if not root.is_dir():
        return []
    deleted = []
    if keep is not None:
        keep = max(1, keep)
        protected = {Path(p).resolve() for p in protect}
        complete = [p for p in list_checkpoints(root) if _looks_complete(p)]
        for path in complete[:max(0, len(complete) - keep)]:
            if path.resolve() in protected:
                continue
            files.remove_tree(path)
            log(f"retention: deleted {path.name} (keeping the newest {keep})")
            deleted.append(path)
    for path in files.remove_stale_temps(root):
        log(f"retention: removed stale temporary directory {path.name}")
        deleted.append(path)
    return deleted


# ------------------------------------------------------------------------------------------------ reading

def _numpy_safe_globals() -> list:
    """What `torch.load(weights_only=True)` needs for numpy arrays (numpy's legacy RNG state holds one)."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    dtypes = {type(np.dtype(t)) for t in (np.uint8, np.uint32, np.int32, np.int64, np.float32, np.float64, np.bool_)}
    return [_reconstruct, np.ndarray, np.dtype, *dtypes]


def read_checkpoint(path, map_location="cpu", verify: bool = True, objects: bool = True) -> CheckpointPayload:
    """Loads a checkpoint (after verifying it unless `verify=False`, for one verified a moment ago); with
    `objects=False` only the weights and trainer_state.json (e.g. to export the model).

    The `.pt` files load with `weights_only=True` (tensors, containers, numbers, numpy arrays); an object
    that needs more was not a state dict and is reported rather than unpickled."""
    path = Path(path)
    manifest = verify_checkpoint(path) if verify else _read_manifest(path)
    device = str(map_location)
    model_state = None  # a sharded checkpoint's weights are in dcp/ (utils/checkpoint/sharded.py)
    if MODEL_FILE in manifest["files"] or not any(rel.startswith(f"{SHARDED_DIR}/") for rel in manifest["files"]):
        try:
            model_state = load_safetensors(str(path / MODEL_FILE), device=device)
        except Exception as e:
            raise CheckpointError(f"checkpoint {path}: cannot load {MODEL_FILE}: {e}") from e
    loaded = {}
    with torch.serialization.safe_globals(_numpy_safe_globals()):
        for key in manifest.get("objects", []) if objects else ():
            file = path / f"{key}.pt"
            try:
                loaded[key] = torch.load(file, map_location=map_location, weights_only=True)
            except Exception as e:
                raise CheckpointError(
                    f"checkpoint {path}: cannot load {file.name} with weights_only=True ({e}); save only "
                    "state dicts (tensors, containers, numbers, strings, numpy arrays) as checkpoint objects"
                ) from e
    return CheckpointPayload(model_state=model_state, objects=loaded, trainer_state=read_trainer_state(path, manifest))


def read_trainer_state(path, manifest: dict | None = None) -> dict:
    """A checkpoint's trainer_state.json, checked (check_trainer_state), without loading anything else."""
    path = Path(path)
    try:
        trainer_state = files.parse_json(files.read_text(path / TRAINER_STATE_FILE))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read {TRAINER_STATE_FILE}: {e}") from e
    check_trainer_state(path, trainer_state, _read_manifest(path) if manifest is None else manifest)
    return trainer_state


_SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                 "max_position_embeddings")


def check_trainer_state(path: Path, state, manifest: dict) -> None:
    """trainer_state.json's values (a checkpoint may come from a bucket, or be crafted) before anything uses
    them: step, tokens and epoch non-negative integers, world_size a positive one, the run record's config an
    object whose fields a resume reads back are valid settings (configs/training_config.py recorded_settings),
    its strategy a string and its seq_len and global batch positive integers, the model record's fields of their
    types and ranges (utils/model/families.py check_model_record) and a shape the checkpoint's weight files can
    hold (a crafted shape would have generate.py or the export allocate it). CheckpointError naming the file and
    field."""
    from configs.training_config import recorded_settings
    from utils.errors import ConfigError
    from utils.model.families import check_model_record

    where = f"checkpoint {path}: {TRAINER_STATE_FILE}"
    advice = "the checkpoint is corrupt or crafted: resume from another one"

    def bad(field: str, value, want: str):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise CheckpointError(f"{where}: {field} is {shown}, not {want}; {advice}")

    if not isinstance(state, dict):
        bad("the file", type(state).__name__, "an object")
    for field, least in (("step", 0), ("tokens", 0), ("epoch", 0), ("world_size", 1), ("seq_len", 1),
                         ("global_batch_sequences", 1)):
        if field == "step" or state.get(field) is not None:
            value = state.get(field)
            if type(value) is not int or value < least:
                bad(field, value, f"an integer of at least {least}")
    for field, kind, want in (("config", dict, "an object of training-config fields"), ("strategy", str, "a string")):
        if field in state and not isinstance(state[field], kind):
            bad(field, state[field], want)
    try:  # what a resume reads back of the run's config, as its settings are checked
        recorded_settings(state.get("config") or {}, "config")
    except ConfigError as exc:
        raise CheckpointError(f"{where}: {exc}; {advice}") from None
    model = state.get("model")
    if model is None:
        return
    try:
        check_model_record(model)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}; {advice}") from None
    if all(field in model for field in _SHAPE_FIELDS[:5]):
        h, layers, inter = model["hidden_size"], model["num_hidden_layers"], model["intermediate_size"]
        parameters = model["vocab_size"] * h + layers * (4 * h * h + 2 * h * inter)  # at least (one embedding)
        weights = sum(int(f.get("size", 0)) for rel, f in manifest.get("files", {}).items()
                      if isinstance(f, dict) and (rel == MODEL_FILE or rel.startswith(f"{SHARDED_DIR}/")))
        if parameters > weights + 2**20:  # a byte a parameter is the least any saved precision takes
            raise CheckpointError(f"{where}: model's shape (hidden_size {h:,}, {layers:,} layers, ...) has "
                                  f"{parameters:,} parameters, more than its {weights:,} bytes of weights hold; the "
                                  f"checkpoint is corrupt or crafted: resume from another one")
