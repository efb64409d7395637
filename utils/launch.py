"""The launcher's supervisor: runs the training command and delivers a scheduler's stop signal to the
training ranks, however the scheduler sends it, then waits for their checkpoint however long it takes.

    python utils/launch.py -- accelerate launch ... train.py ...      (start_training.sh execs this)

Why it exists. `accelerate launch` with one process only Popens train.py and forwards no signal; torchrun
(accelerate's multi-process path) forwards SIGTERM but SIGKILLs the ranks 30 s later, before a 1.2B
checkpoint is on disk; a launcher running as a container's PID 1 ignores SIGTERM it has no handler for;
and a signal to the whole process group (SLURM, systemd, `timeout`, Ctrl-C) used to reach DataLoader
workers and torchrun before train.py could act on it. So:

- the command runs in a session of its own, so a process-group signal reaches only this supervisor;
- SIGTERM, SIGHUP, SIGUSR1 (a common pre-timeout signal on SLURM) and SIGINT are caught here, also as
  PID 1, and forwarded as SIGTERM (SIGINT for Ctrl-C) straight to the ranks, never to torchrun, which then
  simply sees its workers finish: every rank stops at the same optimizer step, rank 0 writes the
  checkpoint, all exit 0. A second Ctrl-C reaches the ranks too, which then stop at once;
- the supervisor is a child subreaper (PID 1 is one anyway): whatever the ranks leave behind is reparented
  here and waited for, so nothing outlives the launcher;
- the last line says how the run ended and names the checkpoint, from the record rank 0 writes to
  `NEOX_STATUS_FILE`. Exit status: 0 for a finished run or a clean stop on a signal, the training's own
  status otherwise (2: a problem the user fixes, already explained on stderr).

Limits: if the supervisor itself is SIGKILLed, nothing is forwarded (the scheduler is then killing the
whole job anyway).
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROG = "start_training.sh"
FORWARDED = {signal.SIGTERM: signal.SIGTERM, signal.SIGHUP: signal.SIGTERM, signal.SIGUSR1: signal.SIGTERM,
             signal.SIGINT: signal.SIGINT}
PR_SET_CHILD_SUBREAPER = 36
LEFTOVER_GRACE_S = 30.0  # non-rank leftovers (e.g. a stuck DataLoader worker) get this long after the ranks


def _children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may hold spaces and parentheses: split after the last ')'
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


class Supervisor:
    def __init__(self, cmd: list[str]):
        self.cmd = cmd
        self.via_launcher = any(k in " ".join(cmd[:4]) for k in ("accelerate", "torchrun", "torch.distributed.run"))
        self.child: subprocess.Popen | None = None
        self.ranks: set[int] = set()
        self.received: list[str] = []

    def ranks_now(self) -> list[int]:
        """The training processes: a launcher's children (accelerate's single-process Popen, or torchrun's
        workers), or the command itself when it runs train.py directly."""
        if self.child is None:
            return []
        if not self.via_launcher:
            return [self.child.pid]
        return _children_of(self.child.pid)

    def on_signal(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        self.received.append(name)
        forward = FORWARDED[signum]
        targets = self.ranks_now()
        self.ranks.update(targets)
        first = len(self.received) == 1
        if first or signum == signal.SIGINT:
            print(f"{PROG}: {name} received: asking {len(targets)} training process(es) to checkpoint and stop "
                  f"after the current step" + ("" if first else " (a second Ctrl-C stops them at once)"),
                  file=sys.stderr, flush=True)
        for pid in targets:
            try:
                os.kill(pid, forward)
            except ProcessLookupError:
                pass

    def run(self) -> int:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # not Linux: orphans go to init as usual
        for signum in FORWARDED:
            signal.signal(signum, self.on_signal)
        fd, status_path = tempfile.mkstemp(prefix="neox-status-", suffix=".json")
        os.close(fd)
        os.unlink(status_path)
        env = dict(os.environ, NEOX_STATUS_FILE=status_path)
        try:
            self.child = subprocess.Popen(self.cmd, env=env, start_new_session=True)
        except OSError as exc:
            print(f"{PROG}: error: cannot start {self.cmd[0]}: {exc}", file=sys.stderr)
            return 1
        code = self._wait_all()
        status = _read_status(status_path)
        try:
            os.unlink(status_path)
        except OSError:
            pass
        return self._report(code, status)

    def _wait_all(self) -> int:
        """Reaps every child (ours and the orphans reparented to us) until none is left; returns the
        command's exit status."""
        code, child_done_at = None, None
        while True:
            if self.child is not None and code is None:
                self.ranks.update(p for p in self.ranks_now() if p != self.child.pid)
            try:
                pid, status = os.waitpid(-1, 0 if code is None else os.WNOHANG)
            except ChildProcessError:
                return code if code is not None else 1
            if pid == 0:  # children left, none finished yet: leftovers after the command ended
                if not (self.ranks & set(_children_of(os.getpid()))) and \
                        time.monotonic() - child_done_at > LEFTOVER_GRACE_S:
                    for leftover in _children_of(os.getpid()):
                        os.kill(leftover, signal.SIGKILL)
                time.sleep(0.2)
                continue
            if pid == self.child.pid:
                code = os.waitstatus_to_exitcode(status)
                child_done_at = time.monotonic()

    def _report(self, code: int, status: dict | None) -> int:
        if code < 0:  # killed by a signal nobody caught
            print(f"{PROG}: training was killed by {signal.Signals(-code).name}", file=sys.stderr)
            return 128 - code
        if not status or status.get("exit_code", code) != 0 or code != 0:
            return code
        if status.get("stopped_by"):
            where = status.get("checkpoint") or "(none written)"
            print(f"{PROG}: stopped by {status['stopped_by']} after step {status.get('step')}; checkpoint {where} "
                  f"(continue with --resume auto)", flush=True)
        elif status.get("final_model"):
            print(f"{PROG}: finished after step {status.get('step')}; last checkpoint {status.get('checkpoint')}, "
                  f"model in {status['final_model']}", flush=True)
        return 0


def _read_status(path: str) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        argv = argv[argv.index("--") + 1:]
    if not argv:
        print(f"usage: python {Path(__file__).name} -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    return Supervisor(argv).run()


if __name__ == "__main__":
    sys.exit(main())
