"""Stopping on SIGTERM/SIGINT at an optimizer-step boundary, every rank at the same step; before the first
step, between setup phases, with nothing to save. Under the launcher, also when the launcher is gone, and
when a rank cannot go on (a failure it names at a step boundary: a data file that stayed unavailable)."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

SUPERVISOR_PID = "NEOX_SUPERVISOR_PID"  # set by utils/runtime/launch.py for the command it supervises
_EARLY: list[str] = []  # signals received after catch_early() and before the StopSignal existed
_SUPERVISOR_LOST: list[str] = []  # why the SIGTERM the watchdog sent came, once it has sent it
_REQUESTED: list[str] = []  # every stop signal this process received (its reason), for waits outside the loop


def stop_requested() -> str | None:
    """The first stop signal this process received, or None: a wait on a background thread (data not yet
    fetched) looks at it between slices of its wait, so that a stop ends the run whatever the thread does."""
    return _REQUESTED[0] if _REQUESTED else None


SIGNAL_SUFFIX = ".signal"  # beside the launcher's status record: the signal it received and forwarded as SIGTERM


def _reason(signum: int) -> str:
    if signum == signal.SIGTERM and _SUPERVISOR_LOST:
        return _SUPERVISOR_LOST[0]
    if signum == signal.SIGTERM and os.environ.get("NEOX_STATUS_FILE"):  # SIGHUP, SIGUSR1 the launcher received
        try:
            with open(os.environ["NEOX_STATUS_FILE"] + SIGNAL_SUFFIX) as f:
                sent = f.read().strip()
            if sent in {s.name for s in signal.Signals}:
                return sent
        except OSError:
            pass
    return signal.Signals(signum).name


def watch_supervisor(interval_s: float = 0.5) -> None:
    """Under the launcher, stop as on SIGTERM once the launcher is gone. Killed with SIGKILL, it forwards
    nothing, and the ranks (children of torchrun or accelerate, which outlive it) would train on as orphans
    holding the output dir's lock. A parent-death signal (PR_SET_PDEATHSIG) cannot tell: it fires when the
    parent dies, and the parent is torchrun, not the launcher above it. So a daemon thread checks that the
    launcher is still among this process's ancestors (a pid reused by another process is not); when it is
    not, the process sends itself SIGTERM, and the run stops at the next step with a checkpoint."""
    pid = os.environ.get(SUPERVISOR_PID, "")
    if not pid.isdigit():
        return

    def watch():
        while not launcher_lost():
            time.sleep(interval_s)
        _SUPERVISOR_LOST.append(launcher_lost())
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()


def launcher_lost() -> str | None:
    """"the loss of its launcher (pid N)" when this process runs under the launcher and it is gone, else None."""
    pid = os.environ.get(SUPERVISOR_PID, "")
    return f"the loss of its launcher (pid {pid})" if pid.isdigit() and int(pid) not in _ancestors() else None


def _ancestors() -> set[int]:
    found, pid = set(), os.getppid()
    while pid and pid not in found:
        found.add(pid)
        pid = parent_pid(pid)
    return found


def parent_pid(pid: int) -> int | None:
    """The parent of process `pid` from /proc (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # pid (comm) state ppid ...; comm may hold spaces and parentheses: split after the last ')'
    return int(stat.rsplit(")", 1)[1].split()[1])


def catch_early() -> None:
    """From here until the StopSignal exists (it needs the process group), SIGTERM/SIGINT are remembered
    instead of killing the process mid-setup; the StopSignal then acts on them. A second SIGINT interrupts."""
    def remember(signum, frame):
        _EARLY.append(_reason(signum))
        _REQUESTED.append(_reason(signum))
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGTERM, remember)
    signal.signal(signal.SIGINT, remember)


class StoppedInSetup(Exception):
    """A stop signal before the first training step: the run ends at once, exit 0, nothing to save."""

    def __init__(self, reason: str, phase: str):
        super().__init__(f"stopped by {reason} during setup ({phase}) before any training step; nothing to save")
        self.reason, self.phase = reason, phase


class StopSignal:
    """SIGTERM/SIGINT set a flag; the loop stops after the current optimizer step. With several processes
    the flag is all-reduced over a CPU (gloo) group, so every rank stops at the same step and the check
    never synchronises the GPU. A second SIGINT interrupts at once. A `failure` handed to agreed() stops
    every rank the same way; `failed` then says so (the run exits non-zero)."""

    def __init__(self, distributed: bool):
        import torch.distributed as dist

        self.requested = bool(_EARLY)
        self.signal_name = _EARLY[0] if _EARLY else None
        self.failed = False
        self._group = dist.new_group(backend="gloo") if distributed else None
        signal.signal(signal.SIGTERM, self._handle)
        if "SIGINT" not in _EARLY:  # after one Ctrl-C, the next one interrupts at once
            signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        self.requested = True
        self.signal_name = _reason(signum)
        _REQUESTED.append(self.signal_name)
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def agreed(self, failure: str | None = None) -> bool:
        """Whether any rank asks to stop. `failure`: this rank cannot go on, and the line says why (a rank other
        than 0 prints it: rank 0 alone writes the log)."""
        if failure is not None and not self.failed:
            self.requested, self.failed, self.signal_name = True, True, failure
        if self._group is None:
            return self.requested
        import torch
        import torch.distributed as dist

        if failure is not None and dist.get_rank() != 0:
            print(f"rank {dist.get_rank()}: {failure}", file=sys.stderr, flush=True)
        flag = torch.tensor([2 if self.failed else 1 if self.requested else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if flag.item() == 2 and not self.failed:
            self.failed, self.signal_name = True, "a failure on another rank (its line above names it)"
        return bool(flag.item())

    def end_setup_if_asked(self, phase: str) -> None:
        """Between setup phases (every rank calls it at the same points): raises StoppedInSetup when a stop
        was asked for on any rank."""
        if self.agreed():
            raise StoppedInSetup(self.reason, phase)

    @property
    def reason(self) -> str:
        # a stop agreed before this rank's own watcher saw its launcher go: the same cause, said as such
        return self.signal_name or launcher_lost() or "a signal on another rank"
