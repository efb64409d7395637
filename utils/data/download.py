"""The download workflow of `download_training_data.py`: mirror a dataset's shards (and its dataset.json and
tokenizer.json) from GCS into a local folder, skipping files whose size and crc32c already match, in
parallel threads, each file verified and renamed into place (utils/io/storage.py's `download_verified`).
The GCS primitives stay in utils/io/storage.py; this is what a user's download does with them."""
from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from utils.io import files
from utils.data.dataset_info import FILE as DATASET_FILE
from utils.data.partition import PLAN_FILE
from utils.data.tokenizer import FILE as TOKENIZER_FILE
from utils.errors import DiskFullError
from utils.io.storage import (RemoteObject, StorageError, clean_stale_partials, download_verified, folder_prefix, gs_url,
                           join_name, list_objects, local_matches, parse_gs_url, short_error, thread_client)


def check_destination(dest_dir) -> None:
    """One StorageError, before any download, when `dest_dir` cannot hold files: it is a file, or this
    user may not create it or write in it (rather than one FAILED line per object)."""
    dest_dir = Path(dest_dir)
    try:
        if dest_dir.exists() and not dest_dir.is_dir():
            raise StorageError(f"--dest {dest_dir} is a file; give a folder")
        dest_dir.mkdir(parents=True, exist_ok=True)
        probe = files.temp_path(dest_dir / "write-check")
        try:
            probe.write_bytes(b"")
        finally:
            probe.unlink(missing_ok=True)
            files.release_temp(probe)
    except StorageError:
        raise
    except OSError as exc:
        raise StorageError(f"--dest {dest_dir}: cannot write there ({exc.strerror}){files.owner_of(dest_dir)}; "
                           f"choose a folder you may write, or fix its permissions") from None


@dataclass
class SyncReport:
    downloaded: int = 0
    skipped: int = 0
    failed: list[str] = field(default_factory=list)  # gs:// urls
    bytes: int = 0
    seconds: float = 0.0
    dry_run: bool = False

    def summary(self) -> str:
        mb = self.bytes / 1e6
        rate = mb / self.seconds if self.seconds > 0 else 0.0
        if self.dry_run:
            return (f"dry run: would download {self.downloaded} ({mb:.1f} MB), skip {self.skipped}; "
                    f"nothing was transferred")
        return (f"downloaded {self.downloaded}, skipped {self.skipped}, failed {len(self.failed)}, "
                f"{mb:.1f} MB in {self.seconds:.1f} s ({rate:.1f} MB/s)")


@dataclass(frozen=True)
class SyncOptions:
    workers: int = 8  # download threads
    max_files: int = -1  # >= 0: the first N shards by name
    dry_run: bool = False  # say what would be downloaded, transfer nothing
    suffix: str = ".npz"  # the objects mirrored
    progress: bool = True  # a progress bar
    with_root_files: tuple[str, ...] = (DATASET_FILE, TOKENIZER_FILE, PLAN_FILE)  # beside them, when present


def sync_prefix(client_factory, source_url: str, dest_dir, options: SyncOptions = SyncOptions()) -> SyncReport:
    """Mirror every object ending in `options.suffix` under `source_url` into `dest_dir` (same relative paths),
    and the `with_root_files` found directly under it (prepare_data.py's dataset description, tokenizer and
    plan). A local file is skipped only when its size and crc32c match; everything else is downloaded,
    verified and renamed into place. Clients are created here, one per worker thread, so this is safe to call
    after a fork."""
    started = time.monotonic()
    bucket, prefix = parse_gs_url(source_url)
    dest_dir = Path(dest_dir)
    report = SyncReport(dry_run=options.dry_run)
    targets = _targets(client_factory(), source_url, dest_dir, options, report)
    with ThreadPoolExecutor(max_workers=max(1, options.workers), thread_name_prefix="gcs-check") as pool:
        matches = list(pool.map(lambda t: local_matches(t[1], t[0]), targets))
    todo = [t for t, ok in zip(targets, matches) if not ok]
    report.skipped = len(targets) - len(todo)
    if options.dry_run:
        for obj, target in todo:
            print(f"would download {gs_url(bucket, obj.name)} ({obj.size} bytes) -> {target}")
        report.downloaded = len(todo)
        report.bytes = sum(o.size for o, _ in todo)
    else:
        _download(client_factory, bucket, todo, options, report)
    report.failed.sort()
    report.seconds = time.monotonic() - started
    return report


def _targets(client, source_url: str, dest_dir: Path, options: SyncOptions,
             report: SyncReport) -> list[tuple[RemoteObject, Path]]:
    """The objects to mirror and where each goes; a name that would leave `dest_dir` is refused (failed)."""
    bucket, prefix = parse_gs_url(source_url)
    listed = list_objects(client, bucket, prefix, None)
    objects = [o for o in listed if o.name.endswith(options.suffix)]
    if not objects:
        raise StorageError(f"no objects ending in {options.suffix!r} under {source_url}: check --source")
    if options.max_files is not None and options.max_files >= 0:
        objects = objects[:options.max_files]
    if not options.dry_run:
        check_destination(dest_dir)
    root_files = {join_name(prefix, name) for name in options.with_root_files}
    objects += [o for o in listed if o.name in root_files]
    root, folder = dest_dir.resolve(), folder_prefix(prefix)
    targets = []
    for obj in objects:
        target = (root / obj.name[len(folder):]).resolve()
        if root not in target.parents:  # an object name with ".." must not escape dest_dir
            print(f"refusing {gs_url(bucket, obj.name)}: its name leaves {dest_dir}", file=sys.stderr)
            report.failed.append(gs_url(bucket, obj.name))
            continue
        targets.append((obj, target))
    if not options.dry_run:
        clean_stale_partials(root)
    return targets


def _download(client_factory, bucket: str, todo: list[tuple[RemoteObject, Path]], options: SyncOptions,
              report: SyncReport) -> None:
    """Downloads `todo` on `options.workers` threads, each verified; the first full disk stops the others."""
    from tqdm import tqdm

    lock = threading.Lock()
    bar = tqdm(total=sum(o.size for o, _ in todo), unit="B", unit_scale=True, desc="download",
               disable=not options.progress or not todo, mininterval=0.5)

    def on_bytes(n: int):
        with lock:
            bar.update(n)

    full: list[DiskFullError] = []  # the first full-disk error: said once, and the other downloads stop

    def fetch(item: tuple[RemoteObject, Path]):
        obj, target = item
        if full:
            return
        try:
            n = download_verified(thread_client(client_factory), bucket, obj, target, on_bytes=on_bytes)
        except DiskFullError as exc:
            with lock:
                full.append(exc)
            return
        except Exception as exc:  # noqa: BLE001 - any failure fails this file, said in one line; the others go on
            with lock:
                report.failed.append(gs_url(bucket, obj.name))
                tqdm.write(f"FAILED {gs_url(bucket, obj.name)}: {short_error(exc, 500)}", file=sys.stderr)
            return
        with lock:
            report.downloaded += 1
            report.bytes += n

    try:
        with ThreadPoolExecutor(max_workers=max(1, options.workers), thread_name_prefix="gcs-download") as pool:
            list(pool.map(fetch, todo))
    finally:
        bar.close()
    if full:
        raise full[0]
