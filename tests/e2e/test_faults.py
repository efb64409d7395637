"""Faults the way users meet them: a busy output dir, GCS down or hanging, a full disk, unreadable or
mismatched checkpoints. Real train.py runs on tiny data, a real emulator, a real small tmpfs."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_checkpoint import BlackHole  # a GCS that accepts connections and never answers
from tests.trainkit import REPO_ROOT, make_shards, metrics, run, train_cmd, train_rows
from utils.checkpoint.format import list_checkpoints, verify_checkpoint
from utils.io import files
from utils.io.lock import LOCK_FILE, OutputDirLock


def one_error_line(proc) -> str:
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 4-step run (checkpoints at 2 and 4) that the resume tests read but never change."""
    root = tmp_path_factory.mktemp("trained")
    data = make_shards(root / "data")
    out = root / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    run(train_cmd(out, data, "per_device_train_batch_size=4", "max_steps=4", "save_steps=2"), env)
    return data, out


# ------------------------------------------------------------------------------------ the output-dir lock

def test_a_live_run_holds_the_output_dir(tmp_path, subprocess_env):
    data = make_shards(tmp_path / "data")
    out = tmp_path / "out"
    holder = OutputDirLock(out)
    holder.acquire(log=lambda m: None)  # this test process plays the live run
    try:
        proc = run(train_cmd(out, data, "max_steps=2"), subprocess_env, check=False)
    finally:
        holder.release()
    line = one_error_line(proc)
    assert proc.returncode == 2 and "in use by another live run" in line
    assert f"pid {os.getpid()}" in line and f"host {socket.gethostname()}" in line
    assert not (out / "checkpoints").exists() and not (out / "logs" / "metrics.jsonl").exists()


def test_a_dead_runs_lock_is_taken_over(tmp_path, subprocess_env):
    data = make_shards(tmp_path / "data")
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / LOCK_FILE).write_text(json.dumps({"host": "oldhost", "pid": int(dead.stdout), "started_unix": 1.0}))
    proc = run(train_cmd(out, data, "max_steps=2", "save_steps=100"), subprocess_env)
    assert f"taking over the lock left by a run that is no longer alive (host oldhost, pid {int(dead.stdout)}" \
           in proc.stdout
    assert max(train_rows(out)) == 2
    assert (out / LOCK_FILE).read_text() == ""  # released at the end


def test_lock_in_process(tmp_path):
    first, second = OutputDirLock(tmp_path), OutputDirLock(tmp_path)
    first.acquire(log=lambda m: None)
    with pytest.raises(Exception, match=f"pid {os.getpid()}"):
        second.acquire(log=lambda m: None)
    first.release()
    said = []
    second.acquire(log=said.append)  # released cleanly: nothing to take over, nothing said
    assert said == []
    second.release()


# --------------------------------------------------------------------------------- GCS down or hanging

@pytest.mark.slow
@pytest.mark.parametrize("trouble", ["refusing", "hanging"])
def test_gcs_trouble_never_blocks_the_loop_and_the_exit_tells_the_truth(tmp_path, subprocess_env, trouble,
                                                                        gcs_emulator):
    data = make_shards(tmp_path / "data")
    out = tmp_path / "out"
    hole = BlackHole() if trouble == "hanging" else None
    if hole is None:
        gcs_emulator.stop()  # connection refused
    subprocess_env["STORAGE_EMULATOR_HOST"] = hole.url if hole else gcs_emulator.url
    try:
        proc = run(train_cmd(out, data, "per_device_train_batch_size=2", "max_steps=6", "save_steps=1",
                             "save_total_limit=1", f"gcs_bucket={gcs_emulator.bucket}", "run_name=r",
                             "upload_timeout_s=5"), subprocess_env, check=False, timeout=600)
    finally:
        if hole:
            hole.close()
    assert proc.returncode == 1, proc.stderr
    assert max(train_rows(out)) == 6
    blocked = [r["blocked_s"] for r in metrics(out) if "checkpoint" in r]
    assert len(blocked) == 6 and max(blocked) < 1.0, blocked  # the device->host copy only, never GCS
    # Whatever did not reach GCS and was not superseded by a newer checkpoint is still on disk, named,
    # with the command that uploads it; the newest checkpoint is among them.
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: upload of")]
    assert errors and "checkpoint-epoch0-step6-" in errors[-1]
    for line in errors:
        url, path = re.search(r"upload it with: python -m utils\.checkpoint\.upload (\S+) (\S+)$", line).group(2, 1)
        verify_checkpoint(path)
        assert url.endswith(Path(path).name)
    if trouble == "hanging":
        assert "timed out: upload not finished after 5" in proc.stderr


@pytest.mark.slow
def test_printed_upload_command_then_resume_from_gcs(tmp_path, subprocess_env, gcs_emulator):
    """GCS is down for the whole run; afterwards the command the run printed uploads the newest checkpoint,
    and a fresh machine resumes from it."""
    data = make_shards(tmp_path / "data")
    out = tmp_path / "out"
    subprocess_env["STORAGE_EMULATOR_HOST"] = "http://127.0.0.1:9"  # nothing listens on the discard port
    proc = run(train_cmd(out, data, "per_device_train_batch_size=2", "max_steps=4", "save_steps=2",
                         f"gcs_bucket={gcs_emulator.bucket}", "run_name=later", "upload_timeout_s=3"),
               subprocess_env, check=False, timeout=600)
    assert proc.returncode == 1
    command = re.findall(r"upload it with: (python -m utils\.checkpoint\.upload \S+ \S+)$", proc.stderr, re.M)[-1]
    subprocess_env["STORAGE_EMULATOR_HOST"] = gcs_emulator.url
    up = subprocess.run(command.replace("python", sys.executable, 1).split(), env=subprocess_env,
                        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stderr
    fresh = tmp_path / "fresh"
    proc = run(train_cmd(fresh, data, "per_device_train_batch_size=2", "max_steps=5",
                         f"gcs_bucket={gcs_emulator.bucket}", "run_name=later", extra=("--resume", "latest")),
               subprocess_env)
    assert "at step 4" in proc.stdout and max(train_rows(fresh)) == 5


# ------------------------------------------------------------------------------------------- disk full

@pytest.mark.slow
def test_disk_full_is_one_line_and_earlier_checkpoints_resume(tmp_path, subprocess_env, small_disk):
    data = make_shards(tmp_path / "data")
    out = small_disk / "out"
    proc = run(train_cmd(out, data, "per_device_train_batch_size=2", "max_steps=40", "save_steps=2",
                         "save_total_limit=20", "logging_steps=1"), subprocess_env, check=False)
    line = one_error_line(proc)
    assert re.search(rf"no space left on {re.escape(str(small_disk))} writing \S+ \(.*GB free\); "
                     "free space", line), line
    assert "--resume auto" in line
    assert re.search(r"warning: [0-9.]+ GB free on .*a checkpoint takes about", proc.stderr), "no early warning"
    saved = list_checkpoints(out / "checkpoints")
    assert saved, "no checkpoint fit at all"
    for path in saved:
        verify_checkpoint(path)  # every complete-looking checkpoint is whole
    bigger = tmp_path / "bigger"
    shutil.copytree(out / "checkpoints", bigger / "checkpoints")
    step = int(re.search(r"-step(\d+)-", saved[-1].name).group(1))
    proc = run(train_cmd(bigger, data, "per_device_train_batch_size=2", f"max_steps={step + 1}",
                         extra=("--resume", "auto")), subprocess_env)
    assert f"at step {step}" in proc.stdout and max(train_rows(bigger)) == step + 1


# ------------------------------------------------------------------------------ smaller ones (item 10)

def test_weights_files_are_readable_by_others(trained):
    _, out = trained
    for path in [out / "final_model" / "model.safetensors"] + [p / "model.safetensors" for p in
                                                                list_checkpoints(out / "checkpoints")]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_an_unreadable_newest_checkpoint_is_skipped(trained, tmp_path):
    if os.getuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to read as a process without the right to bypass permissions")
    _, out = trained
    root = tmp_path / "ckpts"
    shutil.copytree(out / "checkpoints", root)
    newest = list_checkpoints(root)[-1]
    os.chmod(newest / "model.safetensors", 0o000)  # as for another user's file: nobody may read it
    code = ("from utils.checkpoint.format import find_latest_local; "
            f"print('LATEST', find_latest_local({str(root)!r}).name)")
    # root without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH obeys file permissions like any user
    proc = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-c", code],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert proc.returncode == 0, proc.stderr
    assert f"skipping checkpoint {newest.name}" in proc.stdout and "check its permissions" in proc.stdout
    assert f"LATEST {list_checkpoints(root)[-2].name}" in proc.stdout


@pytest.mark.parametrize("change, fragment", [
    (["model=demo", "seq_len=64"], "was written for model 'tiny' but this run builds 'demo'"),
    (["seq_len=32"], "trained with seq_len=64 but this run has seq_len=32"),
    (["max_files=3"], "the data changed since checkpoint"),
    (["max_steps=3"], "is at step 4, and max_steps is 3: nothing left to train"),
])
def test_resume_refuses_what_cannot_continue_in_one_line(trained, tmp_path, subprocess_env, change, fragment):
    data, out = trained
    copy = tmp_path / "out"
    shutil.copytree(out / "checkpoints", copy / "checkpoints")
    sets = ["per_device_train_batch_size=4", "max_steps=6"] + change
    proc = run(train_cmd(copy, data, *sets, extra=("--resume", "latest")), subprocess_env, check=False)
    line = one_error_line(proc)
    assert proc.returncode == 2 and fragment in line, line


@pytest.mark.slow
def test_resume_auto_on_a_fresh_dir_starts_fresh_and_says_so(tmp_path, subprocess_env):
    data = make_shards(tmp_path / "data")
    out = tmp_path / "out"
    proc = run(train_cmd(out, data, "max_steps=2", "save_steps=100", extra=("--resume", "auto")), subprocess_env)
    assert "--resume auto: no checkpoint found in" in proc.stdout and "starting a fresh run" in proc.stdout
    proc = run(train_cmd(out, data, "max_steps=3", "save_steps=100", extra=("--resume", "auto")), subprocess_env)
    assert "Resumed from" in proc.stdout and "at step 2" in proc.stdout and max(train_rows(out)) == 3


def test_no_temporaries_are_left_behind(trained):
    _, out = trained
    leftovers = [p for p in out.rglob("*") if files.is_temp_name(p.name)]
    assert leftovers == []
