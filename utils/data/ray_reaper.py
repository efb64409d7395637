"""Ray's local processes go with the prepare that started them (`python -m utils.data.ray_reaper DIR`).

A local Ray (`--executor ray` without `--ray-address`) runs a GCS server, a raylet, agents, a log monitor
and workers as processes of their own, which outlive a driver killed with SIGKILL (or the OOM killer): nothing
in Ray ends them then. So RayExecutor starts Ray under a temp dir of its own (DIR) and this small process
beside it, in a session of its own, reading its stdin: the driver holds the other end of that pipe, and the
kernel closes it however the driver ends. At EOF every process of the session (whose command line names DIR,
under those, or seen under the driver while it lived: Ray's agents retitle themselves) gets SIGTERM, then
SIGKILL 3 s later, and DIR is removed. After a clean
`ray.shutdown()` there is nothing left to end, and only DIR goes.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import time


def _table() -> dict[int, tuple[int, str, bytes]]:
    """pid -> (parent pid, start time, command line) of every process (Linux's /proc)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                table[int(entry)] = (int(fields[1]), fields[19].decode(), f.read())
        except (OSError, IndexError, ValueError):
            continue
    return table


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def _descendants(table: dict, roots: set[int]) -> set[int]:
    found, grew = set(roots), True
    while grew:
        grew = False
        for pid, (parent, _, _) in table.items():
            if parent in found and pid not in found:
                found.add(pid)
                grew = True
    return found


class Session:
    """The processes of one Ray session: whatever names DIR in its command line, everything under those,
    and everything seen under the driver while it lived (Ray's agents retitle themselves, and lose their
    parent when the raylet goes first)."""

    def __init__(self, directory: str, driver: int):
        self.needle, self.driver = directory.encode(), driver
        self.seen: dict[int, str] = {}  # pid -> start time (a pid reused later is not ours)

    def watch(self) -> None:
        table = _table()
        for pid in _descendants(table, {self.driver}) - {self.driver, os.getpid()}:
            if b"ray" in table[pid][2]:  # Ray's own (the driver may be a process with other children)
                self.seen[pid] = table[pid][1]

    def alive(self) -> list[int]:
        table = _table()
        named = {pid for pid, (_, _, cmdline) in table.items() if self.needle in cmdline}
        ours = set()
        if self.driver not in table or _zombie(self.driver):  # it died: what it left (a live one shut Ray down)
            ours = {pid for pid, start in self.seen.items() if pid in table and table[pid][1] == start}
        return sorted(_descendants(table, named | ours) - {os.getpid(), self.driver})


def end_session(session: Session, directory: str, grace_s: float = 3.0) -> None:
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        pids = session.alive()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and session.alive():
            time.sleep(0.1)
    shutil.rmtree(directory, ignore_errors=True)


def main() -> int:
    import select

    directory = sys.argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the driver's terminal is the driver's
    session = Session(directory, os.getppid())
    stdin = sys.stdin.buffer.raw
    try:
        while True:
            session.watch()
            ready, _, _ = select.select([stdin], [], [], 1.0)
            if ready and not stdin.read(1 << 16):  # the driver's end closed: it ended, one way or another
                break
    except OSError:
        pass
    end_session(session, directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
