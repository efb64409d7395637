"""utils/runtime/cpu_share.py: when a CPU run's threads keep to fewer cores (other programs' load, read as
/proc/stat says it), when they spread out again, and when the watcher does not run at all. The decisions are
driven here by stat files this test writes; the affinity it sets is real (this process's threads, restored).
Through train.py beside a real busy loop, with the losses unchanged: tests/e2e/test_train.py."""
from __future__ import annotations

import os
import threading
import time

import pytest

from utils.runtime import cpu_share, threads
from utils.runtime.cpu_share import CoreShare, busy_ticks, cores_to_keep, own_ticks, why_not

STAT = """cpu  900 0 300 5000 10 0 5 0 0 0
cpu0 400 0 100 2500 5 0 2 3 0 0
cpu1 500 0 200 2500 5 0 3 4 0 0
intr 12345
"""


def test_proc_stat_busy_ticks_per_cpu_and_the_process_own():
    assert busy_ticks({0, 1}, STAT) == {0: 400 + 100 + 2 + 3, 1: 500 + 200 + 3 + 4}
    assert busy_ticks({1}, STAT) == {1: 707}
    # /proc/self/stat: the command may hold spaces and parentheses; utime and stime are fields 14 and 15
    assert own_ticks("4242 (python (x) y) R 1 2 3 4 5 6 7 8 9 10 70 30 0 0 20 0 3") == 100


def test_how_many_cores_a_run_keeps_to():
    assert [cores_to_keep(2, o) for o in (0.5, 1.0, 1.35, 2.0)] == [1, 1, 1, 1]
    assert [cores_to_keep(8, o) for o in (0.5, 1.0, 1.3, 7.5)] == [7, 7, 6, 1]


def test_the_watcher_runs_only_where_it_may(monkeypatch):
    monkeypatch.setattr(threads, "_wait", None)
    assert why_not(2, {}) is None
    assert why_not(1, {}) == "one thread"
    assert why_not(2, {"LOCAL_WORLD_SIZE": "2"}) == "several processes on this node"
    assert why_not(2, {"NEOX_CPU_SHARE": "off"}) == "NEOX_CPU_SHARE=off"
    assert why_not(2, {"NEOX_CPU_SHARE": "maybe"}).startswith("NEOX_CPU_SHARE=maybe is not auto, off or pin")
    assert why_not(2, {"OMP_WAIT_POLICY": "ACTIVE"}) == "OMP_WAIT_POLICY is yours"
    assert why_not(2, {"OMP_PROC_BIND": "close"}) == "OMP_PROC_BIND is yours"
    assert why_not(2, {}, stat="/nonexistent/stat") == "no /proc/stat or CPU affinity here"
    # the GOMP_SPINCOUNT settle_wait() sets is the engine's, not the user's
    monkeypatch.setattr(threads, "torch_imported", lambda: False)
    env = {}
    threads.settle_wait(env)
    assert env["GOMP_SPINCOUNT"] == str(threads.SPINCOUNT) and why_not(2, env) is None
    env = {"GOMP_SPINCOUNT": "5"}
    threads.settle_wait(env)
    assert why_not(2, env) == "GOMP_SPINCOUNT is yours"


class FakeProc:
    """/proc/stat and /proc/self/stat as files: `tick(others, own)` adds that many cores' worth of busy ticks
    over one period, spread over the CPUs this process may use."""

    def __init__(self, tmp_path, cpus, hz, period_s):
        self.stat, self.self_stat = tmp_path / "stat", tmp_path / "self_stat"
        self.cpus, self.hz, self.period_s = cpus, hz, period_s
        self.busy, self.own = {c: 0 for c in cpus}, 0
        self.write()

    def write(self):
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"] + [f"cpu{c} {b} 0 0 100 0 0 0 0 0 0" for c, b in self.busy.items()]
        tmp = self.stat.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.stat)
        tmp = self.self_stat.with_suffix(".tmp")
        tmp.write_text(f"1 (python) R 1 1 1 0 -1 0 0 0 0 0 {self.own} 0 0 0 20 0 1\n")
        tmp.replace(self.self_stat)

    def tick(self, others: float, own: float):
        total = (others + own) * self.hz * self.period_s
        for c in self.cpus:
            self.busy[c] += int(total / len(self.cpus)) + 1
        self.own += int(own * self.hz * self.period_s)
        self.write()


def affinity_of_every_thread() -> set[frozenset]:
    return {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two CPUs")
def test_busy_others_pin_every_thread_to_fewer_cores_and_free_cores_spread_them_again(tmp_path, monkeypatch):
    period = 0.05
    cpus = sorted(os.sched_getaffinity(0))
    fake = FakeProc(tmp_path, cpus, os.sysconf("SC_CLK_TCK"), period)
    said = []

    class Log:
        info = said.append

    # mode "pin": the affinity alone (the throttling team needs torch's OpenMP: the e2e test has it)
    share = CoreShare(Log, mode="pin", period_s=period, stat=str(fake.stat), self_stat=str(fake.self_stat))
    share.start()
    try:
        def run_for(periods: int, others: float, own: float):
            for _ in range(periods):
                fake.tick(others, own)
                time.sleep(period)

        run_for(6, others=0.0, own=len(cpus))
        assert share.kept is None and affinity_of_every_thread() == {frozenset(cpus)}
        run_for(1, others=len(cpus) - 0.5, own=0.5)  # one period alone changes nothing
        assert share.kept is None
        deadline = time.monotonic() + 10
        while share.kept is None and time.monotonic() < deadline:
            run_for(1, others=len(cpus) - 0.5, own=0.5)
        assert share.kept is not None and len(share.kept) == 1, share.kept
        assert affinity_of_every_thread() == {frozenset(share.kept)}
        assert len(said) == 1 and said[0].startswith("sharing the cores: other programs use ")
        # a thread started while pinned inherits it; the spread reaches it too
        ready, done = threading.Event(), threading.Event()
        late = threading.Thread(target=lambda: (ready.set(), done.wait(10)))
        late.start()
        ready.wait(5)
        assert os.sched_getaffinity(late.native_id) == set(share.kept)
        deadline = time.monotonic() + 10
        while share.kept is not None and time.monotonic() < deadline:
            run_for(1, others=0.0, own=1.0)
        assert share.kept is None and affinity_of_every_thread() == {frozenset(cpus)}
        assert os.sched_getaffinity(late.native_id) == set(cpus)
        done.set()
        late.join()
        assert len(said) == 1  # said once, not at every change
    finally:
        share.stop()
        os.sched_setaffinity(0, set(cpus))
    assert affinity_of_every_thread() == {frozenset(cpus)}


def test_a_stat_file_that_goes_away_stops_the_watcher_with_one_line(tmp_path):
    fake = FakeProc(tmp_path, sorted(os.sched_getaffinity(0)), os.sysconf("SC_CLK_TCK"), 0.02)
    said = []

    class Log:
        info = said.append

    share = CoreShare(Log, mode="pin", period_s=0.02, stat=str(fake.stat), self_stat=str(fake.self_stat))
    share.start()
    fake.stat.unlink()
    share._thread.join(timeout=5)
    assert not share._thread.is_alive()
    assert len(said) == 1 and said[0].startswith("sharing the cores: stopped watching (")
    share.stop()


def test_a_helper_thread_that_fails_is_one_line_and_the_threads_spread_out(tmp_path, monkeypatch):
    """An error in the watcher's decision (here: cores_to_keep raising) or in the idle OpenMP team's start (its
    torch call raising) is one line through the run's log, no thread traceback; the threads use every core."""
    import torch

    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    cpus = sorted(os.sched_getaffinity(0))
    said = []

    class Log:
        info = said.append

    def no_team(*args, **kwargs):
        raise RuntimeError("no OpenMP here")

    monkeypatch.setattr(torch, "empty", no_team)
    share = CoreShare(Log, mode="auto", period_s=0.02)
    share._throttle()
    assert said == ["sharing the cores: no idle OpenMP team (RuntimeError: no OpenMP here); the threads keep to fewer "
                    "cores, waiting as before"]
    share._spread()

    def broken(count, others):
        raise KeyError("cores")

    fake = FakeProc(tmp_path, cpus, os.sysconf("SC_CLK_TCK"), 0.02)
    monkeypatch.setattr(cpu_share, "cores_to_keep", broken)
    said.clear()
    share = CoreShare(Log, mode="pin", period_s=0.02, stat=str(fake.stat), self_stat=str(fake.self_stat))
    share.start()
    try:
        deadline = time.monotonic() + 10
        while share._thread.is_alive() and time.monotonic() < deadline:
            fake.tick(len(cpus) - 0.5, 0.5)
            time.sleep(0.02)
        assert not share._thread.is_alive()
    finally:
        share.stop()
    assert said == ["sharing the cores: stopped watching (KeyError: 'cores'); the threads use every core from now on"]
    assert raised == [] and affinity_of_every_thread() == {frozenset(cpus)}


def test_for_run_says_what_it_does_and_why_not(monkeypatch):
    monkeypatch.setattr(cpu_share.CoreShare, "start", lambda self: None)
    monkeypatch.setattr(threads, "_wait", None)
    share, words = CoreShare.for_run(2, environ={})
    assert share is not None and words.startswith("sharing the cores: while other programs use 0.5+ of them")
    assert CoreShare.for_run(1, environ={}) == (None, "sharing the cores: off (one thread)")
