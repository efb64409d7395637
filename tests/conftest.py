"""Shared fixtures: a real in-process GCS emulator, a real small disk, the repo root, and a python that runs the
repo's code."""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# The suite's own processes compute on one thread, as every process it starts does (make_subprocess_env): its
# workers share the cores with each other and with those processes, where torch's OpenMP threads would spin
# waiting for each other (benchmarks/RESULTS.md, "CPU threads on a shared machine"). Set before any test module
# imports torch; a value given wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Emulator:
    """A running gcp-storage-emulator; `url` is what STORAGE_EMULATOR_HOST holds."""

    def __init__(self, bucket: str = "test-bucket"):
        from gcp_storage_emulator.server import create_server

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.bucket = bucket
        self._server = create_server("127.0.0.1", self.port, in_memory=True, default_bucket=bucket)
        self._server.start()
        self.running = True

    def client(self):
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(project="test", credentials=AnonymousCredentials())

    def stop(self):
        if self.running:
            self._server.stop()
            self.running = False

    def restart(self):
        """Serves again, on the same port, what it held when stopped (a GCS outage that ends)."""
        from gcp_storage_emulator.server import APIThread

        if not self.running:
            self._server._api = APIThread("127.0.0.1", self.port, self._server._storage)
            self._server.start()
            self.running = True


@pytest.fixture
def gcs_emulator(monkeypatch):
    """A fresh emulator with one bucket (`emu.bucket`); STORAGE_EMULATOR_HOST points at it for this test
    and for any subprocess it starts (they inherit os.environ)."""
    emu = Emulator()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emu.url)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    yield emu
    emu.stop()


@pytest.fixture
def open_tmp():
    """A temporary directory an unprivileged user can reach (pytest's own are root-only)."""
    import shutil
    import subprocess
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="hardening-"))
    os.chmod(path, 0o755)
    yield path
    subprocess.run(["chmod", "-R", "u+rwx", str(path)], capture_output=True)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_disk(tmp_path, request):
    """A real small filesystem: a tmpfs of 3 MB (another size: parametrize the fixture indirectly, e.g. "5m"),
    mounted in the test's folder; skipped where mounting needs root."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    size = getattr(request, "param", "3m")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                      capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def subprocess_env() -> dict:
    return make_subprocess_env()


def make_subprocess_env() -> dict:
    """Environment for running the repo's scripts in a subprocess: repo on PYTHONPATH, the test's python
    first on PATH (so `accelerate`, `torchrun` resolve to this venv), quiet and single-threaded."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONUNBUFFERED"] = "1"
    return env


# Each file's seconds in the last recorded run (tests/durations.json, written by `pytest --store-durations`): the
# files start longest first (pytest.ini turns off xdist's own order, by number of tests, which ran the demo's one
# 4-minute test last). A file's tests stay on one worker, so a long file started late leaves the others idle at the
# end; longest first, the three workers end within seconds of each other.
DURATIONS = Path(__file__).with_name("durations.json")
_seconds: dict[str, float] = {}


def recorded_durations() -> dict[str, float]:
    import json

    return json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}


def pytest_addoption(parser):
    parser.addoption("--store-durations", action="store_true",
                     help=f"write each test file's seconds in this run to {DURATIONS.relative_to(REPO_ROOT)}")


def pytest_collection_modifyitems(config, items):
    """The longest files first (DURATIONS; a file not in it counts as the median; each file's tests keep their
    order); tests marked `gpu` run only where CUDA is available."""
    import statistics

    import torch

    recorded = recorded_durations()
    usual = statistics.median(recorded.values()) if recorded else 0.0
    items.sort(key=lambda item: -recorded.get(item.nodeid.split("::")[0], usual))  # stable: files stay whole
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    file = report.nodeid.split("::")[0]
    _seconds[file] = _seconds.get(file, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """--store-durations: the controller (not an xdist worker) writes what every worker reported, over the
    recorded seconds of the files this run ran."""
    import json

    if session.config.getoption("store_durations") and not hasattr(session.config, "workerinput") and _seconds:
        recorded = recorded_durations() | {file: round(seconds, 1) for file, seconds in _seconds.items()}
        DURATIONS.write_text(json.dumps(dict(sorted(recorded.items())), indent=0) + "\n")


@pytest.fixture(autouse=True)
def _no_stop_signal_left_over():
    """Each test starts with no stop signal on record in this process: a test that signals the pytest
    process itself (a StopSignal, catch_early) must not make a later in-process wait (utils/runtime/signals.py's
    stop_requested, looked at by the streaming loader) think a stop came."""
    signals = sys.modules.get("utils.runtime.signals")
    if signals is not None:
        for name in ("_REQUESTED", "_EARLY", "_SUPERVISOR_LOST"):
            getattr(signals, name, []).clear()
    yield
