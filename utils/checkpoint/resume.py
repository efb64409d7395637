"""Turning `--resume` into a verified local checkpoint: local listing, GCS listing and verified download."""
from __future__ import annotations

from pathlib import Path

from utils import layout
from utils.checkpoint.format import (
    MANIFEST,
    MODEL_FILE,
    CheckpointError,
    NoCheckpointFound,
    PartialCheckpoint,
    find_latest_local,
    list_checkpoints,
    parse_checkpoint_name,
    verify_checkpoint,
)
from utils.io import files, storage


def _join_url(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def _remote_latest(client, remote_url: str, log) -> tuple[str, tuple[int, int, int]] | None:
    """The newest remote checkpoint (by step) whose manifest exists: (name, parsed)."""
    named = [(parse_checkpoint_name(n), n) for n in storage.list_subdirectories(client, remote_url)]
    named = sorted(((p, n) for p, n in named if p), key=lambda x: (x[0][1], x[1]), reverse=True)
    for parsed, name in named:
        if storage.object_exists(client, _join_url(_join_url(remote_url, name), MANIFEST)):
            return name, parsed
        log(f"skipping remote checkpoint {_join_url(remote_url, name)}: no {MANIFEST} (incomplete upload)")
    return None


def _download(client, url: str, local_root: Path, name: str, log) -> Path:
    """Downloads a remote checkpoint into local_root/name and verifies it."""
    if not storage.object_exists(client, _join_url(url, MANIFEST)):
        raise CheckpointError(f"remote checkpoint {url} has no {MANIFEST}: incomplete upload (or no such "
                              "checkpoint); resume from another one")
    dest = Path(local_root) / name
    if dest.exists():
        try:
            verify_checkpoint(dest)
            log(f"resume: {name} is already present locally at {dest}; not downloading {url}")
            return dest
        except PartialCheckpoint:
            log(f"resume: {dest} holds only the shards its node wrote; downloading the whole checkpoint from {url}")
            files.remove_tree(dest)
        except CheckpointError as e:
            log(f"resume: local copy {dest} is broken ({e}); downloading {url} again")
            files.remove_tree(dest)
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
        files.remove_tree(dest)
        raise CheckpointError(f"checkpoint downloaded from {url} does not verify (deleted the copy): {e}") from e
    return dest


def _held(names: list[str]) -> str:
    """"2 checkpoints: A ... B (newest)" for checkpoint names, oldest first."""
    names = sorted(names, key=lambda n: (parse_checkpoint_name(n)[1], n))
    shown = names if len(names) <= 3 else names[:1] + ["..."] + names[-2:]
    return f"{len(names)} checkpoint{'s' if len(names) != 1 else ''}: {', '.join(shown)}"


def _explain_local_folder(path: Path) -> None:
    """A folder given to --resume that is not itself a checkpoint but a run's output dir or its
    checkpoints/ folder: say so, what it holds, and what to pass instead."""
    if parse_checkpoint_name(path.name):
        return
    for root, what in ((path, "a folder of checkpoints"), (path / layout.CHECKPOINTS, "a run's output directory")):
        names = [p.name for p in list_checkpoints(root)]
        if names:
            newest = max(names, key=lambda n: parse_checkpoint_name(n)[1])
            latest = (f", or with --output-dir {root.parent} --resume latest" if root.name == layout.CHECKPOINTS
                      else "")
            raise CheckpointError(f"{path} is {what}, not a checkpoint; it holds {_held(names)}. Resume from one "
                                  f"with --resume {root / newest}{latest}")
    if (path / MANIFEST).exists() or (path / MODEL_FILE).exists():
        return  # a checkpoint under another name: verify_checkpoint says what is wrong with it
    raise CheckpointError(f"{path} is neither a checkpoint nor a folder holding any (no checkpoint-epoch*-step*-files* "
                          f"directories in it or in its checkpoints/); give a checkpoint directory, a checkpoint name, "
                          f"latest, or a gs:// URL")


def _explain_remote(client, url: str) -> None:
    """For `--resume gs://...` without a manifest there: a missing bucket, a folder of checkpoints (a run's
    remote root), nothing at all under the name, and an incomplete upload are four different answers."""
    if storage.object_exists(client, _join_url(url, MANIFEST)):
        return
    bucket, _ = storage.parse_gs_url(url)
    if not storage.bucket_exists(client, bucket):
        raise CheckpointError(f"--resume {url}: bucket gs://{bucket} does not exist (or these credentials cannot "
                              f"see it); check the bucket name")
    names = [n for n in storage.list_subdirectories(client, url) if parse_checkpoint_name(n)]
    if names:
        newest = max(names, key=lambda n: parse_checkpoint_name(n)[1])
        raise CheckpointError(f"--resume {url} is a folder of checkpoints, not a checkpoint; it holds "
                              f"{_held(names)}. Resume with --resume {_join_url(url, newest)}, or --resume latest "
                              f"with gcs_bucket/gcs_prefix pointing there")
    if not storage.list_objects(client, bucket, storage.parse_gs_url(url)[1], suffix=None):
        raise CheckpointError(f"--resume {url}: nothing in gs://{bucket} under that name; check the path (list "
                              f"it with: gcloud storage ls {url.rsplit('/', 1)[0]}/)")


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
            client = (client_factory or storage.make_client)()
        return client

    if arg.startswith("gs://"):
        name = arg.rstrip("/").rsplit("/", 1)[-1]
        _explain_remote(get_client(), arg.rstrip("/"))
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
        _explain_local_folder(candidate)
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
