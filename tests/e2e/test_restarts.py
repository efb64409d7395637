"""Restarts inside the allocation (start_training.sh --max-restarts) and the hang watchdog, with real
processes: two CPU ranks under accelerate/torchrun, one SIGKILLed or SIGSTOPped from outside at a step past a
checkpoint. The run comes back with --resume auto and ends with the uninterrupted run's weights; past N
restarts it exits non-zero naming them; a bad setting is never retried."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.trainkit import REPO_ROOT, TINY, load_weights, make_shards
from utils.checkpoint.format import list_checkpoints

pytestmark = pytest.mark.slow
SETS = TINY + ["per_device_train_batch_size=2", "save_steps=3", "max_steps=12"]


def launcher_cmd(out: Path, data: Path, *options: str, sets=()) -> list[str]:
    cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--cpu", "--gpus", "2", *options]
    for s in SETS + list(sets):
        cmd += ["--set", s]
    return cmd + ["--", "--output-dir", str(out), "--data-dir", str(data)]


def start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def rank_pid(out: Path, rank: int, not_in=()) -> int | None:
    """The pid of training rank `rank` of the run writing to `out` (a worker of torchrun: RANK in its
    environment, train.py on its command line), other than those in `not_in`."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in not_in:
            continue
        try:
            cmdline, environ = (proc / "cmdline").read_bytes(), (proc / "environ").read_bytes()
        except OSError:
            continue
        if b"train.py" in cmdline and str(out).encode() in cmdline and f"\0RANK={rank}\0".encode() in b"\0" + environ:
            return int(proc.name)
    return None


def steps_done(out: Path) -> int:
    rows = out / "logs" / "metrics.jsonl"
    return rows.read_text().count('"loss"') if rows.exists() else 0


def wait_past_a_checkpoint(out: Path, proc: subprocess.Popen, log: Path, not_in=(), timeout: float = 300) -> int:
    """Waits for a rank-1 process not in `not_in` (this launch's), a checkpoint, and two steps of this launch
    past step 3; returns the rank's pid."""
    deadline, pid, base = time.time() + timeout, None, 0
    while True:
        assert proc.poll() is None, f"the run ended early ({proc.returncode}):\n{log.read_text()[-3000:]}"
        assert time.time() < deadline, f"no step past a checkpoint in time:\n{log.read_text()[-3000:]}"
        if pid is None:
            pid = rank_pid(out, 1, not_in)
            base = steps_done(out)
        elif list_checkpoints(out / "checkpoints") and steps_done(out) >= max(base + 2, 4):
            return pid
        time.sleep(0.2)


def wait_until(done, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    """Polls `done()` while the run goes on; fails with the log's end if the run ends or time runs out first."""
    deadline = time.time() + timeout
    while not done():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


@contextmanager
def killed_on_failure(proc: subprocess.Popen):
    """Whatever happens in the block, the launcher's process group does not outlive it."""
    try:
        yield
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def final_weights(out: Path) -> dict:
    return load_weights(out / "final_model" / "model.safetensors")


@pytest.fixture
def env(subprocess_env):
    return dict(subprocess_env, NEOX_DEBUG_STEP_DELAY_S="0.7")


def test_a_killed_rank_is_restarted_and_the_run_ends_as_an_uninterrupted_one(tmp_path, env):
    data = make_shards(tmp_path / "data")
    ref, out = tmp_path / "ref", tmp_path / "out"
    reference = subprocess.run(launcher_cmd(ref, data), env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                               timeout=400)
    assert reference.returncode == 0, reference.stderr[-3000:]
    log = tmp_path / "out.log"
    proc = start(launcher_cmd(out, data, "--max-restarts", "2", "--restart-delay", "1"), env, log)
    os.kill(wait_past_a_checkpoint(out, proc, log), signal.SIGKILL)
    proc.wait(timeout=400)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    assert re.search(r"rank 1 \(pid \d+\) was killed by SIGKILL; restart 1 of 2 in 1 s", text), text[-4000:]
    assert "(1 restart(s))" in text and "restart 2 of 2" not in text
    assert "Resumed from" in text, text[-4000:]
    expected, got = final_weights(ref), final_weights(out)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_kills_beyond_max_restarts_end_the_run_naming_the_restarts(tmp_path, env):
    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    log = tmp_path / "out.log"
    proc = start(launcher_cmd(out, data, "--max-restarts", "2", "--restart-delay", "0",
                              sets=["max_steps=1000"]), env, log)
    killed: list[int] = []
    for _ in range(3):
        pid = wait_past_a_checkpoint(out, proc, log, not_in=killed)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    proc.wait(timeout=300)
    text = log.read_text()
    assert proc.returncode != 0, text[-4000:]
    assert "restart 1 of 2" in text and "restart 2 of 2" in text, text[-4000:]
    assert "gave up after 2 restart(s) (--max-restarts 2): rank 1" in text, text[-4000:]


def test_a_bad_setting_is_not_restarted(tmp_path, env):
    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    proc = subprocess.run(launcher_cmd(out, data, "--max-restarts", "3", "--restart-delay", "0",
                                       "--resume", str(tmp_path / "no-such-checkpoint")),
                          env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "restart" not in proc.stderr.replace("--max-restarts", ""), proc.stderr[-2000:]
    assert "error:" in proc.stderr and "no-such-checkpoint" in proc.stderr


def hang_files(out: Path) -> dict[int, str]:
    found = {}
    for path in (out / "logs").glob("hang-*-rank*.txt"):
        found[int(path.stem.rsplit("rank", 1)[1])] = path.read_text()
    return found


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_stopped_rank_is_found_by_the_hang_watchdog(tmp_path, env, restarts):
    """SIGSTOP to rank 1 past a checkpoint: within hang_timeout_s + 30 s every rank's stacks are on disk and
    a line names rank 1; the run exits 3, or with --max-restarts comes back (its line says why) and finishes."""
    data, out, log = make_shards(tmp_path / "data"), tmp_path / "out", tmp_path / "out.log"
    timeout_s = 20
    steps = 1000 if restarts == 0 else 14
    proc = start(launcher_cmd(out, data, "--max-restarts", str(restarts), "--restart-delay", "0",
                              sets=[f"hang_timeout_s={timeout_s}", f"max_steps={steps}"]), env, log)
    pid = wait_past_a_checkpoint(out, proc, log)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.time()
    try:
        while len(hang_files(out)) < 2 or "hang watchdog:" not in log.read_text():
            assert time.time() - stopped < timeout_s + 30, f"no stacks in time:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    stacks = hang_files(out)
    assert "no training progress" in stacks[0] and "Thread" in stacks[0], stacks[0][:2000]
    assert "not running" in stacks[1] and "train.py" in stacks[1], stacks[1][:2000]
    proc.wait(timeout=400)
    text = log.read_text()
    assert re.search(rf"hang watchdog: rank 0 made no training progress .*rank 1 \(pid {pid}, .*\) is not running",
                     text), text[-4000:]
    if restarts == 0:  # the watchdog's status, not accelerate's or torchrun's 1
        assert proc.returncode == 3, text[-4000:]
    else:
        assert proc.returncode == 0 and "(1 restart(s))" in text, text[-4000:]
        restarted = r"start_training\.sh: the hang watchdog ended rank \d \(exit status 3\); restart 1 of 1 in 0 s"
        assert re.search(restarted, text), text[-4000:]


STOP_LINE = re.compile(r"^start_training\.sh: stopped by SIGTERM after step (\d+); checkpoint (\S+) ", re.M)


def test_the_stop_s_checkpoint_is_progress_not_a_hang(tmp_path, env):
    """SIGTERM after step 5 of 2 ranks, a checkpoint that takes 25 s to write (a slow disk or bucket:
    NEOX_DEBUG_CHECKPOINT_DELAY_S) and hang_timeout_s=10: the watchdog lets the write finish (it killed the
    rank mid-write, leaving only a temporary folder, exit 1): one verified checkpoint, exit 0, no stacks."""
    from utils.checkpoint.format import verify_checkpoint

    data, out, log = make_shards(tmp_path / "data"), tmp_path / "out", tmp_path / "out.log"
    proc = start(launcher_cmd(out, data, sets=["max_steps=100000", "save_steps=100000", "hang_timeout_s=10"]),
                 dict(env, NEOX_DEBUG_CHECKPOINT_DELAY_S="25"), log)
    with killed_on_failure(proc):
        wait_until(lambda: steps_done(out) >= 5, proc, log)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=300)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    stopped = STOP_LINE.search(text)
    assert stopped and "hang watchdog" not in text and not hang_files(out), text[-4000:]
    verify_checkpoint(Path(stopped.group(2)))
    assert list_checkpoints(out / "checkpoints") == [Path(stopped.group(2))]


def test_a_checkpoint_waiting_for_a_slow_write_is_progress_on_every_rank(tmp_path, env):
    """save_steps=2 on 2 ranks with writes of 15 s and hang_timeout_s=6: at each save rank 0 waits for the
    previous write, and rank 1 waits for rank 0 in its next step's collective. Neither is a hang (rank 0 is
    busy with a checkpoint, rank 1 sees that in rank 0's heartbeat): the run finishes, exit 0, no stacks."""
    data, out, log = make_shards(tmp_path / "data"), tmp_path / "out", tmp_path / "out.log"
    proc = start(launcher_cmd(out, data, sets=["max_steps=6", "save_steps=2", "hang_timeout_s=6"]),
                 dict(env, NEOX_DEBUG_CHECKPOINT_DELAY_S="15"), log)
    with killed_on_failure(proc):
        proc.wait(timeout=400)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    assert "finished after step 6" in text and "hang watchdog" not in text and not hang_files(out), text[-4000:]
    blocked = [r["blocked_s"] for r in map(json.loads, (out / "logs" / "metrics.jsonl").read_text().splitlines())
               if "checkpoint" in r]
    assert len(blocked) == 3 and max(blocked) > 6, blocked  # the saves did wait longer than hang_timeout_s


def test_a_launcher_killed_during_a_restart_wait_leaves_nothing_running(tmp_path, env):
    """`kill -9` of start_training.sh while its supervisor (a session of its own) waits to restart the ranks:
    the supervisor relaunched every rank 8 s later and trained on, holding the folder's lock with nobody
    watching. Now it restarts nothing: 20 s later no process of the run is left."""
    from tests.e2e.test_preemption import leftovers

    data, out, log = make_shards(tmp_path / "data"), tmp_path / "out", tmp_path / "out.log"
    proc = start(launcher_cmd(out, data, "--max-restarts", "2", "--restart-delay", "8", sets=["max_steps=1000"]),
                 env, log)
    try:
        os.kill(wait_past_a_checkpoint(out, proc, log), signal.SIGKILL)
        wait_until(lambda: "restart 1 of 2 in 8 s" in log.read_text(), proc, log, timeout=120)
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.time()
        proc.wait(timeout=10)
        while leftovers(str(out)) and time.time() < killed + 20:
            time.sleep(0.5)
        time.sleep(max(0.0, killed + 20 - time.time()))  # past the restart's moment: nothing started again
        left = leftovers(str(out))
    finally:
        for line in leftovers(str(out)):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
    text = log.read_text()
    assert left == [], (left, text[-3000:])
    assert "no restart" in text and "Resumed from" not in text, text[-3000:]


@pytest.mark.parametrize("small_disk", ["5m"], indirect=True)
def test_a_full_disk_at_the_restart_s_lock_write_is_one_line(tmp_path, env, small_disk):
    """The output folder on a 5 MB tmpfs, rank 1 killed past a checkpoint, the disk filled during the restart's
    wait: the restarted rank 0's first write, the folder's lock record, was a traceback (OSError: No space left on
    device); now one `error:` line naming the lock file and what to do, exit 2 (not restarted again), and the
    checkpoint written before still verifies."""
    from utils.checkpoint.format import verify_checkpoint

    data, out, log = make_shards(tmp_path / "data"), small_disk / "out", tmp_path / "out.log"
    proc = start(launcher_cmd(out, data, "--max-restarts", "1", "--restart-delay", "5",
                              sets=["max_steps=1000", "save_total_limit=1"]), env, log)
    with killed_on_failure(proc):
        os.kill(wait_past_a_checkpoint(out, proc, log), signal.SIGKILL)
        wait_until(lambda: "restart 1 of 1 in 5 s" in log.read_text(), proc, log, timeout=120)
        filler = os.open(small_disk / "filler", os.O_WRONLY | os.O_CREAT)
        with pytest.raises(OSError, match="No space left"):
            while True:
                os.write(filler, b"\0" * 4096)
        os.close(filler)
        proc.wait(timeout=300)
    text = log.read_text()
    assert proc.returncode == 2, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(rf"no space left on \S+ writing {re.escape(str(out / '.run.lock'))} \(",
                                          errors[0]), text[-4000:]
    assert "--resume auto" in errors[0] and "restart 2" not in text
    for path in list_checkpoints(out / "checkpoints"):
        verify_checkpoint(path)
