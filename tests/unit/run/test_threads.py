"""utils/runtime/threads.py: the wait the engine sets for OpenMP's threads, the user's choice winning, and the
run's line. That libgomp really reads it, and that it changes no loss: tests/e2e/test_train.py."""
from __future__ import annotations

import pytest

from utils.runtime import threads


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(threads, "_wait", None)


def test_the_engine_sets_a_bounded_spin_unless_the_user_chose(monkeypatch):
    monkeypatch.setattr(threads, "torch_imported", lambda: False)  # as at the top of an entry point
    env = {"OMP_NUM_THREADS": "2"}
    said = threads.settle_wait(env)
    assert env["GOMP_SPINCOUNT"] == str(threads.SPINCOUNT) and threads.SPINCOUNT > 0
    assert said.startswith(f"spin {threads.SPINCOUNT:,} times, then sleep") and "the engine's default" in said
    for name, value in (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "300000")):
        env = {name: value}
        assert threads.settle_wait(env) == f"{name}={value} (yours)"
        assert env == {name: value}  # nothing added: GOMP_SPINCOUNT would override the user's OMP_WAIT_POLICY


def test_too_late_once_torch_is_imported():
    import torch  # noqa: F401 (OpenMP may be running: its threads keep what they were started with)

    env = {}
    assert "torch was imported before" in threads.settle_wait(env) and env == {}


def test_the_line_says_how_many_threads_why_and_how_they_wait(monkeypatch):
    monkeypatch.setattr(threads, "torch_imported", lambda: False)
    threads.settle_wait({})
    launched = {threads.LAUNCHER_CHOICE: "start_training.sh: 8 core(s) / 2 process(es) per node",
                "OMP_NUM_THREADS": "4"}
    assert threads.describe(4, launched) == (
        "cpu threads: 4 per process (start_training.sh: 8 core(s) / 2 process(es) per node); waiting: spin "
        f"{threads.SPINCOUNT:,} times, then sleep (GOMP_SPINCOUNT={threads.SPINCOUNT}, the engine's default while "
        "the cores are free; OMP_WAIT_POLICY or GOMP_SPINCOUNT change it)")
    assert threads.describe(2, {}, sharing="sharing the cores: off (x)").endswith("; sharing the cores: off (x)")
    assert threads.describe(3, {"OMP_NUM_THREADS": "3"}).startswith("cpu threads: 3 per process (OMP_NUM_THREADS=3, "
                                                                    "yours); waiting: spin")
    assert threads.describe(1, {"OMP_NUM_THREADS": "1"}) == ("cpu threads: 1 per process (OMP_NUM_THREADS=1, yours); "
                                                             "one thread: none waits")
    assert f"torch's default for the {threads.cores()} core(s)" in threads.describe(2, {})
