"""The hang watchdog (`hang_timeout_s`): a rank that makes no training progress for that long is ended, with
every rank's Python stacks on disk and one line naming the rank that stopped and where, so that the launcher's
restarts (start_training.sh --max-restarts) or the scheduler bring the run back from the newest checkpoint
instead of a hung collective burning the allocation until its time limit (over gloo nothing else times out
soon: a collective waits process_group_timeout_s).

Every rank runs one daemon thread. The loop calls `beat(step)` after each optimizer step, and runs the parts of
an iteration that are progress without being a step inside `busy(what)`: an evaluation, a checkpoint's save,
the stop's wait for its checkpoint, a rollback's restore (the clock stops while one runs and starts again when
it ends). The thread publishes, every few seconds, this rank's heartbeat (`logs/.watchdog/rank<R>.json`: pid,
host, last step, when it progressed, what it is busy with, when the thread last ran). A rank waiting in a
collective for another that is busy (rank 0 alone writes a checkpoint) or that progressed lately is not hung:
the run's progress is any running rank's. When the run has not progressed for `hang_timeout_s`, or this
process itself was not running for that long (SIGSTOP, a frozen VM), the thread
- writes `logs/hang-<UTC time>-rank<R>.txt`: a header and every thread's Python stack (faulthandler);
- reads the other ranks' heartbeats: a rank whose thread has not run for a while is not running (stopped,
  frozen or gone) and is named; one on this host that is stopped gets SIGCONT, so that its own watchdog
  (which then finds it was not running) writes its stacks too, and this rank waits a few seconds for them;
- prints one line: this rank, where its main thread waits (innermost frame, and the innermost frame in this
  repository), the ranks that are not running, and the stack file;
- on CUDA, writes NCCL's flight recorder (`logs/nccl-trace-<time>-rank<R>.pkl`, where torch can dump it);
- marks the hang beside the launcher's status record (utils/runtime/run_status.py `mark_hung`), so that the launcher
  exits 3 too, whichever rank fired and whatever accelerate or torchrun exit with;
- exits with status 3 (`os._exit`: a thread cannot unwind a main thread stuck in a collective).

On CUDA, `nccl_flight_recorder_env` (called before the process group exists) also turns on NCCL's own flight
recorder, dumped into logs/ by NCCL's watchdog when a collective times out (process_group_timeout_s):
TORCH_NCCL_TRACE_BUFFER_SIZE, TORCH_NCCL_DUMP_ON_TIMEOUT, TORCH_NCCL_DEBUG_INFO_TEMP_FILE (unless already set).
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from utils.runtime.run_status import HANG_EXIT, mark_hung, mark_trained

REPO_ROOT = Path(__file__).resolve().parents[2]
WAIT_FOR_PEER_STACKS_S = 15.0


def nccl_flight_recorder_env(logs_dir: Path) -> None:
    """On CUDA, before the process group is created: NCCL's flight recorder on, dumped into `logs_dir` on a
    collective's timeout (torch appends the rank to the file name). Values already set are kept."""
    import torch

    if not torch.cuda.is_available():
        return
    Path(logs_dir).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(Path(logs_dir) / "nccl-trace-rank"))


class HangWatchdog:
    def __init__(self, timeout_s: float, logs_dir: Path, rank: int, world: int):
        self.timeout_s, self.logs, self.rank, self.world = float(timeout_s), Path(logs_dir), rank, world
        self.beats = self.logs / ".watchdog"
        self.poll_s = max(0.5, min(5.0, self.timeout_s / 10))
        self.stale_s = 3 * self.poll_s + 5  # a heartbeat older than this: that rank's process is not running
        self.step: int | None = None
        self.progress_t, self.progress_wall = time.monotonic(), time.time()
        self.busy_with: str | None = None  # the phase running now that is progress though no step ends
        self._stop = threading.Event()
        self._host = socket.gethostname()
        self._publishing = threading.Lock()

    def start(self, step: int) -> "HangWatchdog":
        """Arms it (hang_timeout_s 0: off), counting from now, at optimizer step `step`."""
        if self.timeout_s <= 0:
            return self
        self.beat(step)
        self.beats.mkdir(parents=True, exist_ok=True)
        self._publish()  # at once: a heartbeat left by an earlier launch is this rank's no longer
        threading.Thread(target=self._watch, name="hang-watchdog", daemon=True).start()
        return self

    def beat(self, step: int) -> None:
        """A training step is done: progress for this watchdog, and for the launcher (a failure from here on
        may be restarted: --max-restarts), whether or not the watchdog is on."""
        mark_trained()
        self.step, self.progress_t, self.progress_wall = step, time.monotonic(), time.time()

    @contextmanager
    def busy(self, what: str) -> Iterator[None]:
        """`with watchdog.busy("evaluation"): ...`: a part of the loop that is progress though no step ends
        (an evaluation, a checkpoint's save, the stop's wait for its checkpoint): the clock stops while it runs
        and starts again when it ends; the other ranks read it in this rank's heartbeat. Cheap: the loop may
        wrap a call that is due only now and then."""
        self.busy_with = what
        try:
            yield
        finally:
            self.busy_with = None
            self.progress_t, self.progress_wall = time.monotonic(), time.time()

    def stop(self) -> None:
        self._stop.set()

    # --------------------------------------------------------------------------------------- the thread
    def _watch(self) -> None:
        main = threading.main_thread().ident
        last = time.monotonic()
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            not_running_s, last = now - last, now  # this process was stopped (SIGSTOP, a frozen VM) that long
            idle = self._idle_s()
            frozen = not_running_s >= self.timeout_s and self.busy_with is None  # a long call may hold the GIL
            if idle >= self.timeout_s or frozen:
                self._fire(idle, not_running_s, main)
            self._publish()

    def _idle_s(self) -> float:
        """Seconds since the run last progressed, as this rank sees it: its own steps and busy phases, and
        those of every other rank still running (one that waits in a collective for a rank writing a checkpoint
        or evaluating alone is not hung). The other ranks' heartbeats are read only once this rank's own idle
        time has reached the timeout."""
        if self.busy_with is not None:
            return 0.0
        idle = time.monotonic() - self.progress_t
        if idle < self.timeout_s:
            return idle
        now = time.time()
        for peer in self._peers():
            if now - peer.get("alive", 0) > self.stale_s:
                continue  # not running: it makes no progress, and the line names it
            if peer.get("busy"):
                return 0.0
            idle = min(idle, now - peer.get("progress", 0))
        return idle

    def _publish(self) -> None:
        record = {"rank": self.rank, "pid": os.getpid(), "host": self._host, "step": self.step,
                  "progress": self.progress_wall, "busy": self.busy_with, "alive": time.time()}
        path = self.beats / f"rank{self.rank}.json"
        with self._publishing:  # start() and the thread: one temporary file at a time
            try:
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(record))
                os.replace(tmp, path)
            except OSError:
                pass

    def _peers(self) -> list[dict]:
        found = []
        for rank in range(self.world):
            if rank == self.rank:
                continue
            try:
                found.append(json.loads((self.beats / f"rank{rank}.json").read_text()))
            except (OSError, ValueError):
                pass
        return found

    def _fire(self, idle: float, not_running_s: float, main: int | None) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        path = self.logs / f"hang-{stamp}-rank{self.rank}.txt"
        frozen_self = not_running_s >= self.timeout_s
        header = (f"rank {self.rank} (pid {os.getpid()}, host {self._host}): "
                  + (f"this process was not running for {not_running_s:.0f} s (stopped or frozen)"
                     if frozen_self else f"no training progress for {idle:.0f} s")
                  + f" after step {self.step}; hang_timeout_s={self.timeout_s:g}\n\n")
        try:
            with open(path, "w") as f:
                f.write(header)
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as exc:
            path = f"(not written: {exc})"
        now = time.time()
        stopped = [p for p in self._peers() if now - p.get("alive", 0) > self.stale_s]
        woken = []
        for peer in stopped:
            if peer.get("host") == self._host and _state(peer.get("pid")) == "T":
                try:
                    os.kill(int(peer["pid"]), signal.SIGCONT)  # its own watchdog then writes its stacks
                    woken.append(peer)
                except (OSError, ValueError, KeyError):
                    pass
        said = "; ".join(f"rank {p.get('rank')} (pid {p.get('pid')}, host {p.get('host')}) is not running "
                         f"(stopped, frozen or gone: no heartbeat for {now - p.get('alive', 0):.0f} s), last "
                         f"heartbeat at step {p.get('step')}" for p in stopped)
        what = (f"rank {self.rank} was not running for {not_running_s:.0f} s (stopped or frozen) and was woken"
                if frozen_self else f"rank {self.rank} made no training progress for {idle:.0f} s")
        print(f"hang watchdog: {what} (hang_timeout_s={self.timeout_s:g}, last step {self.step}); it was in "
              f"{_where(main)}" + (f"; {said}" if said else "") + f"; stacks in {path}; exiting with status "
              f"{HANG_EXIT} (start_training.sh --max-restarts or the scheduler brings the run back from the newest "
              f"checkpoint)", file=sys.stderr, flush=True)
        self._flight_recorder(stamp)
        mark_hung(self.rank)
        deadline = time.monotonic() + (WAIT_FOR_PEER_STACKS_S if woken else 0)
        while time.monotonic() < deadline and not all(
                list(self.logs.glob(f"hang-*-rank{p.get('rank')}.txt")) for p in woken):
            time.sleep(0.2)
        os._exit(HANG_EXIT)

    def _flight_recorder(self, stamp: str) -> None:
        """On CUDA with NCCL: the flight recorder's record of the recent collectives, where torch can dump it."""
        try:
            import torch
            import torch.distributed as dist

            if not (torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"):
                return
            trace = torch._C._distributed_c10d._dump_nccl_trace()
            (self.logs / f"nccl-trace-{stamp}-rank{self.rank}.pkl").write_bytes(trace)
        except Exception:  # noqa: BLE001 - best effort: an older torch, no recorder
            pass


def _state(pid) -> str | None:
    """A process's state letter from /proc (T: stopped), None when it is gone."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, TypeError, IndexError):
        return None


def _where(thread_id: int | None) -> str:
    """Where a thread is: its innermost frame, and the innermost one in this repository's code."""
    frame = sys._current_frames().get(thread_id) if thread_id else None
    if frame is None:
        return "(unknown)"
    stack = traceback.extract_stack(frame)
    ours = [f for f in stack if f.filename.startswith(str(REPO_ROOT)) and "/.venv/" not in f.filename
            and "site-packages" not in f.filename]

    def name(f) -> str:
        path = Path(f.filename)
        short = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else Path(*path.parts[-2:])
        return f"{f.name} ({short}:{f.lineno})"

    inner = stack[-1]
    if ours and ours[-1] is not inner:
        return f"{name(inner)}, called from {name(ours[-1])}"
    return name(inner)
