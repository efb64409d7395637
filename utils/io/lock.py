"""One live run per output directory.

Two runs on the same `--output-dir` (an orphaned process and its restart, a replacement pod, a resubmitted
job) would interleave metrics.jsonl and overwrite each other's checkpoints and final_model/. Rank 0 holds
an exclusive `flock` on `OUTPUT/.run.lock` for the whole run; the file also records who holds it (host,
pid, start time) so the refusal can name the other run. The kernel drops the lock when its holder dies,
however it dies, so a lock left by a dead run is simply taken over (and said so). Processes forked while
the lock is held (DataLoader workers) close their copy of its descriptor at once: otherwise a worker
orphaned by a `kill -9` of its run would keep the lock, and the restart would be refused naming the dead pid.

`prepare_data.py` takes the same kind of lock for its `--output`, in a hidden `.NAME.lock` file beside it
(the output itself is renamed into place at the end, so it cannot hold its own lock).
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
from utils.io import files

LOCK_FILE = ".run.lock"
FULL_DISK_ADVICE = ("free space there, then run again (a training run: --resume auto continues from its newest "
                    "checkpoint)")
_HELD: set[int] = set()  # lock descriptors this process holds; a forked child closes its copies


def _close_inherited() -> None:
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_inherited)


class OutputDirBusy(UserError):
    """The output directory cannot be locked: another live run holds it, or this user may not write it."""


class OutputDirLock:
    def __init__(self, output_dir, lock_path=None, option: str = "--output-dir"):
        self.path = Path(lock_path) if lock_path else Path(output_dir) / LOCK_FILE
        self.target, self.option = Path(output_dir), option
        self._fd: int | None = None

    def acquire(self, log=print) -> None:
        """Takes the lock or raises OutputDirBusy naming its holder; never waits."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise OutputDirBusy(f"{self.option} {self.target}: cannot create {self.path} ({exc.strerror})"
                                f"{files.owner_of(self.path)}; use a directory you may write, or fix its "
                                "permissions") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            record = _read(fd)
            holder = _describe(record)
            os.close(fd)
            if record and record.get("host") == socket.gethostname() and not files.pid_alive(int(record.get("pid", 0))):
                raise OutputDirBusy(f"{self.target}: the run that locked it ({holder}) is dead, but a process it "
                                    f"started still holds {self.path} (see: fuser -v {self.path}); stop that process, "
                                    f"or wait for it to exit") from None
            raise OutputDirBusy(f"{self.target} is in use by another live run ({holder}); wait for it to "
                                f"finish, stop it, or use another {self.option}") from None
        _HELD.add(fd)
        previous = _read(fd)
        if previous and previous.get("pid") != os.getpid():
            log(f"output dir: taking over the lock left by a run that is no longer alive ({_describe(previous)})")
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started_unix": round(time.time(), 1)}
        try:  # a full disk (a restart into a folder that filled up meanwhile) is one line, as for any write
            with files.write_guard(self.path, advice=FULL_DISK_ADVICE):
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        except UserError:
            _HELD.discard(fd)
            os.close(fd)
            raise
        self._fd = fd
        atexit.register(self.release)  # emptied at exit too when the holder fails before releasing it

    def release(self) -> None:
        """Empties the record and drops the lock (a crash drops it too, leaving the record behind)."""
        fd, self._fd = self._fd, None
        if fd is None or fd not in _HELD:  # not held, or a forked child whose copy is closed (the number may be reused)
            return
        _HELD.discard(fd)
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
