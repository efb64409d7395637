"""A background thread that writes checkpoints while training goes on."""
from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Callable

from utils.checkpoint.format import CheckpointError, CheckpointPayload, ShardedPart, non_cpu_tensor, write_checkpoint
from utils.errors import THREAD_FAILED, BackgroundFailure, UserError


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

    def save(self, root, name: str, payload: CheckpointPayload,
             on_done: Callable[[Path], None] | None = None,
             extra_files: dict[str, Path] | None = None, sharded: ShardedPart | None = None) -> None:
        self.wait()
        device = non_cpu_tensor([payload.model_state, payload.objects])
        if device:
            raise CheckpointError(f"checkpoint {name}: payload holds a tensor on {device}; "
                                  "pass snapshot_to_cpu(...) output to AsyncCheckpointWriter.save")
        self._idle.clear()
        self._jobs.put((Path(root), name, payload, on_done, extra_files, sharded))

    def wait(self) -> Path | None:
        """Blocks until no write is running; returns the last written path or raises the write's error."""
        while not self._idle.wait(1.0):  # never on a dead thread: its write will not end
            if not self._thread.is_alive():
                raise BackgroundFailure(f"{THREAD_FAILED}: {self._thread.name} is gone with a checkpoint half written; "
                                        f"resume from the newest complete one (--resume auto)")
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._last

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            root, name, payload, on_done, extra_files, sharded = job
            try:
                path = write_checkpoint(root, name, payload, extra_files, sharded)
                self._last = path
                if on_done is not None:
                    on_done(path)
            except UserError as e:  # CheckpointError, DiskFullError
                self._error = e
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread by wait()
                what = "writing the ranks' shards" if sharded is not None and self._last != root / name \
                    else "after-write callback"
                error = CheckpointError(f"checkpoint {root / name}: {what} failed: {type(e).__name__}: {e}")
                error.__cause__ = e
                self._error = error
            finally:
                del job, payload
                self._idle.set()
