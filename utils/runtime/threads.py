"""CPU threads: how many intra-op threads a process computes with and how they wait between parallel regions
(issue 51; measured with benchmarks/bench_threads.py, the figures in benchmarks/RESULTS.md).

How many: as before. start_training.sh gives each process cores / processes per node (the cores it may run
on; torchrun alone would give one) and says so in `LAUNCHER_CHOICE`; a process started directly keeps torch's
default (its cores); `OMP_NUM_THREADS` set by the user wins. The count does not follow the machine's load at
run time, because it changes fp32 results: MKL's matrix products and torch's reductions (layer norm's
gradients, a whole-tensor sum) split their sums by thread, so a demo run on one thread and the same run on two
part in the seventh digit of the loss by step 5. A count chosen from what else runs on the machine would make
a run's losses depend on it, and a resumed run's differ from the uninterrupted one.

How they wait: torch's Linux wheels run their parallel regions on libgomp (GNU OpenMP), whose threads, between
regions, spin `GOMP_SPINCOUNT` times before they sleep. With the cores to itself a run is fastest when its
threads spin through a step's gaps between regions (sleeping at once, `OMP_WAIT_POLICY=PASSIVE`, lost a quarter
of the demo's speed: every wake-up is a futex call); beside other programs a spinning thread burns the time
slice its partner needs (the demo trained at 0.15x). So the engine sets `GOMP_SPINCOUNT=SPINCOUNT` (libgomp's
own default, said in the run's line) for the cores it has to itself, and utils/runtime/cpu_share.py changes
the rest while other programs use the cores: the threads keep to fewer cores and libgomp's throttled wait
(100 spins) applies. `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` set by the user win (and turn that watcher off;
other OpenMP runtimes, which read neither, keep their own defaults).

When: libgomp reads its environment once, when torch loads it, so each entry point calls `settle_wait()` at
the top of its main, before anything imports torch (train.py, generate.py, scripts/evaluate.py, the
benchmarks); in a process that has already imported torch it changes nothing and says so. prepare_data.py
imports no torch. The wait never changes a result (a run's losses are the same bit for bit whatever it is:
tests/e2e/test_bench.py).

Imports no torch (it runs before torch is loaded).
"""
from __future__ import annotations

import os
import sys

SPINCOUNT = 300_000  # GOMP_SPINCOUNT the engine sets while the cores are the run's: benchmarks/RESULTS.md
LAUNCHER_CHOICE = "NEOX_THREADS_CHOICE"  # set by start_training.sh with OMP_NUM_THREADS: why that many

_wait: str | None = None  # what settle_wait() found or chose: the run's line says it
_users: str | None = None  # the user's own choice of wait, as settle_wait() found it before setting its own


def cores() -> int:
    """The CPUs this process may run on (its affinity; what `nproc` counts)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def settle_wait(environ=None) -> str:
    """Sets GOMP_SPINCOUNT=SPINCOUNT in `environ` (os.environ) unless the user chose how threads wait; returns
    (and keeps, for `describe`) the wait in words. Call it before torch is imported."""
    global _wait, _users
    environ = os.environ if environ is None else environ
    _wait = _users = _users_wait(environ)
    if _wait is None and torch_imported():  # OpenMP may be running: its threads keep the wait they have
        _wait = "as OpenMP started it (torch was imported before the engine could choose)"
    if _wait is None:
        environ["GOMP_SPINCOUNT"] = str(SPINCOUNT)
        _wait = (f"spin {SPINCOUNT:,} times, then sleep (GOMP_SPINCOUNT={SPINCOUNT}, the engine's default while "
                 f"the cores are free; OMP_WAIT_POLICY or GOMP_SPINCOUNT change it)")
    return _wait


def torch_imported() -> bool:
    return "torch" in sys.modules


def users_wait(environ=None) -> str | None:
    """The user's own choice of how threads wait ("OMP_WAIT_POLICY is yours"), or None: as settle_wait() found
    it (the variable it sets is the engine's, not the user's), else as `environ` says."""
    if _wait is not None:
        return f"{_users.split('=')[0]} is yours" if _users else None
    found = _users_wait(os.environ if environ is None else environ)
    return f"{found.split('=')[0]} is yours" if found else None


def _users_wait(environ) -> str | None:
    name = next((n for n in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if environ.get(n)), None)
    return f"{name}={environ[name]} (yours)" if name else None


def describe(threads: int, environ=None, sharing: str | None = None) -> str:
    """The run's line: how many intra-op threads (`torch.get_num_threads()`), why, how they wait and (`sharing`,
    CoreShare.for_run's words) what they do while other programs use the cores."""
    environ = os.environ if environ is None else environ
    if environ.get(LAUNCHER_CHOICE):
        why = environ[LAUNCHER_CHOICE]
    elif environ.get("OMP_NUM_THREADS"):
        why = f"OMP_NUM_THREADS={environ['OMP_NUM_THREADS']}, yours"
    else:
        why = f"torch's default for the {cores()} core(s) this process may use"
    wait = _wait or _users_wait(environ) or "OpenMP's default (nothing chose it)"
    wait = "one thread: none waits" if threads == 1 else f"waiting: {wait}"
    return f"cpu threads: {threads} per process ({why}); {wait}" + (f"; {sharing}" if sharing else "")
