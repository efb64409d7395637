"""Sharing the cores (issue 51): while other programs use the cores a CPU run computes on, its OpenMP threads
keep to fewer of them and stop spinning; when the cores are free again they spread out and spin as before.

Why: torch's intra-op threads split every parallel region (a matrix product, a reduction) between them and
meet at its end. Beside another busy program each thread holds a core for only part of the time, so a region
lasts until the slowest thread is scheduled again, and a thread that spins while it waits burns the slice its
partner needs: beside two busy loops the demo trained at 0.15x its idle speed with two spinning threads, and a
bounded spin alone (GOMP_SPINCOUNT=1000) kept 0.69-0.77x of one thread while losing 15-25% idle. The thread
count itself cannot follow the load: it changes fp32 results (a demo run on one thread and the same run on two
part in the loss by step 5), so a run's losses would depend on what else ran on the machine.

What: `CoreShare`, a daemon thread started by a CPU run with more than one intra-op thread, reads /proc/stat
every PERIOD_S seconds. When other programs have used at least SHARED_AT cores (of the cores this process may
run on) for CONFIRM periods in a row, it pins every thread of the process to the least busy K of those cores,
K = cores - (what the others use, rounded up), at least 1, and starts one idle OpenMP team of its own: libgomp
then manages more threads than it has cores and waits with its throttled spin (100 spins instead of
GOMP_SPINCOUNT, as libgomp documents for oversubscription), so a waiting thread sleeps at once and the partner
on its core runs. When the others have used at most FREE_AT cores for CONFIRM periods it restores the process's
cores and ends that team: the threads spin again. The threads, how the work is split and the order of every sum
stay as they were: losses are the same bit for bit (benchmarks/bench_threads.py checks them). Measured with
benchmarks/bench_threads.py; the figures in benchmarks/RESULTS.md.

Not started (the run's line says why): one intra-op thread, several ranks on the node (each would count the
others as other programs), not Linux (no /proc/stat), a wait
the user chose (OMP_WAIT_POLICY or GOMP_SPINCOUNT: their threads keep it, and spinning threads pinned together
would wait on each other), a binding the user chose (OMP_PROC_BIND, GOMP_CPU_AFFINITY, OMP_PLACES), or
NEOX_CPU_SHARE=off. NEOX_CPU_SHARE=pin pins without the throttling team (for the benchmark's comparison).
"""
from __future__ import annotations

import math
import os
import threading
import time

PERIOD_S = 0.5
SHARED_AT = 0.5  # cores other programs use (mean over a period) from which the run keeps to fewer cores
FREE_AT = 0.25  # ... and at most which it spreads out again
CONFIRM = 2  # periods in a row before either change
SWITCH = "NEOX_CPU_SHARE"  # auto (default) | off | pin
USERS_BINDING = ("OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "OMP_PLACES")
USERS_WAIT = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (/proc/stat, after the cpu name)


def why_not(threads: int, environ=None, stat: str = "/proc/stat") -> str | None:
    """None when CoreShare may run in this process; else why not, in words."""
    environ = os.environ if environ is None else environ
    switch = environ.get(SWITCH, "auto")
    if switch not in ("auto", "off", "pin"):
        return f"{SWITCH}={switch} is not auto, off or pin: left off"
    if switch == "off":
        return f"{SWITCH}=off"
    if threads < 2:
        return "one thread"
    if int(environ.get("LOCAL_WORLD_SIZE") or 1) > 1:  # the other ranks would count as other programs
        return "several processes on this node"
    from utils.runtime.threads import users_wait

    chosen = users_wait(environ) or next((f"{n} is yours" for n in USERS_BINDING if environ.get(n)), None)
    if chosen:
        return chosen
    if not os.path.isfile(stat) or not hasattr(os, "sched_setaffinity"):
        return "no /proc/stat or CPU affinity here"
    return None


def busy_ticks(cpus, stat_text: str) -> dict[int, int]:
    """Busy clock ticks per CPU (user, nice, system, irq, softirq, steal) of /proc/stat's `cpuN` lines, for
    the CPUs in `cpus`."""
    out = {}
    for line in stat_text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        cpu = int(name[3:])
        if cpu in cpus:
            values = [int(v) for v in fields]
            out[cpu] = sum(values[i] for i in _BUSY_FIELDS if i < len(values))
    return out


def own_ticks(stat_text: str) -> int:
    """utime + stime of /proc/self/stat (every thread of the process)."""
    fields = stat_text[stat_text.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def cores_to_keep(cores: int, others: float) -> int:
    """How many cores a run keeps to while other programs use `others` of its `cores`."""
    return max(1, cores - math.ceil(others - 1e-9))


class CoreShare:
    """The watcher (the module's docstring). `start()` runs it; `stop()` ends it, restoring the cores."""

    def __init__(self, log=None, mode: str = "auto", period_s: float = PERIOD_S, stat: str = "/proc/stat",
                 self_stat: str = "/proc/self/stat"):
        self.log, self.mode, self.period_s = log, mode, period_s
        self.stat, self.self_stat = stat, self_stat
        self.cpus = sorted(os.sched_getaffinity(0))
        self.hz = os.sysconf("SC_CLK_TCK")
        self.kept: list[int] | None = None  # the cores the threads keep to while shared; None: all of them
        self.changes = 0
        self._stop = threading.Event()
        self._release = None  # set to end the throttling team
        self._thread = threading.Thread(target=self._watch, name="cpu-share", daemon=True)

    @classmethod
    def for_run(cls, threads: int, log=None, environ=None) -> tuple[CoreShare | None, str]:
        """A started watcher (or None) and the words for the run's line."""
        environ = os.environ if environ is None else environ
        reason = why_not(threads, environ)
        if reason is not None:
            return None, f"sharing the cores: off ({reason})"
        share = cls(log, mode=environ.get(SWITCH, "auto"))
        share.start()
        return share, (f"sharing the cores: while other programs use {SHARED_AT:g}+ of them, the threads keep to "
                       f"the rest and sleep as they wait ({SWITCH}=off turns it off)")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self.kept is not None:
            self._spread()

    # --------------------------------------------------------------------------------------------- watching
    def _read(self) -> tuple[dict[int, int], int, float]:
        with open(self.stat) as f:
            machine = busy_ticks(set(self.cpus), f.read())
        with open(self.self_stat) as f:
            own = own_ticks(f.read())
        return machine, own, time.monotonic()

    def _watch(self) -> None:
        try:
            before, streak = self._read(), 0
            while not self._stop.wait(self.period_s):
                now = self._read()
                seconds = now[2] - before[2]
                per_cpu = {c: now[0].get(c, 0) - before[0].get(c, 0) for c in self.cpus}
                others = max(0.0, (sum(per_cpu.values()) - (now[1] - before[1])) / self.hz / max(seconds, 1e-6))
                before = now
                wanted = others >= SHARED_AT if self.kept is None else others > FREE_AT
                streak = streak + 1 if wanted != (self.kept is not None) else 0
                if streak >= CONFIRM:
                    streak = 0
                    if self.kept is None:
                        self._keep(cores_to_keep(len(self.cpus), others), per_cpu, others)
                    else:
                        self._spread()
        except Exception as exc:  # noqa: BLE001 (/proc changed under us, or worse): spread out, one line, train on
            try:
                if self.kept is not None:
                    self._spread()
            finally:
                self._say(f"sharing the cores: stopped watching ({type(exc).__name__}: {exc}); the threads use "
                          f"every core from now on")

    def _keep(self, count: int, per_cpu: dict[int, int], others: float) -> None:
        if count >= len(self.cpus):
            return
        self.kept = sorted(sorted(self.cpus, key=lambda c: (per_cpu[c], c))[:count])
        self._set_affinity(set(self.kept))
        if self.mode == "auto":
            self._throttle()
        self.changes += 1
        if self.changes == 1:
            self._say(f"sharing the cores: other programs use {others:.1f} of this run's {len(self.cpus)} cores: its "
                      f"threads keep to {count} of them while they do (the same losses; said once)")

    def _spread(self) -> None:
        self.kept = None
        self._set_affinity(set(self.cpus))
        if self._release is not None:
            self._release.set()
            self._release = None

    def _set_affinity(self, cpus: set[int]) -> None:
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            return
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:  # a thread that ended meanwhile
                pass

    def _throttle(self) -> None:
        """One OpenMP team of this thread's own, idle until released: libgomp then manages more threads than
        cores and waits with its throttled spin count in every team, the run's too."""
        release = threading.Event()
        started = threading.Event()

        def team() -> None:
            try:
                import torch

                torch.empty(1 << 17).fill_(0.0)  # a parallel region from this thread: its own team, left docked
            except Exception as exc:  # noqa: BLE001 (the pinning alone still helps): one line, not a traceback
                self._say(f"sharing the cores: no idle OpenMP team ({type(exc).__name__}: {exc}); the threads keep "
                          f"to fewer cores, waiting as before")
                return
            finally:
                started.set()
            release.wait()  # the team lives as long as this thread

        threading.Thread(target=team, name="cpu-share-team", daemon=True).start()
        started.wait(timeout=5)
        self._release = release

    def _say(self, line: str) -> None:
        if self.log is not None:
            self.log.info(line)
