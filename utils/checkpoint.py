"""Checkpoints: atomic local directories with a crc32c manifest, a background writer, retention, resume.

A checkpoint is a directory `checkpoint-epoch{E}-step{S}-files{F}/` holding

    model.safetensors     the unwrapped model state (HF parameter names)
    <key>.pt              one torch.save file per stateful object (optimizer, scheduler, rng, cursor ...)
    trainer_state.json    step, epoch, tokens, world size, config, versions
    <extra files>         copied in as given (e.g. tokenizer.json)
    manifest.json         written last: size and crc32c of every other file

It is written under `.tmp-<name>-<pid>-<rand>` and renamed into place only after every file, the manifest
included, is on disk. So a directory with a checkpoint's name is complete unless something outside this
module damaged it, and `verify_checkpoint` catches that too. Uploads send the manifest last, so a remote
checkpoint without one is an incomplete upload.
"""
from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file as load_safetensors
from safetensors.torch import save_file as save_safetensors

from utils.process import pid_alive
from utils.storage import file_crc32c

MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
TRAINER_STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 1
# Tests only: seconds each checkpoint write sleeps before its manifest, to stand in for a slow disk.
_TEST_WRITE_DELAY_S = float(os.environ.get("NEOX_TEST_CHECKPOINT_DELAY_S", "0") or 0)

TEMP_PREFIX = ".tmp-"
_NAME_RE = re.compile(r"checkpoint-epoch(\d+)-step(\d+)-files(\d+)")
_TEMP_RE = re.compile(r"\.tmp-(?P<what>.+)-(?P<pid>\d+)-(?P<rand>[0-9a-f]+)")
_OBJECT_KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")

# Temp dirs this process is writing or deleting right now, so retention (maybe on another thread) and a
# reused pid from an earlier incarnation of the run can be told apart.
_ACTIVE_TEMPS: set[Path] = set()
_ACTIVE_LOCK = threading.Lock()


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt, or could not be written; the message names it."""


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
    model_state: dict[str, torch.Tensor]
    objects: dict[str, Any]
    trainer_state: dict


# ---------------------------------------------------------------------------------------------- snapshot

def snapshot_to_cpu(obj):
    """A CPU copy of nested dicts/lists/tuples/dataclasses (a CheckpointPayload) of tensors, so training
    may keep mutating the originals.

    Tensors are cloned (CUDA ones into pinned buffers with non_blocking copies, then one synchronize per
    device); numpy arrays are copied; other leaves are returned as they are (they are immutable in the
    states we save: numbers, strings, None)."""
    devices: set[torch.device] = set()
    out = _snapshot(obj, devices)
    for device in devices:
        torch.cuda.synchronize(device)
    return out


def _snapshot(obj, devices: set):
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.device.type == "cpu":
            return t.clone()
        if t.device.type == "cuda":
            buf = torch.empty_like(t, device="cpu", pin_memory=True)
            buf.copy_(t, non_blocking=True)
            devices.add(t.device)
            return buf
        return t.to("cpu", copy=True)
    if isinstance(obj, dict):
        items = {k: _snapshot(v, devices) for k, v in obj.items()}
        if type(obj) is dict:
            return items
        try:
            return type(obj)(items)
        except TypeError:
            return items
    if isinstance(obj, list):
        return [_snapshot(v, devices) for v in obj]
    if isinstance(obj, tuple):
        items = [_snapshot(v, devices) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _snapshot(getattr(obj, f.name), devices)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def _non_cpu_tensor(obj) -> str | None:
    if isinstance(obj, torch.Tensor):
        return None if obj.device.type == "cpu" else str(obj.device)
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for v in values:
        found = _non_cpu_tensor(v)
        if found:
            return found
    return None


# ------------------------------------------------------------------------------------------------ writing

def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)


def _new_temp(root: Path, what: str) -> Path:
    path = root / f"{TEMP_PREFIX}{what}-{os.getpid()}-{secrets.token_hex(4)}"
    with _ACTIVE_LOCK:
        _ACTIVE_TEMPS.add(path)
    return path


def _release_temp(path: Path) -> None:
    with _ACTIVE_LOCK:
        _ACTIVE_TEMPS.discard(path)


def _remove_tree(path: Path) -> None:
    """Deletes a directory so that it vanishes from its name at once: rename aside, then delete."""
    aside = _new_temp(path.parent, path.name)
    try:
        os.rename(path, aside)
        shutil.rmtree(aside, ignore_errors=True)
    finally:
        _release_temp(aside)


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


def build_manifest(directory: Path, name: str, objects: list[str]) -> dict:
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel != MANIFEST:
            files[rel] = {"size": path.stat().st_size, "crc32c": file_crc32c(path)}
    return {"format_version": FORMAT_VERSION, "name": name, "created_unix": time.time(),
            "objects": objects, "files": files}


def write_checkpoint(root, name: str, payload: CheckpointPayload,
                     extra_files: dict[str, Path] | None = None) -> Path:
    """Writes `root/name` atomically (see the module docstring) and returns its path.

    Safe to run on a background thread while training continues, provided `payload` is a snapshot that
    nobody mutates (see `snapshot_to_cpu`). Re-saving an existing name replaces it: the old directory is
    renamed aside, the new one renamed in, then the old one deleted."""
    root = Path(root)
    if parse_checkpoint_name(name) is None:
        raise CheckpointError(f"'{name}' is not a checkpoint name; build it with checkpoint_name()")
    final = root / name
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create checkpoint directory {root}: {e}") from e
    tmp = _new_temp(root, name)
    try:
        tmp.mkdir()
        save_safetensors(_model_tensors(payload.model_state), str(tmp / MODEL_FILE), metadata={"format": "pt"})
        _fsync_file(tmp / MODEL_FILE)

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
            _fsync_file(dest)

        if _TEST_WRITE_DELAY_S:  # fault injection for the preemption tests: a slow disk
            time.sleep(_TEST_WRITE_DELAY_S)
        manifest = build_manifest(tmp, name, sorted(payload.objects))
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)

        if not final.exists():
            os.rename(tmp, final)
            _fsync_dir(root)
            return final
        old = _new_temp(root, f"old-{name}")
        try:
            os.rename(final, old)
            try:
                os.rename(tmp, final)
            except OSError:
                os.rename(old, final)
                raise
            _fsync_dir(root)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            _release_temp(old)
        return final
    except CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"writing checkpoint {final} failed: {type(e).__name__}: {e}") from e
    finally:
        _release_temp(tmp)


# -------------------------------------------------------------------------------------------- verifying

def _read_manifest(path: Path) -> dict:
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    if not manifest_path.is_file():
        raise CheckpointError(
            f"checkpoint {path} has no {MANIFEST}: it is incomplete (an interrupted write, copy or upload); "
            "resume from another checkpoint or delete it")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        version = manifest["format_version"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({e}); the checkpoint is corrupt") from e
    if version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {version}; this code reads up to "
                              f"{FORMAT_VERSION}: update the code")
    for rel in files:
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} lists '{rel}', outside the checkpoint")
    return manifest


def verify_checkpoint(path) -> dict:
    """Checks every file the manifest lists (size, then crc32c) and returns the manifest."""
    path = Path(path)
    manifest = _read_manifest(path)
    for rel, expected in manifest["files"].items():
        file = path / rel
        if not isinstance(expected, dict) or not {"size", "crc32c"} <= expected.keys():
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} entry for {rel} is malformed; the checkpoint is corrupt")
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: file {rel} is missing; the checkpoint is corrupt")
        size = file.stat().st_size
        if size != expected["size"]:
            raise CheckpointError(f"checkpoint {path}: file {rel} has {size} bytes, the manifest says "
                                  f"{expected['size']}; the checkpoint is corrupt")
        crc = file_crc32c(file)
        if crc != expected["crc32c"]:
            raise CheckpointError(f"checkpoint {path}: file {rel} has crc32c {crc}, the manifest says "
                                  f"{expected['crc32c']}; the checkpoint is corrupt")
    return manifest


def _looks_complete(path: Path) -> bool:
    """Cheap completeness check for retention: manifest readable and every size matches (no crc32c)."""
    try:
        manifest = _read_manifest(path)
        return all((path / rel).is_file() and (path / rel).stat().st_size == f["size"]
                   for rel, f in manifest["files"].items())
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



def _stale_temps(root: Path) -> list[Path]:
    stale = []
    with _ACTIVE_LOCK:
        active = set(_ACTIVE_TEMPS)
    for p in root.iterdir():
        m = _TEMP_RE.fullmatch(p.name)
        if not m or p in active:
            continue
        pid = int(m.group("pid"))
        # Our own pid but not one of our live temps: left by an earlier process that had the same pid.
        if pid == os.getpid() or not pid_alive(pid):
            stale.append(p)
    return stale


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
            _remove_tree(path)
            log(f"retention: deleted {path.name} (keeping the newest {keep})")
            deleted.append(path)
    for path in _stale_temps(root):
        shutil.rmtree(path, ignore_errors=True)
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


def read_checkpoint(path, map_location="cpu", verify: bool = True) -> CheckpointPayload:
    """Loads a checkpoint (after verifying it unless `verify=False`, for one verified a moment ago).

    The `.pt` files load with `weights_only=True` (tensors, containers, numbers, numpy arrays); an object
    that needs more was not a state dict and is reported rather than unpickled."""
    path = Path(path)
    manifest = verify_checkpoint(path) if verify else _read_manifest(path)
    device = str(map_location)
    try:
        model_state = load_safetensors(str(path / MODEL_FILE), device=device)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: cannot load {MODEL_FILE}: {e}") from e
    objects = {}
    with torch.serialization.safe_globals(_numpy_safe_globals()):
        for key in manifest.get("objects", []):
            file = path / f"{key}.pt"
            try:
                objects[key] = torch.load(file, map_location=map_location, weights_only=True)
            except Exception as e:
                raise CheckpointError(
                    f"checkpoint {path}: cannot load {file.name} with weights_only=True ({e}); save only "
                    "state dicts (tensors, containers, numbers, strings, numpy arrays) as checkpoint objects"
                ) from e
    try:
        trainer_state = json.loads((path / TRAINER_STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read {TRAINER_STATE_FILE}: {e}") from e
    return CheckpointPayload(model_state=model_state, objects=objects, trainer_state=trainer_state)


# ------------------------------------------------------------------------------------------ async writer

class AsyncCheckpointWriter:
    """Writes checkpoints on one daemon thread, one at a time.

    `save` waits for the previous write (raising its error, if any), then returns at once. `wait` blocks
    until idle and re-raises a failed write as CheckpointError. The payload must be a CPU snapshot that the
    caller no longer mutates. Call `wait()` before exiting: a daemon thread dies with the interpreter and
    would leave only a temp dir behind."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._last: Path | None = None
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def save(self, root, name: str, payload: CheckpointPayload,
             on_done: Callable[[Path], None] | None = None,
             extra_files: dict[str, Path] | None = None) -> None:
        self.wait()
        device = _non_cpu_tensor([payload.model_state, payload.objects])
        if device:
            raise CheckpointError(f"checkpoint {name}: payload holds a tensor on {device}; "
                                  "pass snapshot_to_cpu(...) output to AsyncCheckpointWriter.save")
        self._idle.clear()
        self._jobs.put((Path(root), name, payload, on_done, extra_files))

    def wait(self) -> Path | None:
        """Blocks until no write is running; returns the last written path or raises the write's error."""
        self._idle.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._last

    def close(self) -> Path | None:
        try:
            return self.wait()
        finally:
            self._jobs.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            root, name, payload, on_done, extra_files = job
            try:
                path = write_checkpoint(root, name, payload, extra_files)
                self._last = path
                if on_done is not None:
                    on_done(path)
            except CheckpointError as e:
                self._error = e
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread by wait()
                error = CheckpointError(f"checkpoint {root / name}: after-write callback failed: "
                                        f"{type(e).__name__}: {e}")
                error.__cause__ = e
                self._error = error
            finally:
                del job, payload
                self._idle.set()


# ------------------------------------------------------------------------------------------------ resume

def _join_url(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def _remote_latest(client, remote_url: str, log) -> tuple[str, tuple[int, int, int]] | None:
    """The newest remote checkpoint (by step) whose manifest exists: (name, parsed)."""
    from utils import storage

    named = [(parse_checkpoint_name(n), n) for n in storage.list_subdirectories(client, remote_url)]
    named = sorted(((p, n) for p, n in named if p), key=lambda x: (x[0][1], x[1]), reverse=True)
    for parsed, name in named:
        if storage.object_exists(client, _join_url(_join_url(remote_url, name), MANIFEST)):
            return name, parsed
        log(f"skipping remote checkpoint {_join_url(remote_url, name)}: no {MANIFEST} (incomplete upload)")
    return None


def _download(client, url: str, local_root: Path, name: str, log) -> Path:
    """Downloads a remote checkpoint into local_root/name and verifies it."""
    from utils import storage

    if not storage.object_exists(client, _join_url(url, MANIFEST)):
        raise CheckpointError(f"remote checkpoint {url} has no {MANIFEST}: incomplete upload (or no such "
                              "checkpoint); resume from another one")
    dest = Path(local_root) / name
    if dest.exists():
        try:
            verify_checkpoint(dest)
            log(f"resume: {name} is already present locally at {dest}; not downloading {url}")
            return dest
        except CheckpointError as e:
            log(f"resume: local copy {dest} is broken ({e}); downloading {url} again")
            _remove_tree(dest)
    Path(local_root).mkdir(parents=True, exist_ok=True)
    log(f"resume: downloading {url} -> {dest}")
    try:
        storage.download_directory(client, url, dest)
    except Exception as e:  # noqa: BLE001 - incl. losing a race to another process downloading the same one
        try:
            verify_checkpoint(dest)
            log(f"resume: another process downloaded {name} to {dest} meanwhile; using it")
            return dest
        except CheckpointError:
            pass
        raise CheckpointError(f"downloading checkpoint {url} failed: {type(e).__name__}: {e}") from e
    try:
        verify_checkpoint(dest)
    except CheckpointError as e:
        _remove_tree(dest)
        raise CheckpointError(f"checkpoint downloaded from {url} does not verify (deleted the copy): {e}") from e
    return dest


def resolve_resume(arg: str, local_root, remote_url: str | None = None, client_factory=None, log=print) -> Path:
    """Turns a `--resume` value into a verified local checkpoint directory.

    `latest`: the newest checkpoint that verifies locally, or the newest complete one under `remote_url`
    when that is newer (or nothing is local), downloaded into local_root. A checkpoint name: local_root/name,
    else remote_url/name. A local directory path. A gs:// URL: downloaded into local_root/<its last part>."""
    local_root = Path(local_root)
    client = None

    def get_client():
        nonlocal client
        if client is None:
            if client_factory is None:
                from utils.storage import make_client
                client = make_client()
            else:
                client = client_factory()
        return client

    if arg.startswith("gs://"):
        name = arg.rstrip("/").rsplit("/", 1)[-1]
        return _download(get_client(), arg.rstrip("/"), local_root, name, log)

    if arg == "latest":
        local = find_latest_local(local_root, log)
        remote = None
        if remote_url:
            try:
                remote = _remote_latest(get_client(), remote_url, log)
            except Exception as e:  # noqa: BLE001 - a reachable local checkpoint still lets the run resume
                if local is None:
                    raise CheckpointError(f"no checkpoint in {local_root}, and listing {remote_url} failed: "
                                          f"{type(e).__name__}: {e}") from e
                log(f"resume: could not list {remote_url} ({type(e).__name__}: {e}); using local {local.name}")
        if remote and (local is None or remote[1][1] > parse_checkpoint_name(local.name)[1]):
            return _download(get_client(), _join_url(remote_url, remote[0]), local_root, remote[0], log)
        if local is not None:
            return local
        where = f"{local_root}" + (f" or {remote_url}" if remote_url else "")
        raise NoCheckpointFound(f"no checkpoint found in {where}; start without --resume, or use "
                                f"--resume auto (resume when there is one, else start fresh)")

    candidate = Path(arg)
    if candidate.is_dir():
        verify_checkpoint(candidate)
        return candidate

    if "/" not in arg and parse_checkpoint_name(arg):
        if (local_root / arg).is_dir():
            try:
                verify_checkpoint(local_root / arg)
                return local_root / arg
            except CheckpointError as e:
                if not remote_url:
                    raise
                log(f"resume: {e}; trying {remote_url}")
        if remote_url:
            return _download(get_client(), _join_url(remote_url, arg), local_root, arg, log)
    where = f"{local_root}" + (f" or {remote_url}" if remote_url else "")
    raise CheckpointError(f"--resume {arg}: no such checkpoint directory, name in {where}, or gs:// URL")
