"""The launcher's supervisor: runs the training command and delivers a scheduler's stop signal to the
training ranks, however the scheduler sends it, then waits for their checkpoint however long it takes.

    python utils/runtime/launch.py -- accelerate launch ... train.py ...      (start_training.sh starts this)

Why it exists. `accelerate launch` with one process only Popens train.py and forwards no signal; torchrun
(accelerate's multi-process path) forwards SIGTERM but SIGKILLs the ranks 30 s later, before a 1.2B
checkpoint is on disk; a launcher running as a container's PID 1 ignores SIGTERM it has no handler for;
and a signal to the whole process group (SLURM, systemd, `timeout`, Ctrl-C) used to reach DataLoader
workers and torchrun before train.py could act on it. So:

- the command runs in a session of its own, so a process-group signal reaches only this supervisor;
- SIGTERM, SIGHUP, SIGUSR1 (a common pre-timeout signal on SLURM) and SIGINT are caught here, also as
  PID 1, and forwarded as SIGTERM (SIGINT for Ctrl-C) straight to the ranks, never to torchrun, which then
  simply sees its workers finish: every rank stops at the same optimizer step, rank 0 writes the
  checkpoint, all exit 0. A second Ctrl-C reaches the ranks too, which then stop at once. A rank gets the
  signal once it acts on it (it catches SIGTERM: the engine's handlers, not Python's default SIGINT one);
  the main thread never blocks for long and the helper threads block these signals, so a signal's handler
  runs within a fraction of a second whenever it comes;
- the supervisor is a child subreaper (PID 1 is one anyway): whatever the ranks leave behind is reparented
  here and waited for, so nothing outlives the launcher;
- the last line says how the run ended and names the checkpoint, from the record each node's first rank writes
  to `NEOX_STATUS_FILE` (utils/runtime/run_status.py). Exit status: 0 for a finished run or a clean stop on a
  signal, train.py's own status otherwise (2: a problem the user fixes, already explained on stderr in one
  `error:` line; 3: the hang watchdog ended a rank, which any rank marks beside the record), not the launcher's
  (accelerate and torchrun exit 1 whatever their rank's status). A command that exits 0 without a record saying
  exit 0 ended before its run finished (a rank that exited halfway, whatever its status): one `error:` line,
  exit 1 (a failure, restarted under --max-restarts like any other after a training step);
  `--stop-exit-code N` makes a stop signal's clean end N where the run did not finish (a Kubernetes Job takes
  a pod that exits 0 as done): on every node, since every rank marks such a stop beside the record;
- the command's stderr passes through `StderrFilter` (with its stdout, over a pseudo-terminal, when ours is
  a terminal, so progress bars still draw and stay in order with the log lines), which leaves out the
  traceback accelerate or torchrun print after a rank failed: that rank has already said what went wrong.

- the ranks get the pid to watch (`NEOX_SUPERVISOR_PID`: start_training.sh's, else this supervisor's): if it
  is SIGKILLed, so that it can forward nothing, each rank notices (utils/runtime/signals.py `watch_supervisor`) and
  stops as on SIGTERM, with a checkpoint. This supervisor watches start_training.sh too, and once it is gone
  restarts nothing (a restart's wait ends at once): nobody would be watching the run it started;
- a rank killed by a signal (SIGKILL, the OOM killer) is one line naming it and the signal, not the other
  ranks' tracebacks about the peer they lost, nor torchrun's report;
- a console that goes away (`| tee log` and Ctrl-C, a closed terminal) never stops it (utils/io/console.py).

Restarts inside the allocation (`--max-restarts N`, `--restart-delay S`). When the command fails after a
training step (a rank killed by SIGKILL or the OOM killer, a CUDA error, a lost peer, the hang watchdog's
exit), the supervisor kills what is left of it at once (torchrun has already ended the other ranks) and
launches the same command again with `--resume auto`, so every rank continues from the newest complete
checkpoint; up to N times, waiting S, 2S, 4S ... (at most 300 s) in between. Each restart is one line on
stderr; the ranks see the count in `NEOX_RESTART_COUNT` and rank 0's status record carries it (`restarts`);
N exhausted, the last line names the restarts and the exit status is the failure's. Never restarted: a stop
signal (it checkpoints and exits 0; one during the backoff ends the launcher, exit 0), the loss of
start_training.sh (likewise), a user error (exit 2), and a failure before the first training step of a
launch (a setting, a missing file: it would fail again; rank 0 marks the first step beside the status file,
`mark_trained`).
Why not torchrun's own `--max-restarts`: it relaunches the workers with the same arguments (no `--resume
auto`: a fresh run would start over, or be refused by its own output folder), it retries every non-zero
exit, a user error's exit 2 and a failure during setup included, it cannot read the status record that says
which is which, and `accelerate launch` of one process does not go through torchrun at all, so one GPU or one
CPU process would get no restarts. Restarting the whole command here serves all of them the same way.
"""
from __future__ import annotations

import signal

_EARLY_STOPS: list[int] = []  # stop signals that came before the supervisor had started anything
if __name__ == "__main__":  # caught from the first line (start_training.sh holds one that comes before)
    for _signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGINT):
        signal.signal(_signum, lambda signum, _frame: _EARLY_STOPS.append(signum))

import ctypes
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from utils.io.console import survive_lost_console
from utils.runtime.run_status import (
    HANG_EXIT,
    HUNG_SUFFIX,
    RESTARTS_ENV,
    STATUS_FILE_ENV,
    STOPPED_SUFFIX,
    TRAINED_SUFFIX,
    RunStatus,
    hung_ranks,
)
from utils.runtime.signals import SIGNAL_SUFFIX, SUPERVISOR_PID, parent_pid
from utils.settings import Bounds, parse_number

PROG = "start_training.sh"
FORWARDED = {signal.SIGTERM: signal.SIGTERM, signal.SIGHUP: signal.SIGTERM, signal.SIGUSR1: signal.SIGTERM,
             signal.SIGINT: signal.SIGINT}
PR_SET_CHILD_SUBREAPER = 36
LEFTOVER_GRACE_S = 30.0  # non-rank leftovers (e.g. a stuck DataLoader worker) get this long after the ranks
LATE_RANK_WAIT_S = 600.0  # how long a stop signal waits for ranks that are still starting
MAX_RESTART_DELAY_S = 300.0  # the backoff between restarts doubles up to this
WAIT_POLL_S = 0.2  # how often the main thread looks for children that ended (and runs a signal's handler)


class StderrFilter:
    """Copies the command's stderr to `sink` as it comes, leaving out what only repeats a rank's failure:
    a launcher's traceback after a failed rank (its last line `subprocess.CalledProcessError: ...` from
    accelerate or `...ChildFailedError` from torchrun) and everything after it (torchrun's failure report,
    read for the rank a signal killed: `killed_rank`), a rank's traceback for a peer it lost (the rank that
    died is named instead; its last line is kept in `peer_lost`), torchrun's log lines about stopping the
    other ranks and about a rank's exit status (the rank said why) or a signal, an `error:`
    line another rank already printed, C++ stack dumps (`Exception raised from ...` and its `frame #N`
    lines), and, on a node whose ranks all finished, torchrun's traceback for an exit barrier that node 0's
    launcher left first (it ended the run with another status): one line says that instead. Other
    tracebacks pass through whole (also those torch prefixes with `[rankN]: `)."""

    START = b"Traceback (most recent call last):"
    LAUNCHER_ERRORS = (b"subprocess.CalledProcessError:",
                       b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError")
    NOISE = re.compile(rb"torch/distributed/elastic/multiprocessing/api\.py:\d+\] "
                       rb"(Sending process (\d+) closing signal|failed \(exitcode: -?\d+\))")
    RANK_PREFIX = re.compile(rb"^\[rank\d+\]: ")  # torch's excepthook, once a process group exists
    PARTIAL_RANK_PREFIX = re.compile(rb"\[(r(a(n(k(\d+(\](:)?)?)?)?)?)?)?")
    PEER_LOST = re.compile(rb"Connection (closed|reset) by peer")  # gloo's words for a rank that died
    DIED_WITH = re.compile(rb"died with <Signals\.\w+: (\d+)>")  # accelerate's one-process launch
    ROOT_CAUSE = b"Root Cause (first observed failure):"  # torchrun's report: then `rank`, `exitcode` fields
    REPORT_FIELD = re.compile(rb"^\s+(rank|exitcode)\s*: (-?\d+) \((?:local_rank|pid): (\d+)\)")
    CPP_DUMP = b"Exception raised from "  # ... (most recent call first):, then frame lines up to a blank line
    EXIT_BARRIER = re.compile(rb"(elastic/agent/server/api\.py:\d+\] )Error waiting on exit barrier")
    EXIT_BARRIER_SAID = (b"note: this node's processes finished, but node 0's launcher had already exited (the "
                         b"run's status is on node 0), so torchrun's exit barrier was not met; nothing was lost\n")

    def __init__(self, sink):
        self.sink = sink
        self.errors_shown: set[bytes] = set()
        self.partial = b""  # the end of an incomplete line, held back only while it may start a traceback
        self.held: list[bytes] | None = None  # the traceback being read
        self.dropping = False
        self.in_cpp_dump = False
        self.barrier_log: bytes | None = None  # the log-record prefix of an exit-barrier report being dropped
        self.held_prefix = b""  # a held traceback's `[rankN]: `: other lines may come between its lines
        self.killed_rank: tuple[int, int | None, int] | None = None  # (rank, pid, signal) of the root cause
        self.peer_lost: str | None = None
        self._in_root_cause, self._report_rank = False, None
        self._closed_pids: set[int] = set()  # ranks torchrun itself signalled after the first failure it saw
        self._other_kills: list[tuple[int, int, int]] = []  # the report's other failures by a signal

    def feed(self, data: bytes) -> None:
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            self._line(line + b"\n")
        if self.held is None and not self.dropping:
            # an incomplete line is shown at once (a progress bar's `\r...` updates), all but what may yet
            # become "Traceback ..." (or "[rankN]: Traceback ...")
            head, sep, last = self.partial.rpartition(b"\r")
            keep = last if last and self._may_start_traceback(last) else b""
            self._write(self.partial[:len(self.partial) - len(keep)])
            self.partial = keep

    def _line(self, line: bytes) -> None:
        text = line.lstrip(b"\r")
        if self.dropping:
            self._read_failure_report(text)
            return
        if self._torch_noise(text):
            return
        if self.held is None or (self.held_prefix and text.strip() and not text.startswith(self.held_prefix)):
            self._plain(line, text)
            return
        self.held.append(line)
        bare = text[len(self.held_prefix):]
        if bare.strip() and not bare.startswith((b" ", b"\t")):  # the exception line ends the traceback
            if bare.startswith(self.LAUNCHER_ERRORS):
                self.dropping = True
                died = self.DIED_WITH.search(bare)
                if died:
                    self.killed_rank = (0, None, int(died.group(1)))
            elif self.PEER_LOST.search(bare):
                self.peer_lost = bare.strip().decode(errors="replace")
            else:
                self._write(b"".join(self.held))
            self.held = None

    def _may_start_traceback(self, partial: bytes) -> bool:
        prefix = self.RANK_PREFIX.match(partial)
        if prefix is None and self.PARTIAL_RANK_PREFIX.fullmatch(partial):
            return True
        return self.START.startswith(partial[prefix.end():] if prefix else partial)

    def _plain(self, line: bytes, text: bytes) -> None:
        """A line outside a held traceback: shown, unless it starts one, repeats an error or is noise."""
        prefix = self.RANK_PREFIX.match(text)
        prefix = prefix.group(0) if prefix else b""
        if self.held is None and text[len(prefix):].startswith(self.START):
            self.held, self.held_prefix = [line], prefix
        elif text.startswith(b"error: ") and text in self.errors_shown:
            pass
        elif noise := self.NOISE.search(text):
            if noise.group(2):
                self._closed_pids.add(int(noise.group(2)))
        else:
            if text.startswith(b"error: "):
                self.errors_shown.add(text)
            self._write(line)

    def _read_failure_report(self, text: bytes) -> None:
        """torchrun's report after its traceback: the rank, pid and exit code (negative: the signal that killed
        it) of each failure. The root cause is the one named, unless it exited with a status while another rank
        was killed by a signal torchrun did not send: torchrun picks its "first observed failure" by a timestamp
        in whole seconds, so a rank SIGKILLed and the rank whose collective then failed ("Connection reset by
        peer", exit 1) tie, and the tie goes to the lower rank: the killed one is the cause."""
        if text.startswith(self.ROOT_CAUSE):
            self._in_root_cause = True
        field = self.REPORT_FIELD.match(text)
        if not field:
            return
        value, extra = int(field.group(2)), int(field.group(3))
        if field.group(1) == b"rank":
            self._report_rank = value
            return
        if self._report_rank is None:
            return
        if not self._in_root_cause:
            if value < 0 and extra not in self._closed_pids:
                self._other_kills.append((self._report_rank, extra, -value))
        elif value < 0:
            self.killed_rank = (self._report_rank, extra, -value)
        elif self._other_kills:
            self.killed_rank = self._other_kills[0]
        self._report_rank = None

    def _torch_noise(self, text: bytes) -> bool:
        """C++ stack dumps and an unmet exit barrier's report (see the class docstring): dropped."""
        if self.in_cpp_dump:
            self.in_cpp_dump = bool(text.strip())
            return True
        if text.startswith(self.CPP_DUMP) and text.rstrip().endswith(b"(most recent call first):"):
            self.in_cpp_dump = True
            return True
        if self.barrier_log is not None:
            if self.barrier_log in text:
                return True
            self.barrier_log = None
        found = self.EXIT_BARRIER.search(text)
        if found:
            self.barrier_log = found.group(1)
            self._write(self.EXIT_BARRIER_SAID)
            return True
        return False

    def close(self) -> None:
        if not self.dropping:
            self._write(b"".join(self.held or []) + self.partial)
        self.held, self.partial = None, b""

    def _write(self, data: bytes) -> None:
        if data:
            try:
                self.sink.write(data)
                self.sink.flush()
            except (OSError, ValueError):
                pass  # our stderr is gone (a closed terminal): nothing to show it on

    def pump(self, fd: int) -> None:
        """Reads `fd` until its writers are all gone (EOF, or EIO from a pseudo-terminal), then closes it."""
        try:
            while True:
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    break
                if not data:
                    break
                self.feed(data)
        finally:
            self.close()
            os.close(fd)


def _same_terminal() -> bool:
    try:
        return sys.stdout.isatty() and sys.stderr.isatty() and \
            os.path.samestat(os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno()))
    except (OSError, ValueError):
        return False


def _stderr_channel() -> tuple[int, int, bool]:
    """(read end, write end, merged) for the command's output. On a terminal (our stdout and stderr the same
    one): a pseudo-terminal of its size for both the command's stdout and stderr, so train.py still sees a
    terminal and draws its progress bar, and its log lines and the bar's redraws keep their order. Else a
    pipe for its stderr alone (its stdout stays ours)."""
    if not _same_terminal():
        read_end, write_end = os.pipe()
        return read_end, write_end, False
    import fcntl
    import pty
    import termios
    import tty

    master, slave = pty.openpty()
    tty.setraw(slave)  # bytes through unchanged (no \n -> \r\n); our own terminal translates as it shows them
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, fcntl.ioctl(sys.stderr.fileno(), termios.TIOCGWINSZ, b"\0" * 8))
    except OSError:
        pass
    return master, slave, True


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (the SigCgt mask in its /proc status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _cmdline(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def _acts_on(pid: int, signum: int) -> bool:
    """Whether training process `pid` acts on the stop signal `signum`: it catches SIGTERM, which the engine's
    handlers do from main()'s start (utils/runtime/signals.py catch_early, with SIGINT's), and `signum`. SIGINT caught
    alone is Python's default handler, there from the interpreter's start: a SIGINT then is a KeyboardInterrupt
    in whatever the rank is importing. And it has exec'd: between fork and exec a rank is a copy of its parent
    (torchrun's agent or this supervisor, which catch both signals), with the parent's command line and its
    handlers in SigCgt, while CPython's subprocess blocks every signal there and resets the handlers to the
    default before it unblocks them: a signal sent then kills the rank (the fresh-clone CI run saw rank 1 of
    a 2-rank launch "killed by SIGINT" at a Ctrl-C 0.7 s in)."""
    if not (_catches(pid, signal.SIGTERM) and _catches(pid, signum)):
        return False
    parent = parent_pid(pid)
    own = _cmdline(pid)
    return own is not None and parent is not None and own != _cmdline(parent)


def _start_thread(target, *args) -> threading.Thread:
    """A daemon thread that never takes the stop signals. POSIX lets the kernel hand a signal sent to this
    process to any thread that does not block it (Linux prefers the main thread, without promising it), and
    Python runs the handler only when the main thread next runs Python code: the main thread, blocked in
    waitpid() for the whole run, would not be woken, and the signal would wait for the run's end. A thread
    starts with its creator's signal mask, so the signals are blocked around its start."""
    stops = set(FORWARDED)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    try:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return thread


def _children_of(pid: int) -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and parent_pid(int(entry)) == pid]


LAUNCHER_PID = "NEOX_LAUNCHER_PID"  # start_training.sh's own pid, which it sets for this supervisor


def watched_launcher() -> str:
    """The pid the ranks watch (utils/runtime/signals.py watch_supervisor): start_training.sh's when it started this
    supervisor (a `kill -9` of the launcher the user started then stops the run with a checkpoint, as one of
    the supervisor did when the script exec'd it), else this supervisor's."""
    launcher = started_by_launcher()
    return str(launcher or os.getpid())


def started_by_launcher() -> int | None:
    """start_training.sh's pid when it started this supervisor (NEOX_LAUNCHER_PID is our parent), else None."""
    launcher = os.environ.get(LAUNCHER_PID, "")
    return int(launcher) if launcher.isdigit() and int(launcher) == os.getppid() else None


@dataclass
class Launch:
    """How one launch of the command ended: its exit status, its node's status record, what its output said,
    whether a rank finished a training step, the ranks the hang watchdog ended (first to fire first), whether a
    stop signal ended it before the run finished, and, for a command that exited 0 before its run finished, what
    says so (`code` is then a failure's)."""
    code: int
    status: RunStatus | None
    output: StderrFilter
    trained: bool
    hung: list[int]
    stopped: bool = False
    ended_early: str | None = None


class Supervisor:
    def __init__(self, cmd: list[str], max_restarts: int = 0, restart_delay: float = 10.0, stop_exit_code: int = 0):
        self.cmd = cmd
        self.max_restarts, self.restart_delay = max_restarts, restart_delay
        self.stop_exit_code = stop_exit_code  # the status of a stop signal's clean end before the run finished
        self.via_launcher = any(k in " ".join(cmd[:4]) for k in ("accelerate", "torchrun", "torch.distributed.run"))
        self.child: subprocess.Popen | None = None
        self.ranks: set[int] = set()
        self.received: list[str] = []
        self.status_path: str | None = None
        self.delivered: set[int] = set()  # ranks a stop signal reached
        self.child_done = threading.Event()
        self.launcher_lost: str | None = None  # start_training.sh is gone (kill -9): nothing is restarted

    @property
    def stopped_by(self) -> str | None:
        """What ended the run from outside: the first stop signal, or the loss of the launcher script."""
        return self.received[0] if self.received else self.launcher_lost

    def watch_launcher(self, launcher: int, interval_s: float = 0.2) -> None:
        """start_training.sh, our parent, killed with SIGKILL: its caller saw the run end, so nothing may start
        again behind it, holding the output folder's lock and the devices with nobody watching. The ranks stop
        with a checkpoint on their own (each watches the script: utils/runtime/signals.py watch_supervisor); this
        supervisor restarts nothing, ends a restart's wait at once, and exits once they have."""
        while os.getppid() == launcher:
            time.sleep(interval_s)
        self.launcher_lost = f"the loss of its launcher (pid {launcher})"
        print(f"{PROG}: the launcher script (pid {launcher}) is gone: no restart; any training process stops with "
              f"a checkpoint", file=sys.stderr, flush=True)

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
        if len(self.received) == 1 and forward != signum and self.status_path:  # the ranks name the signal sent
            try:
                Path(self.status_path + SIGNAL_SUFFIX).write_text(name)  # before they get it as SIGTERM
            except OSError:
                pass
        targets = self.ranks_now()
        self.ranks.update(targets)
        first = len(self.received) == 1
        if first or signum == signal.SIGINT:
            print(f"{PROG}: {name} received: asking {len(targets) or 'the'} training process(es) to checkpoint and "
                  f"stop after the current step" + ("" if first else " (a second Ctrl-C stops them at once)"),
                  file=sys.stderr, flush=True)
        for pid in targets:
            if _acts_on(pid, forward):
                self._deliver(pid, forward)
        if first:  # ranks not started yet, or not yet catching it: they get it as soon as they can act on it
            _start_thread(self._forward_to_late_ranks, forward)

    def _forward_to_late_ranks(self, forward: int) -> None:
        """A stop signal that came while accelerate was still starting the ranks, or before a rank had
        installed its handler (Python's default for SIGTERM is to die mid-setup, its default for SIGINT a
        KeyboardInterrupt): every rank gets it once its /proc status says it acts on it (`_acts_on`), for as
        long as the command runs."""
        deadline = time.monotonic() + LATE_RANK_WAIT_S
        while not self.child_done.is_set() and time.monotonic() < deadline:
            for pid in self.ranks_now():
                if pid not in self.delivered and _acts_on(pid, forward):
                    self.ranks.add(pid)
                    self._deliver(pid, forward)
            time.sleep(0.1)

    def _deliver(self, pid: int, signum: int) -> None:
        self.delivered.add(pid)
        try:
            os.kill(pid, signum)
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
        launcher = started_by_launcher()
        if launcher:
            _start_thread(self.watch_launcher, launcher)
        if _EARLY_STOPS:
            print(f"{PROG}: stopped by {_signal_name(_EARLY_STOPS[0])} before training started; nothing to save",
                  file=sys.stderr)
            return self.stop_exit_code
        restarts = 0
        while True:
            launched = self._launch(restarts)
            if isinstance(launched, int):
                return launched
            why = self._restartable(launched)
            if why is None or restarts >= self.max_restarts:
                result = self._report(launched, restarts)
                if result == 0 and launched.stopped:
                    result = self.stop_exit_code
                if why is not None and self.max_restarts:
                    print(f"{PROG}: gave up after {restarts} restart(s) (--max-restarts {self.max_restarts}): {why}; "
                          f"continue from the newest checkpoint with --resume auto", file=sys.stderr, flush=True)
                return result
            restarts += 1
            delay = min(self.restart_delay * 2 ** (restarts - 1), MAX_RESTART_DELAY_S)
            print(f"{PROG}: {why}; restart {restarts} of {self.max_restarts} in {delay:g} s: every rank again with "
                  f"--resume auto (the newest complete checkpoint)", file=sys.stderr, flush=True)
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline and not self.stopped_by:
                time.sleep(0.1)
            if self.stopped_by:
                print(f"{PROG}: stopped by {self.stopped_by} before restart {restarts}; nothing running, nothing "
                      f"more to save (continue with --resume auto)", file=sys.stderr, flush=True)
                return self.stop_exit_code

    def _restartable(self, launch: Launch) -> str | None:
        """Why this launch's end deserves a restart (what went wrong, in words), or None: it finished or
        stopped cleanly, it was stopped by a signal or lost its launcher script (never retried), it failed on a
        setting or input (exit 2) or before its first training step (a restart would fail the same way), or
        restarts are off."""
        code, status, output = launch.code, launch.status, launch.output
        if not self.max_restarts or code == 0 or self.stopped_by:
            return None
        if code == 2 or (status is not None and status.exit_code == 2):
            return None
        if not launch.trained:
            print(f"{PROG}: not restarting: the run failed before its first training step (a setting, a missing "
                  f"file or the machine; a restart would fail the same way)", file=sys.stderr, flush=True)
            return None
        if output.killed_rank is not None:
            rank, pid, signum = output.killed_rank
            return f"rank {rank}{f' (pid {pid})' if pid else ''} was killed by {_signal_name(signum)}"
        if code < 0:
            return f"training was killed by {_signal_name(-code)}"
        if launch.hung:
            return f"the hang watchdog ended rank {launch.hung[0]} (exit status {HANG_EXIT})"
        if launch.ended_early:
            return launch.ended_early
        return f"training failed (exit status {status.exit_code if status and status.exit_code else code})"

    def _launch(self, restarts: int) -> Launch | int:
        """One launch of the command (after a restart: with --resume auto), or an exit status when it could not
        start."""
        self.child, self.ranks, self.delivered = None, set(), set()
        self.child_done = threading.Event()
        fd, status_path = tempfile.mkstemp(prefix="neox-status-", suffix=".json")
        os.close(fd)
        os.unlink(status_path)
        self.status_path = status_path
        env = dict(os.environ, **{STATUS_FILE_ENV: status_path, SUPERVISOR_PID: watched_launcher(),
                                  RESTARTS_ENV: str(restarts)})
        cmd = self.cmd + (["--resume", "auto"] if restarts else [])  # the last --resume wins (argparse)
        read_end, write_end, merged = _stderr_channel()
        try:
            self.child = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=write_end,
                                          stdout=write_end if merged else None)
        except OSError as exc:
            print(f"{PROG}: error: cannot start {cmd[0]}: {exc}", file=sys.stderr)
            return 1
        finally:
            os.close(write_end)
        sink = (sys.stdout if merged else sys.stderr).buffer
        output = StderrFilter(sink)
        pump = _start_thread(output.pump, read_end)
        code = self._wait_all()
        pump.join(timeout=5)  # every writer has exited: the rest of its output is already in the channel
        status = RunStatus.read(status_path)
        launch = Launch(code, status, output, os.path.exists(status_path + TRAINED_SUFFIX), hung_ranks(status_path),
                        os.path.exists(status_path + STOPPED_SUFFIX))
        if code == 0 and (status is None or status.exit_code):  # exit 0, but the run did not say it ended well
            launch.code = status.exit_code if status else 1
            launch.ended_early = ("training exited with status 0 before its run finished ("
                                  + ("no status record" if status is None else
                                     f"its status record says exit status {status.exit_code}")
                                  + ": no final model, no stop): a process ended early")
        for suffix in ("", SIGNAL_SUFFIX, TRAINED_SUFFIX, HUNG_SUFFIX, STOPPED_SUFFIX):
            try:
                os.unlink(status_path + suffix)
            except OSError:
                pass
        return launch

    def _wait_all(self) -> int:
        """Reaps every child (ours and the orphans reparented to us) until none is left; returns the
        command's exit status. Polled, never blocked in waitpid(): Python runs a signal's handler in the main
        thread between two bytecodes, and a signal that came just before a blocking waitpid() (or that another
        thread took) would wait for the next child to end, with the run training on; so a stop signal is acted
        on within WAIT_POLL_S whenever it comes."""
        code, child_done_at, reaped = None, None, True
        while True:
            if self.child is not None and code is None and reaped:
                self.ranks.update(p for p in self.ranks_now() if p != self.child.pid)
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return code if code is not None else 1
            reaped = pid != 0
            if pid == 0 and code is None:
                time.sleep(WAIT_POLL_S)
                continue
            if pid == 0:  # children left, none finished yet: leftovers after the command ended
                restart_may_follow = code != 0 and self.max_restarts and not self.stopped_by
                if restart_may_follow or not (self.ranks & set(_children_of(os.getpid()))) and \
                        time.monotonic() - child_done_at > LEFTOVER_GRACE_S:
                    for leftover in _children_of(os.getpid()):
                        os.kill(leftover, signal.SIGKILL)
                time.sleep(WAIT_POLL_S)
                continue
            if pid == self.child.pid:
                self.child_done.set()
                code = os.waitstatus_to_exitcode(status)
                child_done_at = time.monotonic()

    def _report(self, launch: Launch, restarts: int = 0) -> int:
        code, status, output = launch.code, launch.status, launch.output
        if code != 0 and self.stopped_by and status is not None and not status.exit_code and \
                (status.stopped_by or status.final_model):
            # the stop signal reached accelerate/torchrun too (Slurm's scancel and preemption signal every process
            # of the step) and ended it, while the ranks stopped cleanly at a checkpoint, or had just finished and
            # exported the model: that is the run's end
            code = 0
        if code < 0:  # killed by a signal nobody caught
            print(f"{PROG}: training was killed by {_signal_name(-code)}", file=sys.stderr)
            return 128 - code
        if code != 0 and output.killed_rank is not None:
            rank, pid, signum = output.killed_rank
            saved = status.checkpoint if status else None
            print(f"{PROG}: rank {rank}{f' (pid {pid})' if pid else ''} was killed by {_signal_name(signum)}, and "
                  f"the other ranks stopped with it; " + (f"last checkpoint {saved}; " if saved else "") +
                  "continue from the newest checkpoint with --resume auto", file=sys.stderr, flush=True)
            return 128 + signum
        if code != 0 and launch.hung:
            return HANG_EXIT  # the rank's watchdog said which and where; accelerate and torchrun exit 1 for it
        if code != 0 and output.peer_lost is not None:
            print(f"{PROG}: a rank lost its connection to the others: {output.peer_lost}", file=sys.stderr, flush=True)
        if launch.ended_early:
            print(f"{PROG}: error: {launch.ended_early}; continue from the newest checkpoint with --resume auto",
                  file=sys.stderr, flush=True)
            return code
        if status and status.exit_code:
            return int(status.exit_code)  # train.py's own status, not the launcher's (accelerate: always 1)
        if not status or code != 0:
            return code
        if status.stopped_by and status.step is None:
            print(f"{PROG}: stopped by {status.stopped_by} during setup, before any training step; nothing to "
                  f"save", flush=True)
        elif status.stopped_by:
            where = status.checkpoint or "(none written)"
            print(f"{PROG}: stopped by {status.stopped_by} after step {status.step}; checkpoint {where} "
                  f"(continue with --resume auto)", flush=True)
        elif status.final_model:
            print(f"{PROG}: finished after step {status.step}; last checkpoint {status.checkpoint}, "
                  f"model in {status.final_model}" + (f" ({restarts} restart(s))" if restarts else ""), flush=True)
        return 0


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    options, argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else ([], argv)
    usage = (f"usage: python utils/runtime/{Path(__file__).name} [--max-restarts N] [--restart-delay S] "
             f"[--stop-exit-code N] -- COMMAND [ARGS...] (start_training.sh runs it for you)")
    if not argv:
        print(f"{Path(__file__).name}: error: no command to run; {usage}", file=sys.stderr)
        return 2
    settings = {"--max-restarts": 0, "--restart-delay": 10.0, "--stop-exit-code": 0}
    while options:
        name, value = options.pop(0), options.pop(0) if options else ""
        try:
            settings[name] = parse_number(value, type(settings[name]).__name__, Bounds("[0, inf)"))
            if name == "--stop-exit-code" and settings[name] > 255:
                raise ValueError
        except (KeyError, ValueError):
            print(f"{Path(__file__).name}: error: {name} {value!r}: expected --max-restarts N (a whole number), "
                  f"--restart-delay S (seconds, >= 0) or --stop-exit-code N (0..255); {usage}", file=sys.stderr)
            return 2
    survive_lost_console()
    return Supervisor(argv, settings["--max-restarts"], settings["--restart-delay"], settings["--stop-exit-code"]).run()


if __name__ == "__main__":
    sys.exit(main())
