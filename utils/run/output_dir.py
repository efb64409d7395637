"""A run's output folder: where it is by default (runs/<run name>/), the lock that keeps it to one live run,
the refusal of a fresh run where another run's files are, and whether every node sees it (a shared
filesystem), which sharded checkpoints on several nodes depend on."""
from __future__ import annotations

import os
import secrets
from pathlib import Path

from utils import layout
from utils.checkpoint.format import parse_checkpoint_name
from utils.runtime.distributed import main_process_only
from utils.errors import UserError
from utils.io.lock import OutputDirLock


def default_output_dir(run_name: str, repo_root: Path) -> Path:
    """runs/<run name>/ in the repo: each run its own folder unless --output-dir says otherwise."""
    name = Path(run_name).name  # a config file's path names its run by its file name
    return repo_root / "runs" / (name if name not in ("", ".", "..") else "run")


def lock_output_dir(output_dir: Path, accelerator) -> OutputDirLock:
    """Rank 0 takes the output dir's lock; every rank learns the outcome, so all stop together if busy."""
    lock = OutputDirLock(output_dir)
    main_process_only(accelerator, lambda: lock.acquire(log=print))
    return lock


def refuse_another_run(output_dir: Path, defaulted: bool) -> None:
    """A fresh run (no --resume) never writes into a folder that holds another run's files: any checkpoint
    (complete or not), final_model/, or rows in logs/metrics.jsonl (a run that trained but never saved).
    Its retention would delete those checkpoints, its export overwrite that model, its rows mix with those,
    so the summary, plot_run.py, generate.py and a later `--resume auto` could take either run's."""
    try:
        found = sorted((p.name for p in (output_dir / layout.CHECKPOINTS).iterdir() if parse_checkpoint_name(p.name)),
                       key=parse_checkpoint_name)
    except OSError:  # none, or unreadable (said where the run reads them)
        found = []
    metrics = output_dir / layout.LOGS / layout.METRICS
    held = ([f"{len(found)} checkpoint(s) (newest {found[-1]})"] if found else []) + \
        ([f"{layout.FINAL_MODEL}/"] if (output_dir / layout.FINAL_MODEL).exists() else []) + \
        ([f"{layout.LOGS}/{layout.METRICS}"] if metrics.is_file() and metrics.stat().st_size else [])
    if held:
        elsewhere = ("--set run_name=NAME (its own folder runs/NAME/) or --output-dir DIR" if defaulted
                     else "a new --output-dir")
        raise UserError(f"{output_dir} holds another run's {', '.join(held)}, which a fresh run there would delete, "
                        f"overwrite or mix with its own; continue that run with --resume auto, or start this one "
                        f"elsewhere with {elsewhere}")


def shared_output_dir(output_dir: Path, accelerator, remote_root: str | None, log) -> bool:
    """Sharded checkpoints are written by every rank into one directory: across nodes it is complete in one
    place only on a shared filesystem, or in GCS. Rank 0 leaves a file in its output dir and every node
    looks for it in its own. False when some node cannot see it: with a bucket each node then uploads its
    own ranks' shards (utils/checkpoint/sharded.py); without one every rank stops in one line."""
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
