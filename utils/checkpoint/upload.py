"""Upload finished checkpoint directories to GCS from a background thread, so training does not wait.

Failures never raise into the training thread: they are logged and collected, and `drain()` / `close()`
report them. The local copy is never touched; `in_flight()` tells checkpoint retention what it must keep.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from utils.storage import StorageError, make_client, upload_directory


@dataclass
class UploadReport:
    succeeded: list[str] = field(default_factory=list)  # gs urls
    failed: list[tuple[str, str]] = field(default_factory=list)  # (gs url, error message)

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclass
class _Job:
    local_dir: Path
    gs_url: str
    seq: int


_STOP = object()


class BackgroundUploader:
    """A bounded queue of checkpoint directories and one daemon thread that uploads them in order, with the
    manifest last. Each result is reported once, by the first `drain()` / `close()` after it finished."""

    def __init__(self, client_factory: Callable = make_client, max_queue: int = 2, retries: int = 5,
                 synchronous: bool = False, log: Callable[[str], None] = print):
        self._client_factory = client_factory
        self._retries = retries
        self._synchronous = synchronous
        self._log = log
        self._client = None
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, max_queue))
        self._cond = threading.Condition()
        self._pending: dict[int, _Job] = {}  # submitted, not finished
        self._in_flight: Counter[Path] = Counter()
        self._results = UploadReport()  # finished, not yet reported
        self._seq = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        if not synchronous:
            self._thread = threading.Thread(target=self._run, name="checkpoint-uploader", daemon=True)
            self._thread.start()

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def submit(self, local_dir, gs_url: str) -> None:
        """Queue a finished checkpoint directory for upload to `gs_url` (blocks while the queue is full).
        With synchronous=True the upload happens now, in this thread. Never raises for upload errors."""
        if self._closed:
            raise RuntimeError("BackgroundUploader.submit() after close()")
        path = Path(local_dir).resolve()
        with self._cond:
            self._seq += 1
            job = _Job(path, gs_url, self._seq)
            self._pending[job.seq] = job
            self._in_flight[path] += 1
        if self._synchronous:
            self._upload(job)
        else:
            self._queue.put(job)

    def in_flight(self) -> set[Path]:
        """Resolved paths of directories queued or uploading: retention must not delete these."""
        with self._cond:
            return set(self._in_flight)

    def drain(self, timeout: float | None = None) -> UploadReport:
        """Wait until everything submitted so far has finished, at most `timeout` seconds. Returns what
        finished since the last drain; anything still pending at the timeout is listed as failed
        ("timed out") and reported again, as it ends, by a later drain."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            last = self._seq
            while any(seq <= last for seq in self._pending):
                if self._thread is not None and not self._thread.is_alive():
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cond.wait(timeout=remaining)
            report, self._results = self._results, UploadReport()
            for seq, job in sorted(self._pending.items()):
                if seq <= last:
                    report.failed.append((job.gs_url, f"timed out: upload of {job.local_dir} not finished "
                                                      f"after {timeout} s"))
        return report

    def close(self, timeout: float | None = None) -> UploadReport:
        """Drain, then stop the thread. Uploads still running at the timeout are abandoned (the thread is a
        daemon) and reported as failed."""
        report = self.drain(timeout)
        self._closed = True
        if self._thread is not None:
            try:
                self._queue.put_nowait(_STOP)
            except queue.Full:
                pass  # still busy after the timeout; the daemon thread dies with the process
            self._thread.join(timeout=1.0)
        return report

    # -------------------------------------------------------------------------------------- internals

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            self._upload(job)

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
                self._log(f"upload FAILED {job.local_dir} -> {job.gs_url}: {error} (the local copy is kept)")
        except Exception:  # noqa: BLE001 - a broken log callback must not kill the uploader
            pass
        with self._cond:
            if error is None:
                self._results.succeeded.append(job.gs_url)
            else:
                self._results.failed.append((job.gs_url, error))
            del self._pending[job.seq]
            self._in_flight[job.local_dir] -= 1
            if self._in_flight[job.local_dir] <= 0:
                del self._in_flight[job.local_dir]
            self._cond.notify_all()
