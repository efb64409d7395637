"""scripts/slurm_train.sbatch through a real one-node Slurm (tests/slurm_cluster.py) on the CPU: a time limit
with --signal=B:TERM -> checkpoint -> requeue -> resume -> finished with the weights of an uninterrupted run;
preemption by a `high` job -> the same; two tasks as two nodes -> world size 2;
scancel -> checkpoint and no requeue; a run that fails on a setting -> failed, not requeued. Skipped with one
line where Slurm cannot start (not root, not installed: apt-get install slurmctld slurmd slurm-client munge).

Requeues are counted with `scontrol show job`'s Restarts, not `sacct`: this cluster has
AccountingStorageType=accounting_storage/none, and there sacct only says "Slurm accounting storage is disabled".
The one other storage plugin Debian ships, accounting_storage/slurmdbd, needs slurmdbd and a MySQL/MariaDB
server, more than a test fixture should start. On a cluster with accounting, `sacct -j JOB -D` lists each run."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import free_port
from tests.slurm_cluster import SlurmCluster, SlurmUnavailable
from tests.trainkit import REPO_ROOT, TINY, load_weights, make_shards, run, train_cmd, training_process

pytestmark = pytest.mark.slow
SETS = TINY + ["per_device_train_batch_size=2", "save_steps=100000"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        cluster.stop()
        pytest.skip(f"no Slurm cluster: {exc}")
    yield cluster
    cluster.stop()


def submit(slurm: SlurmCluster, env: dict, out: Path, data: Path, log: Path, *options: str, sets=(),
           step_delay: str = "0.5", launch: list[str] = ()) -> str:
    launch = shlex.join([*launch, *(word for s in SETS + list(sets) for word in ("--set", s))])
    job_env = dict(env, CONFIG="demo", CPU_PROCESSES="1", LAUNCH_ARGS=launch, MAIN_PORT=str(free_port()),
                   TRAIN_ARGS=shlex.join(["--output-dir", str(out), "--data-dir", str(data)]),
                   NEOX_DEBUG_STEP_DELAY_S=step_delay)
    proc = slurm.run(["sbatch", "--parsable", "--nodes=1", "--cpus-per-task=2", f"--output={log}", *options,
                      str(REPO_ROOT / "scripts" / "slurm_train.sbatch")], env=job_env, cwd=REPO_ROOT)
    return proc.stdout.strip().split(";")[0]


def wait_for(slurm: SlurmCluster, job_id: str, done, timeout: float, log: Path) -> dict:
    deadline = time.time() + timeout
    while True:
        job = slurm.job(job_id)
        if done(job):
            return job
        assert time.time() < deadline, f"{job}\n{log.read_text()[-3000:] if log.exists() else ''}"
        time.sleep(1)


def last_line(log: Path, line: str, timeout: float = 60) -> str:
    """The job's log once `line` is in it (the batch script's last lines come after the job has ended)."""
    deadline = time.time() + timeout
    while line not in log.read_text() and time.time() < deadline:
        time.sleep(0.5)
    return log.read_text()


def ended(job: dict) -> bool:
    return job["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and "COMPLETING" not in job.get(
        "JobState", "")


def test_a_time_limit_checkpoints_requeues_and_the_run_finishes_as_an_uninterrupted_one(slurm, tmp_path,
                                                                                         subprocess_env):
    data = make_shards(tmp_path / "data")
    ref, out, log = tmp_path / "ref", tmp_path / "out", tmp_path / "job.out"
    # The signal comes ~60 s into each run (Slurm checks time limits every few seconds): 150 steps of >= 0.5 s
    # do not fit in the first run; what is left (about half) ends well before the second run's signal.
    run(train_cmd(ref, data, *SETS[len(TINY):], "max_steps=150"), subprocess_env)
    job_id = submit(slurm, subprocess_env, out, data, log, "--time=3", "--signal=B:TERM@120",
                    sets=["max_steps=150"])
    job = wait_for(slurm, job_id, ended, 480, log)
    text = log.read_text()
    assert job["JobState"] == "COMPLETED", (job, text[-3000:])
    assert int(job["Restarts"]) >= 1, (job, text[-3000:])
    assert re.search(r"stopped by SIGTERM after step \d+; checkpoint", text), text[-3000:]
    assert "requeueing (the next run resumes from the newest checkpoint)" in text and "Resumed from" in text, \
        text[-3000:]
    assert "finished after step 150" in text
    expected, got = load_weights(ref / "final_model" / "model.safetensors"), \
        load_weights(out / "final_model" / "model.safetensors")
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def wait_for_steps(slurm: SlurmCluster, job_id: str, out: Path, log: Path, steps: int) -> None:
    rows, deadline = out / "logs" / "metrics.jsonl", time.time() + 300
    while not (rows.exists() and rows.read_text().count('"loss"') >= steps):
        assert time.time() < deadline, log.read_text()[-3000:] if log.exists() else slurm.job(job_id)
        time.sleep(0.5)


def test_preemption_by_a_high_priority_job_checkpoints_requeues_and_finishes_as_an_uninterrupted_run(
        slurm, tmp_path, subprocess_env):
    """The training job in `low`; a job in `high` that needs the whole node preempts it (preempt/partition_prio,
    PreemptMode=REQUEUE, GraceTime=60): Slurm sends SIGTERM to the job's tasks, they checkpoint within the
    grace time, Slurm requeues the job, it resumes once the high job is done and ends with the weights of an
    uninterrupted run."""
    data = make_shards(tmp_path / "data")
    ref, out, log = tmp_path / "ref", tmp_path / "out", tmp_path / "job.out"
    run(train_cmd(ref, data, *SETS[len(TINY):], "max_steps=80"), subprocess_env)
    job_id = submit(slurm, subprocess_env, out, data, log, "--time=10", sets=["max_steps=80"])
    wait_for_steps(slurm, job_id, out, log, 5)
    high = slurm.run(["sbatch", "--parsable", "--partition=high", f"--cpus-per-task={slurm.cpus}",
                      f"--output={tmp_path / 'high.out'}", "--wrap", "sleep 10"]).stdout.strip().split(";")[0]
    wait_for(slurm, high, ended, 300, log)
    job = wait_for(slurm, job_id, ended, 400, log)
    text = log.read_text()
    assert slurm.job(high)["JobState"] == "COMPLETED"
    assert job["JobState"] == "COMPLETED" and int(job["Restarts"]) >= 1, (job, text[-3000:])
    assert re.search(r"stopped by SIGTERM after step \d+; checkpoint", text), text[-3000:]
    assert "preempted (PreemptTime=" in text and "requeueing (the next run resumes from it)" in text, text[-3000:]
    assert "Resumed from" in text and "finished after step 80" in text, text[-3000:]
    expected, got = load_weights(ref / "final_model" / "model.safetensors"), \
        load_weights(out / "final_model" / "model.safetensors")
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_two_tasks_stand_in_for_two_nodes_and_train_with_world_size_2(slurm, tmp_path, subprocess_env):
    """`TASKS_AS_NODES=1` and `--ntasks-per-node=2`: the batch script's two tasks are node ranks 0 and 1 of a
    2-node run over loopback (MAIN_ADDR=127.0.0.1), one process each: world size 2, trained to the end."""
    data, out, log = make_shards(tmp_path / "data"), tmp_path / "out", tmp_path / "job.out"
    job_id = submit(slurm, dict(subprocess_env, TASKS_AS_NODES="1", MAIN_ADDR="127.0.0.1"), out, data, log,
                    "--time=10", "--ntasks-per-node=2", sets=["max_steps=6"], step_delay="0")
    job = wait_for(slurm, job_id, ended, 300, log)
    text = log.read_text()
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "0", (job, text[-3000:])
    assert "job %s: 2 nodes, main 127.0.0.1:" % job_id in text, text[-3000:]
    assert "--num_machines 2" in text and "--machine_rank 0" in text and "--machine_rank 1" in text, text[-3000:]
    assert "world size 2" in text and "finished after step 6" in text, text[-3000:]  # rank 0's launcher says it
    assert (out / "final_model" / "model.safetensors").exists()


def test_scancel_checkpoints_and_does_not_requeue(slurm, tmp_path, subprocess_env):
    data, out, log = make_shards(tmp_path / "data"), tmp_path / "out", tmp_path / "job.out"
    job_id = submit(slurm, subprocess_env, out, data, log, "--time=10", sets=["max_steps=100000"])
    rows, deadline = out / "logs" / "metrics.jsonl", time.time() + 300
    while not (rows.exists() and rows.read_text().count('"loss"') >= 3):
        assert time.time() < deadline, log.read_text()[-3000:] if log.exists() else slurm.job(job_id)
        time.sleep(0.5)
    slurm.run(["scancel", job_id])
    job = wait_for(slurm, job_id, ended, 300, log)
    text = last_line(log, "not requeued by this script")
    assert job["JobState"] == "CANCELLED" and job["Restarts"] == "0", job
    assert re.search(r"stopped by SIGTERM after step \d+; checkpoint", text), text[-3000:]
    assert "the run stopped; not requeued by this script (JobState=COMPLETING" in text, text[-3000:]
    assert "scancel: error" not in text and "requeues itself" not in text, text[-3000:]
    assert list((out / "checkpoints").iterdir())


def test_a_run_that_fails_on_a_setting_is_not_requeued(slurm, tmp_path, subprocess_env):
    data, out, log = make_shards(tmp_path / "data"), tmp_path / "out", tmp_path / "job.out"
    job_id = submit(slurm, subprocess_env, out, data, log, "--time=10",
                    sets=["max_steps=5", "eval_tasks=/no/such/task.jsonl"])
    job = wait_for(slurm, job_id, ended, 300, log)
    text = log.read_text()
    assert job["JobState"] == "FAILED" and job["Restarts"] == "0", (job, text[-2000:])
    assert "error:" in text and "requeueing" not in text, text[-2000:]


def test_train_args_keep_a_path_with_a_space_whole(slurm, tmp_path, subprocess_env):
    """TRAIN_ARGS="--output-dir '/.../my run' ...": split as a shell splits words (it was split on every
    blank, and the run was refused naming '/.../my' and 'run'): the run writes into "my run"."""
    data, out, log = make_shards(tmp_path / "data"), tmp_path / "my run", tmp_path / "job.out"
    job_id = submit(slurm, subprocess_env, out, data, log, "--time=10", sets=["max_steps=2"], step_delay="0")
    job = wait_for(slurm, job_id, ended, 300, log)
    text = log.read_text()
    assert job["JobState"] == "COMPLETED", (job, text[-3000:])
    assert "finished after step 2" in text and (out / "final_model" / "model.safetensors").exists(), text[-3000:]


def test_scancel_during_a_restart_wait_says_only_what_is_true(slurm, tmp_path, subprocess_env):
    """MAX_RESTARTS=1, the rank killed, scancel while the launcher waits to restart it: the batch script said
    "the job then requeues itself" and printed scancel's error (the job was already ending) before ending
    correctly. Now: the launcher stops before the restart, the job is CANCELLED, and no line is untrue or an
    error."""
    data, out, log = make_shards(tmp_path / "data"), tmp_path / "out", tmp_path / "job.out"
    job_id = submit(slurm, dict(subprocess_env, MAX_RESTARTS="1"), out, data, log, "--time=10",
                    sets=["max_steps=100000"], launch=["--restart-delay", "120"])
    wait_for_steps(slurm, job_id, out, log, 3)
    os.kill(training_process(out), signal.SIGKILL)
    deadline = time.time() + 120
    while "restart 1 of 1 in 120 s" not in log.read_text():
        assert time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    slurm.run(["scancel", job_id])
    job = wait_for(slurm, job_id, ended, 120, log)
    text = last_line(log, "not requeued by this script")
    assert job["JobState"] == "CANCELLED" and job["Restarts"] == "0", (job, text[-3000:])
    assert "stopped by SIGTERM before restart 1; nothing running" in text, text[-3000:]
    assert "requeues itself" not in text and "scancel: error" not in text, text[-3000:]
    assert "the run stopped; not requeued by this script (JobState=" in text, text[-3000:]



@pytest.mark.parametrize("words, said", [
    ("'--set sample_prompts=' + 'x' * 200_000", "TRAIN_ARGS is 200021 bytes; Linux passes no environment variable "
                                                "longer than 128 KiB to a program"),
    ("' '.join(['x;y'] * 30_000)", "TRAIN_ARGS is 150000 bytes once quoted; Linux passes no environment variable"),
    ("\"--set a='b\"", "TRAIN_ARGS has an unmatched quote: --set a='b"),
])
def test_train_args_too_long_for_the_tasks_says_so_not_a_quote(tmp_path, words, said):
    """A 200 KB TRAIN_ARGS was reported as "an unmatched quote": exported, it made every program the script started
    fail ("Argument list too long"), xargs included. The script says the real cause, before starting anything (no
    Slurm needed: it ends before srun). The variable is set inside the shell: no exec takes one that long."""
    script = REPO_ROOT / "scripts" / "slurm_train.sbatch"
    value = f"$(python3 -c \"print({words}, end='')\")" if "join" in words or "*" in words else words
    shell = (f"export TRAIN_ARGS={value} SLURM_JOB_ID=7 SLURM_JOB_NUM_NODES=1 MAIN_ADDR=127.0.0.1; "
             f"source {shlex.quote(str(script))}")
    proc = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr[-2000:])
    assert proc.stderr.startswith(f"job 7: error: {said}") and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
