"""SIGTERM delivered the way schedulers deliver it, to the real launcher with real processes: to the
launcher's PID, to its process group, to it as a container's PID 1, by `timeout`, and by SLURM's
`--signal=B:TERM` through scripts/slurm_train.sbatch (with a checkpoint write slowed past torchrun's 30 s).
Every time: all ranks stop at the same step, one verified checkpoint, exit 0 naming it, nothing left
running; and the run continues from it with --resume auto."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.trainkit import REPO_ROOT, TINY, make_shards, run, train_cmd, train_rows
from utils.checkpoint.format import list_checkpoints, verify_checkpoint

pytestmark = pytest.mark.slow
STOP_LINE = re.compile(r"^start_training\.sh: stopped by (\S+) after step (\d+); checkpoint (\S+) ", re.M)


def launcher_cmd(out: Path, data: Path, gpus: int, workers: int) -> list[str]:
    cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--cpu", "--gpus", str(gpus)]
    for s in TINY + ["per_device_train_batch_size=2", "max_steps=100000", "save_steps=100000",
                     f"dataloader_num_workers={workers}", "prefetch_factor=2"]:
        cmd += ["--set", s]
    return cmd + ["--", "--output-dir", str(out), "--data-dir", str(data)]


def wait_for_steps(out: Path, proc: subprocess.Popen, steps: int = 3, timeout: float = 180) -> None:
    rows = out / "logs" / "metrics.jsonl"
    deadline = time.time() + timeout
    while not (rows.exists() and rows.read_text().count('"loss"') >= steps):
        assert proc.poll() is None, f"the run ended early ({proc.returncode})"
        assert time.time() < deadline, "the run did not start training in time"
        time.sleep(0.2)


def leftovers(marker: str) -> list[str]:
    """Processes whose command line or environment mentions `marker` (a test's own output dir)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            text = (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in text:
            found.append(f"{proc.name}: {(proc / 'cmdline').read_bytes()[:200]!r}")
    return found


def check_clean_stop(out: Path, stdout: str, returncode: int) -> int:
    """The launcher exited 0 naming one verified checkpoint at the step every rank stopped at."""
    assert returncode == 0, stdout[-3000:]
    match = STOP_LINE.search(stdout)
    assert match, stdout[-3000:]
    signame, step, path = match.group(1), int(match.group(2)), Path(match.group(3))
    assert signame == "SIGTERM"
    assert path.parent == out / "checkpoints" and f"-step{step}-" in path.name
    verify_checkpoint(path)
    assert list_checkpoints(out / "checkpoints") == [path]
    assert max(train_rows(out)) == step
    deadline = time.time() + 10  # the kernel may still be reaping
    while leftovers(str(out)) and time.time() < deadline:
        time.sleep(0.2)
    assert leftovers(str(out)) == []
    return step


def resume_continues(out: Path, data: Path, step: int, env: dict) -> None:
    proc = run(train_cmd(out, data, "per_device_train_batch_size=2", f"max_steps={step + 1}",
                         extra=("--resume", "auto")), env)
    assert f"at step {step}" in proc.stdout and max(train_rows(out)) == step + 1


def start(cmd: list[str], env: dict, out: Path, **kwargs) -> subprocess.Popen:
    log = open(out.parent / f"{out.name}.log", "w")
    return subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, text=True, **kwargs)


def finish(proc: subprocess.Popen, out: Path, timeout: float = 240) -> str:
    proc.wait(timeout=timeout)
    return (out.parent / f"{out.name}.log").read_text()


@pytest.mark.parametrize("gpus, workers", [(1, 0), (2, 2)])
def test_sigterm_to_the_launcher_pid(tmp_path, subprocess_env, gpus, workers):
    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    proc = start(launcher_cmd(out, data, gpus, workers), subprocess_env, out, start_new_session=True)
    wait_for_steps(out, proc)
    os.kill(proc.pid, signal.SIGTERM)
    step = check_clean_stop(out, finish(proc, out), proc.returncode)
    resume_continues(out, data, step, subprocess_env)


def test_sighup_to_the_launcher_is_reported_as_sighup(tmp_path, subprocess_env):
    """SIGHUP (a closed session, some schedulers) is forwarded to the ranks as SIGTERM; both the rank's line
    and the launcher's name SIGHUP (they said SIGTERM), and the stop is as clean. The SIGHUP must reach the
    supervisor within 60 s (a loaded CI run once lost it); if it does not, the message holds every
    process's signal state."""
    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    hangup = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # under nohup the launcher would start with SIGHUP
    try:  # ignored, and a shell cannot trap a signal it starts with ignored
        proc = start(launcher_cmd(out, data, 1, 0), subprocess_env, out, start_new_session=True)
    finally:
        signal.signal(signal.SIGHUP, hangup)
    log = out.parent / f"{out.name}.log"
    try:
        wait_for_steps(out, proc, timeout=300)
        os.kill(proc.pid, signal.SIGHUP)
        deadline = time.time() + 60
        while "start_training.sh: SIGHUP received" not in log.read_text():
            assert time.time() < deadline, f"the SIGHUP did not reach the supervisor:\n{signal_states(proc.pid)}"
            time.sleep(0.1)
        text = finish(proc, out, timeout=300)
    finally:  # a lost SIGHUP must not leave a 100,000-step run loading the suite
        if proc.poll() is None:
            for line in leftovers(str(out)):  # the script, and the supervisor in a session of its own, and the rest
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
    assert proc.returncode == 0, text[-3000:]
    match = STOP_LINE.search(text)
    assert match and match.group(1) == "SIGHUP", text[-3000:]
    assert re.search(r"^Stopped by SIGHUP after step \d+: checkpoint", text, re.M), text[-3000:]
    verify_checkpoint(Path(match.group(3)))


def signal_states(launcher: int) -> str:
    """The launcher's and its descendants' state and signal masks (pending, blocked, ignored, caught) from
    /proc, one process a line, for a failure's message."""
    lines, todo = [], [launcher]
    while todo:
        pid = todo.pop(0)
        try:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        except OSError:
            continue
        fields = " ".join(f"{key}={status[key].strip()}" for key in ("State", "Threads", "SigPnd", "ShdPnd",
                                                                     "SigBlk", "SigIgn", "SigCgt"))
        lines.append(f"{pid} {_cmdline(pid)[:80]!r}: {fields}")
        todo += _children(pid)
    return "\n".join(lines)


@pytest.mark.parametrize("gpus, workers", [(1, 2), (2, 0)])
def test_sigterm_to_the_process_group(tmp_path, subprocess_env, gpus, workers):
    """SLURM's scancel, systemd and a terminal signal the whole group: the DataLoader workers and torchrun
    must not die first."""
    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    proc = start(launcher_cmd(out, data, gpus, workers), subprocess_env, out, start_new_session=True)
    wait_for_steps(out, proc)
    os.killpg(proc.pid, signal.SIGTERM)
    check_clean_stop(out, finish(proc, out), proc.returncode)


def test_sigterm_to_the_launcher_as_a_containers_pid_1(tmp_path, subprocess_env):
    if os.getuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare to run the launcher as PID 1 of a PID namespace")
    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    cmd = ["unshare", "--pid", "--fork", "--mount-proc"] + launcher_cmd(out, data, 1, 2)
    proc = start(cmd, subprocess_env, out, start_new_session=True)
    wait_for_steps(out, proc)
    children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                and (p / "stat").exists() and _ppid(p) == proc.pid]
    assert len(children) == 1  # unshare's child: the launcher, PID 1 inside its namespace (docker stop's target)
    os.kill(children[0], signal.SIGTERM)
    check_clean_stop(out, finish(proc, out), proc.returncode)


def _ppid(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_timeout_sends_sigterm(tmp_path, subprocess_env):
    """`timeout` forwards the signal it gets (as when its time runs out) to the command and its group."""
    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    cmd = ["timeout", "--preserve-status", "-s", "TERM", "600"] + launcher_cmd(out, data, 1, 0)
    proc = start(cmd, subprocess_env, out, start_new_session=True)
    wait_for_steps(out, proc)
    os.kill(proc.pid, signal.SIGTERM)
    check_clean_stop(out, finish(proc, out), proc.returncode)


def slurm_shims(bin_dir: Path, log: Path) -> None:
    """`srun` runs its command in place (the step's one task); `scancel --signal=SIG JOB` sends SIG to that task,
    as Slurm signals the processes of a job's steps; `scontrol` names this host and records requeues."""
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
                                  f'echo $$ > {bin_dir / "step.pid"}\nexec "$@"\n')
    (bin_dir / "scancel").write_text(f'#!/usr/bin/env bash\n[[ "$1" == --signal=* ]] || exit 1\n'
                                     f'kill -"${{1#--signal=}}" "$(cat {bin_dir / "step.pid"})"\n')
    (bin_dir / "scontrol").write_text(
        f'#!/usr/bin/env bash\nif [[ "$1 $2" == "show hostnames" ]]; then echo 127.0.0.1; exit 0; fi\n'
        f'if [[ "$1 $2" == "show job" ]]; then echo "JobId=$3 JobState=RUNNING"; exit 0; fi\n'
        f'echo "$@" >> {log}\n')
    for name in ("srun", "scancel", "scontrol"):
        (bin_dir / name).chmod(0o755)


def test_slurm_signal_requeue_and_a_checkpoint_slower_than_torchruns_30_s(tmp_path, subprocess_env):
    """The SLURM example on its first submission (nothing to resume: a fresh start), SIGTERM to the batch
    shell as `--signal=B:TERM` sends it, two ranks, a checkpoint write that takes 35 s: the checkpoint is
    whole, the job requeues itself, and the second submission resumes from it."""
    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    slurm_shims(tmp_path / "bin", tmp_path / "scontrol.log")
    sets = " ".join(f"--set {s}" for s in TINY + ["per_device_train_batch_size=2", "save_steps=100000",
                                                   "max_steps=100000"])
    env = dict(subprocess_env, PATH=f"{tmp_path / 'bin'}:{subprocess_env['PATH']}", SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST="node1", SLURM_JOB_NUM_NODES="1", SLURM_NODEID="0", SLURM_SUBMIT_DIR=str(REPO_ROOT),
               CONFIG="demo", GPUS_PER_NODE="2", MAIN_PORT=str(free_port()), LAUNCH_ARGS=f"--cpu {sets}",
               TRAIN_ARGS=f"--output-dir {out} --data-dir {data}", NEOX_DEBUG_CHECKPOINT_DELAY_S="35")
    batch = ["bash", str(REPO_ROOT / "scripts" / "slurm_train.sbatch")]
    proc = start(batch, env, out, start_new_session=True)
    wait_for_steps(out, proc, timeout=240)
    started = time.time()
    os.kill(proc.pid, signal.SIGTERM)  # B:TERM: the batch shell alone
    text = finish(proc, out, timeout=300)
    assert time.time() - started > 30, "the checkpoint write was not slowed"
    assert "--resume auto: no checkpoint found" in text  # the first submission started fresh
    step = check_clean_stop(out, text, proc.returncode)
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    resume_continues(out, data, step, subprocess_env)


def test_sigterm_during_preflight_ends_the_run_within_seconds_with_nothing_to_save(tmp_path, subprocess_env):
    """The launcher gets SIGTERM while train.py is in a long preflight (the demo model, 30 passes): the run
    ends before the next pass, exit 0, saying so; no checkpoint, nothing left running."""
    data = make_shards(tmp_path / "data", n_files=3, rows=480, seq_len=128)
    out = tmp_path / "out"
    cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--cpu"]
    for s in TINY + ["model=demo", "seq_len=128", "per_device_train_batch_size=16", "preflight_steps=30",
                     "eval_batches=30", "max_steps=5"]:
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd + ["--", "--output-dir", str(out), "--data-dir", str(data)], env=subprocess_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    for line in proc.stdout:  # describe_run's last line: the preflight comes next
        if "no gcs_bucket configured" in line:
            break
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - signalled < 10 and proc.returncode == 0, stderr[-3000:]
    assert "Stopped: stopped by SIGTERM during setup (preflight) before any training step" in stdout, stdout
    assert "stopped by SIGTERM during setup, before any training step; nothing to save" in stdout
    assert "Preflight:" not in stdout and not list_checkpoints(out / "checkpoints")
    assert not leftovers(str(out))


@pytest.mark.parametrize("when", ["before launching", "while accelerate starts", "while train.py imports"])
def test_sigterm_before_the_ranks_can_catch_it_still_ends_the_run_cleanly(tmp_path, subprocess_env, when):
    """SIGTERM to the launcher before it has started anything, while accelerate is still starting train.py,
    or while train.py is importing: the launcher hands it to the rank as soon as the rank catches SIGTERM
    (or stops before launching), and the run ends with exit 0, nothing saved, nothing left running."""
    data = make_shards(tmp_path / "data")
    out = tmp_path / "out"
    cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--cpu"]
    for s in TINY + ["max_steps=5"]:
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd + ["--", "--output-dir", str(out), "--data-dir", str(data)], env=subprocess_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    if when == "before launching":
        time.sleep(0.3)  # the launcher is checking the config (a first Python), before it starts anything
    else:
        for line in proc.stdout:  # the command line, printed just before the supervisor starts accelerate
            if line.startswith("+ "):
                break
        time.sleep(0.3 if when == "while accelerate starts" else 2.5)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, (stdout[-2000:], stderr[-3000:])
    if when == "before launching":  # the bash preamble, the supervisor before it launched, or the rank already
        assert (re.search(r"stopped by (a signal|SIGTERM) before training started; nothing to save", stderr)
                or "Stopped: stopped by SIGTERM during setup" in stdout), (stdout[-2000:], stderr[-2000:])
    else:
        assert "Stopped: stopped by SIGTERM during setup" in stdout, stdout
    assert not list_checkpoints(out / "checkpoints") and not leftovers(str(out))


def test_sigterm_as_the_supervisor_starts_ends_the_run_cleanly(tmp_path, subprocess_env):
    """SIGTERM to start_training.sh at the moment its supervisor (utils/runtime/launch.py) is starting, before the
    interpreter has run its first line, with the CPU saturated: it was exec'd and died of the signal (exit
    -15); now the script holds the signal until the supervisor catches it: exit 0, nothing left running."""
    import sys

    data, out = make_shards(tmp_path / "data"), tmp_path / "out"
    cmd = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", "--cpu"]
    for s in TINY + ["max_steps=5"]:
        cmd += ["--set", s]
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        for attempt in range(3):
            proc = subprocess.Popen(cmd + ["--", "--output-dir", str(out), "--data-dir", str(data)],
                                    env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
            deadline = time.monotonic() + 120
            while not any(b"utils/runtime/launch.py" in _cmdline(pid) for pid in [proc.pid, *_children(proc.pid)]):
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.001)
            os.kill(proc.pid, signal.SIGTERM)
            stdout, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 0, (attempt, proc.returncode, stderr[-3000:])
            assert "nothing to save" in stdout + stderr, (stdout[-2000:], stderr[-2000:])
            assert not list_checkpoints(out / "checkpoints")
            deadline = time.time() + 10
            while leftovers(str(out)) and time.time() < deadline:
                time.sleep(0.2)
            assert leftovers(str(out)) == []
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


STOP_MOMENTS = (0.0, 0.02, 0.1, 0.3, 0.7, 1.2, 2.0, 3.0, 4.0, 5.0)  # seconds after the launcher's first line


def sweep_stop_signal(tmp_path: Path, env: dict, options: list[str], sets: list[str], sig: int, send) -> list[str]:
    """Launches start_training.sh `options` with `sets` (and a free --main-port) once per moment of
    STOP_MOMENTS, a busy loop holding each core, and calls `send(proc)` that long after its first line has
    run (bash catches `sig`: its SigCgt; before that the kernel is still exec'ing env and bash, and a signal
    has its default effect, as for any program). Returns what went wrong: a run that did not exit 0, printed
    a traceback, ran on 180 s after the signal or left a process."""
    import sys

    data = make_shards(tmp_path / "data")
    base = [str(REPO_ROOT / "start_training.sh"), "--config", "demo", *options]
    for s in TINY + sets:
        base += ["--set", s]
    # one busy loop per core: every core held (the run's processes make the load higher still)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(len(os.sched_getaffinity(0)))]
    failures = []
    try:
        for delay in STOP_MOMENTS:
            out = tmp_path / f"out-{delay}"
            proc = subprocess.Popen(base + ["--main-port", str(free_port()), "--", "--output-dir", str(out),
                                            "--data-dir", str(data)],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
            deadline = time.monotonic() + 60
            while not catches(proc.pid, sig):  # the script's first line has run
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.0005)
            time.sleep(delay)
            send(proc)
            try:
                stdout, stderr = proc.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
                failures.append(f"{delay} s: still running 180 s after the signal")
            deadline = time.time() + 15
            while leftovers(str(out)) and time.time() < deadline:
                time.sleep(0.2)
            left = leftovers(str(out))
            for line in left:  # no stray trainer outlives a failed moment
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
            if proc.returncode != 0 or any(word in stderr for word in ("Traceback", "Fatal Python error")) or left:
                failures.append(f"{delay} s: exit {proc.returncode}, left {left}\n{stdout[-800:]}\n{stderr[-1500:]}")
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    return failures


@pytest.mark.slow
def test_sigterm_at_any_moment_of_the_first_5_s_ends_the_run_cleanly_on_a_saturated_cpu(tmp_path, subprocess_env):
    """The README's promise, swept: SIGTERM to start_training.sh 0 to 5 s after it starts (bash's preamble,
    the config check, the supervisor's start, accelerate, train.py's imports and setup), with a busy loop
    holding each core: each run ends with exit 0, no traceback, and no process of it left."""
    failures = sweep_stop_signal(tmp_path, subprocess_env, ["--cpu"], ["max_steps=5"], signal.SIGTERM,
                                 lambda proc: proc.send_signal(signal.SIGTERM))
    assert not failures, "\n\n".join(failures)


@pytest.mark.slow
def test_ctrl_c_at_any_moment_of_the_first_5_s_of_two_ranks_ends_the_run_cleanly_on_a_saturated_cpu(
        tmp_path, subprocess_env):
    """Ctrl-C (SIGINT to the launcher's whole process group, as a terminal sends it) 0 to 5 s after a 2-rank
    launch starts, a busy loop holding each core: each run ends with exit 0, no traceback (a SIGINT that
    reached a rank's interpreter start-up was a KeyboardInterrupt or "Fatal Python error: init_import_site"),
    nothing left; the run would train on for ever, so a lost Ctrl-C fails too."""
    interrupt = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # started in the background, SIGINT may be ignored
    try:  # here, and the launcher could not catch it (a shell cannot trap what it starts with ignored)
        failures = sweep_stop_signal(tmp_path, subprocess_env, ["--cpu", "--gpus", "2"],
                                     ["max_steps=100000", "save_steps=100000"], signal.SIGINT,
                                     lambda proc: os.killpg(proc.pid, signal.SIGINT))
    finally:
        signal.signal(signal.SIGINT, interrupt)
    assert not failures, "\n\n".join(failures)


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (/proc's SigCgt), i.e. a shell has run its `trap`."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except OSError:
        pass
    return False


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _children(pid: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and _ppid(proc) == pid:
            found.append(int(proc.name))
    return found
