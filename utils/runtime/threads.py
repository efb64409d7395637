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
regions, spin `GOMP_SPINCOUNT` times before they sleep: 300,000 by default (milliseconds here), the whole
wait for a step's small regions. Alone that is the fastest; when another program holds a core, a spinning
thread burns the time slice its partner (or that program) needs, and the demo beside two busy loops trained
at a third of the speed of one thread. `OMP_WAIT_POLICY=PASSIVE` (sleep at once) keeps the shared speed but
loses a quarter alone (every wake-up is a futex call). So the engine sets `GOMP_SPINCOUNT=SPINCOUNT`: spins that
cover a step's gaps between regions when the threads have the cores, and are over, well within a time slice,
when they do not. `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` set by the user win (and other OpenMP runtimes, which
read neither, keep their own defaults).

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

SPINCOUNT = 1_000  # GOMP_SPINCOUNT the engine sets (libgomp's default: 300,000): benchmarks/RESULTS.md
LAUNCHER_CHOICE = "NEOX_THREADS_CHOICE"  # set by start_training.sh with OMP_NUM_THREADS: why that many

_wait: str | None = None  # what settle_wait() found or chose: the run's line says it


def cores() -> int:
    """The CPUs this process may run on (its affinity; what `nproc` counts)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def settle_wait(environ=None) -> str:
    """Sets GOMP_SPINCOUNT=SPINCOUNT in `environ` (os.environ) unless the user chose how threads wait; returns
    (and keeps, for `describe`) the wait in words. Call it before torch is imported."""
    global _wait
    environ = os.environ if environ is None else environ
    _wait = _users_wait(environ)
    if _wait is None and torch_imported():  # OpenMP may be running: its threads keep the wait they have
        _wait = "as OpenMP started it (torch was imported before the engine could choose)"
    if _wait is None:
        environ["GOMP_SPINCOUNT"] = str(SPINCOUNT)
        _wait = (f"spin {SPINCOUNT:,} times, then sleep (GOMP_SPINCOUNT={SPINCOUNT}, the engine's default; "
                 f"OMP_WAIT_POLICY or GOMP_SPINCOUNT change it)")
    return _wait


def torch_imported() -> bool:
    return "torch" in sys.modules


def _users_wait(environ) -> str | None:
    name = next((n for n in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if environ.get(n)), None)
    return f"{name}={environ[name]} (yours)" if name else None


def describe(threads: int, environ=None) -> str:
    """The run's line: how many intra-op threads (`torch.get_num_threads()`), why, and how they wait."""
    environ = os.environ if environ is None else environ
    if environ.get(LAUNCHER_CHOICE):
        why = environ[LAUNCHER_CHOICE]
    elif environ.get("OMP_NUM_THREADS"):
        why = f"OMP_NUM_THREADS={environ['OMP_NUM_THREADS']}, yours"
    else:
        why = f"torch's default for the {cores()} core(s) this process may use"
    wait = _wait or _users_wait(environ) or "OpenMP's default (nothing chose it)"
    wait = "one thread: none waits" if threads == 1 else f"waiting: {wait}"
    return f"cpu threads: {threads} per process ({why}); {wait}"
