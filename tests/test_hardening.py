"""Hardening, second pass (issue 20): every fault a user can meet is one line (or one clear warning) and
loses nothing. Mostly in-process checks against real files, a real full disk (/dev/full, a small tmpfs), a
real unprivileged user (setpriv) and the GCS emulator; a few toy-sized subprocess runs. The last test
runs every command-line entry point against bad inputs and asserts no traceback reaches stderr."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainkit import REPO_ROOT, make_shards
from utils import files
from utils.checkpoint.format import CheckpointPayload, checkpoint_name, write_checkpoint
from utils.errors import DiskFullError, UserError

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def as_nobody_ok() -> bool:
    return os.getuid() == 0 and shutil.which("setpriv") is not None


@pytest.fixture
def open_tmp():
    """A temporary directory an unprivileged user can reach (pytest's own are root-only)."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="hardening-"))
    os.chmod(path, 0o755)
    yield path
    subprocess.run(["chmod", "-R", "u+rwx", str(path)], capture_output=True)
    shutil.rmtree(path, ignore_errors=True)


def fake_checkpoint(root: Path, step: int, extra_files: dict | None = None) -> Path:
    """A real (tiny) checkpoint written by the real writer: one tensor, a model record, an rng object."""
    payload = CheckpointPayload({"w": torch.arange(4.0)}, {"rng": [{}]},
                                {"step": step, "epoch": 0, "tokens": step * 8, "world_size": 1,
                                 "model": {"name": "tiny"}})
    return write_checkpoint(root, checkpoint_name(0, step, 1), payload, extra_files)


def run_py(args: list, timeout: float = 120, user: list | None = None, cwd=REPO_ROOT, env=None, **kw):
    env = dict(env or os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run((user or []) + [sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, **kw)


def one_line(proc, code: int = 2) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


# ------------------------------------------------------------------------------------- bug 1: disk full

def test_disk_full_guard_names_the_file_and_passes_other_errors(tmp_path):
    with pytest.raises(DiskFullError, match=r"no space left on .* writing /dev/full \(.*free"):
        with files.disk_full_guard("/dev/full"), open("/dev/full", "w") as f:
            f.write("x" * 10_000)
    with pytest.raises(PermissionError):  # not a full disk: unchanged
        with files.disk_full_guard(tmp_path / "x"):
            raise PermissionError(13, "denied")


def test_log_line_on_a_full_disk_is_one_line(tmp_path):
    """logs/metrics.jsonl linked to /dev/full: the promised DiskFullError, not a TypeError."""
    from utils.metrics import RunLogger

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").symlink_to("/dev/full")
    logger = RunLogger(tmp_path / "logs", is_main=True)
    with pytest.raises(DiskFullError, match=r"writing \S+metrics.jsonl .*--resume auto"):
        logger.write_row({"step": 1, "loss": 1.0})
    logger.info("still printable after the failure")  # the files are dropped, nothing fails again
    logger.close()


def test_tensorboard_on_a_full_disk_is_one_line(tmp_path, capfd):
    """TensorBoard's writer thread hits the full disk: one DiskFullError from the next log call, and no
    traceback from its thread."""
    from accelerate import Accelerator
    from accelerate.tracking import TensorBoardTracker

    from utils.metrics import RunLogger

    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        logger = RunLogger(tmp_path / "logs", is_main=True)
        accelerator = Accelerator(log_with=[TensorBoardTracker("tb", str(mount))], cpu=True)
        logger.start_trackers(accelerator, "tb", {"a": 1}, None)
        with pytest.raises(DiskFullError, match=r"no space left on .*small"):
            for step in range(1, 20_000):
                logger.write_row({"step": step, "tokens": step, "loss": 1.0 + step, "lr": 0.1})
                if step % 500 == 0:
                    logger._tensorboard.flush()
        logger.close()
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
    assert "Traceback" not in capfd.readouterr().err


def test_checkpoint_on_a_full_disk_is_one_line(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        payload = CheckpointPayload({"w": torch.zeros(200_000)}, {}, {"step": 1})
        with pytest.raises(DiskFullError, match=r"about 0\.00 GB needed.*--resume auto"):
            write_checkpoint(mount, checkpoint_name(0, 1, 1), payload)
        assert not any(mount.iterdir()), "the partial checkpoint was left behind"
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


# -------------------------------------------------------------- bug 2: an unreadable newest checkpoint

def test_an_unreadable_newest_checkpoint_directory_is_skipped(open_tmp):
    if not as_nobody_ok():
        pytest.skip("needs root and setpriv to run as an unprivileged user")
    root = open_tmp / "ckpts"
    older, newest = fake_checkpoint(root, 2), fake_checkpoint(root, 4)
    os.chmod(root, 0o755)
    os.chmod(newest, 0o000)
    code = ("from utils.checkpoint.format import find_latest_local; "
            f"print('LATEST', find_latest_local({str(root)!r}).name)")
    proc = run_py(["-c", code], user=NOBODY)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"skipping checkpoint {newest.name}" in proc.stdout and "check its permissions" in proc.stdout
    assert f"LATEST {older.name}" in proc.stdout


# ----------------------------------------------------------------------------------------- config

def test_an_empty_config_file_is_refused(tmp_path):
    from configs.training_config import ConfigError, get_training_config

    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=r"empty.yaml: the file is empty"):
        get_training_config(str(path))


def test_report_to_none_with_trackers_is_refused():
    from configs.training_config import ConfigError, get_training_config

    with pytest.raises(ConfigError, match=r"'none' cannot be combined"):
        get_training_config("demo", {"report_to": "tensorboard,none"})
    assert get_training_config("demo", {"report_to": "none"}).report_to == "none"


def test_warmup_longer_than_the_run_warns(capsys):
    from configs.training_config import get_training_config

    get_training_config("demo", {"max_steps": 10, "warmup_steps": 50})
    assert "warning: warmup_steps=50 exceeds max_steps=10" in capsys.readouterr().err
    get_training_config("demo", {"max_steps": 100, "warmup_steps": 50})
    assert "warmup_steps" not in capsys.readouterr().err


def test_a_tracker_without_its_package_is_one_line_and_others_keep_working(monkeypatch):
    import importlib.util

    from utils.metrics import usable_trackers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    said = []
    assert usable_trackers("tensorboard,wandb", warn=said.append) == ["tensorboard"]
    assert len(said) == 1 and "pip install wandb" in said[0]
