"""Upload finished checkpoint directories to GCS from a background thread, so training never waits for GCS.

`submit()` never blocks: with GCS slow, refusing or hanging, the writer thread that calls it (and so the
next checkpoint, and so the training loop) goes on at once. One upload runs at a time; a checkpoint still
waiting its turn when a newer one is submitted is *superseded* (GCS needs the newest, not every one), so
the backlog never grows past one waiting upload. With `clean_superseded` (several nodes without a shared
output dir: the other nodes uploaded their shards of every checkpoint themselves) what the other nodes put
under a superseded checkpoint's URL is deleted before the next upload, since its manifest never goes up:
a run whose uploads lag does not leave those shards in the bucket.

Retention asks `protected()` what it must keep: every checkpoint whose upload is waiting or running, and
the newest one whose upload failed, unless a newer checkpoint has since reached GCS. Only the newest failed
one: when uploads keep failing (a mistyped bucket, lost permissions) keeping every failed checkpoint would
fill the disk of a long run, and the newest one is what a resume needs; this is said once, when an older
failed checkpoint first loses its protection. Failures never raise into training; `drain()` / `close()` report each
result once, and `UploadReport.summary()` says plainly what is where and the command that uploads what is missing.

Run as a script to upload one checkpoint by hand (verified, manifest last):
    python -m utils.checkpoint.upload LOCAL_CHECKPOINT_DIR gs://BUCKET/PREFIX/checkpoints/RUN/NAME
"""
from __future__ import annotations

import collections
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from utils.checkpoint.format import MANIFEST
from utils.io.storage import (
    StorageError,
    check_writable,
    list_objects,
    make_client,
    parse_gs_url,
    retry_call,
    upload_directory,
)

UPLOAD_COMMAND = "python -m utils.checkpoint.upload"


@dataclass
class UploadReport:
    succeeded: list[str] = field(default_factory=list)  # gs urls
    failed: list[tuple[str, str]] = field(default_factory=list)  # (gs url, why): failed or not finished in time
    superseded: list[str] = field(default_factory=list)  # gs urls skipped because a newer one was submitted
    local: dict[str, Path] = field(default_factory=dict)  # gs url -> local directory, for every url above

    @property
    def ok(self) -> bool:
        return not self.failed

    def merge(self, other: "UploadReport") -> None:
        self.succeeded += other.succeeded
        self.failed += other.failed
        self.superseded += other.superseded
        self.local |= other.local

    def summary(self) -> list[str]:
        """What is where, one line each: the failures that matter, with the command that fixes them."""
        lines = []
        for url, why in self.failed:
            path = self.local.get(url)
            where = (f"it is only on local disk at {path}" if path is not None and path.exists()
                     else "its local copy is gone too (retention keeps only the newest checkpoint whose upload "
                          "failed)")
            lines.append(f"upload of {url} failed ({why}); {where}"
                         + (f"; upload it with: {UPLOAD_COMMAND} {path} {url}" if path is not None and path.exists()
                            else ""))
        return lines


@dataclass
class _Job:
    local_dir: Path
    gs_url: str
    seq: int


_STOP = object()


class BackgroundUploader:
    """One daemon thread uploading checkpoint directories in order, the manifest last."""

    def __init__(self, client_factory: Callable = make_client, retries: int = 5, synchronous: bool = False,
                 log: Callable[[str], None] = print, clean_superseded: bool = False):
        self._client_factory = client_factory
        self._retries = retries
        self._synchronous = synchronous
        self._log = log
        self._client = None
        self._cond = threading.Condition()
        self._waiting: collections.deque = collections.deque()  # submitted, not started (at most one)
        self._running: _Job | None = None
        self._failed: dict[Path, _Job] = {}  # local dir -> its failed upload (until a newer one succeeds)
        self._newest_uploaded = 0  # seq of the newest checkpoint that reached GCS
        self._said_bounded = False  # the warning that older failed uploads are no longer kept, said once
        self._results = UploadReport()  # finished, not yet reported
        self._seq = 0
        self._clean_superseded = clean_superseded
        self._orphans: list[str] = []  # superseded checkpoints' URLs whose other-node files are to go
        self._closed = False
        self._thread: threading.Thread | None = None
        if not synchronous:
            self._thread = threading.Thread(target=self._run, name="checkpoint-uploader", daemon=True)
            self._thread.start()

    def check(self, gs_url: str) -> None:
        """Raises StorageError now when `gs_url` cannot take uploads (a missing bucket, no permission),
        rather than at the first checkpoint's upload; GCS unreachable is logged and training goes on."""
        warning = check_writable(self._client_factory(), gs_url)
        if warning:
            self._log(warning)

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def submit(self, local_dir, gs_url: str) -> None:
        """Queue a finished checkpoint directory for upload to `gs_url`; returns at once (with
        synchronous=True the upload happens now, in this thread). Never raises for upload errors."""
        if self._closed:
            raise RuntimeError("BackgroundUploader.submit() after close()")
        with self._cond:
            self._seq += 1
            job = _Job(Path(local_dir).resolve(), gs_url, self._seq)
            if self._synchronous:
                self._running = job
            else:
                while self._waiting:
                    old = self._waiting.popleft()
                    self._results.superseded.append(old.gs_url)
                    self._results.local[old.gs_url] = old.local_dir
                    if self._clean_superseded:
                        self._orphans.append(old.gs_url)
                    self._log(f"upload of {old.local_dir.name} skipped: {job.local_dir.name} is newer and "
                              f"goes to GCS instead")
                self._waiting.append(job)
                self._cond.notify_all()
        if self._synchronous:
            self._upload(job)

    def protected(self) -> set[Path]:
        """Resolved local directories retention must keep: waiting, uploading, or failed and not yet
        superseded by a newer checkpoint that reached GCS."""
        with self._cond:
            keep = {j.local_dir for j in self._waiting}
            if self._running is not None:
                keep.add(self._running.local_dir)
            failed = sorted((job.seq, path) for path, job in self._failed.items() if job.seq > self._newest_uploaded)
            if failed:
                keep.add(failed[-1][1])
            if len(failed) > 1 and not self._said_bounded:
                self._said_bounded = True
                self._log(f"warning: {len(failed)} checkpoint uploads failed in a row; keeping only the newest that "
                          f"failed ({failed[-1][1].name}) beyond save_total_limit, so that the disk does not fill: "
                          f"older ones that never reached GCS are deleted by retention as usual")
            return keep

    def drain(self, timeout: float | None = None) -> UploadReport:
        """Wait until everything submitted so far has finished, at most `timeout` seconds. Returns what
        finished since the last drain; what is still waiting or running at the timeout is listed as
        failed ("not finished after N s") and reported again, as it ends, by a later drain."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._waiting or self._running is not None:
                if self._thread is not None and not self._thread.is_alive():
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cond.wait(timeout=1.0 if remaining is None else min(remaining, 1.0))  # looks at the thread
            report, self._results = self._results, UploadReport()
            dead = self._thread is not None and not self._thread.is_alive()
            for job in ([self._running] if self._running else []) + list(self._waiting):
                report.failed.append((job.gs_url, "the upload thread is gone" if dead
                                      else f"timed out: upload not finished after {timeout} s"))
                report.local[job.gs_url] = job.local_dir
        return report

    def close(self, timeout: float | None = None) -> UploadReport:
        """Drain, then stop the thread. An upload still running at the timeout is abandoned (the thread is
        a daemon and dies with the process) and reported as not finished."""
        report = self.drain(timeout)
        self._closed = True
        if self._thread is not None:
            with self._cond:
                self._waiting.clear()
                self._waiting.append(_STOP)
                self._cond.notify_all()
            self._thread.join(timeout=1.0)
        return report

    # -------------------------------------------------------------------------------------- internals

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting:
                    self._cond.wait()
                job = self._waiting.popleft()
                if job is _STOP:
                    return
                self._running = job
                orphans, self._orphans = self._orphans, []
            self._remove(orphans)
            self._upload(job)

    def _remove(self, urls: list[str]) -> None:
        for url in urls:
            try:
                if self._client is None:
                    self._client = self._client_factory()
                removed = remove_incomplete_upload(self._client, url)
                if removed:
                    self._log(f"removed {removed} file(s) other nodes had uploaded to {url}: that checkpoint was "
                              f"superseded before its manifest went up")
            except Exception as exc:  # noqa: BLE001 - nothing may escape into training
                self._log(f"warning: could not remove the other nodes' files under {url} (superseded, no manifest): "
                          f"{type(exc).__name__}: {exc}")

    def _upload(self, job: _Job) -> None:
        started = time.monotonic()
        error = None
        try:
            if self._client is None:
                self._client = self._client_factory()
            names = upload_directory(self._client, job.local_dir, job.gs_url, retries=self._retries)
        except StorageError as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - nothing may escape into training
            error = f"{type(exc).__name__}: {exc}"
        seconds = time.monotonic() - started
        try:
            if error is None:
                self._log(f"uploaded {job.local_dir} -> {job.gs_url} ({len(names)} files in {seconds:.1f} s)")
            else:
                self._log(f"upload FAILED {job.local_dir} -> {job.gs_url}: {error}")
        except Exception:  # noqa: BLE001 - a broken log callback must not kill the uploader
            pass
        with self._cond:
            self._results.local[job.gs_url] = job.local_dir
            if error is None:
                self._results.succeeded.append(job.gs_url)
                self._newest_uploaded = max(self._newest_uploaded, job.seq)
                for path, old in list(self._failed.items()):  # GCS now holds something newer than these
                    if old.seq < job.seq:
                        del self._failed[path]
                        self._results.failed = [(u, why) for u, why in self._results.failed if u != old.gs_url]
                        self._results.superseded.append(old.gs_url)
            else:
                self._results.failed.append((job.gs_url, error))
                self._failed[job.local_dir] = job
            self._running = None
            self._cond.notify_all()


def remove_incomplete_upload(client, gs_url: str) -> int:
    """Deletes every object under `gs_url` unless its manifest.json is there (a complete checkpoint is
    never touched). Returns how many objects it deleted."""
    bucket, prefix = parse_gs_url(gs_url.rstrip("/"))
    objects = list_objects(client, bucket, prefix, suffix=None)
    if any(o.name == f"{prefix}/manifest.json" for o in objects):
        return 0
    for obj in objects:
        retry_call(lambda name=obj.name: client.bucket(bucket).blob(name).delete(retry=None),
                   what=f"deleting gs://{bucket}/{obj.name}")
    return len(objects)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Upload one checkpoint directory to GCS, verified, manifest last.")
    p.add_argument("local_dir")
    p.add_argument("gs_url", help="gs://BUCKET/PREFIX/checkpoints/RUN/NAME")
    args = p.parse_args(argv)
    if not Path(args.local_dir, MANIFEST).is_file():
        print(f"error: {args.local_dir} is not a complete checkpoint (no {MANIFEST})", file=sys.stderr)
        return 2
    try:
        names = upload_directory(make_client(), args.local_dir, args.gs_url.rstrip("/"))
    except StorageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"uploaded {len(names)} files to {args.gs_url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
