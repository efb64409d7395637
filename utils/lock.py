"""One live run per output directory.

Two runs on the same `--output-dir` (an orphaned process and its restart, a replacement pod, a resubmitted
job) would interleave metrics.jsonl and overwrite each other's checkpoints and final_model/. Rank 0 holds
an exclusive `flock` on `OUTPUT/.run.lock` for the whole run; the file also records who holds it (host,
pid, start time) so the refusal can name the other run. The kernel drops the lock when its holder dies,
however it dies, so a lock left by a dead run is simply taken over (and said so).
"""
from __future__ import annotations

import atexit
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from utils.errors import UserError

LOCK_FILE = ".run.lock"


class OutputDirBusy(UserError):
    """Another live run holds the output directory."""


class OutputDirLock:
    def __init__(self, output_dir):
        self.path = Path(output_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self, log=print) -> None:
        """Takes the lock or raises OutputDirBusy naming its holder; never waits."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read(fd))
            os.close(fd)
            raise OutputDirBusy(f"{self.path.parent} is in use by another live run ({holder}); wait for it to "
                                f"finish, stop it, or use another --output-dir") from None
        previous = _read(fd)
        if previous and previous.get("pid") != os.getpid():
            log(f"output dir: taking over the lock left by a run that is no longer alive ({_describe(previous)})")
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started_unix": round(time.time(), 1)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        atexit.register(self.release)  # emptied at exit too when the holder fails before releasing it

    def release(self) -> None:
        """Empties the record and drops the lock (a crash drops it too, leaving the record behind)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)


def _read(fd: int) -> dict | None:
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw) if raw.strip() else None
    except (OSError, ValueError):
        return None


def _describe(record: dict | None) -> str:
    if not record:
        return "holder unknown"
    started = record.get("started_unix")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    return f"host {record.get('host', '?')}, pid {record.get('pid', '?')}, started {when}"
